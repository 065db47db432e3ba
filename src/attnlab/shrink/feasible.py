"""Which plans a budget allows, checked before any work: the layouts and, for each storage, the values per token and
layer that fit (`feasible`); the engines' own cache codes a format can hold the original attention in (`native_sizes`,
`native_storages`); and the one-line errors that name the smallest budget these storages can meet, its protected rows
among it (issue `eighth`'s bad input). The planner (shrink/plan.py) searches among what `feasible` returns; the sizes
are shrink/sizes.py's. Notation as there: L layers, G KV heads, d head size, V = 2 G d values per token and layer.
"""
from __future__ import annotations

from .sizes import (LLAMA_CPP_CACHE, STORAGES, KVBudget, Layout, fit, fixed_rows_bytes, kept_storages, layer_bytes,
                    layers_bytes, latent_storages, layouts, native_code, original_bytes, original_sizes, spread_context,
                    storage_ok, values_for)

MIN_WHOLE_LATENT = 8  # the smallest latent (values) a keys-whole candidate is given


def keys_whole(teacher) -> int | None:
    """G d, the rope key of the only layout a model with per-head q/k norms plans (module docstring), or None."""
    from ..models.convert import keys_whole_rope_dim

    return keys_whole_rope_dim(teacher)


def writes_native(teacher) -> bool:
    """Whether a GGUF of this model can be written in its source's own architecture (models/export/native_gguf.py)."""
    from ..models.export.native_gguf import check_native

    try:
        check_native(teacher)
    except ValueError:
        return False
    return True


def holds_native(teacher, fmt: str) -> bool:
    """Whether an output of this format can hold the original attention with the engine's own cache codes: a GGUF
    in the source's own architecture (writes_native), or a transformers folder (any model from_attnlab restores)."""
    return fmt == "transformers" or (fmt == "gguf" and writes_native(teacher))


def native_sizes(teacher, fmt: str, storages, context: int | None = None) -> dict[str, float]:
    """{engine cache code: the original's bytes per token in it} for each of `storages` that is one of the format's
    (NATIVE_CACHE), when holds_native; else {}. The bytes are what attnlab's cache of that type allocates, or for
    transformers' codes their steady state (shrink/baselines.py: scales counted)."""
    if not holds_native(teacher, fmt):
        return {}
    from .baselines import baseline_bytes

    return baseline_bytes(teacher, [s for s in storages if native_code(s, fmt)], context)


def native_storages(teacher, budget_bytes: float, fmt: str, storages, context: int | None = None) -> dict[str, int]:
    """native_sizes that fit budget_bytes, largest first."""
    sizes = native_sizes(teacher, fmt, storages, context)
    return {s: b for s, b in sorted(sizes.items(), key=lambda kv: -kv[1]) if b <= budget_bytes}


def check_format(teacher, fmt: str) -> None:
    """ValueError, one line, when the output format cannot hold the model's attention: DeepSeek's and llama.cpp's
    (deepseek2) MLA have no per-head key norm, which the keys of a model with q/k norms need; a GGUF in the source's
    own architecture (writes_native) holds them, with only llama.cpp's cache types to plan."""
    if fmt != "attnlab" and keys_whole(teacher) is not None and not holds_native(teacher, fmt):
        kind = getattr(getattr(teacher, "config", None), "model_type", "") or "this model"
        raise ValueError(f"--format {fmt} cannot hold {kind}: its attention normalises every key head (a per-head "
                         f"key norm, k_norm), which {'DeepSeek-V3' if fmt == 'deepseek' else 'llama.cpp deepseek2'}'s "
                         "MLA does not have; use --format attnlab")


def _keys_whole_storages(layers: tuple, V: int, whole: int, room: float, storages, spread: int | None = None) -> dict:
    """{storage: values per token and layer} of the keys-whole layout: the rope key and the largest latent that fits
    (at least MIN_WHOLE_LATENT, at most V - whole), for each storage where one does. layers: the converted layers as
    Layout.counted gives them; room: their bytes per token (fixed rows spread over `spread` tokens)."""
    out = {}
    for s in storages:
        start = max(0, min(V - whole, values_for(room, s, layers, spread) - whole))
        r = fit(start, whole, s, layers, room, ceiling=V - whole, context=spread)
        if r >= MIN_WHOLE_LATENT:
            out[s] = r + whole
    return out


def feasible(teacher, budget: KVBudget, fmt: str = "attnlab", storages=STORAGES,
             # bytes counted at this sequence length (sliding layers hold their windows; layouts() may keep them);
             # None: every token held in every layer, the fixed rows spread over spread_context's tokens
             context: int | None = None) -> tuple[float, float, list[tuple[Layout, dict]]]:
    """(original 16-bit bytes/token, the budget in bytes, [(layout, {storage: values per token and layer that fit})])
    for a budget some plan can meet; ValueError naming the budget otherwise (checked before any work). Per-head q/k
    norms: the keys whole in each storage (values: rope key + latent), attnlab's format only; other models convert
    every layer. A GGUF the source's own architecture holds may keep the original attention in a llama.cpp cache type
    (native_storages): where only such a plan fits, the layouts are []."""
    if context is not None:
        from ..modules.checks import positive_int
        positive_int("context", context)
    original = original_bytes(teacher, context)
    budget_bytes = budget.bytes_for(original)
    at = "" if context is None else f" at a context of {context} tokens"
    if budget_bytes >= original:
        raise ValueError(f"a KV budget of {budget} ({budget_bytes:.0f} bytes/token) is not below the original's "
                         f"{original:.0f} bytes/token (16-bit{at}): nothing to cut")
    storages = [s for s in storages if storage_ok(s, fmt)] or ["bf16"]
    native = native_storages(teacher, budget_bytes, fmt, storages, context)
    converted = latent_storages(storages, fmt)  # a K/V pair, a GQA's own codes: the original attention only
    if not converted:
        if native:
            return original, budget_bytes, []
        if fmt == "transformers":
            raise ValueError(f"a KV budget of {budget} ({budget_bytes:.0f} bytes/token{at}) is below what "
                             f"{', '.join(storages)} holds: {_smallest_native(teacher, fmt, storages, context, original)}")
        if not holds_native(teacher, fmt):
            raise ValueError(f"a K/V pair ({', '.join(storages)}) is planned only for the original attention in its "
                             "own architecture, which --format gguf writes from a llama, qwen3 or gemma3 GGUF; this "
                             "model would be written as deepseek2, whose one latent row takes one type: use one")
        sizes = native_sizes(teacher, fmt, storages, context)
        held = ", ".join(f"{s} takes {b:.0f} bytes/token ({b / original:.1%})" for s, b in sizes.items())
        raise ValueError(f"a KV budget of {budget} ({budget_bytes:.0f} bytes/token{at}) is below what a K/V pair "
                         f"holds, which only the original attention can use: {held}")
    try:
        return original, budget_bytes, _options(teacher, budget, budget_bytes, original, fmt, converted, context)
    except ValueError as e:
        if native:  # the original attention in a llama.cpp cache type fits: only those are planned
            return original, budget_bytes, []
        if not holds_native(teacher, fmt):
            raise
        smallest = _smallest_native(teacher, fmt, storages, context, original)
        raise ValueError(f"{e}; nor does {smallest}" if smallest else str(e)) from None


def _smallest_native(teacher, fmt: str, storages, context: int | None, original: float) -> str:
    """'the original attention in <the engine's codes>: the smallest, T, takes N bytes/token (P%)', or '' if none."""
    sizes = native_sizes(teacher, fmt, storages, context)
    least = min(sizes, key=sizes.get, default=None)
    if least is None:
        return ""
    engine = "attnlab.hf.KVCache's storages" if fmt == "transformers" else "llama.cpp's cache types"
    return (f"the original attention in {engine}: the smallest, {least}, takes {sizes[least]:.0f} bytes/token "
            f"({sizes[least] / original:.1%})")


def _options(teacher, budget: KVBudget, budget_bytes: float, original: float, fmt: str, storages,
             context: int | None) -> list[tuple[Layout, dict]]:
    """feasible()'s converted layouts and their storages; ValueError naming the budget when none fits."""
    L, G, d, V = original_sizes(teacher)
    spread = spread_context(teacher, context)
    whole = keys_whole(teacher)
    if whole is not None:
        check_format(teacher, fmt)
        if fmt == "gguf":  # a GGUF in the source's own architecture: no MLA holds them (a transformers folder does:
            kind = getattr(teacher.config, "model_type", "this model")  # models/export/native_transformers.py)
            raise ValueError(f"no converted plan fits a GGUF of {kind}: its per-head key norms keep the original "
                             "attention")
        options, kept = [], kept_storages(storages)
        for lay in layouts(teacher, budget_bytes, context, fmt, kept):
            per_storage = _keys_whole_storages(lay.counted(context), V, whole, lay.room, storages, spread)
            if per_storage:
                options.append((lay, per_storage))
        if not options:
            every = layouts(teacher, budget_bytes, context, fmt, [])[0]
            slides = any(w is not None for w in every.windows)
            hint = "; --context counts a sliding layer by its window" if context is None and slides else ""
            # over every layout some budget allows (the original's bytes: any kept storage fits under them), the one
            # whose smallest rows, with what its kept layers take, come to the fewest bytes
            least = min(layouts(teacher, original, context, fmt, kept), key=lambda lay: lay.kept_bytes + min(
                layers_bytes(MIN_WHOLE_LATENT, whole, s, lay.counted(context), spread) for s in storages))
            smallest = _smallest(MIN_WHOLE_LATENT, whole, storages, least.counted(context), spread, original,
                                 kept=(least.kept_bytes, least.kept_dtype) if least.layers is not None else None)
            at = _at(context, spread, storages, every.counted(context))
            raise ValueError(f"no plan can meet a KV budget of {budget} ({budget_bytes:.0f} bytes/token{at}): this "
                             f"model's per-head q/k norms keep its keys whole ({whole} values per token in each of the "
                             f"{L} layers) beside a latent of at least {MIN_WHOLE_LATENT} values; the smallest these "
                             f"storages ({', '.join(storages)}) can meet is {smallest}{hint}")
        return options
    lay = layouts(teacher, budget_bytes, context, fmt, [])[0]
    per_storage = {s: values_for(budget_bytes, s, lay.counted(context), spread) for s in storages}
    per_storage = {s: min(v, V - 2) for s, v in per_storage.items() if v >= 10}
    blocks = [s for s in storages if s in LLAMA_CPP_CACHE]
    if blocks:  # llama.cpp's block types: a rope key of whole blocks it can turn, and a whole-block latent beside it
        from ..models.export.deepseek_gguf import gguf_rope_limit
        limit = min(G * d, gguf_rope_limit(teacher))
        per_storage = {s: v for s, v in per_storage.items() if s not in blocks or (v >= 64 and limit >= 32)}
        if not per_storage:
            need = L * layer_bytes(32, 32, blocks[0])
            why = (f"the rope key llama.cpp can turn here is {limit} values, under one block" if limit < 32 else
                   f"the smallest row of whole blocks (a latent of 31 + the steady channel, a rope key of 32) takes "
                   f"{need} bytes/token ({need / original:.1%})")
            raise ValueError(f"no plan can meet a KV budget of {budget} ({budget_bytes:.0f} bytes/token) in llama.cpp's "
                             f"{', '.join(blocks)} cache, which stores rows in blocks of 32: {why}")
    if not per_storage:
        smallest = _smallest(8, 2, storages, lay.counted(context), spread, original)
        at = _at(context, spread, storages, lay.counted(context))
        raise ValueError(f"no plan can meet a KV budget of {budget} ({budget_bytes:.0f} bytes/token{at}): it leaves "
                         f"fewer than 10 values per token in each of the {L} layers (one rope pair and a latent); "
                         f"the smallest these storages ({', '.join(storages)}) can meet is {smallest}")
    return [(lay, per_storage)]


def _at(context: int | None, spread: int, storages, layers: tuple) -> str:
    """Where a budget's bytes were counted, for an error: ' at a context of T tokens', or, without one and where some
    storage holds fixed rows (protected tokens), the tokens they were spread over; else ''."""
    if context is not None:
        return f" at a context of {context} tokens"
    if any(fixed_rows_bytes(8, 2, s, layers, spread) for s in storages):
        return f", a sequence's fixed rows spread over {spread} tokens"
    return ""


def _smallest(latent: int, rope: int, storages, layers: tuple, spread: int, original: float,
              kept: tuple[float, str] | None = None) -> str:
    """'N bytes/token (P%)' of the storage whose rows of these sizes take the fewest bytes, and, where a sequence's
    fixed rows (the protected tokens: a "+c4" rope key's newest group, a "+w<N>" window) are part of them, theirs.
    kept: (bytes, storage) of the layers a layout keeps unconverted (Layout.kept_dtype), added to N and named."""
    totals = {s: layers_bytes(latent, rope, s, layers, spread) for s in storages}
    least = min(totals, key=totals.get)
    n = totals[least] + (kept[0] if kept else 0.0)
    fixed = fixed_rows_bytes(latent, rope, least, layers, spread)
    rows = f", of which {fixed:.0f} are the rows a sequence holds unquantised whatever its length ({least}), " \
        f"spread over {spread} tokens" if fixed else ""
    keeping = f"; {kept[0]:.0f} of them are the sliding layers kept, their cache in {kept[1]}" if kept else ""
    return f"{n:.0f} bytes/token ({n / original:.1%}){rows}{keeping}"
