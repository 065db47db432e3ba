"""Never lose the user's files; honour every budget and Ctrl-C (issue: the 130-probe bad-input run).

Numbered as the findings they check: (1) an existing --out or `.` is never emptied, (2) the source is
never an output, (3) a checkpoint of another model is refused, (4) one writer per output, (5) budgets
and signals hold (a fake clock where time matters), (10) killed runs' temporaries are cleaned, outputs
get the user's umask, a full disk is one line. Tiny random checkpoints (tests/tiny_checkpoints.py).
"""
import copy
import errno
import json
import os
import signal

import pytest
import torch
from tiny_checkpoints import TEXT, make_checkpoint

from attnlab import GroupedQueryAttention
from attnlab import models as hf
from attnlab.cli import main
from attnlab.heal import HealPlan, Healer, heal_model
from attnlab.heal.data import teacher_windows
from attnlab.heal.evaluate import evaluate_pair
from attnlab.io import (MARKER, check_output, output_lock, replace_with, save_module, write_folder,
                        written_by_attnlab)
from attnlab.runtime import Budget, Stopped, stop_on_signals

T = 16


class FakeClock:
    """Seconds that pass only when the test says so (or when a model runs: see tick_on_forward)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def tick_on_forward(model, clock, seconds):
    """Every pass through `model` advances the clock by `seconds` (a model that takes that long): hooked on its
    token embedding, which transformers' forward and attnlab's Generator both call once per pass."""
    return model.model.embed_tokens.register_forward_pre_hook(lambda *_: setattr(clock, "now", clock.now + seconds))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("safety") / "llama"
    make_checkpoint("llama", folder, initializer_range=0.3)
    teacher, tok, _ = hf.load_model(str(folder))
    return folder, teacher, tok


def _student(teacher):
    student = copy.deepcopy(teacher)
    hf.convert_model(student, "mla", latent_dim=12, rope_dim=4)
    return student


def _windows(n, seed):
    return torch.randint(0, 300, (n, T), generator=torch.Generator().manual_seed(seed))


def _plan(**kw):
    return HealPlan(**{**dict(seq_len=T, batch_size=4, tokens=4 * T * 12, layer_steps=6, layer_windows=8,
                              layer_batch=4, layer_lr=1e-3, lr=2e-3, warmup=2), **kw})


def _cli(args, capsys):
    code = main([str(a) for a in args])
    return code, capsys.readouterr()


def _one_line_error(code, out, fragment):
    lines = out.err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and fragment in lines[0], out.err


def _keep(folder, name="a.txt"):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text("keep")
    return folder / name


# -- (1) an existing --out, or `.`, is never emptied --------------------------------------------------
def test_1_module_conversion_refuses_an_existing_out(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    save_module(GroupedQueryAttention(64, 4, 2), tmp_path / "mod")
    note = _keep(tmp_path / "notes")
    _one_line_error(*_cli(["convert", tmp_path / "mod", "--to", "mla", "--out", "notes"], capsys), "exists")
    _one_line_error(*_cli(["convert", tmp_path / "mod", "--to", "mla", "--out", "notes", "--force"], capsys),
                    "was not written by attnlab")
    assert note.read_text() == "keep"
    here = tmp_path / "s"
    kept = _keep(here)
    monkeypatch.chdir(here)
    _one_line_error(*_cli(["convert", tmp_path / "mod", "--to", "mla", "--out", "."], capsys), "current folder")
    _one_line_error(*_cli(["convert", tmp_path / "mod", "--to", "mla", "--out", "..", "--force"], capsys),
                    "a parent of the current folder")
    assert kept.read_text() == "keep" and sorted(p.name for p in here.iterdir()) == ["a.txt"]


def test_1_model_conversion_with_force_refuses_the_current_folder(tiny, tmp_path, capsys, monkeypatch):
    folder, _, _ = tiny
    kept = _keep(tmp_path / "work")
    monkeypatch.chdir(tmp_path / "work")
    _one_line_error(*_cli(["convert", folder, "--to", "mla", "--out", ".", "--force"], capsys), "current folder")
    assert kept.read_text() == "keep"


def test_1_force_replaces_attnlabs_own_output_only_while_it_holds_nothing_else(tmp_path):
    out = tmp_path / "out"
    save_module(GroupedQueryAttention(16, 2, 1), out)
    assert written_by_attnlab(out) and (out / MARKER).is_file()
    with pytest.raises(ValueError, match="exists; pass --force"):
        save_module(GroupedQueryAttention(16, 2, 2), out)
    save_module(GroupedQueryAttention(16, 2, 2), out, force=True)  # attnlab's own: replaced
    assert json.loads((out / "config.json").read_text())["config"]["num_kv_heads"] == 2
    note = _keep(out, "notes.txt")  # the user put something of theirs into it
    with pytest.raises(ValueError, match=r"holds files attnlab did not write \(notes.txt\)"):
        save_module(GroupedQueryAttention(16, 2, 1), out, force=True)
    assert note.read_text() == "keep"


# -- (2) the source is never an output -----------------------------------------------------------------
def test_2_out_equal_to_inside_or_around_the_source_is_refused_even_with_force(tiny, tmp_path, capsys):
    folder, _, _ = tiny
    src = tmp_path / "src"
    make_checkpoint("llama", src)
    capsys.readouterr()  # transformers' progress bars while writing it
    before = sorted(p.name for p in src.iterdir())
    for out, fragment in ((src, "is the source"), (src / "sub", "lies inside the source"),
                          (tmp_path, "contains the source")):
        _one_line_error(*_cli(["convert", src, "--to", "mla", "--out", out, "--force"], capsys), fragment)
    assert sorted(p.name for p in src.iterdir()) == before
    conv = tmp_path / "conv"
    assert _cli(["convert", folder, "--to", "mla", "--latent-dim", "12", "--rope-dim", "4", "--out", conv],
                capsys)[0] == 0
    # a converted model's folder and its base are both sources of anything made from it
    _one_line_error(*_cli(["export", conv, "--format", "deepseek", "--out", conv, "--force"], capsys),
                    "is the source")
    _one_line_error(*_cli(["heal", conv, "--out", folder, "--tokens", "64", "--force"], capsys), "is the source")


# -- (3) a checkpoint of another model is refused ----------------------------------------------------------
def test_3_resume_refuses_a_checkpoint_of_another_student_or_teacher(tiny, tmp_path):
    folder, teacher, _ = tiny
    ckpt = tmp_path / "heal.pt"
    student = _student(teacher)
    healer = Healer(teacher, copy.deepcopy(student), _windows(16, 0), _plan(), checkpoint=ckpt)
    healer.run(minutes=1, reserve=0.0)
    blob = Healer.read(ckpt)
    other_teacher, _ = make_checkpoint("llama", tmp_path / "other", seed=1, initializer_range=0.3)
    hf.to_attnlab(other_teacher)
    other_student = _student(other_teacher)  # the same shapes, other weights
    with pytest.raises(ValueError, match="belongs to another run: the converted model it started from differs"):
        Healer(teacher, other_student, _windows(16, 0), _plan()).restore(blob)
    with pytest.raises(ValueError, match="belongs to another run: its teacher differs"):
        Healer(other_teacher, copy.deepcopy(student), _windows(16, 0), _plan()).restore(blob)
    Healer(teacher, copy.deepcopy(student), _windows(16, 0), _plan()).restore(blob)  # its own: fine


# -- (4) one writer per output ---------------------------------------------------------------------------
def test_4_a_second_run_into_the_same_out_is_refused_while_the_first_runs(tiny, tmp_path, capsys):
    folder, _, _ = tiny
    conv = tmp_path / "conv"
    assert _cli(["convert", folder, "--to", "mla", "--latent-dim", "12", "--rope-dim", "4", "--out", conv],
                capsys)[0] == 0
    out = tmp_path / "healed"
    with output_lock(out):  # the first run holds it
        _one_line_error(*_cli(["heal", conv, "--out", out, "--tokens", "64", "--seq-len", T], capsys),
                        f"is being written by another attnlab run (pid {os.getpid()})")
        with pytest.raises(ValueError, match="another attnlab run"):
            with output_lock(out):
                pass
    with output_lock(out):  # released when the first ended
        pass
    assert not out.exists()


# -- (5) budgets and signals -----------------------------------------------------------------------------
def test_5_budget_shares_stop_flags_and_check():
    clock = FakeClock()
    b = Budget(1, clock=clock)
    part = b.share(0.5)
    assert part.deadline == 30.0 and b.deadline == 60.0
    clock.now = 31.0
    assert part.expired() and not b.expired()
    with pytest.raises(Stopped) as e:
        part.check()
    assert e.value.reason == "budget"
    b.request_stop()
    with pytest.raises(Stopped) as e:
        b.unbounded().check()
    assert e.value.reason == "stop"
    for bad in (0, -1, float("nan"), True):
        with pytest.raises(ValueError, match="positive number of minutes"):
            Budget(bad)


def test_5_sigterm_and_sigint_become_a_stop_request_and_a_second_interrupts(tmp_path):
    budget = Budget()
    old = signal.getsignal(signal.SIGTERM)
    with stop_on_signals(budget):
        os.kill(os.getpid(), signal.SIGTERM)
        assert budget.stop_requested
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGTERM) is old


def test_5_the_evaluation_before_training_keeps_to_its_share(tiny):
    _, teacher, _ = tiny
    student = _student(teacher)
    clock = FakeClock()
    hooks = [tick_on_forward(m, clock, 1.0) for m in (teacher, student)]  # each forward takes "1 s"
    try:
        held = torch.randint(0, 300, (1, 40 * 8), generator=torch.Generator().manual_seed(3))
        budget = Budget(1, clock=clock)  # 60 s: a tenth is 6 s, three windows of two forwards
        before = evaluate_pair(teacher, student, held, window=8, budget=budget.share(0.1))
        assert before["windows"] == 3 and before["tokens"] == 24 and "greedy_agreement" not in before
        after = evaluate_pair(teacher, student, held, window=8, budget=budget.unbounded(), reference=before)
        assert after["windows"] == 3 and after["tokens"] == 24  # the same windows, after training
    finally:
        for h in hooks:
            h.remove()


def test_5_a_stop_during_the_evaluation_is_honoured_at_the_next_window(tiny, tmp_path):
    _, teacher, _ = tiny
    student = _student(teacher)
    budget = Budget()
    hook = student.register_forward_pre_hook(lambda *_: budget.request_stop())
    try:
        report = heal_model(teacher, student, _windows(16, 0), _windows(8, 1).reshape(1, -1), _plan(),
                            budget=budget, checkpoint=tmp_path / "ckpt.pt")
    finally:
        hook.remove()
    assert report["status"] == "stopped" and report["trained_steps"] == 0 and "after" not in report
    assert (tmp_path / "ckpt.pt").is_file()  # resumable


def test_5_training_stops_in_time_for_the_evaluation_after_it(tiny):
    """A fake clock: every forward costs 1 s. The run ends within the budget plus one step and the evaluation."""
    _, teacher, _ = tiny
    student = _student(teacher)
    clock = FakeClock()
    hooks = [tick_on_forward(m, clock, 1.0) for m in (teacher, student)]
    try:
        budget = Budget(2, clock=clock)  # 120 s
        report = heal_model(teacher, student, _windows(32, 0), _windows(8, 1).reshape(1, -1),
                            _plan(tokens=None, layer_steps=2), budget=budget)
    finally:
        for h in hooks:
            h.remove()
    assert report["status"] in ("budget", "done") and report["trained_steps"] > 0 and "after" in report
    step = 2.0  # one end-to-end step: a teacher and a student forward
    assert clock.now <= 120.0 + step + report["evaluation_seconds"] + 1e-9


def test_5_teacher_writing_stops_starting_batches_when_its_share_is_spent(tiny):
    _, teacher, tok = tiny
    clock = FakeClock()
    hook = tick_on_forward(teacher, clock, 1.0)
    try:
        budget = Budget(1, clock=clock)
        windows = teacher_windows(teacher, tok, 64, T, batch_size=4, budget=budget.share(0.25))  # 15 s
    finally:
        hook.remove()
    per_batch = T  # a prefill and at most T - 1 decode steps, each a forward
    assert 4 <= windows.shape[0] < 64 and clock.now <= 15 + per_batch


def test_5_a_slow_teacher_batch_is_cut_to_what_fits_its_share(tiny):
    """A model whose pass costs 1 s per window in the batch (compute-bound on its batch), windows of T = 16 tokens
    from prompts of 8 (8 passes a batch): one batch of the 32 windows asked for would take 256 s, over the share
    of 180 s. Timed after its first 2 passes, the batch is dropped and written again with as many windows as fit
    at the measured cost, so the teacher ends inside its share, having used most of it."""
    _, teacher, tok = tiny
    clock = FakeClock()
    hook = teacher.model.embed_tokens.register_forward_pre_hook(
        lambda _m, args: setattr(clock, "now", clock.now + args[0].shape[0]))
    try:
        budget = Budget(6, clock=clock)
        windows = teacher_windows(teacher, tok, 64, T, batch_size=32, budget=budget.share(0.5))  # 180 s
    finally:
        hook.remove()
    per_window = T // 2  # passes a batch takes (a prefill and T/2 - 1 decode steps), 1 s each per window
    assert 1 <= windows.shape[0] < 32 and clock.now <= 180
    assert clock.now > 180 - 2 * per_window * 4  # it used its share, not a sliver of it


def test_5_bad_budgets_and_lengths_are_one_line_errors(tiny, tmp_path, capsys):
    folder, _, _ = tiny
    conv = tmp_path / "conv"
    assert _cli(["convert", folder, "--to", "mla", "--latent-dim", "12", "--rope-dim", "4", "--out", conv],
                capsys)[0] == 0
    for minutes in ("0", "-1"):
        _one_line_error(*_cli(["heal", conv, "--out", tmp_path / "h", "--minutes", minutes], capsys),
                        f"--minutes must be a positive number, got {float(minutes)}")
    _one_line_error(*_cli(["heal", conv, "--out", tmp_path / "h", "--tokens", "64", "--seq-len", "100000"], capsys),
                    "--seq-len 100000 exceeds the model's context (max_position_embeddings 256)")
    assert not (tmp_path / "h").exists()


def test_5_a_run_that_trained_nothing_exits_2_and_writes_nothing(tiny, tmp_path, capsys):
    folder, _, _ = tiny
    conv = tmp_path / "conv"
    text = tmp_path / "t.txt"
    text.write_text(TEXT * 8)
    assert _cli(["convert", folder, "--to", "mla", "--latent-dim", "12", "--rope-dim", "4", "--out", conv],
                capsys)[0] == 0
    _one_line_error(*_cli(["heal", conv, "--out", tmp_path / "h", "--minutes", "0.0001", "--text", text,
                           "--seq-len", T], capsys), "nothing trained, nothing written")
    assert not (tmp_path / "h").exists()


# -- (10) killed runs' leftovers, permissions, a full disk ---------------------------------------------------
def test_10_temporaries_of_a_killed_run_are_removed_by_the_next_write(tmp_path):
    out = tmp_path / "out"
    dead = 2 ** 22 + 12345  # above the kernel's default pid_max: no such process
    stale = tmp_path / f".out.attnlab-tmp-{dead}-xyz"
    stale.mkdir()
    (stale / "big.bin").write_bytes(b"0" * 1024)
    live = tmp_path / f".out.attnlab-tmp-{os.getpid()}-abc"  # a run still going (this one) is left alone
    live.mkdir()
    write_folder(out, lambda tmp: (tmp / "x.txt").write_text("x"))
    assert not stale.exists() and live.exists()


def test_10_outputs_get_the_users_umask_not_a_temporarys(tmp_path):
    old = os.umask(0o022)
    try:
        out = write_folder(tmp_path / "out", lambda tmp: (tmp / "x.txt").write_text("x"))
    finally:
        os.umask(old)
    assert oct(out.stat().st_mode & 0o777) == oct(0o755)
    assert oct((out / "x.txt").stat().st_mode & 0o777) == oct(0o644)


def test_10_a_full_disk_is_one_line_and_leaves_nothing(tmp_path):
    def full(tmp):
        (tmp / "part").write_text("x")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(ValueError, match="cannot write .*out: No space left on device"):
        write_folder(tmp_path / "out", full)

    def torch_full(tmp):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing file")

    with pytest.raises(ValueError, match=r"cannot write .*ckpt.pt: the disk refused the write"):
        replace_with(tmp_path / "ckpt.pt", torch_full)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_check_output_allows_a_new_path_and_names_a_file_in_the_way(tmp_path):
    assert check_output(tmp_path / "new" / "deeper") == tmp_path / "new" / "deeper"
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        check_output(tmp_path / "afile" / "out")
