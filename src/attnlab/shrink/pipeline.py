"""`shrink`: a KV budget in, a healed model in the requested format out, in one run inside one time budget: shrink().

A thin pipeline over the library (the functions the separate commands call; request.py checks the request), one
function a phase, each taking the run (_Run) and handing it on, in this order (_shrink):
    load -> data -> plan -> convert -> heal -> baselines -> export (with the report)
"""
from __future__ import annotations

import copy
import json
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..runtime.budget import Budget, Stopped
from .heal_plan import heal_plan
from .feasible import check_format, feasible, keys_whole
from .candidate import Candidate
from .report import final_report
from .sizes import LLAMA_CPP_CACHE, QUANTIZED_CACHE, cached_extra, few_bit, llama_cpp_types, parse_budget
from .request import ShrinkRequest, check_request, pinned, plan_count, storage_choices
from .state import RunState, is_run_folder, run_folder

CALIBRATION_TOKENS = 2048
PROXY_TOKENS = 1024  # the planner's scoring windows, after the calibration's


# -- the phases ------------------------------------------------------------------------------------------
class _Lines:
    """The default display when the caller gives none: log lines (runtime.Progress)."""

    def __init__(self, budget):
        from ..runtime.progress import Progress

        self.lines = Progress(budget=budget)

    def phase(self, text):
        self.lines.line(text)

    def count(self, done, total, what=""):
        self.lines.update(what or "working", done, total)

    def step(self, info):
        what = f"layer-wise (layer {info['layer']})" if info["phase"] == "layers" else "end-to-end KL"
        self.lines.update(what, info["done"], info["total"], loss=info["loss"], tokens_per_s=info["tokens_per_s"])


def _data(req: ShrinkRequest, teacher, tok, budget: Budget, show) -> dict[str, torch.Tensor]:
    """train (N, T), held (1, M), calibration (1, C), proxy (1, P) token ids, and judge_<i> (1, J): held-out texts of
    other kinds (heal.data.judge_texts) that the heal's decisions read beside `held` (module docstring).

    The calibration and proxy windows (what the plan reads) and the held-out windows are the same whatever the clock
    says; only the number of further training windows depends on it (none when pinned(): every window is written)."""
    from ..heal.data import judge_texts, training_data

    if req.text:
        show.phase("reading the training text")
    else:
        show.phase("the teacher writes its own training text")
    n = max(1, CALIBRATION_TOKENS // req.seq_len)
    proxy = max(1, PROXY_TOKENS // req.seq_len)
    windows = req.windows if req.heal else min(req.windows, n + proxy)  # no heal: what the plan reads
    train, held, _ = training_data(teacher, tok, req.seq_len, text=req.text, eval_text=req.eval_text,
                                   windows=windows, seed=req.seed, budget=None if pinned(req) else budget,
                                   share=0.3, batch_size=32, fixed=min(req.windows, n + proxy),
                                   progress=lambda i, k: show.count(i, k, "the teacher writes text"))
    calibration = train[:n].reshape(1, -1).clone()
    data = {"train": train, "held": held, "calibration": calibration}
    if train.shape[0] > n:  # the planner scores candidates on other windows than the calibration's
        data["proxy"] = train[n: n + proxy].reshape(1, -1).clone()
    for i, ids in enumerate(judge_texts(tok)):
        data[f"judge_{i}"] = ids
    return data


LAYER_WINDOW = 256  # the planner's window (plan()'s default): --per-layer's costs read one of the run's own text
# and one made of the kinds of heal.data.planning_texts, half a window of each


def _layer_text(data: dict, tok) -> torch.Tensor:
    """(1, K) the text --per-layer's costs are measured on (plan(layer_ids=)): the first window of the text the plan
    ranks candidates on (the proxy windows, else the calibration's), then heal.data.planning_texts, text of other
    kinds than the run's (sentences, Python source) whose tokens the heal's judge does not read."""
    from ..heal.data import planning_texts

    own = data.get("proxy", data["calibration"])[:, :LAYER_WINDOW]
    return torch.cat([own, *planning_texts(tok, LAYER_WINDOW // 2)], dim=1)


def held_texts(data: dict) -> list[torch.Tensor]:
    """The held-out texts a heal is judged on: the run's held-out windows, then the judge texts (_data)."""
    judges = sorted((k for k in data if k.startswith("judge_")), key=lambda k: int(k.split("_")[1]))
    return [data["held"], *(data[k] for k in judges)]


def _windows(req: ShrinkRequest, teacher) -> bool:
    """Whether the budget counts sliding layers by their windows: a --context, and a model with sliding layers."""
    from ..models.evaluate import sliding_context

    return req.context is not None and sliding_context(teacher) is not None


def _explicit(req: ShrinkRequest, whole: bool = False) -> Candidate:
    """The candidate of explicit sizes: the best measured choices otherwise (docs/decisions.md), the format's norm;
    whole: a model with per-head q/k norms, whose keys stay whole (pairs by frequency, no RoRoPE, no BKV)."""
    storage = "bf16" if req.storage == "auto" else req.storage
    select = "frequency" if whole else "rorope" if req.fmt == "gguf" else "rorope-score"
    return Candidate(req.latent_dim, req.rope_dim, select, not whole,
                     storage, req.fmt == "gguf", extra=cached_extra(req.fmt),
                     rotation="random" if few_bit(storage) or storage in LLAMA_CPP_CACHE else None)


# One budget (runtime.Budget) covers every phase from the start, loading included; each phase gets a bounded share and
# the heal keeps back what the final evaluation and the export need. Pinned work (--tokens and --layer-steps both
# given, or --no-heal: pinned()): every window written, every step run, the clock cuts nothing, so the same request
# and seed give the same weights under any load. One resumable state (shrink/state.py): a run folder beside the output
# (OUT.shrink-run) holds state.json (the request, the phase reached, the plan, minutes per phase), the data, the
# converted student (student/), the heal's checkpoint and the healed student (healed/), each written atomically when
# its phase ends; resume=True continues from the last phase that ended (a request with other arguments is refused),
# and the folder is deleted once the output is written. A stop request (Ctrl-C) ends the run at the next step or window
# with its state saved; kill -9 loses at most the phase (or heal steps since the last checkpoint) in flight. Under
# torchrun (`world`) rank 0 alone runs every phase but the heal and holds the run folder; at the heal it hands the
# others the converted student, the windows and the heal plan (hand_off), and all heal data-parallel
# (heal/distributed.py; docs/distributed.md).
def shrink(req: ShrinkRequest, *, resume: bool = False, force: bool = False, budget: Budget | None = None,
           display=None, world=None, shard: bool = False) -> dict | None:
    """Run the pipeline (module docstring, the comment above); returns the report. Raises runtime.Stopped when stopped
    (state saved).
    world: a torchrun job of N > 1 processes: rank 0 alone plans, converts and writes, every rank heals its share of
    each batch (DDP, or FSDP2 with shard=True); the others return None, and an error on rank 0 before the hand-off
    reaches them as the same error."""
    from ..heal import distributed as dd

    world = world if world is not None else dd.World()
    if world.distributed and not world.main:
        return _follow(req, world, shard, budget if budget is not None else Budget(req.minutes))
    if not world.distributed:
        return _shrink(req, resume, force, budget, display)
    handed = {"done": False}
    try:
        report = _shrink(req, resume, force, budget, display, world=world, shard=shard, handed=handed)
    except BaseException as e:
        if not handed["done"]:  # the others wait for the hand-off: it brings them this error
            kind = "stopped" if isinstance(e, Stopped) else "error" if isinstance(e, ValueError) else "failed"
            dd.broadcast_object((kind, getattr(e, "reason", ""), str(e).splitlines()[0] if str(e) else
                                 type(e).__name__))
        raise
    if not handed["done"]:  # the heal was done before this run (resumed after it): nothing for the others
        dd.broadcast_object(("skip",))
    return report


@dataclass
class _Run:
    """What a shrink's phases share and hand on: the request, its state on disk, its budget and display, and what the
    phases made so far (the teacher, the data, the chosen candidate, the student)."""
    req: ShrinkRequest
    state: RunState
    budget: Budget
    show: object
    overwrite: bool  # --force or --resume: the output may be replaced
    readers: list
    world: object = None
    shard: bool = False
    handed: dict | None = None
    teacher: object = None
    tok: object = None
    meta: dict = field(default_factory=dict)
    data: dict = field(default_factory=dict)
    best: Candidate | None = None
    inputs: list | None = None  # the planner's calibration inputs, until the convert phase reuses them
    student: object = None

    def minutes(self, start: float) -> float:
        """Minutes since `start` on the budget's clock."""
        return (self.budget.clock() - start) / 60

    @property
    def distributed(self) -> bool:
        return self.world is not None and self.world.distributed


def _shrink(req: ShrinkRequest, resume: bool, force: bool, budget: Budget | None, display, *, world=None,
            shard: bool = False, handed: dict | None = None) -> dict:
    """shrink() in one process, or as rank 0 of a torchrun job (world, shard; handed["done"] once the others have
    the hand-off): its phases in order, each handing the run on."""
    run = _begin(req, resume, force, budget, display, world=world, shard=shard, handed=handed)
    _phase_load(run)
    _phase_data(run)
    _phase_plan(run)
    _phase_convert(run)
    _phase_heal(run)
    _phase_baselines(run)
    return _phase_export(run)


def _begin(req: ShrinkRequest, resume: bool, force: bool, budget: Budget | None, display, *, world, shard: bool,
           handed: dict | None) -> _Run:
    """The request checked, its budget, the output checked, and the run folder: loaded to resume, else cleared."""
    from .. import models as hf
    from ..io.folders import check_output
    from ..models.export.deepseek_gguf import is_attnlab_gguf

    check_request(req)
    budget = budget if budget is not None else Budget(req.minutes)
    if pinned(req):  # the work is pinned: the clock cuts nothing (stop requests still hold)
        budget = budget.unbounded()
    out, folder = Path(req.out), run_folder(req.out)
    readers = [*hf.source_paths(req.source), *req.text, *req.eval_text]
    check_output(out, force=force or resume, sources=readers,
                 ours=(is_attnlab_gguf if req.fmt == "gguf" else None))
    state = RunState(folder, req)
    if resume:
        state.load()
    else:
        if not (force and folder.is_dir() and is_run_folder(folder)):  # --force replaces a stopped run's state
            check_output(folder, force=force, sources=readers, what="the run folder")
        if folder.exists():
            shutil.rmtree(folder)
    return _Run(req, state, budget, display or _Lines(budget), force or resume, readers, world, shard, handed)


def _phase_load(run: _Run) -> None:
    """The teacher and its tokenizer, checked for what the request asks of them before any text is written."""
    from .. import models as hf

    req, t = run.req, run.budget.clock()
    run.show.phase(f"loading {req.source}")
    teacher, tok, meta = hf.load_model(req.source)
    if hf.family(teacher) != "llama":
        raise ValueError("shrink cuts causal language models (Llama, Mistral, Qwen2); for an encoder, use "
                         "attnlab convert and attnlab.heal.encoder")
    check_format(teacher, req.fmt)  # before any text is written: a DeepSeek or GGUF export has no per-head key norm
    hf.check_convertible(teacher, rope_dim=req.rope_dim)  # q/k norms: only their keys whole (rope_dim G x d)
    if tok is None:
        raise ValueError(f"{req.source} has no tokenizer files (tokenizer.json ...): shrink needs one to read or "
                         "write text")
    limit = getattr(teacher.config, "max_position_embeddings", None)
    if limit and req.seq_len > limit:
        raise ValueError(f"--seq-len {req.seq_len} exceeds the model's context (max_position_embeddings {limit})")
    if req.latent_dim is None:
        storages = storage_choices(req.storage, req.fmt, _windows(req, teacher))
        feasible(teacher, parse_budget(req.kv_budget), req.fmt, storages, req.context)
    minutes = run.state.data["minutes"]
    minutes["load"] = minutes.get("load", 0.0) + run.minutes(t)
    run.teacher, run.tok, run.meta = teacher, tok, meta
    run.budget.check()


# data: the user's text (calibration: its first CALIBRATION_TOKENS tokens of windows spread over every file,
# heal.data.spread_order; held out: --eval-text, else each file's last tenth), or, without text, text the teacher
# writes itself (seeded) for calibration and training, and other samples of it as held-out text. The calibration,
# proxy and held-out windows are written whatever the clock says (the same on any machine), further training windows
# within a bounded share of the budget; beside them heal.data.judge_texts, held-out text of other kinds.
def _phase_data(run: _Run) -> None:
    """The token windows (_data), or the ones a resumed run wrote."""
    state = run.state
    if state.done("data"):
        run.data = state.load_data()
        return
    t = run.budget.clock()
    run.data = _data(run.req, run.teacher, run.tok, run.budget, run.show)
    # the windows asked of the teacher's own text; with --text every window of the text is read (none asked)
    state.data["work"] = {"training_windows": int(run.data["train"].shape[0]),
                          "windows_asked": None if run.req.text else run.req.windows}
    state.save_data(run.data)
    state.finish("data", run.minutes(t))


# plan: shrink.plan.plan converts candidates calibrated on the calibration text and scores them on the next windows of
# the training text (skipped when the sizes are given explicitly), at most plan_count(--minutes) of them: a count,
# never the clock, so that a loaded machine makes the same plan (it heals less, and the report's "work" says how much).
def _phase_plan(run: _Run) -> None:
    """The chosen candidate: the request's explicit sizes, or the planner's choice (shrink/plan.py)."""
    from .layer_bits import planned_layer_bits
    from .plan import plan as choose

    req, state, data = run.req, run.state, run.data
    if not state.done("plan"):
        t = run.budget.clock()
        if req.latent_dim is not None:
            chosen = {"chosen": _explicit(req, keys_whole(run.teacher) is not None).to_dict(), "explicit": True}
        else:
            run.show.phase("planning: measuring candidate conversions on the calibration text")
            result = choose(run.teacher, data["calibration"], parse_budget(req.kv_budget), fmt=req.fmt,
                            storages=storage_choices(req.storage, req.fmt, _windows(req, run.teacher)),
                            calibrate=req.calibration,
                            proxy_ids=data.get("proxy"), time_budget=run.budget.unbounded(), context=req.context,
                            max_candidates=plan_count(req.minutes), per_layer=req.per_layer,
                            layer_bits=req.storage == "auto" and planned_layer_bits(),
                            layer_ids=_layer_text(data, run.tok) if req.per_layer else None,
                            progress=lambda i, label: run.show.phase(f"planning: candidate {i + 1}: {label}"))
            if run.budget.stop_requested:  # a search cut short is not the plan of this request: nothing saved
                raise Stopped("stop")
            chosen = result.to_dict()
            run.inputs = result.inputs  # the convert phase's calibration inputs, computed once
        state.data["plan"] = chosen
        state.finish("plan", run.minutes(t))
    run.best = Candidate(**{k: v for k, v in state.data["plan"]["chosen"].items()
                            if k in Candidate.__dataclass_fields__})
    run.budget.check()


# convert: models.convert_model, then (for DeepSeek and GGUF) a latent norm fitted on the calibration text
# (models.add_latent_norms) that the heal then trains.
def _phase_convert(run: _Run) -> None:
    """The student: a copy of the teacher converted to the chosen candidate, saved as student/ in the run folder."""
    from .. import models as hf
    from .candidate import apply

    student_dir = run.state.folder / "student"
    if run.state.done("convert"):
        run.student, _, _ = hf.load_model(str(student_dir))
    else:
        t = run.budget.clock()
        run.show.phase(f"converting: {run.best.label()}")
        run.student = copy.deepcopy(run.teacher)
        apply(run.student, run.best, run.data["calibration"] if run.req.calibration else None, inputs=run.inputs)
        run.inputs = None
        hf.save_model(run.student, run.meta["base"], student_dir, force=True, sources=run.readers)
        run.state.finish("convert", run.minutes(t))
    run.budget.check()


# heal: heal.heal_model (layer-wise, then end-to-end KL), its plan sized to the time (shrink/heal_plan.py); with
# --no-heal (req.heal False) only the converted model scored against the original, and no training window written
# beyond the calibration's and the proxy's.
def _phase_heal(run: _Run) -> None:
    """The student healed (heal.heal_model) to its heal plan, saved as healed/; a resumed run's healed/ loaded.
    Under torchrun rank 0 hands the others the student and the data first. ValueError when no step ran."""
    from .. import models as hf
    from ..heal.plan import HealPlan
    from ..heal.run import heal_model

    req, state, budget, folder = run.req, run.state, run.budget, run.state.folder
    if state.done("heal"):
        run.student, _, _ = hf.load_model(str(folder / ("healed" if req.heal else "student")))
        return
    if not req.heal:
        _no_heal(run)
        return
    t = budget.clock()
    reserve = (30.0 if req.fmt != "attnlab" else 10.0) + BASELINE_SECONDS  # baselines and export, after it
    heal_device = run.world.device if run.distributed else req.device
    if state.data["heal_plan"] is None:
        state.data["heal_plan"] = asdict(heal_plan(req, run.teacher, run.student, run.data["train"],
                                                   max(0.0, budget.left() - reserve), heal_device))
        state.save()
    plan = HealPlan(**state.data["heal_plan"])
    run.show.phase("evaluating the converted model before training")
    checkpoint = folder / "heal.pt"
    resume_heal = checkpoint.is_file()
    if run.distributed:
        hand_off(folder / "student", run.data, {"heal_plan": state.data["heal_plan"], "resume": resume_heal,
                                                "reserve": reserve, "checkpoint": str(checkpoint)})
        run.handed["done"] = True
    report = heal_model(run.teacher, run.student, run.data["train"], held_texts(run.data), plan,
                        device=heal_device, budget=_heal_budget(budget, reserve), checkpoint=checkpoint,
                        resume=resume_heal, progress=run.show.step, world=run.world, shard=run.shard,
                        keep_better=not req.keep_worse)
    state.data["report"]["heal"] = report
    state.data["minutes"]["heal"] = state.data["minutes"].get("heal", 0.0) + run.minutes(t)
    state.save()
    if report["status"] == "stopped":
        raise Stopped("stop")
    if not report["steps_done"]:
        raise ValueError(f"nothing was trained: the budget ({req.minutes} min) was spent before the first heal "
                         f"step ({budget.elapsed() / 60:.1f} min went to loading, data, planning and "
                         "converting); nothing written (give more --minutes; --resume keeps what is done)")
    if report["status"] == "budget" or report["status"] == "done":
        hf.save_model(run.student, run.meta["base"], folder / "healed", force=True, sources=run.readers)
        state.finish("heal", 0.0)


NOT_RUN = "not run"  # the heal report's status under --no-heal


def _no_heal(run: _Run) -> None:
    """--no-heal: the converted student scored against the teacher on the held-out texts, as a heal's evaluation
    before training is but with no greedy continuations (they took longer than the plan); the report's heal says none
    ran."""
    from ..heal.evaluate import held_out_texts
    from ..heal.run import measure_pair

    t = run.budget.clock()
    run.show.phase("evaluating the converted model (--no-heal: no training)")
    report = {"status": NOT_RUN, "steps_done": 0, "healed": False}
    measure_pair(run.teacher, run.student, held_out_texts(held_texts(run.data)), report, run.budget, prompts=0)
    run.state.data["report"]["heal"] = report
    run.state.data["done"].append("heal")
    run.state.finish("evaluate", run.minutes(t))


def final_evaluation(heal: dict) -> dict:
    """The held-out evaluation of the model a run wrote: after its heal, or the converted one's where none ran."""
    return heal.get("after") or (heal.get("before") if heal.get("status") == NOT_RUN else None) or {}


# baselines: the original with its cache quantized without training (shrink/baselines.py), at or above the bytes
# reached, scored on the heal's held-out windows.
def _phase_baselines(run: _Run) -> None:
    """The training-free baselines at or above the bytes reached, on the windows the heal scored (once a run)."""
    state, req = run.state, run.req
    if "baselines" in state.data["report"]:
        return
    run.show.phase("scoring the original with its cache quantized (llama.cpp types, KIVI), no training")
    state.data["report"]["baselines"] = _baselines(run.teacher, run.student, run.data["held"],
                                                   state.data["report"].get("heal", {}), req.context,
                                                   QUANTIZED_CACHE if req.fmt == "transformers" else ())
    state.save()


# export: models.save_model, export_deepseek, export_gguf, export_native or export_transformers; where each output runs
# (shrink/engines.py) goes into the report.
def _phase_export(run: _Run) -> dict:
    """The report (final_report) and the output in the requested format, then the run folder deleted; returns the
    report. A stop request here ends the run before anything is written."""
    from .. import models as hf
    from ..io.folders import replace_file

    req, budget, out = run.req, run.budget, Path(run.req.out)
    t = budget.clock()
    run.show.phase(f"writing {out} ({req.fmt})")
    if budget.stop_requested:  # honoured at the phase boundary; the export itself is short and atomic
        raise Stopped("stop")
    report = final_report(req, run.state, run.teacher, run.student, run.meta)  # shrink/report.py
    if req.fmt == "attnlab":
        hf.save_model(run.student, run.meta["base"], out, extra={"shrink": report}, force=run.overwrite,
                      sources=run.readers)
    else:
        _write_export(run, out, report)
        report["minutes"]["export"] = run.minutes(t)
        replace_file(out.with_name(out.name + ".shrink.json"), json.dumps(report, indent=2).encode())
    report["minutes"]["export"] = run.minutes(t)
    report["minutes"]["total"] = budget.elapsed() / 60
    shutil.rmtree(run.state.folder, ignore_errors=True)
    return report


def _write_export(run: _Run, out: Path, report: dict) -> None:
    """A format other than attnlab's: its sidecar report checked first, then the DeepSeek folder, transformers
    folder, or GGUF (in the source's own architecture, or deepseek2); what was written goes into `report`."""
    from .. import models as hf
    from ..io.folders import check_output

    req, best, student, tok, force = run.req, run.best, run.student, run.tok, run.overwrite
    tokenizer = None if Path(run.meta["base"]).is_dir() else tok
    check_output(out.with_name(out.name + ".shrink.json"), force=force, sources=run.readers, ours=_is_report)
    if req.fmt == "deepseek":
        hf.export_deepseek(student, out, tokenizer=tokenizer, force=force)
    elif req.fmt == "transformers" and (best.native or keys_whole(run.teacher) is not None):  # the source's class
        from ..models.export.native_transformers import export_transformers  # (a keys-whole MLA with its value bases)

        kept = best.kept_dtype if best.layers else None
        report["written"] = export_transformers(student, out, tok, force=force,
                                                storage=best.kv_dtypes or best.kv_dtype, kept_dtype=kept)
    elif req.fmt == "transformers":  # an MLA: DeepSeek-V3, its config naming the KVCache storage of the latent
        path = hf.export_deepseek(student, out, tokenizer=tokenizer, force=force)
        report["written"] = {"path": str(path), "architecture": "deepseek_v3",
                             "kv_dtype": best.kv_dtypes or best.kv_dtype}
    elif best.native:  # the source's own architecture, the attention tensors the heal moved rewritten
        from ..models.export.native_gguf import export_native

        report["written"] = export_native(student, out, force=force, cache_types=llama_cpp_types(best.kv_dtype))
    else:
        hf.export_gguf(student, out, tokenizer=tok, force=force)


BASELINE_SECONDS = 30.0  # kept back from the heal: two teacher passes over the held-out windows


def _heal_budget(budget: Budget, reserve: float) -> Budget:
    """The heal's share of the budget: what is left but `reserve` seconds (baselines and export after it)."""
    return budget.share(seconds=max(0.0, budget.left() - reserve)) if budget.deadline else budget


def hand_off(student_dir: Path, data: dict, info: dict) -> None:
    """Rank 0 of a torchrun job, at the heal: the converted student's folder (its files, as bytes: no shared disk
    is assumed), the training and held-out windows and what the heal needs, to every other rank (_follow)."""
    from ..heal import distributed as dd

    files = {p.name: p.read_bytes() for p in sorted(student_dir.iterdir()) if p.is_file()}
    dd.broadcast_object(("ok", {**info, "files": files}))
    dd.broadcast_tensors([data["train"], *held_texts(data)])


def _follow(req: ShrinkRequest, world, shard: bool, budget: Budget) -> None:
    """A rank other than 0: load the teacher, wait for rank 0's hand-off, heal its share; returns None."""
    import tempfile

    from .. import models as hf
    from ..heal import distributed as dd
    from ..heal.plan import HealPlan
    from ..heal.run import heal_model

    if pinned(req):
        budget = budget.unbounded()
    teacher, _, _ = hf.load_model(req.source)
    got = dd.broadcast_object(None)  # patient: rank 0 writes text, plans and converts first
    if got[0] == "skip":
        return None
    if got[0] != "ok":
        kind, reason, text = got
        if kind == "stopped":
            raise Stopped(reason, text)
        raise dd.Relayed(text if kind == "error" else f"rank 0 failed before the heal ({text})")
    info = got[1]
    train, *held = dd.broadcast_tensors(None)
    with tempfile.TemporaryDirectory(prefix="attnlab-shrink-rank") as tmp:
        for name, blob in info["files"].items():
            (Path(tmp) / name).write_bytes(blob)
        student, _, _ = hf.load_model(tmp)
    report = heal_model(teacher, student, train, held, HealPlan(**info["heal_plan"]), device=world.device,
                        budget=_heal_budget(budget, info["reserve"]), checkpoint=Path(info["checkpoint"]),
                        resume=info["resume"], world=world, shard=shard, keep_better=not req.keep_worse)
    if report["status"] == "stopped":
        raise Stopped("stop")
    return None


def _baselines(teacher, student, held, heal: dict, context: int | None = None, extra: tuple = ()) -> dict:
    """shrink.baselines for the report: every baseline's bytes (at `context`, when the budget was counted there), the
    two cheapest at or above the student's scored on the held-out tokens the heal's final evaluation read (with its
    window). extra: storages besides shrink.baselines.BASELINES (a transformers folder: transformers' QuantizedCache
    codes, the untouched model with the same cache)."""
    from . import baselines
    from .sizes import planned_bytes, spread_context

    after, teacher_eval = final_evaluation(heal), heal.get("teacher") or {}
    if after.get("texts"):  # several held-out texts: the baselines on the first, the run's own held-out windows
        after, teacher_eval = after["texts"][0], (teacher_eval.get("texts") or [{}])[0]
    if after.get("perplexity") is None or teacher_eval.get("perplexity") is None:
        return {"note": "not scored: the heal has no final evaluation"}
    sizes = baselines.baseline_bytes(teacher, (*baselines.BASELINES, *extra), context=context)
    reached = planned_bytes(student, context, spread_context(teacher, context))  # as the budget counted them
    names = baselines.at_or_above(sizes, reached)
    scored = baselines.score(teacher, held, names, tokens=after.get("tokens"))
    return baselines.compare(reached, after["perplexity"], teacher_eval["perplexity"], sizes, scored)


def _is_report(path: Path) -> bool:
    try:
        return json.loads(path.read_text()).get("format") == "attnlab-shrink-report"
    except (OSError, ValueError, AttributeError):
        return False
