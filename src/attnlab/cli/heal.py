"""`attnlab heal`: distil a converted model back towards the original (attnlab.heal does the work)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from .base import UsageProblem, console


def _writable_parent(out: Path) -> None:
    """UsageProblem unless a folder can be written beside `out` (checked before any work starts)."""
    import tempfile

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=f".{out.name}.probe.", dir=out.parent):
            pass
    except OSError as e:
        raise UsageProblem(f"cannot write to {out}: {e.strerror or e}") from None


def heal(source: Path = typer.Argument(..., help="A converted-model folder written by attnlab convert."),
         out: Path = typer.Option(..., "--out", help="Folder to write the healed model to."),
         text: Optional[list[Path]] = typer.Option(None, "--text", help="Training text file (repeat the option); "
                                                   "default: text the teacher writes from varied prompts."),
         eval_text: Optional[list[Path]] = typer.Option(None, "--eval-text", help="Held-out text for the report; "
                                                        "default: the last 10% of --text, or more teacher text."),
         tokens: Optional[int] = typer.Option(None, "--tokens", help="End-to-end distillation tokens."),
         minutes: Optional[float] = typer.Option(None, "--minutes", help="Time budget for data and training."),
         device: str = typer.Option("cpu", "--device", help="cpu or cuda (bf16 autocast on cuda)."),
         seed: int = typer.Option(0, "--seed", help="Seed of data order and of the teacher's sampled text."),
         resume: bool = typer.Option(False, "--resume", help="Continue from the checkpoint of an earlier run."),
         teacher_source: Optional[str] = typer.Option(None, "--teacher", help="Teacher model (default: the "
                                                      "folder's base model, unconverted)."),
         windows: int = typer.Option(64, "--windows", help="Teacher-written windows when no --text is given."),
         seq_len: Optional[int] = typer.Option(None, "--seq-len", help="Tokens per training window [256]."),
         batch_size: Optional[int] = typer.Option(None, "--batch-size", help="Windows per end-to-end step [4]."),
         layer_steps: Optional[int] = typer.Option(None, "--layer-steps", help="Layer-wise steps per layer "
                                                   "(0: skip) [100]."),
         layer_lr: Optional[float] = typer.Option(None, "--layer-lr", help="Layer-wise learning rate [3e-3]."),
         lr: Optional[float] = typer.Option(None, "--lr", help="End-to-end learning rate (AdamW, cosine) [3e-4]."),
         lora_rank: Optional[int] = typer.Option(None, "--lora-rank", help="Train LoRA adapters of this rank "
                                                 "(peft) instead of the attention weights."),
         checkpoint: Optional[Path] = typer.Option(None, "--checkpoint", help="Checkpoint file "
                                                   "(default: OUT.heal.pt beside --out)."),
         checkpoint_minutes: float = typer.Option(5.0, "--checkpoint-minutes", help="Minutes between checkpoints."),
         force: bool = typer.Option(False, "--force", help="Overwrite an existing --out folder.")):
    """Heal a converted model by distillation from the original (layer-wise, then KL on next tokens).

    Example: attnlab heal smollm2-mla192 --out smollm2-mla192-healed --minutes 25
    Example: attnlab heal smollm2-mla192 --out healed --text notes.txt --eval-text other.txt --tokens 200000
    """
    import signal
    import time

    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from .. import models as hf
    from ..heal.data import check_pair, read_ids, teacher_windows, text_windows
    from ..heal.distill import HealPlan, heal_model

    if tokens is None and minutes is None:
        raise UsageProblem("give --tokens, --minutes or both")
    if device not in ("cpu", "cuda"):
        raise UsageProblem(f"--device must be cpu or cuda, not {device!r}")
    if device == "cuda":
        import torch
        if not torch.cuda.is_available():
            raise UsageProblem("--device cuda: no CUDA device is available")
    meta_file = Path(source) / "config.json"
    if not (Path(source) / "attention.safetensors").is_file() or not meta_file.is_file():
        raise UsageProblem(f"{source} is not a converted attnlab model (no attention.safetensors/config.json; "
                           "attnlab convert writes one)")
    if out.exists() and not (force or resume):
        raise UsageProblem(f"{out} exists; pass --force to overwrite it")
    _writable_parent(out)
    checkpoint = checkpoint or out.with_name(out.name + ".heal.pt")
    if resume and not checkpoint.is_file():
        raise UsageProblem(f"no heal checkpoint at {checkpoint} (nothing to resume)")
    t_start = time.monotonic()
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()  # rich draws the one progress bar
    student, tok, meta = hf.load_model(str(source))
    if hf.family(student) != "llama":
        raise UsageProblem("heal trains causal language models (Llama family); for encoders see attnlab.heal.encoder")
    teacher, _, _ = hf.load_model(teacher_source or meta["base"])
    given = dict(seq_len=seq_len, batch_size=batch_size, layer_steps=layer_steps, layer_lr=layer_lr,
                 lr=lr)  # None: HealPlan's default
    plan = HealPlan(tokens=tokens, seed=seed, lora_rank=lora_rank, **{k: v for k, v in given.items() if v is not None})
    seq_len = plan.seq_len
    plan.check()
    check_pair(teacher, student)
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TextColumn("{task.fields[rate]}"), TextColumn("loss {task.fields[loss]}"), TimeRemainingColumn(),
                  console=console, transient=True) as bar:
        task = bar.add_task("preparing data", total=None, rate="", loss="-")
        if text:
            train, held = text_windows(tok, text, seq_len, eval_paths=eval_text)
        else:
            gen = lambda i, n: bar.update(task, description="teacher writes text", completed=i, total=n)  # noqa
            train = teacher_windows(teacher, tok, windows, seq_len, seed=seed, progress=gen)
            if eval_text:
                held = read_ids(tok, eval_text)[None]
            else:
                held = teacher_windows(teacher, tok, 8, seq_len, seed=seed + 7919, progress=gen).reshape(1, -1)
        budget = None if minutes is None else max(0.0, minutes - (time.monotonic() - t_start) / 60)

        def show(info):
            what = "layer-wise" if info["phase"] == "layers" else "end-to-end KL"
            bar.update(task, description=f"{what}" + (f" (layer {info['layer']})" if info["phase"] == "layers"
                                                      else ""), completed=info["done"], total=info["total"],
                       rate=f"{info['tokens_per_s']:.0f} tok/s", loss=f"{info['loss']:.4f}")

        def wire(healer):
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: healer.request_stop())

        report = heal_model(teacher, student, train, held, plan, minutes=budget, device=device,
                            checkpoint=checkpoint, resume=resume, checkpoint_seconds=60 * checkpoint_minutes,
                            progress=show, stop_hook=wire)
    report["data"] = {"text": [str(t) for t in text or []], "eval_text": [str(t) for t in eval_text or []],
                      "training_windows": int(train.shape[0]), "held_out_tokens": int(held.shape[1]),
                      "self_generated": not text}
    table = Table(title=f"heal {source} ({report['status']}: {report['minutes']:.1f} min, "
                        f"{report['distill_tokens']} end-to-end tokens)")
    for col in ("model", "perplexity", "top-1 agreement", "greedy prefix (64)", "KV bytes/token"):
        table.add_column(col, justify="right")
    t = report["teacher"]
    table.add_row("teacher", f"{t['perplexity']:.3f}", "1", "1", str(t["kv_bytes_per_token"]))
    for name in ("before", "after"):
        r = report[name]
        g = r.get("greedy_agreement", {}).get("prefix")
        table.add_row(f"student {name}", f"{r['perplexity']:.3f}", f"{r['top1_agreement']:.4f}",
                      "-" if g is None else f"{g:.4f}", str(r["kv_bytes_per_token"]))
    console.print(table)
    if report["status"] == "stopped":
        console.print(f"stopped; the checkpoint is {checkpoint} (continue with --resume)")
        raise typer.Exit(1)
    extra = {k: v for k, v in meta.items() if k not in ("format", "version", "base", "layers")}
    hf.save_model(student, meta["base"], out, extra={**extra, "heal": report})
    if report["status"] == "budget":
        console.print(f"time budget spent before the plan ended; --resume continues from {checkpoint}")
    console.print(f"wrote {out}")
