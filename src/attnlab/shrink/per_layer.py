"""One option per layer within a byte budget: the multiple-choice knapsack of the planner's per-layer rounds (4, 5).

Layer l's option o costs c[l][o] (the KL to the original with that layer alone changed) and takes s[l][o] bytes per
token; single-layer changes add up to first order, so the pick minimises sum_l c[l][o_l] with sum_l s[l][o_l] <=
budget, by dynamic programming over layers and whole bytes (exact for the sums given; ties: the first option listed).
"""
from __future__ import annotations

import math  # core: plain Python, no torch


def choose_per_layer(costs, sizes, budget: int) -> list[int]:
    """The option index of each layer minimising the summed cost with the summed size <= budget (whole bytes).
    ValueError naming the values for ragged or empty tables, negative or non-integer sizes, or a budget no choice
    meets (it names the smallest total)."""
    if not costs or len(costs) != len(sizes) or any(len(c) != len(s) or not c for c, s in zip(costs, sizes)):
        raise ValueError(f"costs and sizes must be tables of the same shape with an option or more per layer, got "
                         f"{[len(c) for c in costs]} and {[len(s) for s in sizes]}")
    if any(not isinstance(x, int) or isinstance(x, bool) or x < 0 for row in sizes for x in row):
        raise ValueError(f"sizes must be non-negative whole numbers of bytes, got {sizes!r}")
    if any(not math.isfinite(float(x)) for row in costs for x in row):
        raise ValueError(f"costs must be finite numbers, got {costs!r}")
    least = sum(min(row) for row in sizes)
    if least > budget:
        raise ValueError(f"a budget of {budget} bytes is below the smallest choice, {least} bytes (each layer's "
                         f"smallest option)")
    best = {0: (0.0, [])}  # bytes spent -> (summed cost, choices): the cheapest way to spend exactly that
    for c_row, s_row in zip(costs, sizes):
        nxt: dict[int, tuple[float, list[int]]] = {}
        for spent, (cost, picks) in best.items():
            for o, (c, s) in enumerate(zip(c_row, s_row)):
                total = spent + s
                if total > budget:
                    continue
                value = cost + float(c)
                if total not in nxt or value < nxt[total][0]:
                    nxt[total] = (value, picks + [o])
        best = nxt
    return min(best.values(), key=lambda v: (v[0], v[1]))[1]
