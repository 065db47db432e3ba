"""The per-layer choice within a byte budget (shrink/per_layer.py). Oracles: a choice worked out by hand, and every
choice enumerated (itertools.product) on random small tables."""
import itertools
import random

import pytest

from attnlab.shrink.per_layer import choose_per_layer


def test_a_choice_worked_out_by_hand():
    """Two layers, options (cost, bytes): layer 0 (5, 10) or (1, 30); layer 1 (4, 10) or (3, 20). With 40 bytes:
    (0,0) 9 at 20 B, (0,1) 8 at 30 B, (1,0) 5 at 40 B, (1,1) 4 at 50 B (too big): layer 0's large option, layer 1's
    small one. With 30 bytes: (0,1), 8."""
    costs, sizes = [[5, 1], [4, 3]], [[10, 30], [10, 20]]
    assert choose_per_layer(costs, sizes, 40) == [1, 0]
    assert choose_per_layer(costs, sizes, 30) == [0, 1]
    assert choose_per_layer(costs, sizes, 20) == [0, 0]


def test_the_choice_is_the_best_of_every_choice_on_random_tables():
    rng = random.Random(0)
    for _ in range(200):
        layers, options = rng.randint(1, 4), rng.randint(1, 3)
        costs = [[rng.random() for _ in range(options)] for _ in range(layers)]
        sizes = [[rng.randint(0, 9) for _ in range(options)] for _ in range(layers)]
        budget = rng.randint(sum(min(s) for s in sizes), sum(max(s) for s in sizes))
        feasible = [p for p in itertools.product(range(options), repeat=layers)
                    if sum(sizes[l][o] for l, o in enumerate(p)) <= budget]
        best = min(sum(costs[l][o] for l, o in enumerate(p)) for p in feasible)
        got = choose_per_layer(costs, sizes, budget)
        assert sum(sizes[l][o] for l, o in enumerate(got)) <= budget
        assert sum(costs[l][o] for l, o in enumerate(got)) == pytest.approx(best, abs=1e-12)


def test_bad_tables_and_budgets_are_refused_naming_the_values():
    with pytest.raises(ValueError, match=r"a budget of 15 bytes is below the smallest choice, 20 bytes"):
        choose_per_layer([[1], [1]], [[10], [10]], 15)
    with pytest.raises(ValueError, match=r"same shape .* got \[2\] and \[1\]"):
        choose_per_layer([[1, 2]], [[10]], 15)
    with pytest.raises(ValueError, match=r"sizes must be non-negative whole numbers of bytes, got \[\[1.5\]\]"):
        choose_per_layer([[1]], [[1.5]], 15)
