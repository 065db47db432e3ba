"""`attnlab bench`: timings against torch and transformers in one process (bench/ does the work)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from .base import console, write_atomic


# -- bench ----------------------------------------------------------------------------------------
def bench(suite: list[str] = typer.Option(["decode", "deepseek", "prefill", "memory", "convert"], "--suite",
                                          help="Suites to run (repeat the option): decode, deepseek, prefill, "
                                               "memory, convert, model (whole models, minutes; not by default)."),
          quick: bool = typer.Option(False, "--quick", help="Tiny sizes: checks that everything runs, in seconds."),
          device: str = typer.Option("cpu", "--device", help="Where decode and deepseek run: cpu or cuda."),
          json_out: Optional[Path] = typer.Option(None, "--json", help="Write all figures as JSON."),
          plot: Optional[Path] = typer.Option(None, "--plot", help="PNG of decode time against context.")):
    """Time attnlab against torch and transformers in one process; print tables of medians and ratios.

    Example: attnlab bench --suite decode --suite deepseek --json benchmarks/results/bench.json
    """
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from ..bench.suites import dumps, run_benchmarks

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
        write_atomic(json_out, dumps(result).encode())
        console.print(f"wrote {json_out}")
    if plot is not None and "decode" in result:
        from .plots import decode_plot
        decode_plot(result["decode"], plot)
        console.print(f"wrote {plot}")
