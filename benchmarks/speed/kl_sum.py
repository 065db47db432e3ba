"""What the KL between two models' next-token distributions costs: models.divergence.kl_sum (four positions at a time)
against the same sum over whole windows (a log-softmax of each, then p (t - s) summed), in float32 and float64.

    python benchmarks/speed/kl_sum.py     # prints a table, writes benchmarks/results/kl_sum.json

512 positions (two windows of 256, what one planner forward reads) of random logits at SmolLM2's and Gemma 3's
vocabularies; the median of REPEATS calls, both ways in one process; the error is against float64's whole-window sum.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from provenance import finish, provenance, write_results  # noqa: E402

from attnlab.models.divergence import kl_sum  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "kl_sum.json"
VOCABULARIES = {"smollm2": 49_152, "gemma3-270m": 262_144}
POSITIONS = 512
REPEATS = 5


def whole(teacher: torch.Tensor, student: torch.Tensor, dtype: torch.dtype) -> float:
    """The sum over whole windows: each side's log-softmax as one tensor, then p (t - s) summed at once."""
    t, s = teacher.to(dtype).log_softmax(-1), student.to(dtype).log_softmax(-1)
    return float((t.exp() * (t - s)).sum())


def timed(fn, *args) -> tuple[float, float]:
    """(median seconds over REPEATS calls, the value)."""
    times, value = [], None
    for _ in range(REPEATS):
        start = time.perf_counter()
        value = fn(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times), value


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    prov = provenance(sys.argv, results=(str(RESULTS.relative_to(ROOT)),))
    rows = []
    for model, V in VOCABULARIES.items():
        g = torch.Generator().manual_seed(0)
        teacher = torch.randn(2, POSITIONS // 2, V, generator=g) * 3
        student = teacher + torch.randn(teacher.shape, generator=g) * 0.1
        exact = whole(teacher, student, torch.float64)
        for dtype in (torch.float32, torch.float64):
            t_whole, v_whole = timed(whole, teacher, student, dtype)
            t_blocks, v_blocks = timed(kl_sum, teacher, student, dtype)
            rows.append({"model": model, "vocabulary": V, "dtype": str(dtype).split(".")[1], "whole_s": t_whole,
                         "blocks_s": t_blocks, "speedup": t_whole / t_blocks, "whole_error": abs(v_whole / exact - 1),
                         "blocks_error": abs(v_blocks / exact - 1)})
    print("| vocabulary | dtype | whole windows (s) | blocks of 4 (s) | speed-up | error: whole, blocks |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['vocabulary']:,} ({r['model']}) | {r['dtype']} | {r['whole_s']:.3f} | {r['blocks_s']:.3f} | "
              f"{r['speedup']:.1f}x | {r['whole_error']:.1e}, {r['blocks_error']:.1e} |")
    out = {"what": __doc__.splitlines()[0], "positions": POSITIONS, "repeats": REPEATS, "rows": rows,
           "provenance": finish(prov)}
    write_results(RESULTS, out)


if __name__ == "__main__":
    main()
