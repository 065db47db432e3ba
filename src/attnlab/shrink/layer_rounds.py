"""The planner's per-layer rounds, after rounds 0-3 (shrink/plan.py) on the winner: round 4, a latent size per
layer (asked for, where the winner cuts rank), and round 5, bits by layer (asked for, where the winner codes every
layer alike in a few-bit latent). Each measures every layer alone (shrink/layer_costs.py), chooses within the bytes
(shrink/per_layer.py) and measures the choice as one more candidate. Functions of the planner (plan._Planner)."""
from __future__ import annotations

import math

import torch

from .candidate import Candidate, rank, token_windows
from .layer_bits import ladder
from .sizes import layer_bytes

def per_layer(planner, layer_ids: torch.Tensor | None) -> None:
    """Round 4, where the winner cuts rank: each layer alone at per_layer_sizes() (shrink/layer_costs.py), the
    sizes of least summed KL within the bytes (shrink/per_layer.py), measured as one candidate past the count."""
    from ..convert.report import unreported
    from .layer_costs import Prefix, layer_costs
    from .per_layer import choose_per_layer

    best = min(planner.converted(), key=rank)
    sizes = per_layer_sizes(best, planner.V)
    if len(sizes) <= 1 or planner.stopped():
        return
    L = planner.L
    windows = planner.windows if layer_ids is None else token_windows(layer_ids[0], planner.window)
    prefix = Prefix(planner.teacher, windows)

    def change(layer: int, r: int) -> None:
        if planner.stopped():  # a stop request (or the clock) ends round 4 with nothing measured
            raise _Cut
        with unreported():
            planner.convert(Candidate(r, best.rope_dim, best.rope_select, best.balance, best.kv_dtype, False,
                                      rotation=best.rotation, layers=[layer], kept_dtype=None))

    def counted(done: int, total: int) -> None:
        if planner.progress and done % len(sizes) == 0:
            planner.progress(len(planner.measured), f"per layer: {done // len(sizes)} of {L} layers measured "
                                                    f"alone at r={', '.join(map(str, sizes))}")

    try:
        costs = layer_costs(prefix, L, sizes, change, planner.restore, progress=counted)
    except _Cut:
        costs = None
    rows = byte_rows(planner, [(r, best.rope_dim, best.kv_dtype) for r in sizes])
    dims = [sizes[o] for o in choose_per_layer(costs, rows, int(planner.budget_bytes))] if costs else []
    if len(set(dims)) > 1:
        planner.measure(Candidate(round(sum(dims) / L), best.rope_dim, best.rope_select, best.balance,
                                  best.kv_dtype, False, rotation=best.rotation, round=4, latent_dims=dims))


def byte_rows(planner, options) -> list[list[int]]:
    """Each converted layer's whole bytes per token in each (latent, rope key, storage) option, as the budget
    counts them at its window: the sizes rounds 4 and 5 choose within."""
    row = {w: [math.ceil(layer_bytes(r, p, storage, planner.spread, w)) for r, p, storage in options]
           for w in set(planner.converted_layers)}  # one row per kind of layer
    return [row[w] for w in planner.converted_layers]


def layer_bits(planner) -> None:
    """Round 5, if asked, where the winner codes every layer alike in a Ladder's storage: each layer's two probes
    measured alone (shrink/layer_bits.py), the bits of least modelled KL within the bytes (shrink/per_layer.py),
    measured as one candidate past the count. Not for a GGUF, whose llama.cpp cache has one type."""
    from .per_layer import choose_per_layer

    best = min(planner.measured, key=rank)
    steps = ladder(best.kv_dtype)
    if not planner.layer_bits_asked or planner.fmt not in ("attnlab", "transformers") or steps is None or \
            best.layers is not None or best.latent_dims or best.kv_dtypes or planner.stopped():
        return
    probes = layer_probes(planner, best, steps)
    if probes is None:
        return
    options = steps.options()
    costs = [[steps.cost(v, k, b, key) for b, key in options] for v, k in probes]
    latent = best.latent_dim + best.extra
    rows = byte_rows(planner, [(latent, best.rope_dim, steps.spell(b, key)) for b, key in options])
    picks = choose_per_layer(costs, rows, int(planner.budget_bytes))
    storages = [steps.spell(*options[o]) for o in picks]
    if storages != [best.kv_dtype] * len(storages):
        planner.measure(Candidate(best.latent_dim, best.rope_dim, best.rope_select, best.balance, best.kv_dtype,
                                  best.latent_norm, extra=best.extra, rotation=best.rotation, round=5,
                                  kv_dtypes=storages))


def layer_probes(planner, best: Candidate, steps) -> list[tuple[float, float]] | None:
    """(V, K) of each layer: the KL with that layer alone in steps' value and key probe, the teacher converted to
    `best` with plain caches, on COST_WINDOWS proxy windows (shrink/layer_costs.py); None when a stop or the
    clock cut it short."""
    from ..convert.report import unreported
    from ..models.adapters import attnlab_modules
    from .layer_bits import COST_WINDOWS
    from .layer_costs import Prefix

    try:
        with unreported():
            planner.convert(Candidate(best.latent_dim, best.rope_dim, best.rope_select, best.balance, None,
                                      best.latent_norm, extra=best.extra, rotation=best.rotation))
        modules = list(attnlab_modules(planner.teacher))
        prefix = Prefix(planner.teacher, planner.windows[:COST_WINDOWS])
        out = []
        for i, m in enumerate(modules):
            if planner.stopped():
                return None
            if planner.progress:
                planner.progress(len(planner.measured),
                                 f"bits by layer: layer {i + 1} of {len(modules)} measured alone")
            pair = []
            for probe in (steps.value_probe(), steps.key_probe()):
                m.kv_dtype = probe
                try:
                    pair.append(prefix.kl(i))
                finally:
                    m.kv_dtype = None
            out.append(tuple(pair))
        return out
    finally:
        planner.restore()


class _Cut(Exception):
    """Round 4 ended by a stop request or the planning clock before its costs were measured."""


PER_LAYER_SHARES = (0.7, 1.4)  # round 4's latent sizes beside the uniform winner's own, as shares of it
PER_LAYER_STEP = 16  # ... rounded to multiples of this


def per_layer_sizes(best: Candidate, values: int) -> list[int]:
    """Round 4's latent sizes for a winner that cuts rank: its latent and PER_LAYER_SHARES of it in multiples of
    PER_LAYER_STEP, from PER_LAYER_STEP to `values` - its rope key, each once, ascending. [] for a winner that keeps
    every value, is per-layer already or converts some layers only."""
    ceiling = values - best.rope_dim
    if best.latent_dims or best.layers is not None or best.latent_dim >= ceiling:
        return []
    out = {best.latent_dim}
    for share in PER_LAYER_SHARES:
        r = int(round(best.latent_dim * share / PER_LAYER_STEP)) * PER_LAYER_STEP
        out.add(min(ceiling, max(PER_LAYER_STEP, r)))
    return sorted(out)

