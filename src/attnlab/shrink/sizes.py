"""What a cache costs: the storages the planner may choose (STORAGES), the budget (KVBudget), bytes per token.

Every size is measured from the cache a module allocates for it (on the meta device), so the planner's arithmetic is
the caches' own: a few-bit row's bytes step with its groups and packing, and `fit` moves a latent up or down until one
value more would not fit. At a context see Layout.counted and layouts; the fixed rows: DEFAULT_CONTEXT.
"""
from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import dataclass

import torch

# Notation: L layers, G KV heads, d head size; V = 2 G d values per token and layer in the original GQA cache; a
# compressed MLA caches r (latent) + p (rope key) values per token and layer.

FORMATS = ("attnlab", "deepseek", "gguf", "transformers")
# latent in 4 or 2 bits (groups of 32) with the rope key in 8 bits per token; or latent in 3 or 4 bits with the rope
# key in 4 bits per channel over groups of 64 tokens (KIVI's key layout; docs/decisions.md); last, a 6-bit latent
# beside the 8-bit rope key: what holds every value of a GQA between 4 bits (41% of SmolLM2's bytes) and 8 (51%).
# Each keeps its newest RECENT rows plain as well (+w16: each query reads them unquantised, modules/recent.py), a
# fixed cost a sequence that the budget counts (docs/decisions.md). The 3-bit latent
# takes one scale and minimum per 256 values (rotated first, measured as good as groups of 64), and is offered with a
# window of 8 as well: what keeps every value of SmolLM2 in 25% of the bytes at 4,096 tokens (docs/decisions.md).
# The 2-bit latent in the same groups of 256 beside the same rope key: more
# rank in the same bytes (at 12.5% of SmolLM2's, beside a rope key of 40, r=256 against the 3-bit latent's 176;
# docs/decisions.md)
RECENT = 16
FEW_BIT = (*(f"{s}+w{RECENT}" for s in ("int4/g32+r8", "int2/g32+r8", "int3/g256+c4", "int2/g256+c4", "int4/g32+c4",
                                        "int6/g32+r8")),
           f"int3/g256+c4+w{RECENT // 2}")
STORAGES = ("bf16", "int8", *FEW_BIT)
# The planner's few-bit latents keep their first SINK rows plain too ("+s1": an attention sink, modules/sink.py;
# fitted on the development texts with and without a heal, docs/decisions.md). ATTNLAB_SINK=N plans N instead (0:
# none): the protocol's variant to measure it against the default.
SINK = 1
SINK_VARIABLE = "ATTNLAB_SINK"


def planned_sink() -> int:
    """The first rows the planner's few-bit latents keep plain: ATTNLAB_SINK where set (0 to 63), else SINK."""
    value = os.environ.get(SINK_VARIABLE)
    if value is None:
        return SINK
    if not value.isdigit() or int(value) > 63:
        raise ValueError(f"{SINK_VARIABLE} must be a whole number of rows from 0 to 63, got {value!r}")
    return int(value)


def with_sink(storages, sink: int) -> tuple[str, ...]:
    """The storages with each windowed few-bit latent's first `sink` rows kept plain too ("int3/g256+c4+w8" ->
    "int3/g256+c4+s1+w8": the FEW_BIT family, an MLA's only); the others, and every one for sink 0, as they are."""
    def kept(s: str) -> str:
        base, plus, window = s.rpartition("+w")
        return f"{base}+s{sink}+w{window}" if sink and plus and few_bit(s) and "+s" not in base else s
    return tuple(kept(s) for s in storages)
# a GGUF's cache is llama.cpp's: its f16 ("bf16" here: the same bytes) or a block type of --cache-type-k, which
# quantises deepseek2's cached row [latent | rope key] in blocks of 32 (modules/lowbit.py computes it bit for bit)
LLAMA_CPP_CACHE = ("q8_0", "q5_0", "q4_1", "q4_0")
# llama.cpp also takes K and V in different types (--cache-type-k q8_0 --cache-type-v q4_0: "q8_0,q4_0" here), for the
# original attention only (deepseek2's one latent row lives in its K cache); auto plans the pair users most often pick
GGUF_STORAGES = ("bf16", "q8_0", "q8_0,q4_0", "q5_0", "q4_0")
# a transformers folder holds the original attention with attnlab.hf.KVCache in one of the storages a GQA cache holds
# (llama.cpp's types rotated as llama.cpp rotates them), or an MLA written as DeepSeek-V3 whose KVCache holds its
# latent in one of attnlab's own (STORAGES): --format transformers plans both
TRANSFORMERS_CACHE = ("q8_0", "q8_0,q4_0", "q5_0", "int4/g32", "q4_0", "iq4_nl", "int3/g64", "int2/g32")
# transformers' own QuantizedCache codes (quanto backend, modules/lowbit.py: bit for bit): the baselines beside it
QUANTIZED_CACHE = ("quanto4", "quanto2")
NATIVE_CACHE = {"gguf": LLAMA_CPP_CACHE, "transformers": TRANSFORMERS_CACHE}  # the engine's own codes, per format

def storage_ok(storage: str, fmt: str = "attnlab") -> bool:
    """Whether the planner can store a cache so in that format: bf16 in every one; in attnlab's own also int8 and its
    int2 to int7 groups (any /g<N>, with or without +r8 or +c4, and +w<N>); in a GGUF llama.cpp's cache types; in a
    transformers folder attnlab's own and the GQA storages of attnlab.hf.KVCache (TRANSFORMERS_CACHE)."""
    from ..modules.storage import check_kv_dtype

    if storage == "bf16":
        return True
    if fmt == "transformers" and native_code(storage, fmt):
        return True
    if fmt not in ("attnlab", "transformers"):
        return native_code(storage, fmt)
    try:
        fmt = check_kv_dtype(storage)
    except ValueError:
        return False
    if fmt is not None and fmt.code == "int8" and fmt.group is None:
        return True  # int8 per part (with or without a recent window)
    return fmt.low is not None and fmt.low.kind == "asym" and not fmt.low.segments  # runs: chosen per layer, not asked


def latent_storages(storages, fmt: str) -> list[str]:
    """The storages a converted (MLA) candidate may take in that format: in a transformers folder attnlab's own (its
    KVCache holds a DeepSeek-V3 latent so), elsewhere all but a K/V pair (the original attention's only)."""
    if fmt == "transformers":
        return [s for s in storages if storage_ok(s, "attnlab")]
    return [s for s in storages if not llama_cpp_pair(s)]


def cached_extra(fmt: str) -> int:
    """Latent channels an export caches beyond the MLA's: DeepSeek's constant channel and a GGUF's steady one (1); a
    transformers folder's KVCache keeps the MLA's latent only (0)."""
    return int(fmt in ("deepseek", "gguf"))


def llama_cpp_pair(storage: str) -> bool:
    """Whether a storage is a K/V pair of two of llama.cpp's cache types ("q8_0,q4_0"; modules/storage.py)."""
    names = storage.split(",")
    return len(names) == 2 and names[0] != names[1] and all(n in LLAMA_CPP_CACHE for n in names)


def native_code(storage: str, fmt: str) -> bool:
    """Whether a storage is one of the engine's own cache codes for that format (NATIVE_CACHE; for a GGUF also a K/V
    pair of llama.cpp's types), which the original attention can be planned in."""
    return storage in NATIVE_CACHE.get(fmt, ()) or (fmt in NATIVE_CACHE and llama_cpp_pair(storage))


def few_bit(storage: str) -> bool:
    """Whether a storage is one of attnlab's own few-bit groups (int2 to int7, modules/lowbit.py's spelling)."""
    return latent_bits(storage) is not None


def latent_bits(storage: str) -> int | None:
    """The bits of a latent value in one of attnlab's few-bit storages ("int2/g256+c4+w16": 2); None for any other
    storage."""
    from ..modules.storage import check_kv_dtype

    try:
        fmt = check_kv_dtype(storage)
    except ValueError:
        return None
    return fmt.low.bits if fmt is not None and fmt.low is not None and fmt.low.kind == "asym" else None


def llama_cpp_types(storage: str) -> tuple[str, str]:
    """The llama.cpp cache types (--cache-type-k, --cache-type-v) a GGUF storage is planned for: f16 for the 16-bit
    cache, the two of a K/V pair ("q8_0,q4_0"), else the one type twice."""
    if llama_cpp_pair(storage):
        k, v = storage.split(",")
        return k, v
    kind = "f16" if storage == "bf16" else storage
    return kind, kind


@dataclass(frozen=True)
class KVBudget:
    """What the user asked for: a fraction of the original's 16-bit cache, or bytes per token."""
    kind: str  # "fraction" or "bytes"
    value: float

    def bytes_for(self, original_bytes: float) -> float:
        return self.value * original_bytes if self.kind == "fraction" else self.value

    def __str__(self) -> str:
        return f"{self.value * 100:.4g}%" if self.kind == "fraction" else f"{self.value:.0f} bytes/token"


def parse_budget(text) -> KVBudget:
    """`50%` or `0.5` (a fraction of the original's 16-bit cache) or `6000` (bytes per token); ValueError otherwise."""
    s = str(text).strip().lower()
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*(%|b|bytes)?", s)
    if not m:
        raise ValueError(f"--kv-budget must be a percentage (50%), a fraction (0.5) or bytes per token (6000), "
                         f"got {text!r}")
    number, unit = float(m.group(1)), m.group(2)
    if unit == "%" or (unit is None and number < 1):
        fraction = number / 100 if unit == "%" else number
        if not 0 < fraction < 1:
            raise ValueError(f"--kv-budget must lie strictly between 0% and 100% of the original's cache, got {text!r}")
        return KVBudget("fraction", fraction)
    if number < 1:
        raise ValueError(f"--kv-budget in bytes must be at least 1, got {text!r}")
    return KVBudget("bytes", number)


# -- sizes ------------------------------------------------------------------------------------------
def original_sizes(model) -> tuple[int, int, int, int]:
    """(layers L, KV heads G, head size d, values per token and layer V = 2 G d) of an unconverted Llama-family
    model."""
    from ..models.adapters import attnlab_modules
    from ..modules.gqa import GroupedQueryAttention

    mods = attnlab_modules(model)
    m = mods[0]
    if not isinstance(m, GroupedQueryAttention):
        raise ValueError(f"the model is already converted (layer 0 is a {type(m).__name__}): plan from its source")
    if m.rope is None:
        raise ValueError("the planner cuts RoPE models (Llama, Mistral, Qwen2); this model has no rotary embedding")
    return len(mods), m.num_kv_heads, m.head_dim, m.kv_values_per_token


def layer_cache(latent_dim: int, rope_dim: int, storage: str, max_len: int = 1, dtype: torch.dtype | None = None,
                window: int | None = None):
    """The cache one layer's latent of that size allocates in that storage for one sequence of up to max_len tokens,
    on the meta device (nothing allocated), its rows in dtype (default float32); window: the layer's sliding window
    (its cache then holds the window's rows where the storage allows, modules/cache.py window_for)."""
    from ..modules.mla import MultiHeadLatentAttention

    width = max(8, latent_dim)  # wide enough that the latent is not above the layer's useful rank
    m = MultiHeadLatentAttention(width, 1, latent_dim, head_dim=width, rope_dim=rope_dim, kv_dtype=storage,
                                 sliding_window=window, device="meta")
    return m.init_cache(1, max_len, dtype=dtype, device="meta")


def layer_bytes(latent_dim: int, rope_dim: int, storage: str, context: int | None = None,
                window: int | None = None) -> float:
    """Bytes one layer's latent cache allocates per token in that storage, scales included (layer_cache): per token
    held (an int), or at a context (`_Cache.bytes_at`: a sliding layer (window) holding its window's rows, and a
    sequence's fixed rows, the "+c4" rope key's newest group and a "+w<N>" window's rows, spread over its tokens;
    those rows in bfloat16, the 16 bits the budget counts in)."""
    if context is None:
        return layer_cache(latent_dim, rope_dim, storage).bytes_per_token
    return layer_cache(latent_dim, rope_dim, storage, context, dtype=torch.bfloat16, window=window).bytes_at(context)


def layers_bytes(latent_dim: int, rope_dim: int, storage: str, layers, context: int | None = None) -> float:
    """Whole-model cache bytes per token of latent caches of these sizes in that storage: `layers` is a number of
    layers holding every token, or each layer's sliding window (None: a global layer), a window counting only at a
    context (layer_bytes)."""
    return sum(n * layer_bytes(latent_dim, rope_dim, storage, context, w) for w, n in _windows(layers).items())


def fixed_rows_bytes(latent_dim: int, rope_dim: int, storage: str, layers, context: int | None) -> float:
    """The part of layers_bytes at a context that is a sequence's fixed rows (a "+c4" rope key's newest group, a
    "+w<N>" window) spread over it; 0 per token held (no context)."""
    if context is None:
        return 0.0
    return sum(n * layer_cache(latent_dim, rope_dim, storage, context, dtype=torch.bfloat16, window=w).fixed_bytes
               for w, n in _windows(layers).items()) / context


def _windows(layers) -> dict:
    """{sliding window (None: global): layers} of layers_bytes' `layers` (a number, or each layer's window)."""
    return Counter(layers) if isinstance(layers, tuple) else {None: layers}


def bytes_per_token(values: int, storage: str, layers, rope_dim: int = 2, context: int | None = None) -> float:
    """Whole-model cache bytes per token of `values` per layer (latent + rope key) in that storage (layers_bytes)."""
    return layers_bytes(values - rope_dim, rope_dim, storage, layers, context)


def values_for(budget_bytes: float, storage: str, layers, context: int | None = None) -> int:
    """The most values per token and layer that fit the byte budget in that storage (even, for RoPE pairs), `layers`
    and `context` as layers_bytes counts them: from the cost of one value more and of the scales and fixed rows (each
    linear in the values); for a few-bit storage an estimate from its mean cost per value (fit() makes each split
    fit)."""
    def total(latent: int, rope: int) -> float:
        return layers_bytes(latent, rope, storage, layers, context)

    if storage in LLAMA_CPP_CACHE:  # whole blocks of 32 values only
        per_block = total(32, 32) / 2
        return int(budget_bytes // per_block) * 32
    per_value = (total(258, 62) - total(2, 2)) / 316 if few_bit(storage) else total(3, 2) - total(2, 2)
    fixed = total(2, 2) - 4 * per_value  # scales, and the rows a sequence holds whatever its length
    v = int((budget_bytes - fixed) // per_value)
    return v - v % 2


def fit(latent: int, rope: int, storage: str, layers, budget_bytes: float, extra: int = 0,
        ceiling: int | None = None, context: int | None = None) -> int:
    """The largest latent size (from `latent`, up to `ceiling` when given) whose layers fit the budget with
    this rope key (0 if none does): a few-bit row's bytes step with its groups and packing, not with each value,
    so the estimate from values_for() is moved up or down until one value more would not fit (`layers` and
    `context` as layers_bytes counts them)."""
    def fits(n: int) -> bool:
        return layers_bytes(n + extra, rope, storage, layers, context) <= budget_bytes

    while ceiling is not None and latent < ceiling and fits(latent + 1):
        latent += 1
    while latent > 0 and not fits(latent):
        latent -= 1
    return latent


def _even(x: float) -> int:
    return max(2, int(round(x / 2)) * 2)


def splits(values: int, shares=(0.3,), *, max_rope: int, min_latent: int = 8, block: int | None = None,
           extra: int = 0, strict: bool = False) -> list[tuple[int, int]]:
    """(latent, rope) pairs of `values` with the rope key taking about each share (even, >= 2, <= max_rope).

    block (llama.cpp's quantised caches, q8_0, store rows in blocks of 32): the rope key and the latent with its
    `extra` channels made multiples of `block` (at most `values` in all) where the sizes allow it; pairs that cannot
    be aligned come as they are, or with strict (llama.cpp's block types refuse such rows) are left out."""
    out = []
    for s in shares:
        p = min(_even(values * s), max_rope - max_rope % 2)
        if block:
            pb = min(max(block, round(p / block) * block), max_rope // block * block)
            rb = (values + extra - pb) // block * block - extra
            if pb >= block and rb >= min_latent:
                p = pb
                if (rb, p) not in out:
                    out.append((rb, p))
                continue
            if strict:
                continue
        if values - p >= min_latent and (values - p, p) not in out:
            out.append((values - p, p))
    return out


# -- the context a plan counts bytes at -------------------------------------------------------------------
# Without --context the budget counts every token in every layer (a sliding layer as a global one), and what a
# sequence holds whatever its length (the fixed rows: a "+c4" rope key's newest group, a "+w<N>" window) spread over
# this many tokens, or the model's max_position_embeddings where shorter: a budget that holds from there on
DEFAULT_CONTEXT = 4096


def spread_context(model, context: int | None = None) -> int:
    """The sequence length a plan spreads the fixed rows over: `context` when given, else DEFAULT_CONTEXT or the
    model's max_position_embeddings where shorter."""
    if context is not None:
        return context
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return min(DEFAULT_CONTEXT, int(limit)) if isinstance(limit, int) and limit > 0 else DEFAULT_CONTEXT


def planned_bytes(model, context: int | None = None, spread: int | None = None) -> float:
    """A model's cache bytes per token as the planner counts them (its fixed rows in bfloat16): at a context (sliding
    layers holding their windows, the fixed rows spread over it, kv_bytes_per_token), or, with none, per token held in
    every layer plus the fixed rows spread over `spread` tokens (default spread_context)."""
    from ..models.evaluate import kv_bytes_per_token, kv_fixed_bytes

    if context is not None:
        return kv_bytes_per_token(model, torch.bfloat16, context=context)
    spread = spread_context(model) if spread is None else spread
    return kv_bytes_per_token(model, torch.bfloat16) + kv_fixed_bytes(model, torch.bfloat16) / spread


# -- layer types at a context ------------------------------------------------------------------------------
# what the sliding layers a candidate keeps (unconverted) may store their cache in, each where the request names it
# (the plain command names bf16 and int8; `--kv-dtype int4/g32` names 4 bits in groups of 32, a scale and minimum
# each, for every layer's cache). Offered to the plain command beside its few-bit latents (87c257a) it took Gemma 3's
# 15 sliding layers from 137 bytes a token at 32,768 tokens to 84, the values' latent from 8 to 56-88 and the median
# at 18% from 2.29x to 1.10x, but the worst text by less than the seeds' spread (docs/decisions.md):
# not a default
KEPT_STORAGES = ("bf16", "int8", "int4/g32")


def kept_storages(storages) -> list[str]:
    """The storages of KEPT_STORAGES the kept layers may use under a request's storages: those it names."""
    return [s for s in KEPT_STORAGES if s in storages]


@dataclass(frozen=True)
class Layout:
    """Which layers a candidate converts, and the bytes per token the budget leaves them.

    layers: the converted layers' indices (None: all); the others keep the original's attention, their cache in
    kept_dtype. windows: each converted layer's sliding window (None: global). room: the budget less what the kept
    layers' caches take at the context (kept_bytes)."""
    layers: tuple[int, ...] | None
    kept_dtype: str | None
    windows: tuple
    room: float
    kept_bytes: float = 0.0

    def counted(self, context: int | None) -> tuple:
        """The converted layers as layers_bytes counts them: each one's sliding window at a context, else every layer
        global (every token held)."""
        return self.windows if context is not None else (None,) * len(self.windows)


def layouts(teacher, budget_bytes: float, context: int | None, fmt: str = "attnlab",
            kept=KEPT_STORAGES) -> list[Layout]:
    """Every layer converted; and, for a model with both sliding and global layers planned at a context in attnlab's
    format (or a transformers folder, which holds a keys-whole model's layers so), the global layers converted and the
    sliding ones kept as they are, their cache in each of `kept` whose bytes leave room (at a long context a sliding
    layer holds a small share of its tokens: the bytes are the global layers')."""
    from ..models.adapters import attnlab_modules

    mods = attnlab_modules(teacher)
    windows = tuple(m.sliding_window for m in mods)
    out = [Layout(None, None, windows, budget_bytes)]
    slide = [i for i, w in enumerate(windows) if w is not None]
    glob = [i for i, w in enumerate(windows) if w is None]
    if context is None or fmt not in ("attnlab", "transformers") or not slide or not glob:
        return out
    for storage in kept:
        cost = sum(mods[i].init_cache(1, 1, dtype=torch.bfloat16, device="meta", kv_dtype=storage).bytes_at(context)
                   for i in slide)
        if cost < budget_bytes:
            out.append(Layout(tuple(glob), storage, tuple(windows[i] for i in glob), budget_bytes - cost, cost))
    return out


def original_bytes(teacher, context: int | None = None) -> float:
    """The original's 16-bit cache in bytes per token: every token held (2 V L), or at a context (sliding layers
    holding their windows)."""
    if context is None:
        L, _, _, V = original_sizes(teacher)
        return bytes_per_token(V, "bf16", L)
    from ..models.evaluate import kv_bytes_per_token

    return kv_bytes_per_token(teacher, torch.bfloat16, kv_dtype="bf16", context=context)
