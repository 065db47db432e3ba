"""`attnlab convert`: a saved module, or every layer of a model, to another family, with its report."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from .base import UsageProblem, console, quiet_transformers, write_atomic
from .export import folder_source

LATENT_NORMS = ("none", "steady", "fit")


# -- convert --------------------------------------------------------------------------------------
def _report_table(report) -> Table:
    table = Table(title=f"{report.source} -> {report.target} ({'exact' if report.exact else 'lossy'})")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    table.add_row("output error (probe, float64)", f"{report.output_error:.3e}")
    for name, err in report.matrix_errors.items():
        table.add_row(f"matrix error {name}", f"{err:.3e}")
    if report.energy_kept is not None:
        table.add_row("energy kept", f"{report.energy_kept:.4f}")
    table.add_row("KV values per token", f"{report.kv_values_before} -> {report.kv_values_after}")
    for note in report.notes:
        table.add_row("note", note)
    return table



def _self_calibration(model, tok, tokens: int, seed: int):
    """(token ids (1, N), what they are): text the model writes itself, for a lossy cut given no --calibration."""
    from ..heal.data import teacher_windows

    if tok is None:
        raise UsageProblem("a lossy cut is calibrated on text, and the model has no tokenizer to write its own: give "
                           "--calibration FILE (or --no-calibration)")
    seq = 256
    with console.status(f"the model writes {tokens} tokens of its own calibration text (seed {seed})"):
        ids = teacher_windows(model, tok, max(1, -(-tokens // seq)), seq, seed=seed, batch_size=8).reshape(1, -1)
    return ids[:, :tokens], f"text the model wrote itself (seed {seed})"


def _convert_model(source, to, out, latent_dim, rope_dim, kv_heads, method, calibration, calibration_tokens,
                   report_json, fmt="attnlab", force=False, rope_select=None, balance=None,
                   latent_norm="none", kv_budget=None, use_calibration=True, seed=0):
    """rope_select, balance: None is the model's default: rorope-score with BKV, or for a model with per-head q/k
    norms (Qwen3, Gemma 3) the only layout it converts to, its keys whole (pairs by frequency, no BKV)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from .. import models as hf

    _check_convert(to, fmt, latent_dim, rope_dim, latent_norm, calibration, kv_budget, use_calibration)
    lossy = to == "mla" and (latent_dim is not None or kv_budget is not None)
    from ..io.folders import check_output
    check_output(out, force=force, sources=[*hf.source_paths(source), calibration])  # before any work
    if fmt == "deepseek" and Path(source).is_dir() and hf.is_checkpoint(source):
        if kv_budget is not None:
            raise UsageProblem("--kv-budget measures candidates on the model in memory; the streamed DeepSeek "
                               "conversion of a folder takes --latent-dim and --rope-dim")
        if lossy and calibration is None and use_calibration:
            raise UsageProblem("the streamed conversion never holds the model, so it cannot write its own "
                               "calibration text: give --calibration FILE (or --no-calibration, much worse)")
        return _convert_streamed(source, to, out, latent_dim, rope_dim, calibration, calibration_tokens,
                                 report_json, force, rope_select or "rorope-score", balance is not False,
                                 "fit" if latent_norm == "fit" else "constant")
    quiet_transformers()
    model, tok, meta = hf.load_model(source)
    whole = hf.keys_whole_rope_dim(model) is not None  # per-head q/k norms: their keys stay whole
    rope_select = rope_select or ("frequency" if whole else "rorope-score")
    balance = (not whole) if balance is None else balance
    hf.check_convertible(model, exact=to == "mla" and latent_dim is None and kv_budget is None,
                         **({} if kv_budget is not None else dict(rope_dim=rope_dim, pair_selection=rope_select,
                                                                   balance=balance)))
    if fmt == "deepseek":
        hf.check_deepseek_request(model, to, latent_dim if kv_budget is None else 1)
    calibrated_on = None
    scoring = 1024 if kv_budget is not None else 0  # the planner scores candidates on text after the calibration's
    ids = hf.read_text_ids(tok, calibration, calibration_tokens + scoring) if calibration is not None else None
    if ids is not None and ids.numel() == 0:
        raise UsageProblem(f"{calibration}: 0 tokens; calibration needs text")
    if ids is not None:
        calibrated_on = str(calibration)
    elif lossy and use_calibration and hf.family(model) == "llama":
        ids, calibrated_on = _self_calibration(model, tok, calibration_tokens + scoring, seed)
    proxy_ids = None
    if ids is not None and scoring:
        ids, proxy_ids = ids[:, :calibration_tokens], ids[:, calibration_tokens:]
        proxy_ids = proxy_ids if proxy_ids.shape[1] >= 256 else None  # too short: scored on the calibration
    if ids is not None:
        calibrated_on = f"{ids.shape[1]} tokens of {calibrated_on}"
    elif lossy and not use_calibration:
        console.print("[yellow]warning:[/yellow] --no-calibration: the cut is chosen on the weights alone, which "
                      "measured many times worse (docs/decisions.md)")
    plan = None
    if kv_budget is not None:
        plan = _plan(model, ids, proxy_ids, kv_budget, fmt)
        best = plan.best
        latent_dim, rope_dim, rope_select, balance = (best.latent_dims or best.latent_dim, best.rope_dim,
                                                      best.rope_select, best.balance)  # sizes per layer: round 4
    n = len(hf.attnlab_modules(model))
    before = hf.kv_bytes_per_token(model)
    with Progress(TextColumn("converting layers"), BarColumn(), MofNCompleteColumn(), console=console,
                  transient=True) as bar:
        task = bar.add_task("layers", total=n)
        reports = hf.convert_model(model, to, latent_dim=latent_dim, rope_dim=rope_dim, num_kv_heads=kv_heads,
                                   method=method, calibration_ids=ids, pair_selection=rope_select,
                                   balance=balance, progress=lambda i: bar.update(task, completed=i + 1))
    norm_errors = None
    if latent_norm == "fit":
        norm_errors = hf.add_latent_norms(model, ids)
    elif latent_norm == "steady":
        from ..models.export.latent_norm import add_steady_channels
        norm_errors = add_steady_channels(model, ids)
    modules = hf.attnlab_modules(model)
    # what the written model caches: attnlab's modules, or the DeepSeek export (+1 constant channel without a norm)
    cached = [m.kv_values_per_token + (fmt == "deepseek" and m.kv_norm is None) for m in modules]
    size = modules[0]._anchor.dtype.itemsize
    after = sum(cached) * size if fmt == "deepseek" else hf.kv_bytes_per_token(model)
    _print_conversion(f"{source} -> {to}", reports, cached, modules, norm_errors, latent_norm, fmt, before, after)
    summary = {"source": source, "to": to, "latent_dim": latent_dim, "rope_dim": rope_dim,
               "rope_select": rope_select, "balance": balance, "calibration": calibrated_on,
               "plan": None if plan is None else plan.to_dict(),
               "kv_bytes_per_token_before": before, "kv_bytes_per_token_after": after,
               "layers": [r.to_dict() for r in reports], "latent_norm": latent_norm,
               "latent_norm_errors": norm_errors}
    if fmt == "deepseek":  # kv_a_layernorm made linear by a constant latent channel (export.constant_channel)
        hf.export_deepseek(model, out, tokenizer=None if folder_source(model) else tok, force=force)
    else:
        hf.save_model(model, meta["base"], out, extra={"conversion": summary}, force=force,
                      sources=[*hf.source_paths(source), calibration])
    if report_json is not None:
        write_atomic(report_json, json.dumps(summary, indent=2).encode())
    console.print(f"wrote {out}")


def _plan(model, ids, proxy_ids, kv_budget: str, fmt: str):
    """--kv-budget: the planner's choice of sizes (16-bit caches), printed with the three next best."""
    from ..shrink.candidate import rank
    from ..shrink.plan import plan as choose
    from ..shrink.sizes import parse_budget

    with console.status("planning: measuring candidate cuts on the calibration text") as status:
        plan = choose(model, ids, parse_budget(kv_budget), fmt=fmt, storages=("bf16",), proxy_ids=proxy_ids,
                      progress=lambda i, label: status.update(f"planning: candidate {i + 1}: {label}"))
    best = plan.best
    console.print(f"plan for a KV budget of {plan.budget}: {best.label()} (proxy KL {best.proxy:.4f}; "
                  + "; ".join(f"{c.label()} {c.proxy:.4f}" for c in sorted(plan.measured, key=rank)[1:4]) + ")")
    return plan


def _check_convert(to, fmt, latent_dim, rope_dim, latent_norm, calibration, kv_budget, use_calibration) -> None:
    """convert's options that exclude or need each other, checked before any work: a UsageProblem naming them."""
    if fmt not in ("attnlab", "deepseek"):
        raise UsageProblem(f"--format must be attnlab or deepseek, not {fmt!r}")
    if latent_norm not in LATENT_NORMS:
        raise UsageProblem(f"--latent-norm must be one of {', '.join(LATENT_NORMS)}, not {latent_norm!r}")
    if latent_norm != "none" and (to != "mla" or latent_dim is None):
        raise UsageProblem(f"--latent-norm {latent_norm} needs --to mla --latent-dim R (a compressed, "
                           "decoupled-RoPE MLA)")
    if latent_norm != "none" and calibration is None:
        raise UsageProblem(f"--latent-norm {latent_norm} fits the norm on calibration text: give --calibration FILE")
    if latent_norm == "steady" and fmt == "deepseek":
        raise UsageProblem("--latent-norm steady is for llama.cpp (GGUF); --format deepseek is exact without a norm "
                           "(one constant latent channel, the same one extra cached number)")
    if kv_budget is not None and (latent_dim is not None or rope_dim is not None):
        raise UsageProblem("give --kv-budget (attnlab chooses the sizes) or --latent-dim/--rope-dim, not both")
    if kv_budget is not None and to != "mla":
        raise UsageProblem(f"--kv-budget plans an MLA: use --to mla, not {to!r}")
    if kv_budget is not None and not use_calibration:
        raise UsageProblem("--kv-budget measures candidate cuts on text: it cannot run with --no-calibration "
                           "(give --latent-dim and --rope-dim instead)")
    if calibration is not None and not use_calibration:
        raise UsageProblem("give --calibration FILE or --no-calibration, not both")


def _print_conversion(title, reports, cached, modules, norm_errors, latent_norm, fmt, before, after) -> None:
    """The conversion's table (each layer's errors and cached values), the latent norms' errors and the bytes."""
    table = Table(title=f"{title}: {reports[0].source} -> {reports[0].target} per layer")
    for col in ("layer", "exact", "output error", "QK error", "OV error", "KV values/token"):
        table.add_column(col, justify="right")
    for i, r in enumerate(reports):
        table.add_row(str(i), "yes" if r.exact else "no", f"{r.output_error:.2e}",
                      f"{r.matrix_errors.get('QK', 0):.2e}", f"{r.matrix_errors.get('OV', 0):.2e}",
                      f"{r.kv_values_before} -> {cached[i]}")
    console.print(table)
    if norm_errors is not None:
        console.print(f"latent norms fitted ({latent_norm}): output error per layer (added by the norm) "
                      + " ".join(f"{e:.2e}" for e in norm_errors)
                      + f"; max {max(norm_errors):.2e}, mean {sum(norm_errors) / len(norm_errors):.2e}")
    if fmt == "deepseek" and modules[0].kv_norm is None:
        console.print(f"the DeepSeek export caches {cached[0]} values per token per layer: latent "
                      f"{modules[0].latent_dim} + 1 constant channel (its kv_a_layernorm made linear) + rope "
                      f"{modules[0].rope_dim}")
    console.print(f"KV cache bytes per token (whole model, {modules[0]._anchor.dtype}"
                  f"{', as the DeepSeek export caches it' if fmt == 'deepseek' else ''}): {before} -> {after}")


def _convert_streamed(source, to, out, latent_dim, rope_dim, calibration, calibration_tokens, report_json, force,
                      rope_select="frequency", balance=False, latent_norm="constant"):
    """A transformers folder to a DeepSeek checkpoint, one layer at a time (models/stream.py)."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
    )

    from ..models.stream import calibration_ids_for, convert_checkpoint

    if to != "mla":
        raise UsageProblem(f"--format deepseek writes an MLA: use --to mla, not {to!r}")
    ids = calibration_ids_for(source, calibration, calibration_tokens) if calibration is not None else None
    with Progress(TextColumn("converting layers (streamed)"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task("layers", total=None)
        summary = convert_checkpoint(source, out, latent_dim=latent_dim, rope_dim=rope_dim, calibration_ids=ids,
                                     pair_selection=rope_select, balance=balance, force=force,
                                     latent_norm=latent_norm,
                                     progress=lambda i, n: bar.update(task, completed=i + 1, total=n))
    before, after = summary["kv_values_per_token_per_layer"]
    console.print(f"KV values per token per layer: {before} -> {after}"
                  + (" (latent + 1 constant channel + rope, as the export caches them)"
                     if latent_norm == "constant" else ""))
    if summary["latent_norm_output_errors"] and latent_norm == "fit":
        errors = summary["latent_norm_output_errors"]
        console.print("latent norms fitted: output error per layer (added by the norm) "
                      + " ".join(f"{e:.2e}" for e in errors))
    if report_json is not None:
        write_atomic(report_json, json.dumps(summary, indent=2).encode())
    console.print(f"wrote {out}")



def convert(source: str = typer.Argument(..., help="An attnlab checkpoint folder, a model (smollm2, minilm, gemma3-270m), or "
                                                     "a transformers folder / GGUF file (Llama, Mistral, Qwen2)."),
            to: str = typer.Option(..., "--to", help="Target family: mha, gqa, mla, absorbed."),
            out: Path = typer.Option(..., "--out", help="Folder to write the converted checkpoint to."),
            kv_heads: Optional[int] = typer.Option(None, "--kv-heads", help="gqa: number of KV heads."),
            method: Optional[str] = typer.Option(None, "--method", help="gqa: mean or fit."),
            latent_dim: Optional[int] = typer.Option(None, "--latent-dim", help="mla: latent size (lossy)."),
            rope_dim: Optional[int] = typer.Option(None, "--rope-dim",
                                                   help="mla of a RoPE model: decoupled rotary dims kept (frequency, "
                                                        "norm: a multiple of 2 x KV heads; rorope: any even number)."),
            energy: Optional[float] = typer.Option(None, "--energy", help="mla: keep this fraction of energy."),
            split: bool = typer.Option(False, "--split/--joint", metavar="",
                                       help="mla of a saved module: factor K and V separately (default: jointly)."),
            rope_select: Optional[str] = typer.Option(None, "--rope-select",
                                            help="mla of a RoPE model: what keeps rotating: frequency, norm "
                                                 "(pairs per KV head), rorope (mixed planes by frequency: GGUF within "
                                                 "its rope limit) or rorope-score (mixed planes by score, allocated "
                                                 "for all layers at once; DeepSeek export) (docs/decisions.md). "
                                                 "Default rorope-score; frequency for Qwen3/Gemma 3 (keys whole)."),
            balance: Optional[bool] = typer.Option(None, "--balance/--no-balance", metavar="",
                                                   help="mla of a RoPE model: balance K and V before the joint SVD "
                                                        "(BKV; on by default, the best measured; off for Qwen3/Gemma "
                                                        "3, whose latent holds only the values)."),
            kv_budget: Optional[str] = typer.Option(None, "--kv-budget", help="mla of a RoPE model: the KV cache to "
                                                    "keep (50%, 0.25, or bytes per token); attnlab chooses the sizes "
                                                    "and what keeps rotating by measuring candidates."),
            no_calibration: bool = typer.Option(False, "--no-calibration", metavar="",
                                                help="Cut on the weights alone (much worse). By default a lossy cut "
                                                     "is calibrated on --calibration FILE, or on text the model "
                                                     "writes itself."),
            seed: int = typer.Option(0, "--seed", help="Seed of the model's own calibration text."),
            calibration: Optional[Path] = typer.Option(None, "--calibration",
                                                       help="Model conversions: a text file whose activations "
                                                            "whiten the SVDs."),
            calibration_tokens: int = typer.Option(2048, "--calibration-tokens", help="Tokens of it to use."),
            report_json: Optional[Path] = typer.Option(None, "--report", help="Also write the report as JSON."),
            fmt: str = typer.Option("attnlab", "--format", help="Models: attnlab (attention layers beside the base) "
                                    "or deepseek (a DeepseekV3 checkpoint transformers loads alone)."),
            force: bool = typer.Option(False, "--force/--no-force", metavar="",
                                       help="Models: overwrite an existing --out folder."),
            latent_norm: str = typer.Option("none", "--latent-norm", help="mla of a model, with --calibration: give "
                                            "every layer the RMSNorm on its latent that DeepSeek and llama.cpp "
                                            "always apply, fitted on the text (lossy, reported). steady: the latent "
                                            "gets one more channel, nearly constant, so the norm is nearly a fixed "
                                            "scale (small error; what a GGUF for llama.cpp's quantisers needs); "
                                            "fit: a plain norm (large error before training; heal trains it).")):
    """Convert a saved attention module, or every layer of a real model, to another family; print the report table.

    Example: attnlab convert smollm2 --to mla --kv-budget 50% --out smollm2-half
    Example: attnlab convert ckpt/gqa --to mla --latent-dim 64 --out ckpt/mla64
    Example: attnlab convert ~/Llama-3.2-1B --to mla --latent-dim 256 --format deepseek --out llama-mla
    """
    from .. import models as hf
    from ..convert.choose import convert as run_conversion
    from ..io.modules import load_module, save_module

    if calibration_tokens < 1:
        raise UsageProblem(f"--calibration-tokens must be a positive number of tokens, got {calibration_tokens}")
    if source in hf.LOADERS or (Path(source) / "attention.safetensors").exists() or hf.is_checkpoint(source):
        if energy is not None or split:
            raise UsageProblem(f"{'--energy' if energy is not None else '--split'} applies to a saved attention "
                               "module; a whole model takes --latent-dim (and --rope-dim)")
        return _convert_model(source, to, out, latent_dim, rope_dim, kv_heads, method, calibration,
                              calibration_tokens, report_json, fmt, force, rope_select, balance, latent_norm,
                              kv_budget=kv_budget, use_calibration=not no_calibration, seed=seed)
    module = load_module(source)
    new, report = run_conversion(module, to, num_kv_heads=kv_heads, method=method, latent_dim=latent_dim,
                                 energy=energy, joint=not split)
    save_module(new, out, extra={"conversion": report.to_dict()}, force=force, sources=[source])
    console.print(_report_table(report))
    console.print(str(report), highlight=False)
    if report_json is not None:
        write_atomic(report_json, report.to_json().encode())
    console.print(f"wrote {out}")
