"""Data-parallel healing (attnlab.heal.distributed) against the one-process run, the oracle.

Two processes on CPU (gloo) heal a tiny float64 Llama with DDP and with FSDP2 at the global batch
of the one-process run; the final weights and the loss curves must be the oracle's to float64
rounding. A 2-process run stopped after k steps resumes in one process to the weights of an
uninterrupted 2-process run. The same file is the workers' script: `python test_distributed.py
WORKDIR` with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set, as torchrun would set them.

The tolerance: in float64 the two runs differ only in the order of floating-point sums (each rank
sums half the rows, then the gradients are averaged; FSDP2 also sums a norm in pieces), about
1e-16 relative per step. AdamW's step is a ratio of moments, so a relative error of the gradient
stays a relative error of the step (it is not amplified by 1/eps unless a gradient element is
~1e-8, where the error is 1e-16 absolute); over the 10 steps here that is ~1e-14. The asserted
1e-9 relative leaves five orders of margin and is still 7 orders below a float32 run's (or a
wrong split's: one row missing moves the weights by ~1e-3).
"""
import copy
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

T = 16  # tokens per window
PLAN = dict(seq_len=T, batch_size=4, tokens=4 * T * 4, layer_steps=3, layer_windows=8, layer_batch=4,
            layer_lr=1e-3, lr=2e-3, warmup=2)  # 2 layers x 3 layer-wise steps, then 4 end-to-end steps
STEPS = 2 * 3 + 4
RUNS = {"ddp": (False, None), "fsdp": (True, None),  # name: (shard, stop after this many steps)
        "ddp_stop": (False, 4), "fsdp_stop": (True, 8),  # inside layer 1; inside the end-to-end phase
        "fsdp_layer_stop": (True, 4),
        "ddp_student": (False, None), "fsdp_student": (True, None)}  # layer_inputs "student" (the stream each rank)
TOL = 1e-9


def _windows(n, seed):
    return torch.randint(0, 300, (n, T), generator=torch.Generator().manual_seed(seed))


def _weights(model):
    from attnlab.models import attnlab_modules

    return [v.detach().clone() for m in attnlab_modules(model) for v in m.state_dict().values()]


def _rel(a, b):
    """The largest relative difference over a list of tensors (each measured against its own norm)."""
    return max(float((x - y).norm() / y.norm().clamp_min(1e-300)) for x, y in zip(a, b, strict=True))


def _models(work: Path):
    """(teacher, student) in float64: the teacher from the tiny folder, the student's weights from the file."""
    from attnlab import models as hf

    teacher, _, _ = hf.load_model(str(work / "llama"))
    teacher = teacher.double()
    student = copy.deepcopy(teacher)
    hf.convert_model(student, "mla", latent_dim=12, rope_dim=4)
    student.load_state_dict(torch.load(work / "student.pt", weights_only=True))
    return teacher, student


def _local_share(model) -> float:
    """The share of a model's parameter values this rank holds (1.0 unsharded; about 1/N under FSDP2 shards)."""
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    held = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params)
    return held / max(1, sum(p.numel() for p in params))


def _run(teacher, student, *, world=None, shard=False, stop_at=None, checkpoint=None, restore=None,
         inputs="teacher"):
    """Heal in place; (status, the loss after every step, the state, rows): rows["model"] and rows["layer0"] list
    the rows of every call of the teacher and of its first attention layer, the batches this process computed;
    rows["teacher_share"] the share of the teacher's values this process held while it trained."""
    from attnlab.heal import HealPlan, Healer
    from attnlab.models import attnlab_modules

    losses, rows = [], {"model": [], "layer0": []}

    def progress(info):
        losses.append(info["loss"])
        if stop_at is not None and len(losses) == stop_at and (world is None or world.main):
            healer.request_stop()  # rank 0 alone asks: the stop is agreed, every rank stops here

    healer = Healer(teacher, student, _windows(32, seed=0), HealPlan(**PLAN, layer_inputs=inputs), world=world,
                    shard=shard,
                    checkpoint=checkpoint, progress=progress)
    if restore is not None:
        healer.restore(Healer.read(restore))
    rows["teacher_share"] = _local_share(teacher)
    hooks = [m.register_forward_pre_hook(lambda mod, args, kw, key=key: rows[key].append(
        (args[0] if args else kw["input_ids"]).shape[0]), with_kwargs=True)
        for key, m in (("model", teacher), ("layer0", attnlab_modules(teacher)[0]))]
    try:
        status = healer.run()
    finally:
        for h in hooks:
            h.remove()
    return status, losses, healer.state, rows


def _worker(work: Path) -> None:
    """One rank: every run of RUNS, its results in work/NAME.rankR.pt."""
    from attnlab.heal.distributed import close_world, init_world

    torch.set_num_threads(1)
    world = init_world("cpu", timeout_s=60)
    first, base = _models(work)
    try:
        teacher, student = copy.deepcopy(first), copy.deepcopy(base)
        torch.save(_evaluation(teacher, student, world), work / f"eval.rank{world.rank}.pt")
        teacher, student = copy.deepcopy(first), copy.deepcopy(base)
        torch.save(_probed(teacher, student, world), work / f"probe.rank{world.rank}.pt")
        for name, (shard, stop_at) in RUNS.items():
            teacher, student = copy.deepcopy(first), copy.deepcopy(base)  # FSDP2 shards its teacher in place
            status, losses, state, rows = _run(teacher, student, world=world, shard=shard, stop_at=stop_at,
                                               checkpoint=work / f"{name}.ckpt" if stop_at else None,
                                               inputs="student" if name.endswith("_student") else "teacher")
            torch.save({"status": status, "losses": torch.tensor(losses, dtype=torch.float64), "rows": rows,
                        "layer_losses": state["layer_losses"], "distill_losses": state["distill_losses"],
                        "tokens": state["tokens"], "weights": _weights(student)},
                       work / f"{name}.rank{world.rank}.pt")
    finally:
        close_world(world)


HELD = 5 * T + T // 2  # held-out tokens: 6 windows of T (the last shorter), 3 rounds of 2 ranks


def _evaluation(teacher, student, world=None) -> dict:
    """evaluate_pair before and after (with the reference) on held-out ids, the windows each model scored here (its
    forward calls) and the batch sizes its first attention layer saw (the greedy continuations go through attnlab's
    loop, layer by layer, a batch of this rank's prompts): the evaluation the heal runs, split over the ranks when
    `world` has several."""
    from attnlab.heal.evaluate import evaluate_pair
    from attnlab.models import attnlab_modules

    held = torch.randint(0, 300, (1, HELD), generator=torch.Generator().manual_seed(7))
    calls = {"teacher": [], "student": [], "teacher_layer0": [], "student_layer0": []}
    watched = [("teacher", teacher), ("student", student), ("teacher_layer0", attnlab_modules(teacher)[0]),
               ("student_layer0", attnlab_modules(student)[0])]
    hooks = [m.register_forward_pre_hook(lambda mod, args, kw, key=key: calls[key].append(
        (args[0] if args else kw.get("input_ids", kw.get("hidden_states"))).shape[0]), with_kwargs=True)
        for key, m in watched]
    try:
        before = evaluate_pair(teacher, student, held, window=T, prompts=5, prompt_len=8, new_tokens=4, world=world)
        windows = {k: len(calls[k]) for k in ("teacher", "student")}
        batches = {k: sorted(set(calls[k])) for k in ("teacher_layer0", "student_layer0")}
        after = evaluate_pair(teacher, student, held, window=T, prompts=5, prompt_len=8, new_tokens=4,
                              reference=before, world=world)
    finally:
        for h in hooks:
            h.remove()
    figures = lambda r: {k: r[k] for k in ("perplexity", "top1_agreement", "tokens", "windows")} | {  # noqa: E731
        "greedy": [r["greedy_agreement"][k] for k in ("prefix", "tokens")]} | (
        {"teacher_perplexity": r["teacher_perplexity"]} if "teacher_perplexity" in r else {})
    return {"before": figures(before), "after": figures(after), "windows": windows, "batches": batches,
            "teacher_top": before["_teacher_top"], "teacher_tokens": before["greedy_agreement"]["teacher_tokens"]}


def _probed(teacher, student, world=None) -> dict:
    """heal_model with a probe (the end-to-end phase first, judged on held-out windows at step 3 of 4): its verdict
    and the final weights (DDP over the ranks of `world`)."""
    from attnlab.heal import HealPlan, heal_model

    held = torch.randint(0, 300, (1, HELD), generator=torch.Generator().manual_seed(7))
    report = heal_model(teacher, student, _windows(32, seed=0), held, HealPlan(**PLAN, probe=0.5), world=world,
                        keep_better=False)
    return {"probe": report["probe"], "weights": _weights(student)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**kw):
    """This environment without a torchrun job's variables, plus a free local rendezvous and `kw`."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1", **kw}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(folder, the one-process oracle's (status, losses, state, rows) and final weights, teacher, student before
    training): the tiny models on disk, the two workers' results beside them, the oracle run in this process."""
    from tiny_checkpoints import make_checkpoint

    from attnlab import models as hf

    work = tmp_path_factory.mktemp("dist")
    make_checkpoint("llama", work / "llama", initializer_range=0.3)
    teacher, _, _ = hf.load_model(str(work / "llama"))
    teacher = teacher.double()
    base = copy.deepcopy(teacher)
    hf.convert_model(base, "mla", latent_dim=12, rope_dim=4)
    torch.save(base.state_dict(), work / "student.pt")
    env = _env(WORLD_SIZE="2")
    procs = [subprocess.Popen([sys.executable, __file__, str(work)], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
    student = copy.deepcopy(base)
    oracle = _run(teacher, student)
    return work, oracle, _weights(student), teacher, base


def _result(work, name, rank):
    return torch.load(work / f"{name}.rank{rank}.pt", weights_only=True)


@pytest.mark.parametrize("name", ["ddp", "fsdp"])
def test_two_processes_give_the_one_process_weights_and_loss_curve(runs, name):
    """DDP and FSDP2 over 2 ranks, layer-wise then end-to-end, at the oracle's global batch of 4 windows; under FSDP2
    each rank holds half of the teacher (sharded too, every teacher forward a collective) and the weights are still
    the oracle's."""
    work, (status, losses, state, rows), weights, _, base = runs
    assert status == "done" and len(losses) == STEPS
    for rank in range(2):
        got = _result(work, name, rank)
        # the teacher's layer inputs of the 8 layer-wise windows and the guard's 4 check windows: one process in
        # chunks of 8 and 4, each rank its 6 (split, then gathered); the guard's checks of layer 0 before and after
        # its steps, 4 windows on every rank; every training batch (3 layer-wise targets of 4 windows per layer, 4
        # end-to-end batches of 4) split in half
        assert rows["model"] == [8, 4] + [4] * 4 and rows["teacher_share"] == 1.0
        assert rows["layer0"] == [8, 4] + [4] + [4] * 3 + [4] + [4] * 4
        assert got["rows"] == {"model": [6] + [2] * 4, "layer0": [6] + [4] + [2] * 3 + [4] + [2] * 4,
                               "teacher_share": pytest.approx(0.5 if name == "fsdp" else 1.0, abs=0.01)}
        assert got["status"] == "done" and got["tokens"] == state["tokens"] == PLAN["tokens"]
        assert _rel(got["weights"], weights) <= TOL, (name, rank, _rel(got["weights"], weights))
        # the recorded losses are the whole batch's (the mean of the ranks'), the curve one process prints
        assert torch.allclose(got["losses"], torch.tensor(losses, dtype=torch.float64), rtol=TOL, atol=0)
        assert got["layer_losses"] == pytest.approx(state["layer_losses"], rel=TOL)
        assert got["distill_losses"] == pytest.approx(state["distill_losses"], rel=TOL)
    assert _rel(weights, _weights(base)) > 1e-2  # the comparison is not between untrained weights


@pytest.mark.parametrize("name", ["ddp_student", "fsdp_student"])
def test_two_processes_on_the_students_own_inputs_give_the_one_process_weights(runs, name):
    """layer_inputs "student": every rank carries the whole residual stream through the student's layers (the
    windows gathered first), so DDP and FSDP2 over 2 ranks end with the weights of one process on the same plan."""
    work, _, _, teacher, base = runs
    student = copy.deepcopy(base)
    status, losses, _, _ = _run(copy.deepcopy(teacher), student, inputs="student")
    assert status == "done" and len(losses) == STEPS
    for rank in range(2):
        got = _result(work, name, rank)
        assert got["status"] == "done"
        assert _rel(got["weights"], _weights(student)) <= TOL, (name, rank, _rel(got["weights"], _weights(student)))
        assert torch.allclose(got["losses"], torch.tensor(losses, dtype=torch.float64), rtol=TOL, atol=0)


def test_two_processes_split_the_evaluation_and_both_report_the_one_process_figures(runs):
    """evaluate_pair over 2 ranks: 6 windows scored 3 by each rank (none twice), the 5 prompts of greedy agreement
    split 3 and 2, and both ranks return the one-process figures, before and after (the reference's windows and
    cached answers), to float64 rounding of sums in another order; the teacher's answers gathered whole."""
    work, _, _, teacher, base = runs
    one = _evaluation(teacher, copy.deepcopy(base))
    # one process, before training: each model scores the 6 windows, a batch of 1 each, and continues the 5 prompts
    # as one batch
    assert one["before"]["windows"] == 6 and one["windows"] == {"teacher": 6, "student": 6}
    assert one["batches"] == {"teacher_layer0": [1, 5], "student_layer0": [1, 5]}
    for rank in range(2):
        got = torch.load(work / f"eval.rank{rank}.pt", weights_only=True)
        assert got["windows"] == {"teacher": 3, "student": 3}, got["windows"]  # 3 of the 6 windows
        prompts = 3 - rank  # 5 prompts: 3 on rank 0, 2 on rank 1
        assert got["batches"] == {"teacher_layer0": [1, prompts], "student_layer0": [1, prompts]}, got["batches"]
        for when in ("before", "after"):
            for k, v in one[when].items():
                assert got[when][k] == pytest.approx(v, rel=1e-12, abs=0), (rank, when, k)
        assert all(torch.equal(a, b) for a, b in zip(got["teacher_top"], one["teacher_top"], strict=True))
        assert torch.equal(got["teacher_tokens"], one["teacher_tokens"])


def test_two_processes_reach_the_one_process_probe_verdict_and_weights(runs):
    """The heal's probe over 2 ranks (DDP): both judge the end-to-end phase on the split evaluation, reach the verdict
    one process reaches on the same figures, and end with its weights."""
    work, _, _, teacher, base = runs
    one = _probed(copy.deepcopy(teacher), copy.deepcopy(base))
    assert one["probe"]["step"] == 3
    for rank in range(2):
        got = torch.load(work / f"probe.rank{rank}.pt", weights_only=True)
        assert got["probe"]["verdict"] == one["probe"]["verdict"] and got["probe"]["step"] == 3
        assert got["probe"]["perplexity"] == pytest.approx(one["probe"]["perplexity"], rel=1e-12)
        assert _rel(got["weights"], one["weights"]) <= TOL


@pytest.mark.parametrize("name", ["ddp_stop", "fsdp_stop", "fsdp_layer_stop"])
def test_a_two_process_run_stopped_after_k_steps_resumes_in_one_process(runs, name):
    """The 2-process checkpoint (written by rank 0 alone, in the one-process format; FSDP2's gathered from the shards of
    one layer, or of every layer) resumes in one process to the weights of the uninterrupted 2-process run."""
    work, _, _, teacher, base = runs
    stopped = [_result(work, name, r) for r in range(2)]
    k = RUNS[name][1]
    assert [s["status"] for s in stopped] == ["stopped", "stopped"] and [len(s["losses"]) for s in stopped] == [k, k]
    student = copy.deepcopy(base)
    status, losses, _, _ = _run(teacher, student, restore=work / f"{name}.ckpt")
    assert status == "done" and len(losses) == STEPS - k
    straight = _result(work, name.split("_")[0], 0)
    assert _rel(_weights(student), straight["weights"]) <= TOL
    assert torch.allclose(torch.tensor(losses, dtype=torch.float64), straight["losses"][k:], rtol=TOL, atol=0)


@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_parts_cover_every_item_once_in_rank_order_and_differ_by_at_most_one(size):
    """distributed.part_of, which splits the evaluation's windows and the teacher's layer inputs: the ranks' slices
    laid end to end are range(n), in rank order, and no share is more than one item larger than another."""
    from attnlab.heal.distributed import World, part_of

    for n in range(0, 13):
        parts = [range(n)[part_of(n, r, size)] for r in range(size)]
        assert [i for p in parts for i in p] == list(range(n))
        assert max(map(len, parts)) - min(map(len, parts)) <= 1
        assert [World(rank=r, size=size).part(n) for r in range(size)] == [part_of(n, r, size) for r in range(size)]


def test_a_batch_that_does_not_split_over_the_processes_is_refused_before_any_work(runs):
    from attnlab.heal import HealPlan, Healer
    from attnlab.heal.distributed import World

    _, _, _, teacher, base = runs
    student = copy.deepcopy(base)
    two = World(rank=0, size=2, backend="gloo")  # no process group is needed to refuse it
    with pytest.raises(ValueError, match=r"batch_size 3 does not split over 2 processes"):
        Healer(teacher, student, _windows(32, 0), HealPlan(**{**PLAN, "batch_size": 3}), world=two)
    with pytest.raises(ValueError, match=r"layer-wise batch of 3 windows \(layer_batch 4, at most the 3 layer-wise "
                                         r"windows\) does not split over 2 processes"):
        Healer(teacher, student, _windows(32, 0), HealPlan(**{**PLAN, "layer_windows": 3}), world=two)
    with pytest.raises(ValueError, match=r"shard=True \(FSDP2\) needs a process group of 2 or more ranks; the world "
                                         r"has 1"):
        Healer(teacher, student, _windows(32, 0), HealPlan(**PLAN), shard=True)


def test_torchrun_heal_writes_what_one_process_writes(runs, tmp_path, capsys):
    """`torchrun --nproc-per-node 2 -m attnlab heal --shard` (FSDP2; DDP is the Healer's tests') against `attnlab heal`
    in one process, on the tiny converted folder (float32, as convert writes it): the same report and weights; rank 0
    alone prints and writes. (The evaluation before training leaves derived caches in the student's attention: the
    sharded copies are made after it, as in every real run.)

    In float32 the order of sums changes each gradient by ~1e-7 relative, and AdamW's steps keep that relative size:
    the two runs' changes of the weights differ by ~1e-5 of their size (measured 9.5e-6), asserted <= 1e-3; a wrong
    split (the layer-wise loss over a rank's own target power) differs by ~1e-1. The losses: measured 3e-7."""
    from tiny_checkpoints import TEXT

    from attnlab import models as hf
    from attnlab.cli import main

    work = runs[0]
    conv, text = tmp_path / "conv", tmp_path / "train.txt"
    text.write_text(TEXT * 12)
    assert main(["convert", str(work / "llama"), "--to", "mla", "--latent-dim", "12", "--rope-dim", "4", "--out",
                 str(conv)]) == 0
    args = ["heal", str(conv), "--text", str(text), "--tokens", str(4 * T * 4), "--seq-len", str(T),
            "--layer-steps", "1", "--layer-batch", "4", "--lr", "1e-3", "--keep-worse"]  # the heal's weights
    assert main([*args, "--out", str(tmp_path / "one")]) == 0
    capsys.readouterr()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "attnlab", *args, "--shard", "--out", str(tmp_path / "two")],
                          env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.count(f"wrote {tmp_path / 'two'}") == 1  # rank 0 alone prints
    one, two = (json.loads((tmp_path / d / "config.json").read_text())["heal"] for d in ("one", "two"))
    assert two["status"] == one["status"] == "done" and two["distill_tokens"] == one["distill_tokens"]
    assert two["layer_losses"] == pytest.approx(one["layer_losses"], rel=1e-4)
    assert two["distill_loss_last"] == pytest.approx(one["distill_loss_last"], rel=1e-4)
    assert two["after"]["perplexity"] == pytest.approx(one["after"]["perplexity"], rel=1e-4)
    before = _weights(hf.load_model(str(conv))[0])
    a, b = _weights(hf.load_model(str(tmp_path / "one"))[0]), _weights(hf.load_model(str(tmp_path / "two"))[0])
    moved = [x - y for x, y in zip(a, before)]
    assert _rel([x - y for x, y in zip(b, before)], moved) <= 1e-3 and _rel(a, before) > 1e-3
    assert not list(tmp_path.glob(".two.attnlab-lock")) and (tmp_path / "two.heal.pt").is_file()


def test_torchrun_shrink_plans_once_and_writes_what_one_process_writes(runs, tmp_path, capsys, monkeypatch):
    """`torchrun --nproc-per-node 2 -m attnlab shrink --shard` (FSDP2: the teacher sharded for the heal, whole again
    for rank 0's baselines after it) against `attnlab shrink` in one process, on the tiny Llama
    (float32), the heal's steps fixed (--tokens, --layer-steps) so that no timing enters: rank 0 alone plans, prints
    and writes; the plan and the heal's losses are the one-process run's (to 1e-4: float32 sums in another order; a
    wrong split of the layer-wise loss moves them by ~1e-1, the heal's torchrun test), and so are the weights; the
    others received the plan, the data and the converted student from rank 0 (no second text or plan)."""
    from tiny_checkpoints import TEXT

    from attnlab import models as hf
    from attnlab.cli import main

    monkeypatch.setenv("ATTNLAB_CPU_BF16", "0")  # float32 on any CPU: the sums are compared to 1e-4

    work = runs[0]
    text, held = tmp_path / "train.txt", tmp_path / "held.txt"
    text.write_text(TEXT * 40)
    held.write_text(TEXT[::-1] * 8)
    args = ["shrink", str(work / "llama"), "--kv-budget", "25%", "--text", str(text), "--eval-text", str(held),
            "--tokens", str(4 * T * 4), "--seq-len", str(T), "--layer-steps", "2", "--kv-dtype", "bf16"]
    assert main([*args, "--out", str(tmp_path / "one")]) == 0
    capsys.readouterr()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "attnlab", *args, "--shard", "--out", str(tmp_path / "two")],
                          env=_env(), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.count(f"wrote {tmp_path / 'two'}") == 1 and proc.stdout.count("plan for a KV budget") == 1
    one, two = (json.loads((tmp_path / d / "config.json").read_text())["shrink"] for d in ("one", "two"))
    # the same plan (the proxies to float32 rounding: torchrun runs each process on one thread, other sums)
    assert two["plan"]["chosen"]["label"] == one["plan"]["chosen"]["label"] and two["heal_plan"] == one["heal_plan"]
    assert [c["label"] for c in two["plan"]["candidates"]] == [c["label"] for c in one["plan"]["candidates"]]
    assert [c["proxy"] for c in two["plan"]["candidates"]] == pytest.approx(
        [c["proxy"] for c in one["plan"]["candidates"]], rel=1e-4)
    h1, h2 = one["heal"], two["heal"]
    assert h2["status"] == h1["status"] == "done" and h2["distill_tokens"] == h1["distill_tokens"]
    assert h2["layer_losses"] == pytest.approx(h1["layer_losses"], rel=1e-4)
    assert h2["distill_loss_last"] == pytest.approx(h1["distill_loss_last"], rel=1e-4)
    assert two["held_out"]["after"]["perplexity"] == pytest.approx(one["held_out"]["after"]["perplexity"], rel=1e-4)
    assert two["held_out"]["teacher"]["perplexity"] == pytest.approx(one["held_out"]["teacher"]["perplexity"], rel=1e-5)
    scored = [[(r["kv_dtype"], r["perplexity"] or 0.0) for r in x["baselines"]["rows"]] for x in (one, two)]  # rank 0
    assert [k for k, _ in scored[1]] == [k for k, _ in scored[0]] and any(p for _, p in scored[0])  # alone, after
    assert [p for _, p in scored[1]] == pytest.approx([p for _, p in scored[0]], rel=1e-5)  # the heal: a whole teacher
    a, b = _weights(hf.load_model(str(tmp_path / "one"))[0]), _weights(hf.load_model(str(tmp_path / "two"))[0])
    assert _rel(b, a) <= 1e-3
    assert not (tmp_path / "two.shrink-run").exists() and not list(tmp_path.glob(".two*"))
    # rank 0's error before the hand-off (no plan meets 20 bytes/token, found after loading): the other rank
    # gets it instead of waiting, and only rank 0 says it
    bad = [a if a != "25%" else "20" for a in args]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "attnlab", *bad, "--out", str(tmp_path / "three")],
                          env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and (proc.stdout + proc.stderr).count("no plan can meet a KV budget of 20") == 1, \
        proc.stderr[-3000:]


def test_torchrun_shrink_at_eight_processes_writes_what_one_process_writes(runs, tmp_path, capsys, monkeypatch):
    """Any number of processes that divides --batch-size: `torchrun --nproc-per-node 8 -m attnlab shrink --batch-size
    8` (DDP, gloo) on the tiny Llama, the heal pinned (--tokens, --layer-steps), against one process with the same
    arguments: the same heal plan (a layer-wise batch of whole end-to-end batches, so 8 divides it too), the same
    losses and weights (to 1e-3/1e-4: float32 sums split 8 ways, as the two-process test)."""
    from tiny_checkpoints import TEXT

    from attnlab import models as hf
    from attnlab.cli import main

    monkeypatch.setenv("ATTNLAB_CPU_BF16", "0")  # float32 on any CPU: the sums are compared to 1e-4

    work = runs[0]
    text, held = tmp_path / "train.txt", tmp_path / "held.txt"
    text.write_text(TEXT * 40)
    held.write_text(TEXT[::-1] * 8)
    args = ["shrink", str(work / "llama"), "--kv-budget", "25%", "--text", str(text), "--eval-text", str(held),
            "--tokens", str(8 * T * 2), "--seq-len", str(T), "--layer-steps", "2", "--kv-dtype", "bf16",
            "--batch-size", "8"]
    assert main([*args, "--out", str(tmp_path / "one")]) == 0
    capsys.readouterr()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "8",
                           "-m", "attnlab", *args, "--out", str(tmp_path / "eight")],
                          env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    one, eight = (json.loads((tmp_path / d / "config.json").read_text())["shrink"] for d in ("one", "eight"))
    assert eight["heal_plan"] == one["heal_plan"] and one["heal_plan"]["batch_size"] == 8
    assert one["heal_plan"]["layer_batch"] % 8 == 0 and one["request"]["batch_size"] == 8
    h1, h8 = one["heal"], eight["heal"]
    assert h8["status"] == h1["status"] == "done" and h8["distill_tokens"] == h1["distill_tokens"] == 8 * T * 2
    assert h8["layer_losses"] == pytest.approx(h1["layer_losses"], rel=1e-4)
    assert h8["distill_loss_last"] == pytest.approx(h1["distill_loss_last"], rel=1e-4)
    a, b = _weights(hf.load_model(str(tmp_path / "one"))[0]), _weights(hf.load_model(str(tmp_path / "eight"))[0])
    assert _rel(b, a) <= 1e-3


@pytest.mark.parametrize("size, batch, accepted, suggested", [(3, 4, "run 2, 4 of them", "--batch-size 6"),
                                                              (8, 4, "run 2, 4 of them", "--batch-size 8"),
                                                              (5, 6, "run 2, 3, 6 of them", "--batch-size 10")])
def test_a_world_that_does_not_divide_the_batch_is_refused_in_one_line_naming_what_would_do(
        runs, tmp_path, capsys, monkeypatch, size, batch, accepted, suggested):
    """Before any work (no group is joined, nothing is loaded): one line on stderr, exit 2."""
    from attnlab.cli import main

    for k, v in {"WORLD_SIZE": str(size), "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(k, v)
    code = main(["shrink", str(runs[0] / "llama"), "--kv-budget", "25%", "--batch-size", str(batch),
                 "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and accepted in err and suggested in err and str(size) in err
    assert not (tmp_path / "x").exists() and not (tmp_path / "x.shrink-run").exists()


def _heal_ranks(work: Path, tmp_path: Path, timeout: int):
    """Two ranks of an endless `attnlab heal` started as torchrun starts them (RANK, WORLD_SIZE, a rendezvous; no
    agent that would stop a survivor itself), returned once rank 0 has written a checkpoint and taken a few more
    steps: (processes, out, checkpoint)."""
    import time

    from tiny_checkpoints import TEXT

    from attnlab.cli import main

    conv, text, out = tmp_path / "conv", tmp_path / "train.txt", tmp_path / "out"
    text.write_text(TEXT * 12)
    assert main(["convert", str(work / "llama"), "--to", "mla", "--latent-dim", "12", "--rope-dim", "4", "--out",
                 str(conv)]) == 0
    args = [sys.executable, "-m", "attnlab", "heal", str(conv), "--text", str(text), "--tokens", str(10 ** 8),
            "--seq-len", str(T), "--layer-steps", "0", "--checkpoint-minutes", "0.002", "--collective-timeout",
            str(timeout), "--out", str(out)]
    env = _env(WORLD_SIZE="2")
    procs = [subprocess.Popen(args, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    ckpt = out.with_name(out.name + ".heal.pt")
    deadline = time.monotonic() + 240
    while not ckpt.is_file() and time.monotonic() < deadline and procs[0].poll() is None:
        time.sleep(0.2)
    if not ckpt.is_file():
        _end(procs)
        raise AssertionError(procs[0].communicate(timeout=30)[1][-2000:])
    time.sleep(1.0)  # a few more steps and checkpoints
    return procs, out, ckpt


def _end(procs):
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.communicate()


def test_a_rank_killed_with_sigkill_ends_the_others_in_one_line_with_the_checkpoint_intact(runs, tmp_path):
    """Once rank 0 of a 2-rank heal has written a checkpoint, rank 1 is killed with SIGKILL: rank 0 exits 2 within
    the collective timeout (plus start-up slack) with one line on stderr naming its rank and the checkpoint, writes
    no output, and the checkpoint reads back whole (written atomically: no partial file)."""
    import signal
    import time

    from attnlab.heal import Healer

    timeout = 20
    procs, out, ckpt = _heal_ranks(runs[0], tmp_path, timeout)
    try:
        procs[1].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        stdout, stderr = procs[0].communicate(timeout=timeout + 90)
        took = time.monotonic() - killed
    finally:
        _end(procs)
    lines = stderr.strip().splitlines()
    assert procs[0].returncode == 2 and len(lines) == 1, stderr[-3000:]
    assert lines[0].startswith("error: rank 0 of 2: another process of the job stopped answering") or \
        "rank 0 of 2: another process of the job stopped answering" in lines[0], lines
    assert f"the last checkpoint is {ckpt}" in lines[0]
    assert took <= timeout + 30, took
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(("out", ".out"))) \
        == [ckpt.name]
    blob = Healer.read(ckpt)
    assert blob["format"] == "attnlab-heal" and blob["state"]["steps_done"] > 0


@pytest.mark.parametrize("sig, ranks", [("SIGTERM", [1]), ("SIGINT", [0, 1])])
def test_a_signal_to_one_rank_or_all_stops_every_rank_at_the_same_step(runs, tmp_path, sig, ranks):
    """SIGTERM to rank 1 alone (a scheduler stopping one process), or SIGINT to both (Ctrl-C in the terminal of a
    torchrun job): the stop is decided across the ranks, so both stop at the same step and exit 1 well within the
    collective timeout (a rank left waiting in a collective would exit 2 only after it, naming a lost peer).
    Rank 0 says where the checkpoint is, nothing is written as output, and the checkpoint resumes."""
    import signal
    import time

    from attnlab.heal import Healer

    timeout = 60
    procs, out, ckpt = _heal_ranks(runs[0], tmp_path, timeout)
    try:
        sent = time.monotonic()
        for r in ranks:
            procs[r].send_signal(getattr(signal, sig))
        results = [p.communicate(timeout=timeout + 90) for p in procs]
        took = time.monotonic() - sent
    finally:
        _end(procs)
    assert [p.returncode for p in procs] == [1, 1], [e[-2000:] for _, e in results]
    assert took < timeout, took
    assert f"stopped; the checkpoint is {ckpt} (continue with --resume)" in " ".join(results[0][0].split())
    assert not any("stopped answering" in e for _, e in results)
    assert not out.exists()
    blob = Healer.read(ckpt)
    assert blob["state"]["steps_done"] > 0


def test_shard_without_torchrun_is_one_line(runs, tmp_path, capsys):
    from attnlab.cli import main

    code = main(["heal", str(tmp_path / "conv"), "--out", str(tmp_path / "o"), "--tokens", "64", "--shard"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "--shard needs a process group" in lines[0], lines


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
