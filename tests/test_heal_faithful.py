"""The heal's faithfulness guards over 2 processes (gloo, CPU) against one process, the oracle: the end-to-end blow-up
guard's rollbacks (DDP and FSDP2: the same steps rolled back, the same weights, and a 2-process checkpoint written
right after a rollback resumes in one process to them) and the evaluation of several held-out texts (every rank
reports the one-process figures of each text and of all of them).

The same file is the workers' script (`python test_heal_faithful.py WORKDIR` with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT set, as torchrun sets them); tests/test_distributed.py has the pattern and says why float64 and 1e-9.
"""
import copy
import sys
from pathlib import Path

import pytest
import torch

T = 16
# end to end only, at a rate far too large (tests/test_heal.py: the blow-up guard's case), 12 steps
PLAN = dict(seq_len=T, batch_size=4, tokens=4 * T * 12, layer_steps=0, layer_windows=8, layer_batch=4,
            layer_lr=1e-3, lr=1.0, warmup=2)
TOL = 1e-9
RUNS = {"ddp": False, "fsdp": True}


def _windows(n, seed):
    return torch.randint(0, 300, (n, T), generator=torch.Generator().manual_seed(seed))


def _texts():
    """Two held-out texts: 3 windows and a half, and 2 windows."""
    return [torch.randint(0, 300, (1, n), generator=torch.Generator().manual_seed(n)) for n in (3 * T + T // 2, 2 * T)]


def _weights(model):
    from attnlab.models import attnlab_modules

    return [v.detach().clone() for m in attnlab_modules(model) for v in m.state_dict().values()]


def _rel(a, b):
    return max(float((x - y).norm() / y.norm().clamp_min(1e-300)) for x, y in zip(a, b, strict=True))


def _models(work: Path):
    """(teacher, student) in float64; the student converted keeping most of the cache (tests/test_heal.py's
    _near_student: its end-to-end loss more than doubles at lr 1.0), its weights those the fixture wrote (a
    conversion in another process, with other threads, may differ in the last bits: a checkpoint's fingerprint would
    refuse it)."""
    from attnlab import models as hf

    teacher, _, _ = hf.load_model(str(work / "llama"))
    teacher = teacher.double()
    student = copy.deepcopy(teacher)
    hf.convert_model(student, "mla", latent_dim=28, rope_dim=8)
    if (work / "student.pt").is_file():
        student.load_state_dict(torch.load(work / "student.pt", weights_only=True))
    return teacher, student


def _run(teacher, student, *, world=None, shard=False, stop_at=None, checkpoint=None, restore=None):
    """Heal in place, stopping after the step of index stop_at; (status, the losses of every step, whether each was
    rolled back, the state)."""
    from attnlab.heal import HealPlan, Healer

    losses, rolled = [], []

    def progress(info):
        losses.append(info["loss"])
        rolled.append(info["rolled_back"])
        if len(losses) - 1 == stop_at and (world is None or world.main):
            healer.request_stop()  # rank 0 alone asks: the stop is agreed

    healer = Healer(teacher, student, _windows(32, seed=0), HealPlan(**PLAN), world=world, shard=shard,
                    checkpoint=checkpoint, progress=progress)
    if restore is not None:
        healer.restore(Healer.read(restore))
    status = healer.run()
    return status, losses, rolled, healer.state


def _figures(result):
    keys = ("perplexity", "top1_agreement", "kl", "tokens", "windows")
    return {k: result[k] for k in keys} | {"texts": [{k: t[k] for k in keys} for t in result["texts"]]}


def _evaluation(teacher, student, world=None):
    """evaluate_texts before and after (with the reference) on the two held-out texts."""
    from attnlab.heal.evaluate import evaluate_texts

    kw = dict(window=T, prompts=3, prompt_len=8, new_tokens=4, world=world)
    before = evaluate_texts(teacher, student, _texts(), **kw)
    with torch.no_grad():  # the student moves a little: the figures after differ from before
        for p in student.parameters():
            p.mul_(1.01)
    after = evaluate_texts(teacher, student, _texts(), reference=before, **kw)
    return {"before": _figures(before), "after": _figures(after)}


def _worker(work: Path) -> None:
    from attnlab.heal.distributed import close_world, init_world

    torch.set_num_threads(1)
    world = init_world("cpu", timeout_s=60)
    try:
        teacher, student = _models(work)
        torch.save(_evaluation(teacher, student, world), work / f"eval.rank{world.rank}.pt")
        for name, shard in RUNS.items():
            stops = {}  # the stopped runs: right after the first rollback, and right before the second
            for tag in (name, f"{name}_after", f"{name}_before"):
                teacher, student = _models(work)
                status, losses, rolled, state = _run(teacher, student, world=world, shard=shard, stop_at=stops.get(tag),
                                                     checkpoint=work / f"{tag}.ckpt" if tag != name else None)
                if tag == name:
                    first = rolled.index(True)
                    stops = {f"{name}_after": first, f"{name}_before": rolled.index(True, first + 1) - 1}
                torch.save({"status": status, "losses": losses, "rolled": rolled, "rollbacks": state["rollbacks"],
                            "lr_scale": state["lr_scale"], "weights": _weights(student)},
                           work / f"{tag}.rank{world.rank}.pt")
    finally:
        close_world(world)


def _env(**kw):
    """This environment without a torchrun job's variables, plus a free local rendezvous and `kw`."""
    import os
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1", **kw}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(folder, the one-process oracle (status, losses, rolled, state), its final weights): the workers' results
    beside them."""
    import subprocess

    from tiny_checkpoints import make_checkpoint

    work = tmp_path_factory.mktemp("faithful")
    make_checkpoint("llama", work / "llama", initializer_range=0.3)
    torch.save(_models(work)[1].state_dict(), work / "student.pt")
    env = _env(WORLD_SIZE="2")
    procs = [subprocess.Popen([sys.executable, __file__, str(work)], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
    teacher, student = _models(work)
    oracle = _run(teacher, student)
    return work, oracle, _weights(student)


@pytest.mark.parametrize("name", list(RUNS))
def test_two_processes_roll_back_the_one_process_steps_and_reach_its_weights(runs, name):
    """DDP and FSDP2 over 2 ranks: the same steps rolled back (the decision is taken on the whole batch's loss, the
    same on every rank), the same cut rate, the one-process weights and losses to float64 rounding."""
    work, (status, losses, rolled, state), weights = runs
    assert status == "done" and len(state["rollbacks"]) >= 2 and sum(rolled) == len(state["rollbacks"])
    for rank in range(2):
        got = torch.load(work / f"{name}.rank{rank}.pt", weights_only=True)
        assert got["status"] == "done" and got["rolled"] == rolled and got["lr_scale"] == state["lr_scale"]
        assert [r["step"] for r in got["rollbacks"]] == [r["step"] for r in state["rollbacks"]]
        assert got["losses"] == pytest.approx(losses, rel=TOL)
        assert _rel(got["weights"], weights) <= TOL, (name, rank, _rel(got["weights"], weights))


@pytest.mark.parametrize("when", ["after", "before"])
@pytest.mark.parametrize("name", list(RUNS))
def test_a_two_process_run_stopped_around_a_rollback_resumes_in_one_process(runs, name, when):
    """The checkpoint written by rank 0 right after a rollback, or right before one (its last good weights then differ
    from its weights, and the resumed run must go back to them), gathered from the ranks' shards under FSDP2, resumes
    in one process to the uninterrupted 2-process run's weights."""
    work, _, _ = runs
    stopped = [torch.load(work / f"{name}_{when}.rank{r}.pt", weights_only=True) for r in range(2)]
    assert [s["status"] for s in stopped] == ["stopped", "stopped"]
    assert stopped[0]["rolled"][-1] == (when == "after") and stopped[0]["rolled"].count(True) == 1
    teacher, student = _models(work)
    status, losses, rolled, state = _run(teacher, student, restore=work / f"{name}_{when}.ckpt")
    assert rolled[0] == (when == "before")
    straight = torch.load(work / f"{name}.rank0.pt", weights_only=True)
    assert status == "done" and [(r["step"], r["lr_scale"]) for r in state["rollbacks"]] == \
        [(r["step"], r["lr_scale"]) for r in straight["rollbacks"]]
    assert losses == pytest.approx(straight["losses"][len(stopped[0]["losses"]):], rel=TOL)
    assert _rel(_weights(student), straight["weights"]) <= TOL


def test_two_processes_report_the_one_process_figures_of_each_held_out_text(runs):
    """evaluate_texts over 2 ranks (each text's windows split): every rank reports the one-process KL, top-1
    agreement and perplexity of each text and of both, before and after."""
    work, _, _ = runs
    teacher, student = _models(work)
    one = _evaluation(teacher, student)
    assert len(one["before"]["texts"]) == 2 and one["after"]["kl"] != one["before"]["kl"]
    for rank in range(2):
        got = torch.load(work / f"eval.rank{rank}.pt", weights_only=True)
        for when in ("before", "after"):
            for part, want in [(got[when], one[when]), *zip(got[when]["texts"], one[when]["texts"], strict=True)]:
                for k in ("perplexity", "top1_agreement", "kl", "tokens", "windows"):
                    assert part[k] == pytest.approx(want[k], rel=1e-12, abs=0), (rank, when, k)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    _worker(Path(sys.argv[1]))
