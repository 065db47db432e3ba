"""What a heal phase trains, wrapped for the ranks of a torchrun job (TrainedPart): the module the optimizer steps and
the one a step calls.

One process: the layer-wise phase's attention module, or the end-to-end phase's student. With DDP (distributed.py)
the called part is their DDP wrapper; with FSDP2 (shard=True) each trained attention module gets a sharded twin.
"""
from __future__ import annotations

from torch import nn

from . import distributed as dd


class TrainedPart:
    """The trained part of `student` for one phase and layer at a time (module docstring). attn: the student's
    attention modules in order; layers: those the heal trains (default all). After wrap(): `owner` holds the
    parameters the optimizer updates (FSDP2: the twins), `part` is what a step calls."""

    def __init__(self, student: nn.Module, attn: list[nn.Module], world: dd.World, shard: bool, device,
                 layers=None):
        self.student, self.attn, self.world, self.shard, self.device = student, attn, world, shard, device
        self.layers = list(range(len(attn))) if layers is None else list(layers)  # the trained ones
        self.part = self.owner = None
        self._twins: dict[int, nn.Module] = {}
        self._attached = False

    def wrap(self, phase: str, layer: int) -> list[nn.Parameter]:
        """Wrap what `phase` trains (after letting go of the last part); returns the parameters to optimise."""
        self.release()
        if self.world.distributed:
            self.student.to(self.device)  # DDP and FSDP2 take modules on their device
        if self.shard:
            wanted = [layer] if phase == "layers" else self.layers
            for i in wanted:
                self._twins[i] = dd.wrap(dd.replica(self.attn[i]), self.world, shard=True)
            self.owner = nn.ModuleList(self._twins[i] for i in wanted)  # the optimizer's parameters, in order
            self.part = self._twins[layer] if phase == "layers" else self.student  # attached to step
        else:
            self.owner = self.attn[layer] if phase == "layers" else self.student
            self.part = dd.wrap(self.owner, self.world)
        return [p for p in self.owner.parameters() if p.requires_grad]

    def _swap(self, old: nn.Module, new: nn.Module) -> None:
        for parent in self.student.modules():
            for name, child in parent.named_children():
                if child is old:
                    setattr(parent, name, new)
                    return
        raise ValueError("an attention module is no longer in the student")  # pragma: no cover - a bug

    # FSDP2: each twin is distributed.replica, then fully_shard. The layer-wise phase calls its layer's twin; the
    # end-to-end phase swaps the twins into the student for the training steps only (attach), so that an evaluation
    # between runs sees the student's own modules and runs no collective, and gathers the twins' full weights back
    # into those modules (sync) before a checkpoint, a guard's comparison or the end (detach, release).
    def attach(self, phase: str) -> None:
        """FSDP2, end-to-end: the sharded twins take their modules' places in the student, for the training steps."""
        if phase == "distill" and self._twins and not self._attached:
            for i, twin in self._twins.items():
                self._swap(self.attn[i], twin)
            self._attached = True

    def sync(self) -> None:
        """FSDP2: the twins' full weights into the student's own modules (a collective; every rank calls it)."""
        for i, twin in self._twins.items():
            self.attn[i].load_state_dict(dd.full_state_dict(twin))

    def detach(self, sync: bool = True) -> None:
        """FSDP2: the student's own modules back in place, holding the trained weights (twins and optimizer kept)."""
        if sync:
            self.sync()
        if self._attached:
            for i, twin in self._twins.items():
                self._swap(twin, self.attn[i])
            self._attached = False

    def release(self) -> None:
        """Let go of the wrapped part (its weights are the student's again): at a new layer or phase, at the end."""
        self.detach()
        self._twins, self.part, self.owner = {}, None, None
        if self.world.distributed:
            import gc
            gc.collect()  # a dropped DDP wrapper's gradient hooks go with it, before the next wrapper's backward

    def optimizer_state(self, optimizer) -> dict:
        """The optimizer's state in the one-process format (FSDP2: gathered by parameter index)."""
        return dd.full_optimizer_state(self.owner, optimizer) if self.shard else optimizer.state_dict()

    def load_optimizer_state(self, optimizer, state: dict) -> None:
        if self.shard:
            dd.load_optimizer_state(self.owner, optimizer, state)
        else:
            optimizer.load_state_dict(state)

