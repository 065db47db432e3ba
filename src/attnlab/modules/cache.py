"""KV and latent caches: preallocated buffers that grow along the sequence axis, stored plain or quantised.

A cache belongs to the module that made it (`module.init_cache(...)`) and is
passed back to that module's forward. It is a plain object, not an nn.Module:
torch.compile treats int attributes of modules as constants, which would
recompile a compiled decode step for every token; the length of a plain object
becomes a dynamic size after its first change, so a compiled step compiles
twice and then never again. Its tensors never enter a module's state_dict.

- `KVCache` (MHA, GQA): k (B, G, S_max, d) and v (B, G, S_max, dv), only the
  num_kv_heads heads, never the H query heads.
- `LatentCache` (MLA): one buffer (B, S_max, r + rope_dim) holding the latent
  c = W_DKV y (after the optional RMSNorm) and, beside it, the shared RoPE key.
  Keeping them side by side lets the absorbed decode read key and value as
  views of one tensor, with no copy per step.

Storage (`kv_dtype`; `cache.dtype` stays the activation dtype the cache returns):
- None: plain, in the activation dtype (the default); "fp32", "bf16": plain in that dtype.
- "int8": symmetric integers, code = round_half_even(x / s) clamped to [-127, 127], one
  float32 scale s = amax / 127 per token and *part* of a row: for an MLA row the latent c
  (r numbers) and the rotary key k_R (p numbers) have a scale each (k_R is rotated and not
  normalised, its size has nothing to do with c's); for K and V of a GQA one per token and
  KV head; for a GQA-tiled MLA row one per token and KV head of K and of V.
- "fp8": torch.float8_e4m3fn codes of x / s with s = amax / 448 (its largest finite value),
  the same scales; where the torch build has no float8_e4m3fn it is refused.
- "int8/g<N>", "fp8/g<N>": one scale per N channels of a part instead of one per part.
- few-bit ("q4_0", "int4/g32", "int3/g64+c4", ...): packed codes and float16 meta (modules/lowbit.py); with
  "+c4" an MLA's rope key is kept per channel over groups of 64 tokens, its newest, incomplete group
  unquantised (modules/key_groups.py); such a cache reads back dequantised rows and refuses fixed_slot.
Per part is the default because per-group scales did not measure clearly better on a real
model (docs/generation.md, "Quantised KV caches"): on SmolLM2-135M, int8 per part costs at
most 1.003x perplexity on the GQA and nothing measurable on its MLA at half the KV values
(2 scales, 8 bytes per token and layer); groups of 32 gained 0.1-0.2% on the GQA and nothing
on the MLA for 7 scales (28 bytes) on the MLA's 192 codes.
Scales are float32: 4 bytes each, counted in bytes_per_token; float16 would save 2 bytes a
scale, but below amax = 127 * 6e-5 its scales turn subnormal and lose precision.
Tokens are quantised once, when written (`extend`), and read back dequantised to the
activation dtype, (code * s) computed in float32 (float64 for float64 activations), each part
times its scale by broadcasting. Readers that can (`QuantisedKV.foldable`: one scale per part,
float32/float64 activations) skip that copy: the GQA and the absorbed MLA decode take the codes
and multiply the scores and the softmax weights by the scales (`attend(key_scale=, value_scale=)`),
which makes an 8-bit decode step cost what a 16-bit one does (docs/generation.md).
`round_trip` applies the same quantisation to new keys of a forward without a cache; when they
require gradients (a heal), the gradient passes straight through the storage (the identity's),
since integer codes would cut the graph and leave the key/value projections untrained.

Cross-attention: the first call with a context fills the cache and marks it
`static`; later calls reuse it and append nothing.

Sliding window (`window=W`, what init_cache gives a module with a sliding_window, Gemma 3's sliding
layers): a query at position i sees keys i - W < j <= i, so between calls the cache needs only the
last W - 1 tokens. It allocates window_rows(W, max_len) = min(max_len, W + min(W, 64)) rows, not
max_len: the tokens held, in order, and room for new ones; when the room runs out the last W - 1 rows
move to the front (for Gemma 3's W = 512, 511 rows copied every 65 tokens: about 8 rows per token
written, against the 512 each decode step reads). A chunk longer than the room (a long prompt) is
attended whole from the returned rows and only its last W - 1 are kept. `length` stays
the number of tokens written (the next position); `key_start` is the position of the first row the
last extend() returned, which the module's window mask and a RoPE applied after the cache read.
Tokens dropped are gone: truncate() cannot go back before what a later query would need, and a
fixed_slot view (a fixed-shape step) needs every slot, so a module's init_cache(sliding=False)
keeps every token and leaves the window to the mask; so does a "+c4" storage (window_for), whose
rope key is quantised per channel over groups of 64 tokens and cannot drop one token at a time.
"""
from __future__ import annotations

import copy
import functools
import re
import weakref
from typing import NamedTuple

import torch
from torch import nn

from . import checks, lowbit
from .key_groups import RopeKeyGroups

KV_DTYPES = ("fp32", "bf16", "int8", "fp8", "q8_0", "q5_0", "q4_0", "q4_1", "int4", "int3", "int2", "kivi4",
             "kivi2")
PLAIN = {"fp32": torch.float32, "bf16": torch.bfloat16}
QMAX = {"int8": 127.0, "fp8": 448.0}  # the largest code: int8 symmetric, float8_e4m3fn's largest finite value
SCALE_DTYPE = torch.float32
_SPELLING = re.compile(r"(fp32|bf16)|(int8|fp8)(?:/g([1-9][0-9]*))?")


@functools.cache
def fp8_supported() -> bool:
    """True where this torch build has torch.float8_e4m3fn and can cast to and from it."""
    if not hasattr(torch, "float8_e4m3fn"):
        return False
    try:
        return bool(torch.ones(1).to(torch.float8_e4m3fn).float().item() == 1.0)
    except (RuntimeError, TypeError):
        return False


class StorageFormat(NamedTuple):
    """A parsed kv_dtype: its spelling, its code ("fp32", "bf16", "int8", "fp8", or a few-bit one), its scale
    group (None: per part), and for the few-bit storages their LowBit (modules/lowbit.py)."""
    name: str
    code: str
    group: int | None
    low: lowbit.LowBit | None = None

    @property
    def quantised(self) -> bool:
        return self.code in QMAX or self.low is not None

    @property
    def evaluation_only(self) -> bool:
        """KIVI: applied to keys and values of a forward without a cache, never stored by a cache."""
        return self.low is not None and self.low.kind == "kivi"

    @property
    def storage_dtype(self) -> torch.dtype:
        if self.low is not None:
            return torch.uint8
        return PLAIN[self.code] if self.code in PLAIN else torch.int8 if self.code == "int8" else torch.float8_e4m3fn


def check_kv_dtype(kv_dtype) -> StorageFormat | None:
    """Parse a kv_dtype ("fp32", "bf16", "int8", "fp8", "int8/g<N>", "fp8/g<N>", the few-bit ones of
    modules/lowbit.py: "q8_0", "q5_0", "q4_0", "q4_1", "int4[/g<N>][+r8|+c4]", "int3...", "int2...", "kivi4",
    "kivi2"; or None); one-line errors."""
    if kv_dtype is None:
        return None
    choices = ("'fp32', 'bf16', 'int8', 'fp8' (or 'int8/g<N>', 'fp8/g<N>': one scale per N channels), llama.cpp's "
               "'q8_0', 'q5_0', 'q4_0', 'q4_1', 'int4', 'int3', 'int2' (or 'int4/g<N>', ..., and after any of them '+r8' "
               "for an MLA's rope key in 8 bits or '+c4' for it in 4 bits per channel), 'kivi4', 'kivi2' or None")
    if not isinstance(kv_dtype, str):
        raise TypeError(f"kv_dtype must be one of {choices}, got {type(kv_dtype).__name__} ({kv_dtype!r})")
    low = lowbit.parse(kv_dtype)
    if low is not None:
        return StorageFormat(kv_dtype, low.code, low.group, low)
    found = _SPELLING.fullmatch(kv_dtype)
    if found is None:
        raise ValueError(f"kv_dtype must be one of {choices}, got {kv_dtype!r}")
    code = found.group(1) or found.group(2)
    if code == "fp8" and not fp8_supported():
        raise ValueError(f"kv_dtype {kv_dtype!r} needs torch.float8_e4m3fn, which torch {torch.__version__} "
                         "does not support; use 'int8'")
    return StorageFormat(kv_dtype, code, int(found.group(3)) if found.group(3) else None)


# -- quantisation --------------------------------------------------------------------------------
WINDOW_ROOM = 64  # rows a window cache allocates beyond its window (at most the window itself)


def window_rows(window: int, max_len: int) -> int:
    """Rows a cache of that window allocates for sequences of up to max_len tokens (module docstring)."""
    return min(max_len, window + min(window, WINDOW_ROOM))


def window_for(sliding_window: int | None, kv_dtype, sliding: bool = True) -> int | None:
    """The window a module's cache keeps: its sliding_window, unless sliding is False or the storage keeps a rope
    key per channel over groups of tokens ("+c4"), which cannot drop one token at a time (then every token is
    kept and the module's mask applies the window)."""
    fmt = check_kv_dtype(kv_dtype)
    if not sliding or (fmt is not None and fmt.low is not None and fmt.low.rope_channel):
        return None
    return sliding_window


def num_scales(parts: tuple[int, ...], group: int | None) -> int:
    """Scales per row: one per part, or one per `group` channels of each part (the last group may be short)."""
    return sum(1 if group is None else -(-w // group) for w in parts)


def _each_scale(y: torch.Tensor, scales: torch.Tensor, parts: tuple[int, ...], group: int | None, op) -> torch.Tensor:
    """y (..., W) in place: op(channels, scale) for each part (each group of N channels of it with /g<N>)
    and its scale column of scales (..., n), broadcast over the channels (no gathered copy of the scales)."""
    start = col = 0
    for w in parts:
        g = w if group is None or group >= w else group
        n, whole = -(-w // g), w // g * g  # scales of the part; channels in its full groups
        y_p, s = y[..., start:start + w], scales[..., col:col + n]
        if whole:
            op(y_p[..., :whole].unflatten(-1, (whole // g, g)), s[..., :whole // g, None])
        if whole < w:  # the short last group
            op(y_p[..., whole:], s[..., n - 1:])
        start, col = start + w, col + n
    return y


def quantise(x: torch.Tensor, parts: tuple[int, ...], fmt: StorageFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., W) -> codes (..., W) in fmt's storage dtype and float32 scales (..., n); see the module docstring.
    Few-bit formats: packed uint8 codes and float16 scales (and minima), modules/lowbit.py."""
    if fmt.low is not None:
        return lowbit.encode(x, parts, fmt.low)
    xf = x.to(torch.promote_types(x.dtype, SCALE_DTYPE))  # (..., W)
    amax, start = [], 0
    for w in parts:
        part = xf[..., start:start + w].abs()  # (..., w)
        if fmt.group is None or fmt.group >= w:
            amax.append(part.amax(-1, keepdim=True))  # (..., 1)
        else:
            n = -(-w // fmt.group)
            part = nn.functional.pad(part, (0, n * fmt.group - w))  # (..., n*g), zeros do not raise amax
            amax.append(part.unflatten(-1, (n, fmt.group)).amax(-1))  # (..., n)
        start += w
    scales = (torch.cat(amax, -1) / QMAX[fmt.code]).to(SCALE_DTYPE)  # (..., n)
    s = torch.where(scales > 0, scales, torch.ones_like(scales)).to(xf.dtype)  # (..., n)
    y = xf.clone() if xf is x else xf  # divided in place below; x itself stays as given
    y = _each_scale(y, s, parts, fmt.group, torch.Tensor.div_)  # (..., W), |y| <= QMAX up to rounding
    if fmt.code == "int8":
        return torch.round(y).clamp_(-127, 127).to(torch.int8), scales
    return y.clamp_(-QMAX["fp8"], QMAX["fp8"]).to(torch.float8_e4m3fn), scales


def dequantise(codes: torch.Tensor, scales: torch.Tensor, parts: tuple[int, ...], group: int | None,
               dtype: torch.dtype, low: lowbit.LowBit | None = None) -> torch.Tensor:
    """codes (..., W), scales (..., n) -> (codes * scale) (..., W) in `dtype`, multiplied in float32
    (float64 for float64); few-bit formats (low) through lowbit.decode."""
    if low is not None:
        return lowbit.decode(codes, scales, parts, low, dtype)
    work = torch.promote_types(dtype, SCALE_DTYPE)
    out = _each_scale(codes.to(work), scales.to(work), parts, group, torch.Tensor.mul_)  # (..., W)
    return out if work == dtype else out.to(dtype)


def round_trip(x: torch.Tensor, kv_dtype, parts: tuple[int, ...], role: str | None = None) -> torch.Tensor:
    """x as a cache with this kv_dtype (a spelling or a StorageFormat) returns it: quantised then
    dequantised, or rounded to a plain storage dtype. role ("key", "value"): what x (..., S, W) holds,
    for KIVI, which quantises keys along the tokens (lowbit.kivi_round_trip)."""
    fmt = kv_dtype if isinstance(kv_dtype, StorageFormat) else check_kv_dtype(kv_dtype)
    if fmt is None:
        return x
    if fmt.evaluation_only:
        stored = lowbit.kivi_round_trip(x.detach(), fmt.low, role)
    elif not fmt.quantised:
        stored = x.to(fmt.storage_dtype).to(x.dtype)
    elif fmt.low is not None:
        stored = lowbit.round_trip(x.detach(), parts, fmt.low)
    else:
        codes, scales = quantise(x, parts, fmt)
        stored = dequantise(codes, scales, parts, fmt.group, x.dtype, fmt.low)
    if x.requires_grad:  # training through the storage: its values forward, the identity's gradient back
        return x + (stored - x).detach()  # (straight-through; integer codes would cut the graph)
    return stored


class QuantisedKV(NamedTuple):
    """Rows of a quantised cache as stored: codes (..., S, W), float32 scales (..., S, n), how scales map
    to channels (parts, group), and the activation dtype they are read back in."""
    data: torch.Tensor
    scales: torch.Tensor
    parts: tuple[int, ...]
    group: int | None
    dtype: torch.dtype
    low: lowbit.LowBit | None = None  # a few-bit format: data holds packed codes, scales float16 meta

    @property
    def shape(self) -> torch.Size:
        """(..., S, W): the rows' shape as read back (a packed row is narrower in storage)."""
        return (*self.data.shape[:-1], sum(self.parts)) if self.low is not None else self.data.shape

    @property
    def foldable(self) -> bool:
        """Whether a reader may take the codes in the activation dtype and apply the scales per row of
        each part (one scale per part, a float32/float64 activation dtype: the same products in the same
        precision as dequantise(), in another order)."""
        return (self.low is None and num_scales(self.parts, self.group) == len(self.parts)
                and self.dtype in (torch.float32, torch.float64))

    def codes(self) -> torch.Tensor:
        """The codes in the activation dtype (exact: int8 and e4m3 codes are representable), (..., S, W)."""
        return self.data.to(self.dtype)

    def dequantise(self) -> torch.Tensor:
        return dequantise(self.data, self.scales, self.parts, self.group, self.dtype, self.low)  # (..., S, W)


def dense(kv):
    """A tensor as it is; QuantisedKV rows dequantised."""
    return kv.dequantise() if isinstance(kv, QuantisedKV) else kv


def with_row_scale(kv) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(rows, per-row factor (..., S) or None) whose product is dense(kv): the codes and their scale for
    one-part QuantisedKV rows a reader can fold (QuantisedKV.foldable), else dense(kv) and None."""
    if isinstance(kv, QuantisedKV) and kv.foldable and len(kv.parts) == 1:
        return kv.codes(), kv.scales[..., 0].to(kv.dtype)
    return dense(kv), None


# -- the caches ----------------------------------------------------------------------------------
class _Cache:
    """Named buffers of shape (B, ..., S_max, width) that share a length; quantised ones with scales beside them.

    parts[name]: the widths each scale covers in a row of buffer `name` (see the module docstring).
    """

    key_start = 0  # position of the first row the last extend() returned (a window cache drops older ones)

    def __init__(self, owner: nn.Module, batch_size: int, max_len: int, buffers: dict[str, tuple[int, ...]],
                 dtype: torch.dtype, device, *, kv_dtype=None, parts: dict[str, tuple[int, ...]] | None = None,
                 window: int | None = None):
        checks.positive_int("batch_size", batch_size)
        checks.positive_int("max_len", max_len)
        if window is not None:
            checks.positive_int("window", window)
        fmt = check_kv_dtype(kv_dtype)
        if fmt is not None and fmt.evaluation_only:
            raise ValueError(f"kv_dtype {kv_dtype!r} is KIVI, an evaluation baseline (keys quantised per channel "
                             "over whole groups of tokens, in a forward without a cache); attnlab's caches store "
                             "q8_0, q5_0, q4_0, q4_1, int4/g<N>, int2/g<N>, int8 or fp8")
        if window is not None and fmt is not None and fmt.low is not None and fmt.low.rope_channel:
            raise ValueError(f"kv_dtype {kv_dtype!r} keeps the rope key per channel over groups of "
                             f"{lowbit.KEY_TOKENS} tokens, which a sliding-window cache (window {window}) cannot "
                             "drop a token at a time; use a kv_dtype without +c4, or sliding=False")
        self._owner = weakref.ref(owner)
        self.batch_size, self.max_len, self.window = batch_size, max_len, window
        self.capacity = max_len if window is None else window_rows(window, max_len)  # rows allocated
        buffers = {name: (*shape[:-2], self.capacity, shape[-1]) for name, shape in buffers.items()}
        self._length = 0
        self._start = 0  # tokens dropped from the front (a window cache): row 0 holds position _start
        self.static = False
        self._dtype, self.kv_dtype, self._format = dtype, kv_dtype, fmt
        stored = dtype if fmt is None else fmt.storage_dtype
        self._parts = {name: (parts or {}).get(name, (shape[-1],)) for name, shape in buffers.items()}
        self._names = list(buffers)
        self._scale_names = {}
        self._channel: dict[str, RopeKeyGroups] = {}  # "+c4": a rope key per channel over groups of tokens
        for name, shape in buffers.items():
            parts_n = self._parts[name]
            if fmt is not None and fmt.quantised and sum(parts_n) != shape[-1]:
                raise ValueError(f"scale parts {parts_n} of {name} do not add up to its width {shape[-1]}")
            if fmt is not None and fmt.low is not None:  # packed codes, float16 meta per group
                lowbit.check_parts(parts_n, fmt.low)
                if fmt.low.rope_channel:  # the rope key's meta per group of tokens, its newest group unquantised
                    self._channel[name] = RopeKeyGroups(shape, parts_n, fmt.low, max_len, dtype, device)
                setattr(self, name, torch.zeros(*shape[:-1], lowbit.packed_row(parts_n, fmt.low), dtype=stored,
                                                device=device))
                self._scale_names[name] = name + "_scales"
                setattr(self, name + "_scales", torch.zeros(*shape[:-1], lowbit.meta_row(parts_n, fmt.low),
                                                            dtype=lowbit.META_DTYPE, device=device))
                continue
            setattr(self, name, torch.zeros(shape, dtype=stored, device=device))
            if fmt is not None and fmt.quantised:
                self._scale_names[name] = name + "_scales"
                setattr(self, name + "_scales", torch.zeros(
                    *shape[:-1], num_scales(parts_n, fmt.group), dtype=SCALE_DTYPE, device=device))

    def _row_names(self) -> list[str]:
        """The tensors with one row per token: the buffers and, for quantised storage, their scales."""
        return self._names + list(self._scale_names.values())

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the cache allocated: the buffers and, for quantised storage, their scales (and for a
        rope key per channel its meta per group of tokens and its newest group, unquantised)."""
        return [getattr(self, n) for n in self._row_names()] + [t for g in self._channel.values() for t in g.tensors()]

    def _per_token_share(self, numbers: bool) -> int:
        """A rope key per channel: each token's share of its group's meta (rounded up), in numbers or bytes."""
        per_group = sum(g.meta_per_group() for g in self._channel.values())
        return -(-per_group * (1 if numbers else 2) // lowbit.KEY_TOKENS)

    @property
    def dtype(self) -> torch.dtype:
        """The activation dtype the cache takes and returns (its storage is `kv_dtype`)."""
        return self._dtype

    @property
    def storage_dtype(self) -> torch.dtype:
        return getattr(self, self._names[0]).dtype

    @property
    def quantised(self) -> bool:
        return bool(self._scale_names)

    @property
    def device(self) -> torch.device:
        return getattr(self, self._names[0]).device

    @property
    def values_per_token(self) -> int:
        """Numbers stored per token of one sequence (scales included), counted from the allocated tensors."""
        rows = [getattr(self, n) for n in self._row_names()]
        return sum(b.numel() for b in rows) // (self.batch_size * self.capacity) + self._per_token_share(True)

    @property
    def bytes_per_token(self) -> int:
        """Bytes stored per token held of one sequence (scales included), measured from the allocated tensors; a
        rope key per channel counts in the steady state (a share of its group's meta; its newest, incomplete
        group is a fixed KEY_TOKENS rows a sequence, not a cost per token). A window cache holds at most
        `capacity` tokens whatever the context (bytes_at)."""
        rows = [getattr(self, n) for n in self._row_names()]
        per_row = sum(b.numel() * b.element_size() for b in rows) // (self.batch_size * self.capacity)
        return per_row + self._per_token_share(False)

    def bytes_at(self, context: int) -> float:
        """Bytes per token of one sequence of `context` tokens: bytes_per_token, or for a window cache the rows a
        cache made for that context allocates (window_rows) spread over the context."""
        checks.positive_int("context", context)
        if self.window is None:
            return float(self.bytes_per_token)
        return self.bytes_per_token * window_rows(self.window, context) / context

    @property
    def held(self) -> int:
        """Tokens in the buffers now (length, less what a window cache dropped)."""
        return self.length - self._start

    @property
    def length(self) -> int:
        """Tokens held so far (for a fixed_slot view: max_len - 1, see there)."""
        return self._length if self._slot is None else self.max_len - 1

    _slot: torch.Tensor | None = None

    def fixed_slot(self, slot: torch.Tensor) -> "_Cache":
        """A fixed-shape view of this cache for one-token decode steps (CUDA graphs, torch.compile).

        extend() writes the one new token at `slot`, a 1-element int64 tensor (its value is
        data, not a Python int, so every step runs the same operations on the same shapes), and
        returns the whole max_len buffers; attention must then mask the slots not yet written
        (a key-padding mask over max_len). The view shares this cache's memory and reports
        length max_len - 1, so a module attends to max_len keys; after the steps, tell this
        cache how far it is filled with mark_filled().
        """
        if not isinstance(slot, torch.Tensor) or slot.dtype != torch.int64 or slot.numel() != 1:
            raise TypeError(f"slot must be a 1-element int64 tensor, got {slot!r}")
        if self._channel:
            raise ValueError(f"kv_dtype {self.kv_dtype!r} quantises the rope key a group of {lowbit.KEY_TOKENS} "
                             "tokens at a time, which a fixed-shape step cannot: decode without fixed_shape")
        if self.window is not None:
            raise ValueError(f"this cache keeps a sliding window of {self.window} tokens, and a fixed-shape step "
                             "needs every slot: make it with init_cache(..., sliding=False)")
        part = copy.copy(self)
        part._slot = slot.view(1)
        return part

    def mark_filled(self, length: int) -> None:
        """Declare the first `length` slots written (by steps through a fixed_slot view)."""
        if not 0 <= length <= self.max_len:
            raise ValueError(f"length must be between 0 and max_len {self.max_len}, got {length}")
        self._length = length

    def reset(self) -> None:
        self._length = self._start = self.key_start = 0
        self.static = False

    def truncate(self, length: int) -> None:
        """Forget every token after the first `length` (for example rejected draft tokens)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"length must be between 0 and the cached {self.length}, got {length}")
        if self.window is not None and self._start > max(0, length - self.window + 1):
            raise ValueError(f"this sliding-window cache dropped the tokens before {self._start}; going back to "
                             f"{length} needs them from {max(0, length - self.window + 1)}")
        for name, groups in self._channel.items():  # the kept tokens of a group now incomplete go back unquantised
            groups.truncate(getattr(self, name), getattr(self, self._scale_names[name]), self.length, length)
        self._length = length

    def check_owner(self, module: nn.Module, batch_size: int, dtype: torch.dtype) -> None:
        if self._owner() is not module:
            raise ValueError(f"this {type(self).__name__} was made by another module; "
                             f"use {type(module).__name__}.init_cache() of the module it is passed to")
        if batch_size != self.batch_size:
            raise ValueError(f"cache was made for batch_size {self.batch_size}, got a batch of {batch_size}")
        if dtype != self.dtype:
            raise ValueError(f"cache holds {self.dtype} but the input is {dtype}")

    # -- writing and reading -----------------------------------------------------------------
    def _encode(self, name: str, t: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(buffer, rows to write into it) pairs for new rows t of buffer `name`: codes and scales, or t in storage."""
        buf = getattr(self, name)
        if name not in self._scale_names:
            return [(buf, t.to(buf.dtype))]
        codes, scales = quantise(t, self._parts[name], self._format)
        return [(buf, codes), (getattr(self, self._scale_names[name]), scales)]

    def write(self, **new: torch.Tensor) -> None:
        """Write the new tokens after the cached ones (at the slot, for a fixed_slot view), quantised if so stored."""
        n = next(iter(new.values())).shape[-2]
        if self._slot is not None:
            if n != 1:
                raise ValueError(f"a fixed_slot view writes one token per call, got {n}")
            for name, t in new.items():
                for buf, rows in self._encode(name, t):
                    if buf.element_size() == 1 and buf.is_floating_point():  # index_copy_ lacks float8: copy bytes
                        buf, rows = buf.view(torch.uint8), rows.view(torch.uint8)
                    buf.index_copy_(buf.dim() - 2, self._slot, rows)
            return
        if self.length + n > self.max_len:
            raise ValueError(f"cannot append {n} tokens: the cache holds {self.length} of max_len {self.max_len}")
        if self.window is not None:
            self._extend_window(new, n)
            return
        end = self.length + n
        for name, t in new.items():
            if name in self._channel:
                self._channel[name].write(getattr(self, name), getattr(self, self._scale_names[name]), self.length, t)
                continue
            for buf, rows in self._encode(name, t):
                buf[..., self.length:end, :] = rows
        self._length = end

    def stored(self, rows: int | None = None) -> tuple:
        """Each buffer's first `rows` rows (default: the tokens held; a fixed_slot view: all max_len) as stored:
        a tensor in the activation dtype for plain storage, QuantisedKV for quantised storage."""
        if rows is None:
            rows = self.max_len if self._slot is not None else self.held
        out = []
        for name in self._names:
            if name in self._channel:  # dequantised here: the rope key's groups have their meta apart
                out.append(self._channel[name].read(getattr(self, name), getattr(self, self._scale_names[name]),
                                                    self._length, rows))
                continue
            scales = getattr(self, self._scale_names[name])[..., :rows, :] if name in self._scale_names else None
            out.append(self._as_read(getattr(self, name)[..., :rows, :], scales, name))
        return tuple(out)

    def _as_read(self, rows: torch.Tensor, scales: torch.Tensor | None, name: str):
        """Rows of buffer `name` as stored() gives them: QuantisedKV with their scales, or in the activation dtype."""
        if scales is not None:
            return QuantisedKV(rows, scales, self._parts[name], self._format.group, self.dtype, self._format.low)
        return rows if rows.dtype == self.dtype else rows.to(self.dtype)

    def _extend_window(self, new: dict[str, torch.Tensor], n: int) -> tuple:
        """A window cache's write (module docstring); returns the rows this call attends, as stored()."""
        keep_max = self.window - 1
        held = self.held
        if held + n > self.capacity and held > keep_max:  # drop what no later query sees, keep the order
            drop = held - keep_max
            for name in self._row_names():
                buf = getattr(self, name)
                buf[..., :keep_max, :] = buf[..., drop:held, :].clone()
            self._start, held = self._start + drop, keep_max
        self.key_start = self._start
        if held + n <= self.capacity:
            for name, t in new.items():
                for buf, rows in self._encode(name, t):
                    buf[..., held:held + n, :] = rows
            self._length += n
            return self.stored()
        out = []  # a chunk longer than the room: attend the held rows and all new ones, keep the last W - 1
        keep = min(keep_max, held + n)
        for name, t in new.items():
            pairs = self._encode(name, t)  # (buffer, new rows): the codes or values, then the scales if quantised
            joined = [torch.cat([buf[..., :held, :], rows], dim=-2) for buf, rows in pairs]
            out.append(self._as_read(joined[0], joined[1] if len(joined) > 1 else None, name))
            for (buf, _), rows in zip(pairs, joined):
                buf[..., :keep, :] = rows[..., rows.shape[-2] - keep:, :]
        self._length += n
        self._start = self._length - keep
        return tuple(out)

    def extend(self, **new: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Write the new tokens after the cached ones; return each buffer up to the new length (the
        whole buffers for a fixed_slot view; a window cache: from key_start), in the activation dtype (dequantised)."""
        return tuple(dense(t) for t in self.extend_stored(**new))

    def extend_stored(self, **new: torch.Tensor) -> tuple:
        """As extend, but quantised buffers come back as stored (QuantisedKV), for readers that dequantise
        themselves (the absorbed-decode kernel)."""
        if self.window is not None and self._slot is None:
            n = next(iter(new.values())).shape[-2]
            if self.length + n > self.max_len:
                raise ValueError(f"cannot append {n} tokens: the cache holds {self.length} of max_len {self.max_len}")
            return self._extend_window(new, n)
        self.write(**new)
        return self.stored()

    def batch_view(self, batch_size: int) -> "_Cache":
        """This cache for its first `batch_size` rows, sharing its memory (a smaller batch in a bigger cache)."""
        checks.positive_int("batch_size", batch_size)
        if batch_size > self.batch_size:
            raise ValueError(f"batch_size {batch_size} exceeds the {self.batch_size} rows this cache was made for")
        if batch_size == self.batch_size:
            return self
        part = copy.copy(self)
        for name in self._row_names():
            setattr(part, name, getattr(self, name)[:batch_size])
        part._channel = {name: groups.rows_of(batch_size) for name, groups in self._channel.items()}
        part.batch_size = batch_size
        return part

    def view(self) -> tuple[torch.Tensor, ...]:
        """The tokens held, in the activation dtype (dequantised)."""
        return tuple(dense(t) for t in self.stored(self.held))

    def view_stored(self) -> tuple:
        """The tokens held, as stored (see stored())."""
        return self.stored(self.held)

    def __repr__(self) -> str:
        window = "" if self.window is None else f", window={self.window}"
        return (f"{type(self).__name__}(batch_size={self.batch_size}, max_len={self.max_len}, length={self.length}, "
                f"dtype={self.dtype}, kv_dtype={self.kv_dtype!r}{window})")


class KVCache(_Cache):
    """K (B, G, S_max, d) and V (B, G, S_max, dv); quantised: scales per token and KV head (or per group)."""

    def __init__(self, owner, batch_size: int, max_len: int, num_kv_heads: int, head_dim: int, v_head_dim: int,
                 *, dtype, device=None, kv_dtype=None, window: int | None = None):
        super().__init__(owner, batch_size, max_len, {
            "k": (batch_size, num_kv_heads, max_len, head_dim),
            "v": (batch_size, num_kv_heads, max_len, v_head_dim),
        }, dtype, device, kv_dtype=kv_dtype, window=window)


class LatentCache(_Cache):
    """[c, k_R] rows (B, S_max, r + p); quantised: a scale per token for c and one for k_R (or per group),
    or, for a GQA-tiled MLA, `parts` = its KV heads' widths (one scale per token and head of K and of V)."""

    def __init__(self, owner, batch_size: int, max_len: int, latent_dim: int, rope_dim: int, *, dtype, device=None,
                 kv_dtype=None, parts: tuple[int, ...] | None = None, window: int | None = None):
        if parts is None:
            parts = (latent_dim, rope_dim) if rope_dim else (latent_dim,)
        super().__init__(owner, batch_size, max_len, {"kv": (batch_size, max_len, latent_dim + rope_dim)},
                         dtype, device, kv_dtype=kv_dtype, parts={"kv": tuple(parts)}, window=window)
        self.latent_dim, self.rope_dim = latent_dim, rope_dim
