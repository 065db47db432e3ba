"""Data-parallel healing: the process group of a torchrun job, what its ranks share, how the trained part is wrapped.

init_world joins the group torchrun's environment describes (RANK, WORLD_SIZE, LOCAL_RANK; gloo on a CPU, NCCL on
CUDA); a single process joins nothing (World()) and every helper here is then the identity. Each rank computes its
rows of every global batch (World.rows), and wrap makes a step the one-process step, up to the order of float sums.
"""
from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
from torch import nn

PATIENT_S = 24 * 3600.0  # how long a rank waits for what rank 0 alone makes (the teacher's text)


@dataclass(frozen=True)
class World:
    """This process's place in the job: rank of size, its device, the backend (None: one process, no group)."""
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def main(self) -> bool:
        """Rank 0: the one that prints and writes."""
        return self.rank == 0

    def rows(self, n: int, what: str = "batch size") -> slice:
        """This rank's rows of a global batch of n rows; ValueError naming both numbers unless N divides n."""
        if n % self.size:
            raise ValueError(f"the {what} ({n}) does not split over {self.size} processes: give a multiple of "
                             f"{self.size}")
        part = n // self.size
        return slice(self.rank * part, (self.rank + 1) * part)

    def part(self, n: int) -> slice:
        """This rank's share of n items that need not split evenly (windows to score, prompts to continue): contiguous,
        in rank order, the first n mod N ranks one item more (part_of)."""
        return part_of(n, self.rank, self.size)


def part_of(n: int, rank: int, size: int) -> slice:
    """Rank `rank` of `size`'s contiguous share of n items: the first n mod size ranks take one more (some may take
    none when n < size); the shares cover range(n) once, in rank order."""
    base, extra = divmod(n, size)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (rank < extra))


_groups: dict = {}  # "patient": the gloo group with a long timeout; "mesh": FSDP2's device mesh


def _env_int(environ, name: str, default: int) -> int:
    raw = environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} in the environment is not an integer (torchrun sets it)") from None


def world_from_env(device="cpu", environ=None) -> World:
    """The World torchrun's environment describes (RANK, WORLD_SIZE, LOCAL_RANK), without joining a group."""
    environ = os.environ if environ is None else environ
    size = _env_int(environ, "WORLD_SIZE", 1)
    rank = _env_int(environ, "RANK", 0)
    local = _env_int(environ, "LOCAL_RANK", rank)
    if size < 1 or not 0 <= rank < size or local < 0:
        raise ValueError(f"torchrun's environment is inconsistent: RANK={rank}, WORLD_SIZE={size}, "
                         f"LOCAL_RANK={local}")
    device = torch.device(device)
    if device.type == "cuda":
        device = torch.device("cuda", local if size > 1 else (device.index or 0))
    elif device.type != "cpu":
        raise ValueError(f"data-parallel healing runs on cpu (gloo) or cuda (NCCL), not {device.type}")
    backend = None if size == 1 else ("nccl" if device.type == "cuda" else "gloo")
    return World(rank=rank, size=size, local_rank=local, device=device, backend=backend)


def init_world(device="cpu", timeout_s: float = 120.0, *, patient_s: float = PATIENT_S, environ=None) -> World:
    """Join the process group torchrun's environment describes (gloo on CPU, NCCL on CUDA); one process: no group.

    timeout_s bounds every collective of the training (a rank that stopped answering is an error
    after that long); patient_s bounds the waits for what rank 0 alone makes.
    """
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise ValueError(f"the collective timeout must be a positive number of seconds, got {timeout_s!r}")
    world = world_from_env(device, environ)
    if not world.distributed:
        return world
    import torch.distributed as dist

    if not dist.is_available():
        raise ValueError("this torch build has no torch.distributed: data-parallel healing needs it")
    if world.device.type == "cuda":
        if world.local_rank >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK {world.local_rank} has no GPU: this machine has "
                             f"{torch.cuda.device_count()} (give torchrun --nproc-per-node <= that)")
        torch.cuda.set_device(world.device)
    if not dist.is_initialized():
        dist.init_process_group(world.backend, rank=world.rank, world_size=world.size,
                                timeout=timedelta(seconds=float(timeout_s)))
    _groups["patient"] = dist.new_group(backend="gloo", timeout=timedelta(seconds=max(float(timeout_s), patient_s)))
    return world


def close_world(world: World) -> None:
    """Leave the process group (nothing for one process)."""
    _groups.clear()
    if world.distributed:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _active() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _device() -> torch.device:
    """Where the default group's collectives take their tensors (NCCL: this rank's GPU)."""
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# -- decisions and figures ---------------------------------------------------------------------------
# agree: a stop request, an expired budget, a checkpoint due on any rank is seen by all, so all stop or write at the
# same step; global_mean: a per-rank loss -> the whole batch's, the one to print.
def agree(flag: bool) -> bool:
    """True on every rank if `flag` is True on any (all_reduce MAX): all ranks stop at the same step."""
    if not _active():
        return bool(flag)
    import torch.distributed as dist

    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def largest(value: int) -> int:
    """The largest of the ranks' integers (e.g. the most severe of their statuses)."""
    if not _active():
        return int(value)
    import torch.distributed as dist

    t = torch.tensor([int(value)], dtype=torch.int64, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def global_mean(value: torch.Tensor) -> float:
    """The mean over ranks of a per-rank scalar: with equal rows per rank, the whole batch's mean loss."""
    if not _active():
        return value.item()
    import torch.distributed as dist

    t = value.detach().reshape(1).to(_device(), torch.float64)
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def all_sum(t: torch.Tensor) -> torch.Tensor:
    """The sum over ranks of a tensor (a new tensor on t's device; no autograd): e.g. a loss's global denominator.
    Reduced on the group's device (NCCL takes no CPU tensor: an evaluation's float64 sums are kept on the CPU)."""
    t = t.detach().clone()
    if _active():
        import torch.distributed as dist

        there = t.to(_device())
        dist.all_reduce(there)
        t = there.to(t.device)
    return t


def gather_rows(part: torch.Tensor, n: int) -> torch.Tensor:
    """The whole of a tensor of n rows on every rank, from each rank's part_of(n) rows (`part`, its rows in order):
    one all_gather of the parts padded to the largest, then trimmed (one process: `part`). Work split over the ranks
    (the teacher's layer inputs, the evaluation's windows) is put back together with it."""
    if not _active():
        return part
    import torch.distributed as dist

    size = dist.get_world_size()
    counts = [len(range(n)[part_of(n, r, size)]) for r in range(size)]
    if part.shape[0] != counts[dist.get_rank()]:
        raise ValueError(f"rank {dist.get_rank()} holds {part.shape[0]} rows of {n}; its share is "
                         f"{counts[dist.get_rank()]}")
    padded = torch.zeros((max(counts), *part.shape[1:]), dtype=part.dtype, device=_device())
    padded[: part.shape[0]] = part.detach()
    parts = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(parts, padded)
    return torch.cat([t[:c] for t, c in zip(parts, counts)]).to(part.device)


def gather_objects(obj) -> list:
    """Every rank's `obj`, in rank order, on every rank (all_gather_object on the training group: pickled between the
    job's own processes; small things only, e.g. the teacher's answers on the windows a rank scored)."""
    if not _active():
        return [obj]
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# -- what rank 0 alone makes ---------------------------------------------------------------------------
# (the teacher's text, a file only it can read). patient=True goes through a second gloo group with a long timeout
# (patient_s), since the others may wait minutes for rank 0 where a training collective waits seconds. Objects travel
# pickled between the job's own processes (broadcast_object_list); nothing read from disk is unpickled.
def broadcast_object(obj=None, *, patient: bool = True):
    """Rank 0's `obj` on every rank (the others pass anything); patient: through the long-timeout gloo group."""
    if not _active():
        return obj
    import torch.distributed as dist

    box = [obj]
    group = _groups.get("patient") if patient else None
    dist.broadcast_object_list(box, src=0, group=group, device=None if group is not None else _device())
    return box[0]


def broadcast_tensors(tensors=None, *, patient: bool = True) -> list[torch.Tensor]:
    """Rank 0's list of tensors on every rank, on CPU (the others pass None): shapes and dtypes first, then the data."""
    if not _active():
        return list(tensors)
    import torch.distributed as dist

    meta = broadcast_object(None if tensors is None else [(tuple(t.shape), t.dtype) for t in tensors],
                            patient=patient)
    group = _groups.get("patient") if patient else None
    device = torch.device("cpu") if group is not None else _device()
    out = []
    for k, (shape, dtype) in enumerate(meta):
        t = tensors[k].detach().to(device).contiguous() if dist.get_rank() == 0 else \
            torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(t, src=0, group=group)
        out.append(t.cpu())
    return out


class Relayed(ValueError):
    """Rank 0's error, raised again on another rank that waited for rank 0 (rank 0 reports it; the others need not)."""


def from_rank0(make, *, carry: tuple = (ValueError,)):
    """make() run on rank 0 alone, its result on every rank; an error of a `carry` type (or runtime.Stopped) that
    make() raises on rank 0 is raised on every rank, with its message (one process: make())."""
    from ..runtime.budget import Stopped

    if not _active():
        return make()
    import torch.distributed as dist

    payload = None
    if dist.get_rank() == 0:
        try:
            payload = ("ok", make())
        except Stopped as e:
            payload = ("stopped", e.reason, str(e))
        except carry as e:
            payload = ("error", type(e), str(e))
        except BaseException as e:  # anything else: the others must not wait for a broadcast that never comes
            broadcast_object(("failed", type(e).__name__, str(e).splitlines()[0] if str(e) else ""))
            raise
    payload = broadcast_object(payload)
    if payload[0] == "ok":
        return payload[1]
    if payload[0] == "stopped":
        raise Stopped(payload[1], payload[2])
    if payload[0] == "error":
        raise payload[1](payload[2])
    raise RuntimeError(f"rank 0 failed ({payload[1]}: {payload[2]})")


# -- the trained part ------------------------------------------------------------------------------
# With DDP every rank holds the whole student and teacher, and the gradients are averaged over the ranks. FSDP2
# (fully_shard over a one-dimensional device mesh) all-gathers the weights for each forward and backward and
# reduce-scatters the averaged gradients: each rank keeps 1/N of the trained weights, their gradients and the
# optimizer's moments; the frozen teacher is sharded too (shard_frozen) and gathered whole for evaluations (whole).
# Checkpoints hold the one-process format (full_state_dict, full_optimizer_state: parameters by index), so a
# checkpoint of N ranks resumes at any number, one included; load_optimizer_state shards it again.
def _mesh(world: World):
    from torch.distributed.device_mesh import init_device_mesh

    if "mesh" not in _groups:
        _groups["mesh"] = init_device_mesh(world.device.type, (world.size,))
    return _groups["mesh"]


def _holds_tensor(value) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (tuple, list)):
        return any(_holds_tensor(v) for v in value)
    return isinstance(value, dict) and any(_holds_tensor(v) for v in value.values())


def replica(module: nn.Module) -> nn.Module:
    """A deep copy of a module (parameters, buffers, settings) without the caches derived from its weights (an MLA's
    absorbed weights): the copy derives its own."""
    state = ("_parameters", "_buffers", "_modules")
    held = [(sub, name, value) for sub in module.modules() for name, value in vars(sub).items()
            if name not in state and _holds_tensor(value)]
    try:
        for sub, name, _ in held:
            sub.__dict__[name] = None
        return copy.deepcopy(module)
    finally:
        for sub, name, value in held:
            sub.__dict__[name] = value


def wrap(module: nn.Module, world: World, shard: bool = False) -> nn.Module:
    """The module under DDP (a new wrapper around it), or with shard=True under FSDP2 (the module itself, changed in
    place: its parameters become DTensor shards). One process: the module unchanged (shard=True: ValueError)."""
    if shard and not world.distributed:
        raise ValueError(f"sharding (FSDP2) needs a process group of 2 or more ranks; this world has {world.size}")
    if not world.distributed:
        return module
    if shard:
        from torch.distributed.fsdp import fully_shard

        return fully_shard(module, mesh=_mesh(world))
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    # buffers (rotary frequencies) are equal on every rank and never change: no broadcast before each forward
    quiet = ({"forward_sync_buffers": False}
             if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
             else {"broadcast_buffers": False})
    ids = [world.device.index] if world.device.type == "cuda" else None
    return DistributedDataParallel(module, device_ids=ids, **quiet)


def shard_frozen(model: nn.Module, world: World, units) -> nn.Module:
    """FSDP2 over a frozen model (the teacher), in place: each of `units` (its attention modules first, then its
    decoder layers: nested, so that a layer-wise step can call one attention module alone) a unit of its own, then
    the root. Every rank keeps 1/N of the weights; each unit's forward all-gathers its own and frees them after, so
    every forward is a collective that all ranks must run together. whole() gathers it for good."""
    from torch.distributed.fsdp import fully_shard

    mesh = _mesh(world)
    for unit in units:
        fully_shard(unit, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def whole(model: nn.Module, gathered: bool = True) -> None:
    """gathered=True: every FSDP2 unit of a model sharded by shard_frozen all-gathers its weights and keeps them, so
    that the model and any part of it (attnlab's generation loop calls a layer's norms and MLP one by one) run on one
    rank alone, with no collective (an evaluation whose length differs by rank, rank 0's report after the heal);
    False: back to shards. A collective: every rank calls it. No-op for a model without FSDP2 units."""
    from torch.distributed.fsdp import FSDPModule

    for unit in (m for m in model.modules() if isinstance(m, FSDPModule)):
        unit.set_reshard_after_forward(not gathered, recurse=False)
        if gathered:
            unit.unshard()
        else:
            unit.reshard()


def sharded(module: nn.Module) -> bool:
    """True for a module under FSDP2 (fully_shard)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def full_state_dict(module: nn.Module) -> dict:
    """The module's unsharded state dict on every rank: under FSDP2 gathered (get_model_state_dict, full_state_dict;
    a collective: every rank calls it); a plain or DDP module's own tensors otherwise."""
    if isinstance(module, nn.parallel.DistributedDataParallel):
        module = module.module
    if not sharded(module):
        return module.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))


def full_optimizer_state(module: nn.Module, optimizer) -> dict:
    """optimizer.state_dict() as one process would have it (parameters by index, unsharded tensors), on rank 0;
    for FSDP2 gathered from the shards (a collective: every rank calls it; the others get {})."""
    if not sharded_params(optimizer):
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    full = get_optimizer_state_dict(module, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not full:
        return {}
    index, groups, n = {}, [], 0
    for g in full["param_groups"]:
        names = list(g["params"])
        index.update({name: n + k for k, name in enumerate(names)})
        groups.append({**g, "params": list(range(n, n + len(names)))})
        n += len(names)
    return {"state": {index[name]: s for name, s in full["state"].items()}, "param_groups": groups}


def load_optimizer_state(module: nn.Module, optimizer, state: dict) -> None:
    """Load a one-process optimizer state (full_optimizer_state's format) into an optimizer of plain parameters, or
    of FSDP2 shards (every rank passes the full state; each keeps its shard)."""
    if not sharded_params(optimizer):
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    names = {p: name for name, p in module.named_parameters()}
    order = [names[p] for g in optimizer.param_groups for p in g["params"]]
    given = [k for g in state["param_groups"] for k in g["params"]]
    if len(given) != len(order):
        raise ValueError(f"the optimizer state holds {len(given)} parameters and this optimizer {len(order)}")
    by_name = dict(zip(given, order))
    full = {"state": {by_name[k]: s for k, s in state["state"].items()},
            "param_groups": [{**g, "params": [by_name[k] for k in g["params"]]} for g in state["param_groups"]]}
    set_optimizer_state_dict(module, optimizer, optim_state_dict=full, options=StateDictOptions(full_state_dict=True))


def sharded_params(optimizer) -> bool:
    """True when the optimizer's parameters are DTensor shards (FSDP2)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for g in optimizer.param_groups for p in g["params"])


# -- failures ----------------------------------------------------------------------------------------
# A rank that dies makes the others fail at their next collective: gloo raises a RuntimeError ("Connection closed by
# peer", "Timed out waiting"), NCCL a torch.distributed.DistError.
def collective_failure(e: BaseException) -> bool:
    """True for the error a collective raises when a peer stopped answering (died, or exceeded the timeout)."""
    try:
        from torch.distributed import DistError
    except ImportError:  # a build without torch.distributed
        return False
    if isinstance(e, DistError):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and ("gloo" in text or "Connection closed by peer" in text
                                            or "Connection reset by peer" in text or "Timed out waiting" in text)
