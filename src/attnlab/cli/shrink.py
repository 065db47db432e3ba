"""`attnlab shrink`: a KV budget in, a healed model out, in one command that keeps its time budget.

The pipeline is attnlab.shrink's (plan -> convert -> heal -> export over the library's own
functions); this file parses, wires Ctrl-C and the one progress display, and prints the report.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from .base import RunDisplay, UsageProblem, console, positive, quiet_transformers
from .ranks import COLLECTIVE_TIMEOUT, SHARD, Silent, rank_errors, said_by_rank0


def _summary(report: dict) -> Table:
    kv = report["kv_bytes_per_token"]
    held = report["held_out"]
    chosen = report["plan"].get("chosen", {})
    table = Table(title=f"shrink: {chosen.get('label', '')} ({report['minutes'].get('total', 0):.1f} min)")
    table.add_column("")
    table.add_column("teacher", justify="right")
    table.add_column("student before heal", justify="right")
    table.add_column("student after heal", justify="right")
    t, b, a = held.get("teacher") or {}, held.get("before") or {}, held.get("after") or {}
    fmt = lambda d, k, spec: "-" if d.get(k) is None else format(d[k], spec)  # noqa: E731
    table.add_row("held-out perplexity", fmt(t, "perplexity", ".3f"), fmt(b, "perplexity", ".3f"),
                  fmt(a, "perplexity", ".3f"))
    table.add_row("top-1 agreement", "1", fmt(b, "top1_agreement", ".4f"), fmt(a, "top1_agreement", ".4f"))
    greedy = lambda d: "-" if "greedy_agreement" not in d else f"{d['greedy_agreement']['prefix']:.4f}"  # noqa: E731
    table.add_row("greedy prefix (64)", "1", greedy(b), greedy(a))
    table.add_row("KV bytes/token", f"{kv['original_16bit']} (16-bit)", str(kv["shrunk"]), str(kv["shrunk"]))
    if kv.get("fixed_per_sequence"):  # "+c4": the rope key's newest group of tokens, unquantised, in every sequence
        table.add_row("KV bytes/sequence, fixed", "0", str(kv["fixed_per_sequence"]), str(kv["fixed_per_sequence"]))
    planned = kv.get("as_planned") or {}
    if planned.get("context") is None and kv.get("fixed_per_sequence"):  # the budget's count: fixed rows spread
        label = f"as budgeted (fixed over {planned['fixed_rows_over']:,} tokens)"
        table.add_row(label, f"{planned['original_16bit']:.0f}", f"{planned['shrunk']:.0f}", f"{planned['shrunk']:.0f}")
    if kv.get("at_context"):  # sliding layers hold at most their window: the bytes of a long sequence are fewer
        at = kv["at_context"]
        table.add_row(f"at {at['context']} tokens", f"{at['original_16bit']:.0f}", f"{at['shrunk']:.0f}",
                      f"{at['shrunk']:.0f}")
    return table


def _against_baselines(report: dict) -> str | None:
    """One line: the best training-free baseline at or above the bytes reached, and whether the result beats it."""
    against = (report.get("baselines") or {}).get("against")
    if not against:
        return None
    verdict = "beats" if against["beats"] else "does NOT beat"
    return (f"against the original with a {against['baseline']} cache ({against['baseline_bytes']} bytes/token, "
            f"no training): perplexity {against['baseline_perplexity']:.3f}; this result ({against['perplexity']:.3f}) "
            f"{verdict} it ({against['perplexity_ratio_to_baseline']:.3f}x)")


def _candidates(report: dict) -> Table | None:
    plan = report["plan"]
    if plan.get("explicit") or not plan.get("candidates"):
        return None
    at = f" at {plan['context']:,} tokens" if plan.get("context") else \
        f", fixed rows over {plan['fixed_rows_over']:,} tokens" if plan.get("fixed_rows_over") else ""
    table = Table(title=f"plan for a KV budget of {plan['budget']} ({plan['budget_bytes']:.0f} bytes/token{at}): "
                        "candidates by proxy (KL on the calibration text)")
    for col in ("candidate", "bytes/token", "proxy KL"):
        table.add_column(col, justify="left" if col == "candidate" else "right")
    for c in plan["candidates"]:
        table.add_row(c["label"], f"{c['bytes_per_token']:.0f}", f"{c['proxy']:.4f}")
    return table


def _check_numbers(place, *, minutes, tokens, seq_len, context, latent_dim, rope_dim, device: str, layer_steps,
                   shard: bool, batch_size: int) -> None:
    """The command line's numbers and their fit to the processes (UsageProblem naming the option)."""
    positive("--minutes", minutes)
    positive("--tokens", tokens, integer=True)
    positive("--seq-len", seq_len, integer=True)
    positive("--context", context, integer=True)
    positive("--latent-dim", latent_dim, integer=True)
    positive("--rope-dim", rope_dim, integer=True)
    if device not in ("cpu", "cuda"):
        raise UsageProblem(f"--device must be cpu or cuda, not {device!r}")
    if layer_steps is not None and layer_steps < 0:
        raise UsageProblem(f"--layer-steps must be 0 (skip the phase) or more, got {layer_steps}")
    if shard and not place.distributed:
        raise UsageProblem("--shard needs a process group: it shards the trained weights over the processes of "
                           "a torchrun job (torchrun --nproc-per-node N -m attnlab shrink ..., N >= 2); this is "
                           "one process")
    positive("--batch-size", batch_size, integer=True)
    if place.distributed and batch_size % place.size:
        fits = [n for n in range(2, batch_size + 1) if batch_size % n == 0]
        runs = f"run {', '.join(map(str, fits))} of them" if fits else "run one process"
        bigger = place.size * -(-batch_size // place.size)  # the nearest batch that splits over these processes
        raise UsageProblem(f"shrink's heal splits batches of --batch-size {batch_size} windows over the processes: "
                           f"{place.size} processes do not divide it; {runs}, or give a --batch-size that "
                           f"{place.size} divides (--batch-size {bigger})")


def _print_report(report: dict) -> None:
    """What a finished run prints: the candidates, the summary, the lines that judge it, the minutes and work."""
    from ..heal.guard import guard_line, probe_line, switch_line
    from ..shrink.pipeline import NOT_RUN

    table = _candidates(report)
    if table is not None:
        console.print(table)
    console.print(_summary(report))
    where = report.get("runs_in") or {}
    runs = f"runs in {where['engine']}: {where['how']}" if where else None
    for line in (_against_baselines(report), (report.get("llama_cpp") or {}).get("note"), runs):
        if line:
            console.print(line)
    heal = report.get("heal") or {}
    # the verdict's line reads the evaluation after the heal, which the report keeps under held_out
    for line in (probe_line(heal), switch_line({**heal, "after": (report.get("held_out") or {}).get("after")}),
                 guard_line(heal)):
        if line:
            console.print(line)
    skipped = heal.get("status") == NOT_RUN
    if skipped:
        console.print("no heal ran (--no-heal): the converted weights were written")
    if heal.get("kept"):  # the heal made it worse: the converted weights are what was written
        console.print(f"kept {heal['kept']}")
    minutes_by_phase = ", ".join(f"{k} {v:.1f}" for k, v in report["minutes"].items())
    console.print(f"minutes per phase: {minutes_by_phase}")
    work = report.get("work") or {}
    if work:
        healed = "no heal" if skipped else \
            f"{work.get('heal_steps')} heal steps ({work.get('end_to_end_steps')} end to end, " \
            f"{work.get('end_to_end_tokens')} tokens)"
        console.print(f"work: {work.get('training_windows')} training windows, {work.get('candidates_measured')} "
                      f"candidates planned, {healed}" + ("; pinned" if work.get("pinned") else
                                                         "; the clock set how much"))


def shrink(source: str = typer.Argument(..., help="The model: smollm2, a transformers folder or a .gguf file "
                                          "(Llama, Mistral, Qwen2)."),
           kv_budget: str = typer.Option(..., "--kv-budget", help="The KV cache to keep: a share of the original's "
                                         "16-bit cache (50%, 0.25) or bytes per token for the whole model (6000)."),
           context: Optional[int] = typer.Option(None, "--context", help="Count the budget's bytes per token at this "
                                                 "sequence length: a sliding-window layer holds only its window, and "
                                                 "the planner may keep such layers unconverted (Gemma 3), and what a "
                                                 "sequence holds whatever its length (a +c4 rope key's newest 64 "
                                                 "tokens, a +w16 window) is spread over it (default: every token "
                                                 "held in every layer, the fixed rows spread over 4096 tokens, or "
                                                 "the model's max_position_embeddings where shorter)."),
           out: Path = typer.Option(..., "--out", help="Where to write: a folder (attnlab, deepseek) or a .gguf file."),
           minutes: float = typer.Option(10.0, "--minutes", help="Time budget for everything, from the start."),
           text: Optional[list[Path]] = typer.Option(None, "--text", help="Training and calibration text (repeat); "
                                                     "default: text the model writes itself."),
           eval_text: Optional[list[Path]] = typer.Option(None, "--eval-text", help="Held-out text for the report "
                                                          "(never trained or calibrated on)."),
           fmt: str = typer.Option("attnlab", "--format", help="attnlab (attention layers beside the base), deepseek "
                                   "(a DeepseekV3 folder) or gguf (one file llama.cpp runs: from a llama, qwen3 or "
                                   "gemma3 GGUF, the original attention healed for a llama.cpp cache type, in its own "
                                   "architecture, where that measures best; else deepseek2) or transformers (the "
                                   "source's own class, save_pretrained, planned for attnlab.hf.KVCache)."),
           kv_dtype: str = typer.Option("auto", "--kv-dtype", help="Cache storage: auto (attnlab's format may "
                                        "choose 8-bit or 2- to 6-bit latents when they measure better; a GGUF llama.cpp's "
                                        "f16, q8_0, q8_0 K with q4_0 V, q5_0 or q4_0 cache), bf16, int8, int2 to int7 "
                                        "(int4/g<N>: a scale per N channels; +r8: the rope key in 8 bits; +c4: the "
                                        "rope key in 4 bits per channel over groups of 64 tokens, +c3, +c2 in 3, 2; "
                                        "+w<N> after any of them: the newest N tokens kept unquantised too, as "
                                        "auto's few-bit ones do with +w16); "
                                        "for --format gguf bf16 (llama.cpp's f16) or a llama.cpp cache type, q8_0, q5_0, "
                                        "q4_1, q4_0, or K and V apart as K,V (q8_0,q4_0: --cache-type-k q8_0 "
                                        "--cache-type-v q4_0; the original attention only); for --format "
                                        "transformers a storage of attnlab.hf.KVCache: q8_0, q8_0,q4_0, q5_0, "
                                        "int4/g32, q4_0, iq4_nl, int3/g64, int2/g32."),
           latent_dim: Optional[int] = typer.Option(None, "--latent-dim", help="Skip the planner: this latent size "
                                                    "(with --rope-dim)."),
           rope_dim: Optional[int] = typer.Option(None, "--rope-dim", help="Skip the planner: this rope size."),
           no_calibration: bool = typer.Option(False, "--no-calibration", metavar="", help="Cut on the weights "
                                               "alone (much worse; by default the cut is calibrated on text)."),
           seed: int = typer.Option(0, "--seed", help="Seed of the model's own text and of the data order."),
           tokens: Optional[int] = typer.Option(None, "--tokens", help="End-to-end heal tokens (default: as many "
                                                "as the time allows). With --layer-steps it pins the work: the "
                                                "same weights under any load, --minutes not enforced."),
           seq_len: int = typer.Option(256, "--seq-len", help="Tokens per training window."),
           batch_size: int = typer.Option(4, "--batch-size", help="Windows per end-to-end heal step (the layer-wise "
                                          "batch is a whole number of them); under torchrun the global batch, which "
                                          "the number of processes must divide."),
           device: str = typer.Option("cpu", "--device", help="cpu or cuda."),
           resume: bool = typer.Option(False, "--resume/--no-resume", help="Continue a stopped run (same arguments)."),
           force: bool = typer.Option(False, "--force/--no-force", help="Replace an existing --out (only one "
                                      "attnlab wrote)."),
           layer_steps: Optional[int] = typer.Option(None, "--layer-steps", help="Layer-wise heal steps per layer "
                                                     "(0: skip the phase; default: sized to the time). With "
                                                     "--tokens it pins the work."),
           keep_worse: bool = typer.Option(False, "--keep-worse", help="Write the healed weights even when they "
                                           "moved away from the original on a held-out text (by default the "
                                           "converted ones are written then, and the report says so)."),
           per_layer: bool = typer.Option(False, "--per-layer", help="Also plan a latent size per layer (each "
                                          "layer alone at three sizes, about 1.5 minutes on SmolLM2-135M, taken from "
                                          "the heal; --format attnlab). Measured at 12.5% it did not beat one size "
                                          "for all, in 10 minutes nor with a text in 30 (docs/decisions.md)."),
           no_heal: bool = typer.Option(False, "--no-heal", help="Plan, convert and write the codec with no "
                                        "training: no heal, no training text beyond the plan's (a few minutes; at "
                                        "25% and above the heal seldom pays on a CPU: docs/decisions.md)."),
           shard: bool = SHARD, collective_timeout: float = COLLECTIVE_TIMEOUT):
    """Shrink a model's KV cache to a budget: plan, convert, heal and export in one run.

    Example: attnlab shrink smollm2 --kv-budget 25% --no-heal --format transformers --out small (the codec alone)
    Example: attnlab shrink ~/Llama-3.2-1B --kv-budget 25% --text notes.txt --minutes 30 --format gguf --out small.gguf
    Example: torchrun --nproc-per-node 8 -m attnlab shrink ~/Llama-3.2-1B --kv-budget 25% --device cuda --out small
    """
    from ..runtime.budget import Budget, Stopped, stop_on_signals
    from ..shrink.request import ShrinkRequest, check_request
    from ..shrink.state import run_folder
    from ..shrink.pipeline import shrink as run

    from ..heal import distributed as dd

    place = dd.world_from_env(device if device in ("cpu", "cuda") else "cpu")  # torchrun's; no group joined yet
    with said_by_rank0(place.rank):  # the command line's checks: the same on every rank
        _check_numbers(place, minutes=minutes, tokens=tokens, seq_len=seq_len, context=context,
                       latent_dim=latent_dim, rope_dim=rope_dim, device=device, layer_steps=layer_steps, shard=shard,
                       batch_size=batch_size)
        req = ShrinkRequest(source=source, kv_budget=kv_budget, out=str(out), fmt=fmt, minutes=minutes,
                            text=[str(t) for t in text or []], eval_text=[str(t) for t in eval_text or []],
                            seed=seed, device=device, calibration=not no_calibration, storage=kv_dtype,
                            latent_dim=latent_dim, rope_dim=rope_dim, tokens=tokens, seq_len=seq_len,
                            layer_steps=layer_steps, keep_worse=keep_worse, context=context, batch_size=batch_size,
                            per_layer=per_layer, heal=not no_heal)
        try:
            check_request(req)
        except ValueError as e:
            raise UsageProblem(str(e)) from None
    if no_calibration and place.main:
        console.print("[yellow]warning:[/yellow] --no-calibration: the cut is chosen on the weights alone, which "
                      "measured many times worse before healing (docs/decisions.md)")
    from ..io.folders import output_lock

    quiet_transformers()
    budget = Budget(minutes)
    world = dd.init_world(device, collective_timeout)
    with rank_errors(world, collective_timeout, run_folder(out) / "heal.pt"):
        with (output_lock(out) if world.main else contextlib.nullcontext()), stop_on_signals(budget), \
                (RunDisplay(budget) if world.main else Silent()) as show:
            try:
                report = run(req, resume=resume, force=force, budget=budget, display=show, world=world, shard=shard)
            except Stopped as e:
                if not world.main:
                    raise typer.Exit(1 if e.reason == "stop" else 2) from None
                where = run_folder(out)
                if e.reason == "stop":
                    console.print(f"stopped; the run's state is in {where} (continue with --resume)")
                    raise typer.Exit(1)
                raise UsageProblem(f"the budget ({minutes} min) was spent before the heal could start: nothing "
                                   f"written; --resume with more --minutes continues from {where}") from None
    if not world.main:
        return
    _print_report(report)
    console.print(f"wrote {out}")
