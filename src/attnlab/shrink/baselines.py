"""The training-free baselines (BASELINES): the original model's cache quantized the way users do it today.

A shrunk model is worth its training only where it beats what one flag gives the untouched model. Every shrink report
names them at their bytes per token (scales and minima counted), scores the two smallest at or above the bytes reached
on the shrunk model's held-out windows (at_or_above, score) and says by how much the result beats the best, or loses.
"""
from __future__ import annotations

import math

# llama.cpp's cache types (--cache-type-k/-v; a GQA's keys and values Hadamard-rotated as llama.cpp rotates a quantized
# cache, modules/lowbit.py, so that each scores what llama.cpp itself gives: tests/test_llama_cpp_cache.py), KIVI-style
# 4 and 2 bits (modules/lowbit.py) and TurboQuant's 4.25, 3.25 and 2.25 bits a value (modules/turbo.py)
BASELINES = ("q8_0", "q5_0", "q4_1", "q4_0", "iq4_nl", "kivi4", "kivi2", "tq4", "tq3", "tq2")


def baseline_bytes(teacher, names=BASELINES, context: int | None = None) -> dict[str, float]:
    """Bytes per token of the teacher's whole cache in each baseline storage it can be stored in (llama.cpp's
    blocks need head sizes that are multiples of 32; the others are left out); at a context, a sliding layer's
    cache holding its window (models.kv_bytes_per_token)."""
    from ..models.evaluate import kv_bytes_per_token

    out = {}
    for n in names:
        try:
            out[n] = kv_bytes_per_token(teacher, kv_dtype=n, context=context)
        except ValueError:  # a row that is not whole blocks: llama.cpp refuses that cache type for this model
            continue
    return out


def score(teacher, held_out, names, *, window: int | None = None, tokens: int | None = None) -> dict[str, float]:
    """The teacher's perplexity on held-out ids (1, M) (the first `tokens`) with each storage; the teacher
    comes back with the storage it had. window: default 512, or the model's context where shorter."""
    from ..models.adapters import attnlab_modules
    from ..models.evaluate import default_window, perplexity

    window = default_window(teacher) if window is None else window
    ids = held_out if tokens is None else held_out[:, :tokens]
    saved = [m.kv_dtype for m in attnlab_modules(teacher)]
    out = {}
    try:
        for n in names:
            for m in attnlab_modules(teacher):
                m.kv_dtype = n
            out[n] = perplexity(teacher, ids, window=window)
    finally:
        for m, k in zip(attnlab_modules(teacher), saved):
            m.kv_dtype = k
    return out


def at_or_above(sizes: dict[str, int], reached: int, count: int = 2) -> list[str]:
    """The baselines at the `count` smallest sizes in bytes per token that are >= `reached`, cheapest first, every
    one of a size (q4_1 and KIVI 4-bit cost the same 5 bits a value on SmolLM2: both are scored)."""
    levels = sorted({b for b in sizes.values() if b >= reached})[:count]
    return sorted((n for n, b in sizes.items() if b in levels), key=lambda n: sizes[n])


def compare(reached_bytes: int, perplexity: float, teacher_perplexity: float, sizes: dict[str, int],
            scored: dict[str, float]) -> dict:
    """The report's baseline section: every baseline's bytes, the scored ones' perplexity and ratio, and the
    verdict against the best scored baseline at or above the bytes reached."""
    rows = [{"kv_dtype": n, "kv_bytes_per_token": b,
             "perplexity": scored.get(n), "ratio": scored[n] / teacher_perplexity if n in scored else None}
            for n, b in sorted(sizes.items(), key=lambda kv: kv[1])]
    fair = {n: p for n, p in scored.items() if sizes[n] >= reached_bytes and math.isfinite(p)}
    verdict = None
    if fair:
        best = min(fair, key=fair.get)
        verdict = {"baseline": best, "baseline_bytes": sizes[best], "baseline_perplexity": fair[best],
                   "perplexity": perplexity, "beats": perplexity < fair[best],
                   "perplexity_ratio_to_baseline": perplexity / fair[best]}
    return {"rows": rows, "against": verdict}
