"""`attnlab heal`: distil a converted model back towards the original (attnlab.heal does the work).

`heal` is the command, `report_table` its before/after table. `--minutes` covers everything from the command's start;
Ctrl-C or SIGTERM stop at the next step with a checkpoint (`--resume` continues). Under torchrun (`torchrun
--nproc-per-node N -m attnlab heal ...`) the heal is data-parallel (attnlab.heal.distributed); rank 0 alone writes.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from .base import RunDisplay, UsageProblem, console, positive, quiet_transformers
from .ranks import COLLECTIVE_TIMEOUT, SHARD, Silent, rank_errors, said_by_rank0


def report_table(title: str, report: dict) -> Table:
    """The teacher and the student before/after: perplexity, top-1 and greedy agreement, KV bytes per token."""
    table = Table(title=title)
    for col in ("model", "perplexity", "top-1 agreement", "greedy prefix (64)", "KV bytes/token"):
        table.add_column(col, justify="right")
    t = report["teacher"]
    table.add_row("teacher", f"{t['perplexity']:.3f}", "1", "1", str(t["kv_bytes_per_token"]))
    for name in ("before", "after"):
        r = report.get(name)
        if r is None:
            continue
        g = r.get("greedy_agreement", {}).get("prefix")
        table.add_row(f"student {name}", f"{r['perplexity']:.3f}", f"{r['top1_agreement']:.4f}",
                      "-" if g is None else f"{g:.4f}", str(r["kv_bytes_per_token"]))
    return table


def check_seq_len(seq_len: int, model) -> None:
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit and seq_len > limit:
        raise UsageProblem(f"--seq-len {seq_len} exceeds the model's context (max_position_embeddings {limit})")


def heal(source: Path = typer.Argument(..., help="A converted-model folder written by attnlab convert."),
         out: Path = typer.Option(..., "--out", help="Folder to write the healed model to."),
         text: Optional[list[Path]] = typer.Option(None, "--text", help="Training text file (repeat the option); "
                                                   "default: text the teacher writes from varied prompts."),
         eval_text: Optional[list[Path]] = typer.Option(None, "--eval-text", help="Held-out text for the report; "
                                                        "default: the last 10% of each --text file, or more "
                                                        "teacher text."),
         tokens: Optional[int] = typer.Option(None, "--tokens", help="End-to-end distillation tokens."),
         minutes: Optional[float] = typer.Option(None, "--minutes", help="Time budget for everything the command "
                                                 "does, from its start."),
         device: str = typer.Option("cpu", "--device", help="cpu or cuda (bf16 autocast on cuda)."),
         seed: int = typer.Option(0, "--seed", help="Seed of data order and of the teacher's sampled text."),
         resume: bool = typer.Option(False, "--resume/--no-resume", help="Continue from the checkpoint of an "
                                     "earlier run (same model, teacher and plan)."),
         teacher_source: Optional[str] = typer.Option(None, "--teacher", help="Teacher model (default: the "
                                                      "folder's base model, unconverted)."),
         windows: int = typer.Option(64, "--windows", help="Teacher-written windows when no --text is given."),
         seq_len: Optional[int] = typer.Option(None, "--seq-len", help="Tokens per training window [256]."),
         batch_size: Optional[int] = typer.Option(None, "--batch-size", help="Windows per end-to-end step [4]."),
         layer_steps: Optional[int] = typer.Option(None, "--layer-steps", help="Layer-wise steps per layer "
                                                   "(0: skip) [100]."),
         layer_batch: Optional[int] = typer.Option(None, "--layer-batch", help="Windows per layer-wise step [8]."),
         layer_lr: Optional[float] = typer.Option(None, "--layer-lr", help="Layer-wise learning rate [3e-3]."),
         layer_inputs: Optional[str] = typer.Option(None, "--layer-inputs", help="Where a layer-wise step reads "
                                                    "a layer's inputs: teacher (its hidden states) or student (the "
                                                    "student's own, through the layers healed before it; shrink's "
                                                    "choice for a low-rank cut) [teacher]."),
         lr: Optional[float] = typer.Option(None, "--lr", help="End-to-end learning rate (AdamW, cosine) [3e-4]."),
         lora_rank: Optional[int] = typer.Option(None, "--lora-rank", help="Train LoRA adapters of this rank "
                                                 "(peft) instead of the attention weights."),
         checkpoint: Optional[Path] = typer.Option(None, "--checkpoint", help="Checkpoint file "
                                                   "(default: OUT.heal.pt beside --out)."),
         checkpoint_minutes: float = typer.Option(5.0, "--checkpoint-minutes", help="Minutes between checkpoints."),
         force: bool = typer.Option(False, "--force/--no-force", help="Replace an existing --out folder "
                                    "(only one attnlab wrote)."),
         keep_worse: bool = typer.Option(False, "--keep-worse", help="Write the healed weights even when the "
                                         "held-out perplexity rose (by default the converted ones are written "
                                         "back then, and the report says so)."),
         shard: bool = SHARD, collective_timeout: float = COLLECTIVE_TIMEOUT):
    """Heal a converted model by distillation from the original (layer-wise, then KL on next tokens).

    Example: attnlab heal smollm2-mla192 --out smollm2-mla192-healed --minutes 25
    Example: attnlab heal smollm2-mla192 --out healed --text notes.txt --eval-text other.txt --tokens 200000
    Example: torchrun --standalone --nproc-per-node 4 -m attnlab heal smollm2-mla192 --out healed --device cuda
    """
    from .. import models as hf
    from ..heal import distributed as dd
    from ..heal.data import check_pair, training_data
    from ..heal.plan import HealPlan
    from ..heal.run import heal_model
    from ..heal.guard import guard_line, probe_line, switch_line
    from ..io.folders import check_output, output_lock
    from ..runtime.budget import Budget, Stopped, stop_on_signals

    try:
        place = dd.world_from_env(device if device in ("cpu", "cuda") else "cpu")  # torchrun's; no group joined yet
    except ValueError as e:
        raise UsageProblem(str(e)) from None
    # The budget covers loading the models, the teacher's writing (a bounded share), the evaluation before training (a
    # bounded share), training, and the evaluation after it (kept in reserve). Ctrl-C or SIGTERM stop at the next step
    # or evaluation window with a checkpoint; a second one interrupts at once. A run that trained nothing writes nothing
    # and exits 2. One lock per output: a second run into the same --out is refused while the first runs.
    # Under torchrun every process joins the process group; rank 0 alone prints, holds the output lock, prepares the
    # training text (the teacher's writing included) and sends it to the others, and writes the checkpoint, the healed
    # folder and its report. --shard shards the trained weights with FSDP2 instead of replicating them under DDP. A rank
    # whose peer stopped answering at a collective (it died, or exceeded --collective-timeout) says so in one line and
    # exits 2.
    with said_by_rank0(place.rank):  # the command line's checks: the same on every rank, so only rank 0 reports them
        budget = Budget(positive("--minutes", minutes))  # from the command's start: loading counts
        for name, value, integer in (("--tokens", tokens, True), ("--checkpoint-minutes", checkpoint_minutes, False),
                                     ("--windows", windows, True), ("--collective-timeout", collective_timeout, False),
                                     ("--seq-len", seq_len, True), ("--batch-size", batch_size, True),
                                     ("--layer-batch", layer_batch, True), ("--layer-lr", layer_lr, False),
                                     ("--lr", lr, False), ("--lora-rank", lora_rank, True)):
            positive(name, value, integer=integer)
        _check_heal_run(place, tokens, minutes, device, shard, layer_steps, layer_inputs, batch_size, layer_batch)
        readers, checkpoint = _check_heal_files(place, source, out, checkpoint, [*(text or []), *(eval_text or [])],
                                                teacher_source, force or resume, resume)
    quiet_transformers()
    world = dd.init_world(device, collective_timeout)
    device = world.device if world.distributed else device
    with rank_errors(world, collective_timeout, checkpoint):
        with (output_lock(out) if world.main else contextlib.nullcontext()), stop_on_signals(budget), \
                (RunDisplay(budget) if world.main else Silent()) as show:
            try:
                show.phase("loading the student and the teacher")
                student, tok, meta = hf.load_model(str(source))
                if hf.family(student) != "llama":
                    raise UsageProblem("heal trains causal language models (Llama family); for encoders see "
                                       "attnlab.heal.encoder")
                teacher, _, _ = hf.load_model(teacher_source or meta["base"])
                readers.append(meta["base"])
                if world.main:
                    check_output(out, force=force or resume, sources=readers)
                given = dict(seq_len=seq_len, batch_size=batch_size, layer_steps=layer_steps,
                             layer_batch=layer_batch, layer_lr=layer_lr, lr=lr,
                             layer_inputs=layer_inputs)  # None: HealPlan's default
                plan = HealPlan(tokens=tokens, seed=seed, lora_rank=lora_rank,
                                **{k: v for k, v in given.items() if v is not None})
                plan.check()
                check_pair(teacher, student)
                check_seq_len(plan.seq_len, teacher)
                show.phase("preparing data" if text else "the teacher writes text")
                made = {}

                def prepare():  # rank 0 alone (the others wait for it, up to a day: the teacher may write for long)
                    budget.check()
                    made["train"], made["held"], data = training_data(
                        teacher, tok, plan.seq_len, text=text, eval_text=eval_text, windows=windows, seed=seed,
                        budget=budget, progress=lambda i, n: show.count(i, n, "the teacher writes text"))
                    return data

                data = dd.from_rank0(prepare, carry=(ValueError, UsageProblem))
                train, held = dd.broadcast_tensors([made["train"], made["held"]] if world.main else None)
                show.phase("evaluating before training")
                report = heal_model(teacher, student, train, held, plan, budget=budget, device=device,
                                    checkpoint=checkpoint, resume=resume,
                                    checkpoint_seconds=60 * checkpoint_minutes,
                                    progress=show.step if world.main else None, world=world, shard=shard,
                                    keep_better=not keep_worse)
            except Stopped as e:
                spent = f"{budget.elapsed() / 60:.1f} of {minutes} minutes" if minutes else "time"
                raise UsageProblem("stopped before training began: nothing trained, nothing written"
                                   if e.reason == "stop" else
                                   f"the budget ({spent}) was spent before training began: nothing trained, "
                                   "nothing written (give more --minutes)") from None
            report["data"] = data
            title = (f"heal {source} ({report['status']}: {report['minutes']:.1f} min training, "
                     f"{budget.elapsed() / 60:.1f} min in all, {report['distill_tokens']} end-to-end tokens)")
            if "teacher" in report and world.main:
                console.print(report_table(title, report))
                for line in (probe_line(report), switch_line(report), guard_line(report),
                             report.get("kept") and f"kept {report['kept']}"):
                    if line:
                        console.print(line)
            if not report["steps_done"]:
                raise UsageProblem(f"nothing was trained: the budget was spent first ({budget.elapsed() / 60:.1f} "
                                   "min went to loading, data and evaluation); nothing written (give more --minutes)")
            if report["status"] == "stopped":
                if world.main:
                    console.print(f"stopped; the checkpoint is {checkpoint} (continue with --resume)")
                raise typer.Exit(1)
            if world.main:
                extra = {k: v for k, v in meta.items() if k not in ("format", "version", "base", "layers")}
                hf.save_model(student, meta["base"], out, extra={**extra, "heal": report}, force=force or resume,
                              sources=readers)
    if not world.main:
        return
    if report["status"] == "budget":
        console.print(f"time budget spent before the plan ended; --resume continues from {checkpoint}")
    console.print(f"wrote {out}")


def _check_heal_run(place, tokens, minutes, device, shard, layer_steps, layer_inputs, batch_size,
                    layer_batch) -> None:
    """heal's options that depend on each other, the device and torchrun's processes: a UsageProblem naming them."""
    from ..heal.plan import LAYER_INPUTS, HealPlan

    if layer_steps is not None and layer_steps < 0:
        raise UsageProblem(f"--layer-steps must be 0 (skip the phase) or more, got {layer_steps}")
    if layer_inputs is not None and layer_inputs not in LAYER_INPUTS:
        raise UsageProblem(f"--layer-inputs must be {' or '.join(LAYER_INPUTS)}, got {layer_inputs!r}")
    if tokens is None and minutes is None:
        raise UsageProblem("give --tokens, --minutes or both")
    if device not in ("cpu", "cuda"):
        raise UsageProblem(f"--device must be cpu or cuda, not {device!r}")
    if device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise UsageProblem("--device cuda: no CUDA device is available")
    if shard and not place.distributed:
        raise UsageProblem("--shard needs a process group: it shards the trained weights over the processes of "
                           "a torchrun job (torchrun --nproc-per-node N -m attnlab heal ..., N >= 2); this is "
                           "one process")
    if place.distributed:  # the global batches split evenly over the processes
        for name, value, default in (("--batch-size", batch_size, HealPlan.batch_size),
                                     ("--layer-batch", layer_batch, HealPlan.layer_batch)):
            value = default if value is None else value
            if (name == "--batch-size" or layer_steps != 0) and value % place.size:
                raise UsageProblem(f"{name} {value} does not split over the {place.size} processes: give a "
                                   f"multiple of {place.size}")


def _check_heal_files(place, source: Path, out: Path, checkpoint, texts: list, teacher_source, force: bool,
                      resume: bool):
    """(the files the run reads, its checkpoint's path) once the source is a converted model and rank 0 may write
    the output and the checkpoint; a UsageProblem naming the file."""
    from .. import models as hf
    from ..io.folders import check_output

    if not (Path(source) / "attention.safetensors").is_file() or not (Path(source) / "config.json").is_file():
        raise UsageProblem(f"{source} is not a converted attnlab model (no attention.safetensors/config.json; "
                           "attnlab convert writes one)")
    readers = [*hf.source_paths(source), *texts, *(hf.source_paths(teacher_source) if teacher_source else [])]
    checkpoint = checkpoint or out.with_name(out.name + ".heal.pt")
    if place.main:  # rank 0 alone writes: the output rules are its own
        check_output(out, force=force, sources=readers)
        if resume and not checkpoint.is_file():
            raise UsageProblem(f"no heal checkpoint at {checkpoint} (nothing to resume)")
        if not resume and not force and checkpoint.exists():
            raise UsageProblem(f"a heal checkpoint {checkpoint} exists from an earlier run: continue it with "
                               "--resume, or start afresh with --force")
        check_output(checkpoint, force=True, sources=readers, ours=lambda p: True, what="--checkpoint")
    return readers, checkpoint
