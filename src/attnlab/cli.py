"""The attnlab command: a thin layer over the library (parse, call, render).

Errors are one line on stderr with exit status 2; --debug shows the traceback.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from .cli_base import UsageProblem, console
from .cli_export import export, folder_source
from .cli_heal import heal

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Run, convert and explain multi-head attention and its KV-sharing variants.")
app.command()(heal)  # cli_heal.py
app.command()(export)  # cli_export.py
_state = {"debug": False}


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="Show tracebacks instead of one-line errors.")):
    _state["debug"] = debug


def _write_atomic(path: Path, data: bytes) -> None:
    """Write via a temporary file in the same folder, so a failure leaves nothing half-written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


# -- tour -----------------------------------------------------------------------------------------
@app.command()
def tour(markdown: Optional[Path] = typer.Option(None, "--markdown", help="Also write the tour as Markdown."),
         plots: Optional[Path] = typer.Option(None, "--plots", help="Write PNG figures into this folder.")):
    """Walk the study's 14 parts, answering each by running attnlab and checking the answer.

    Example: attnlab tour --markdown tour.md --plots figures/
    """
    from .tour import run_tour, to_markdown

    with console.status("running the study's parts...") as status:
        sections = run_tour(progress=lambda part: status.update(f"parts 1-{part} done..."))
    failed = 0
    for s in sections:
        console.rule(f"[bold]Part {s.part}[/bold]: {s.title}")
        for line in s.lines:
            console.print(f"  {line}", highlight=False, markup=False)
        for c in s.checks:
            mark = "[green]PASS[/green]" if c.passed else "[red]FAIL[/red]"
            detail = f" [dim]({c.detail})[/dim]" if c.detail else ""
            console.print(f"  {mark} {c.name}{detail}", highlight=False)
            failed += not c.passed
    total = sum(len(s.checks) for s in sections)
    colour = "green" if not failed else "red"
    console.print(f"\n[bold {colour}]{total - failed} of {total} checks passed[/bold {colour}]")
    if markdown is not None:
        _write_atomic(markdown, to_markdown(sections).encode())
        console.print(f"wrote {markdown}")
    if plots is not None:
        from .plots import tour_figures
        for path in tour_figures(plots):
            console.print(f"wrote {path}")
    raise typer.Exit(1 if failed else 0)


# -- kv -------------------------------------------------------------------------------------------
@app.command()
def kv(preset: Optional[str] = typer.Argument(None, help="A preset name; omit for every preset."),
       context: int = typer.Option(4096, help="Context length in tokens."),
       batch: int = typer.Option(1, help="Sequences in the batch."),
       dtype: str = typer.Option("bfloat16", help="Cache dtype: bfloat16, float16, float32, float64, float8."),
       kind: Optional[str] = typer.Option(None, help="Custom model: 'gqa' or 'mla' (with the size options)."),
       layers: int = typer.Option(1, help="Custom: number of layers."),
       dim: int = typer.Option(4096, help="Custom: hidden size."),
       heads: int = typer.Option(32, help="Custom: query heads."),
       kv_heads: int = typer.Option(8, help="Custom gqa: key/value heads."),
       head_dim: int = typer.Option(128, help="Custom: head size."),
       latent_dim: int = typer.Option(512, help="Custom mla: latent size."),
       rope_dim: int = typer.Option(64, help="Custom mla: decoupled RoPE size."),
       json_out: Optional[Path] = typer.Option(None, "--json", help="Also write the table as JSON."),
       plot: Optional[Path] = typer.Option(None, "--plot", help="PNG of cache memory against context length.")):
    """KV-cache size per token and for a context, read from real (meta-device) caches.

    Example: attnlab kv llama-3-8b --context 32768 --batch 8
    """
    from .presets import PRESETS, AttentionConfig, get_preset, kv_footprint, parse_dtype

    dt = parse_dtype(dtype)
    if kind is not None:
        configs = [AttentionConfig("custom", kind, layers, dim, heads, head_dim, num_kv_heads=kv_heads,
                                   latent_dim=latent_dim, rope_dim=rope_dim)]
    elif preset is not None:
        configs = [get_preset(preset)]
    else:
        configs = list(PRESETS.values())
    rows = [kv_footprint(c, context=context, batch=batch, dtype=dt) for c in configs]
    table = Table(title=f"KV cache, {dtype}, context {context}, batch {batch}")
    for col in ("model", "kind", "values/token/layer", "bytes/token", "per token", "total"):
        table.add_column(col, justify="left" if col in ("model", "kind") else "right")
    for r in rows:
        table.add_row(r.name, r.kind, str(r.values_per_token_per_layer), str(r.bytes_per_token),
                      _human_bytes(r.bytes_per_token), _human_bytes(r.bytes_total))
    console.print(table)
    if json_out is not None:
        _write_atomic(json_out, json.dumps([r.to_dict() for r in rows], indent=2).encode())
    if plot is not None:
        from .plots import kv_plot
        kv_plot(configs, dt, plot)
        console.print(f"wrote {plot}")


# -- bench ----------------------------------------------------------------------------------------
@app.command()
def bench(suite: list[str] = typer.Option(["decode", "deepseek", "prefill", "memory", "convert"], "--suite",
                                          help="Suites to run (repeat the option): decode, deepseek, prefill, "
                                               "memory, convert, model (whole models, minutes; not by default)."),
          quick: bool = typer.Option(False, "--quick", help="Tiny sizes: checks that everything runs, in seconds."),
          device: str = typer.Option("cpu", "--device", help="Where decode and deepseek run: cpu or cuda."),
          json_out: Optional[Path] = typer.Option(None, "--json", help="Write all figures as JSON."),
          plot: Optional[Path] = typer.Option(None, "--plot", help="PNG of decode time against context.")):
    """Time attnlab against torch and transformers in one process; print tables of medians and ratios.

    Example: attnlab bench --suite decode --suite deepseek --json benchmarks/results.json
    """
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from .bench import dumps, run_benchmarks

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                  transient=True) as bar:
        task = bar.add_task("measuring the machine...", total=None)
        result = run_benchmarks(tuple(suite), quick=quick, device=device,
                                progress=lambda what: bar.update(task, description=f"done: {what}"))
    m, rates = result["machine"], result["rates"]
    console.print(f"machine: {m.get('gpu', m['cpu'])}, {m['threads']} threads, torch {m['torch']}; "
                  f"matmul {rates['flops_per_s'] / 1e9:.1f} GFLOP/s, read bandwidth {rates['bytes_per_s'] / 1e9:.1f} GB/s")
    for name in suite:
        rows = result[name]
        table = Table(title=name)
        for col in rows[0]:
            table.add_column(col, justify="left" if isinstance(rows[0][col], str) else "right")
        for r in rows:
            table.add_row(*(f"{v:.4g}" if isinstance(v, float) else str(v) for v in r.values()))
        console.print(table)
    if json_out is not None:
        _write_atomic(json_out, dumps(result).encode())
        console.print(f"wrote {json_out}")
    if plot is not None and "decode" in result:
        from .plots import decode_plot
        decode_plot(result["decode"], plot)
        console.print(f"wrote {plot}")


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


def _convert_model(source, to, out, latent_dim, rope_dim, kv_heads, method, calibration, calibration_tokens,
                   report_json, fmt="attnlab", force=False, rope_select="frequency", balance=False,
                   latent_norm="none"):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from . import models as hf

    if fmt not in ("attnlab", "deepseek"):
        raise UsageProblem(f"--format must be attnlab or deepseek, not {fmt!r}")
    if latent_norm not in ("none", "fit"):
        raise UsageProblem(f"--latent-norm must be none or fit, not {latent_norm!r}")
    if latent_norm == "fit" and (to != "mla" or latent_dim is None):
        raise UsageProblem("--latent-norm fit needs --to mla --latent-dim R (a compressed, decoupled-RoPE MLA)")
    if Path(out).exists() and not force:
        raise UsageProblem(f"{out} exists; pass --force to overwrite it")
    if fmt == "deepseek" and Path(source).is_dir() and hf.is_checkpoint(source):
        return _convert_streamed(source, to, out, latent_dim, rope_dim, calibration, calibration_tokens,
                                 report_json, force, rope_select, balance,
                                 "fit" if latent_norm == "fit" else "constant")
    model, tok, meta = hf.load_model(source)
    if fmt == "deepseek":
        hf.check_deepseek_request(model, to, latent_dim)
    ids = hf.read_text_ids(tok, calibration, calibration_tokens) if calibration is not None else None
    n = len(hf.attnlab_modules(model))
    before = hf.kv_bytes_per_token(model)
    with Progress(TextColumn("converting layers"), BarColumn(), MofNCompleteColumn(), console=console,
                  transient=True) as bar:
        task = bar.add_task("layers", total=n)
        reports = hf.convert_model(model, to, latent_dim=latent_dim, rope_dim=rope_dim, num_kv_heads=kv_heads,
                                   method=method, calibration_ids=ids, pair_selection=rope_select,
                                   balance=balance, progress=lambda i: bar.update(task, completed=i + 1))
    norm_errors = hf.add_latent_norms(model, ids) if latent_norm == "fit" else None
    after = hf.kv_bytes_per_token(model)
    table = Table(title=f"{source} -> {to}: {reports[0].source} -> {reports[0].target} per layer")
    for col in ("layer", "exact", "output error", "QK error", "OV error", "KV values/token"):
        table.add_column(col, justify="right")
    for i, r in enumerate(reports):
        table.add_row(str(i), "yes" if r.exact else "no", f"{r.output_error:.2e}",
                      f"{r.matrix_errors.get('QK', 0):.2e}", f"{r.matrix_errors.get('OV', 0):.2e}",
                      f"{r.kv_values_before} -> {r.kv_values_after}")
    console.print(table)
    if norm_errors is not None:
        console.print(f"latent norms fitted: output error per layer (added by the norm) max {max(norm_errors):.2e}, "
                      f"mean {sum(norm_errors) / len(norm_errors):.2e}")
    console.print(f"KV cache bytes per token (whole model, {hf.attnlab_modules(model)[0]._anchor.dtype}): "
                  f"{before} -> {after}")
    summary = {"source": source, "to": to, "latent_dim": latent_dim, "rope_dim": rope_dim,
               "rope_select": rope_select, "balance": balance,
               "kv_bytes_per_token_before": before, "kv_bytes_per_token_after": after,
               "layers": [r.to_dict() for r in reports], "latent_norm": latent_norm,
               "latent_norm_errors": norm_errors}
    if fmt == "deepseek":  # kv_a_layernorm made linear by a constant latent channel (export.constant_channel)
        hf.export_deepseek(model, out, tokenizer=None if folder_source(model) else tok, force=True)
    else:
        hf.save_model(model, meta["base"], out, extra={"conversion": summary})
    if report_json is not None:
        _write_atomic(report_json, json.dumps(summary, indent=2).encode())
    console.print(f"wrote {out}")


def _convert_streamed(source, to, out, latent_dim, rope_dim, calibration, calibration_tokens, report_json, force,
                      rope_select="frequency", balance=False, latent_norm="constant"):
    """A transformers folder to a DeepSeek checkpoint, one layer at a time (models/stream.py)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .models.stream import calibration_ids_for, convert_checkpoint

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
    console.print(f"KV values per token per layer: {before} -> {after}")
    if report_json is not None:
        _write_atomic(report_json, json.dumps(summary, indent=2).encode())
    console.print(f"wrote {out}")


@app.command()
def convert(source: str = typer.Argument(..., help="An attnlab checkpoint folder, a model (smollm2, minilm), or "
                                                     "a transformers folder / GGUF file (Llama, Mistral, Qwen2)."),
            to: str = typer.Option(..., "--to", help="Target family: mha, gqa, mla, absorbed."),
            out: Path = typer.Option(..., "--out", help="Folder to write the converted checkpoint to."),
            kv_heads: Optional[int] = typer.Option(None, "--kv-heads", help="gqa: number of KV heads."),
            method: Optional[str] = typer.Option(None, "--method", help="gqa: mean or fit."),
            latent_dim: Optional[int] = typer.Option(None, "--latent-dim", help="mla: latent size (lossy)."),
            rope_dim: Optional[int] = typer.Option(None, "--rope-dim",
                                                   help="mla of a RoPE model: decoupled rotary dims kept."),
            energy: Optional[float] = typer.Option(None, "--energy", help="mla: keep this fraction of energy."),
            split: bool = typer.Option(False, "--split", help="mla: factor K and V separately."),
            rope_select: str = typer.Option("frequency", "--rope-select",
                                            help="mla of a RoPE model: what keeps rotating: frequency, norm, "
                                                 "rorope or rorope-score (docs/real-models.md)."),
            balance: bool = typer.Option(False, "--balance", help="mla of a RoPE model: balance K and V before "
                                                                   "the joint SVD (BKV)."),
            calibration: Optional[Path] = typer.Option(None, "--calibration",
                                                       help="Model conversions: a text file whose activations "
                                                            "whiten the SVDs."),
            calibration_tokens: int = typer.Option(2048, "--calibration-tokens", help="Tokens of it to use."),
            report_json: Optional[Path] = typer.Option(None, "--report", help="Also write the report as JSON."),
            fmt: str = typer.Option("attnlab", "--format", help="Models: attnlab (attention layers beside the base) "
                                    "or deepseek (a DeepseekV3 checkpoint transformers loads alone)."),
            force: bool = typer.Option(False, "--force", help="Models: overwrite an existing --out folder."),
            latent_norm: str = typer.Option("none", "--latent-norm", help="mla of a model: fit gives every layer "
                                            "an RMSNorm on its latent, fitted on the calibration text (what "
                                            "DeepSeek and llama.cpp always apply; lossy, reported).")):
    """Convert a saved attention module, or every layer of a real model, to another family.

    Writes safetensors + config.json and prints the report table.
    Example: attnlab convert smollm2 --to mla --latent-dim 256 --out smollm2-mla256
    Example: attnlab convert ckpt/gqa --to mla --latent-dim 64 --out ckpt/mla64
    Example: attnlab convert ~/Llama-3.2-1B --to mla --latent-dim 256 --format deepseek --out llama-mla
    """
    from . import models as hf
    from .convert import convert as run_conversion
    from .io import load_module, save_module

    if source in hf.LOADERS or (Path(source) / "attention.safetensors").exists() or hf.is_checkpoint(source):
        return _convert_model(source, to, out, latent_dim, rope_dim, kv_heads, method, calibration,
                              calibration_tokens, report_json, fmt, force, rope_select, balance, latent_norm)
    module = load_module(source)
    new, report = run_conversion(module, to, num_kv_heads=kv_heads, method=method, latent_dim=latent_dim,
                                 energy=energy, joint=not split)
    save_module(new, out, extra={"conversion": report.to_dict()})
    console.print(_report_table(report))
    console.print(str(report), highlight=False)
    if report_json is not None:
        _write_atomic(report_json, report.to_json().encode())
    console.print(f"wrote {out}")


# -- eval / generate -------------------------------------------------------------------------------
@app.command(name="eval")
def eval_(source: str = typer.Argument(..., help="A model (smollm2) or a folder written by attnlab convert."),
          text: Path = typer.Option(..., "--text", help="An English text file to score."),
          max_tokens: int = typer.Option(2048, "--max-tokens", help="Score at most this many tokens."),
          window: int = typer.Option(512, "--window", help="Tokens per forward pass.")):
    """Perplexity of a causal model on a text, and its KV-cache bytes per token.

    Example: attnlab eval smollm2-mla256 --text /usr/share/common-licenses/GPL-3
    """
    from . import models as hf

    model, tok, meta = hf.load_model(source)
    if hf.family(model) != "llama":
        raise UsageProblem("eval scores causal language models (smollm2 and its conversions)")
    ids = hf.read_text_ids(tok, text, max_tokens)
    ppl = hf.perplexity(model, ids, window=window)
    print(f"perplexity: {ppl:.4f}")
    print(f"tokens: {ids.shape[1]}")
    print(f"kv bytes per token: {hf.kv_bytes_per_token(model)}")


@app.command()
def generate(source: str = typer.Argument(..., help="A model (smollm2) or a folder written by attnlab convert."),
             prompts: list[str] = typer.Argument(..., help="One prompt, or several to run as one left-padded batch."),
             max_new_tokens: int = typer.Option(32, "--max-new-tokens", help="Tokens to generate per prompt."),
             temperature: float = typer.Option(0.0, "--temperature", help="0 is greedy; above 0 samples."),
             top_k: Optional[int] = typer.Option(None, "--top-k", help="Sample among the k most likely tokens."),
             top_p: Optional[float] = typer.Option(None, "--top-p", help="Sample among the most likely tokens "
                                                   "whose probability reaches p (nucleus)."),
             seed: Optional[int] = typer.Option(None, "--seed", help="Seed of the sampler (same seed, same text)."),
             stream: bool = typer.Option(True, "--stream/--no-stream", help="Print a single prompt's tokens as "
                                         "they come.")):
    """Continue one prompt or a batch of them with attnlab's own generation loop (static caches).

    Prints the continuations only; a line of timings goes to stderr.
    Example: attnlab generate smollm2-mla256 "The capital of France is" --max-new-tokens 16
    """
    import time

    from . import models as hf
    from .generate import check_sampling
    from .generate import generate as run_generation

    check_sampling(temperature, top_k, top_p)
    model, tok, _ = hf.load_model(source)
    if hf.family(model) != "llama":
        raise UsageProblem("generate needs a causal language model (smollm2 and its conversions)")
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    enc = tok(list(prompts), return_tensors="pt", padding=True)
    P = enc.input_ids.shape[1]
    eos = getattr(model.generation_config, "eos_token_id", None) or tok.eos_token_id
    shown = {"text": "", "tokens": []}

    def show(column):  # one prompt: print what the new token adds to the decoded text
        shown["tokens"].append(int(column[0]))
        text = tok.decode(shown["tokens"], skip_special_tokens=True)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            print(text[len(shown["text"]):], end="", flush=True)
            shown["text"] = text

    live = stream and len(prompts) == 1
    t0 = time.perf_counter()
    out = run_generation(model, enc.input_ids, enc.attention_mask, max_new_tokens=max_new_tokens,
                         temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, eos_token_id=eos,
                         pad_token_id=tok.pad_token_id, stream=show if live else None)
    seconds = time.perf_counter() - t0
    if live:
        print(tok.decode(shown["tokens"], skip_special_tokens=True)[len(shown["text"]):])
    elif len(prompts) == 1:
        print(tok.decode(out[0, P:], skip_special_tokens=True))
    else:
        for i, (prompt, row) in enumerate(zip(prompts, out[:, P:])):
            print(f"--- {i + 1}: {prompt}")
            print(tok.decode(row, skip_special_tokens=True))
    new = out.shape[1] - P
    print(f"{len(prompts)} x {new} tokens in {seconds:.2f} s ({len(prompts) * new / seconds:.1f} tokens/s)",
          file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the app, turning expected errors into one line on stderr and status 2."""
    args = sys.argv[1:] if argv is None else argv
    debug = "--debug" in args
    try:
        rc = app(args=args, prog_name="attnlab", standalone_mode=False)
    except typer.Exit as e:
        return e.exit_code
    except SystemExit as e:
        return int(e.code or 0)
    except Exception as e:  # noqa: BLE001 - the one place errors become messages
        import click
        if debug:
            raise
        if isinstance(e, click.exceptions.UsageError):
            msg = e.format_message()
        elif isinstance(e, click.exceptions.Abort):
            msg = "aborted"
        else:
            msg = str(e) or type(e).__name__
        print(f"attnlab: error: {msg.splitlines()[0] if msg else type(e).__name__}", file=sys.stderr)
        return 2
    return rc if isinstance(rc, int) else 0


if __name__ == "__main__":
    sys.exit(main())
