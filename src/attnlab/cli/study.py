"""`attnlab tour` (the study's 14 parts, checked) and `attnlab kv` (KV-cache sizes of real models)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from .base import console, human_bytes, write_atomic


# -- tour -----------------------------------------------------------------------------------------
def tour(markdown: Optional[Path] = typer.Option(None, "--markdown", help="Also write the tour as Markdown."),
         plots: Optional[Path] = typer.Option(None, "--plots", help="Write PNG figures into this folder.")):
    """Walk the study's 14 parts, answering each by running attnlab and checking the answer.

    Example: attnlab tour --markdown tour.md --plots figures/
    """
    from ..study.tour import run_tour, to_markdown

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
        write_atomic(markdown, to_markdown(sections).encode())
        console.print(f"wrote {markdown}")
    if plots is not None:
        from .plots import tour_figures
        for path in tour_figures(plots):
            console.print(f"wrote {path}")
    raise typer.Exit(1 if failed else 0)



# -- kv -------------------------------------------------------------------------------------------
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
    """KV-cache size per token and for a context, read from real (meta-device) caches. A model with sliding-window
    layers (gemma-3-*) is stated at the context: its sliding layers hold at most their window.

    Example: attnlab kv llama-3-8b --context 32768 --batch 8
    """
    from ..bench.presets import (
        PRESETS,
        AttentionConfig,
        get_preset,
        kv_footprint,
        parse_dtype,
    )

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
    for col in ("model", "kind", "values/token/layer", "bytes/token", "per token", "total", "held/token"):
        table.add_column(col, justify="left" if col in ("model", "kind") else "right")
    for r in rows:  # bytes/token at the context (sliding layers hold their window); held: every layer, every token
        table.add_row(r.name, r.kind, str(r.values_per_token_per_layer), str(r.bytes_per_token),
                      human_bytes(r.bytes_per_token), human_bytes(r.bytes_total), human_bytes(r.bytes_per_token_held))
    console.print(table)
    if json_out is not None:
        write_atomic(json_out, json.dumps([r.to_dict() for r in rows], indent=2).encode())
    if plot is not None:
        from .plots import kv_plot
        kv_plot(configs, dt, plot)
        console.print(f"wrote {plot}")
