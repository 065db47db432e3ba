"""How a KV cache stores its rows: plain, int8/fp8 with float32 scales, or few-bit codes (modules/lowbit.py).

`check_kv_dtype(kv_dtype)` parses a storage's spelling into a `StorageFormat` (the grammar: the comment above
KV_DTYPES); `quantise` and `dequantise` write and read rows; `round_trip` gives a forward without a cache what a cache
would return; `rotation` says where llama.cpp's Hadamard rotation applies; `QuantisedKV` holds rows as stored.
"""
from __future__ import annotations

import functools
import re
from typing import NamedTuple

import torch
from torch import nn

from . import lowbit
from . import rotation as rotations
from .sink import without_sinks

# Storages (`kv_dtype`; a cache's `dtype` stays the activation dtype it returns):
# - None: plain, in the activation dtype (the default); "fp32", "bf16": plain in that dtype.
# - "int8": code = round_half_even(x / s) clamped to [-127, 127], one float32 scale s = amax / 127 per token and
#   *part* of a row: an MLA row's latent c (r numbers) and rope key k_R (p numbers, rotated, not normalised) have a
#   scale each; a GQA's K and V one per token and KV head (a GQA-tiled MLA's cache is a GQA's KVCache: the same).
#   "fp8": torch.float8_e4m3fn codes of x / s, s = amax / 448, the same scales (refused where torch has no e4m3fn).
#   "int8/g<N>", "fp8/g<N>": one scale per N channels of a part instead of one per part.
# - few-bit ("q4_0", "iq4_nl", "int4/g32", "int3/g64+c4", "tc4x40-3x56+c4", ...): packed codes and float16 meta,
#   modules/lowbit.py (the comment above its SPELLING). With "+c4" an MLA's rope key is kept per channel over groups
#   of 64 tokens, its newest, incomplete group unquantised (modules/key_groups.py); such a cache reads back
#   dequantised rows and refuses fixed_slot.
# - "<quantised>+s<N>" ("int3/g64+c4+s1"): the first N rows of an MLA's latent cache also kept plain and left out of
#   the codes (an attention sink; modules/sink.py); it comes before any "+w<N>" ("int3/g64+c4+s1+w8").
# - "<quantised>+w<N>" ("int3/g64+c4+w16"): the newest N rows of an MLA's latent cache also kept plain; each query
#   reads its newest N rows plain and the older ones as stored (modules/recent.py). Of KIVI or quanto ("kivi4+w128":
#   KIVI's 16-bit residual), a GQA's forward without a cache reads them so.
# - "K,V" of llama.cpp's block formats ("q8_0,q4_0": --cache-type-k q8_0 --cache-type-v q4_0): keys in K, values in V,
#   for a cache that holds them apart (a GQA's; an MLA's one row refuses it). Its StorageFormat is the key's with
#   `value` the value's; `for_role` gives the one a role's rows use.
KV_DTYPES = ("fp32", "bf16", "int8", "fp8", "q8_0", "q5_0", "q4_0", "q4_1", "iq4_nl", "int7", "int6", "int5", "int4",
             "int3", "int2", "tq4", "tq3", "tq2", "tq1", "tqp5", "tqp4", "tqp3", "tqp2", "kivi4", "kivi2", "quanto4",
             "quanto2")
PLAIN = {"fp32": torch.float32, "bf16": torch.bfloat16}
QMAX = {"int8": 127.0, "fp8": 448.0}  # the largest code: int8 symmetric, float8_e4m3fn's largest finite value
SCALE_DTYPE = torch.float32  # 4 bytes a scale, in bytes_per_token (float16 scales go subnormal for amax < 127 * 6e-5)
PAIR_CODES = ("q8_0", "q5_0", "q4_1", "q4_0", "iq4_nl")  # llama.cpp's types a "K,V" pair may name
_SPELLING = re.compile(r"(fp32|bf16)|(int8|fp8)(?:/g([1-9][0-9]*))?")
_RECENT = re.compile(r"(.+)\+w([0-9]+)")  # "<storage>+w<N>": a recent window of N plain rows (modules/recent.py)
_SINK = re.compile(r"(.+)\+s([0-9]+)")  # "<storage>+s<N>": the first N rows plain (modules/sink.py)


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
    value: StorageFormat | None = None  # a K/V pair's value storage (this tuple then describes the key's)
    recent: int | None = None  # "+w<N>": the newest N rows also kept plain (an MLA's latent cache; modules/recent.py)
    sink: int | None = None  # "+s<N>": the first N rows also kept plain (an MLA's latent cache; modules/sink.py)

    def for_role(self, role: str | None) -> StorageFormat:
        """The storage of rows of this role: for a K/V pair the key's ("key") or the value's ("value"); itself for one
        storage of both. ValueError for a pair's rows of no role (an MLA's latent row holds keys and values in one)."""
        if self.value is None:
            return self
        if role == "value":
            return self.value
        if role == "key":
            return self._replace(name=self.name.split(",")[0], value=None)
        raise ValueError(f"kv_dtype {self.name!r} stores keys and values apart (llama.cpp's --cache-type-k and "
                         f"--cache-type-v); rows of role {role!r} hold both (an MLA's latent): use one type, e.g. "
                         f"{self.name.split(',')[0]!r}")

    @property
    def base_name(self) -> str:
        """The spelling without its recent window ("int3/g64+c4" of "int3/g64+c4+w16"): what a cache that cannot
        keep one stores."""
        return self.name[:self.name.rindex("+w")] if self.recent else self.name

    @property
    def quantised(self) -> bool:
        return self.code in QMAX or self.low is not None

    @property
    def evaluation_only(self) -> bool:
        """KIVI and transformers' quanto codes: applied to keys and values of a forward without a cache, never
        stored by a cache."""
        return self.low is not None and self.low.kind in ("kivi", "quanto")

    @property
    def storage_dtype(self) -> torch.dtype:
        if self.low is not None:
            return torch.uint8
        return PLAIN[self.code] if self.code in PLAIN else torch.int8 if self.code == "int8" else torch.float8_e4m3fn


def check_kv_dtype(kv_dtype) -> StorageFormat | None:
    """Parse a kv_dtype: "fp32", "bf16", "int8", "fp8" (or "int8/g<N>", "fp8/g<N>"), the few-bit storages of
    modules/lowbit.py ("q4_0", "iq4_nl", "int4[/g<N>][+r8|+c4|+c3|+c2]" and int2 to int7, "tq4", "kivi2", "quanto4",
    ...), any quantised one with "+s<N>" (the first N rows plain) and/or "+w<N>" after it (the newest N plain), a K/V
    pair of llama.cpp's types ("q8_0,q4_0"), or None (gives None). One-line ValueError or TypeError."""
    if kv_dtype is None:
        return None
    choices = ("'fp32', 'bf16', 'int8', 'fp8' (or 'int8/g<N>', 'fp8/g<N>': one scale per N channels), llama.cpp's "
               "'q8_0', 'q5_0', 'q4_0', 'q4_1', 'iq4_nl', 'int2' to 'int7' (or 'int4/g<N>', ..., and after any "
               "of them '+r8' for an MLA's rope key in 8 bits or '+c4', '+c3', '+c2' for it in 4, 3, 2 bits per "
               "channel), runs of a transform-coded latent as 'tc4x40-3x56+c4', any of the quantised ones with "
               "'+s<N>' (an MLA's first N rows kept plain) and/or '+w<N>' after it (its newest N rows kept plain), "
               "TurboQuant's 'tq1' to 'tq4' (or 'tqp2' to 'tqp5' with its 1-bit residual sketch), 'kivi4', 'kivi2', "
               "'quanto4', "
               "'quanto2', a K/V pair of llama.cpp's types such as 'q8_0,q4_0', or None")
    if not isinstance(kv_dtype, str):
        raise TypeError(f"kv_dtype must be one of {choices}, got {type(kv_dtype).__name__} ({kv_dtype!r})")
    if "," in kv_dtype:
        return _pair(kv_dtype)
    windowed = _RECENT.fullmatch(kv_dtype)
    if windowed is not None:
        return _with_recent(kv_dtype, windowed.group(1), int(windowed.group(2)))
    sunk = _SINK.fullmatch(kv_dtype)
    if sunk is not None:
        return _with_sink(kv_dtype, sunk.group(1), int(sunk.group(2)))
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


def each_layer(kv_dtype, layers: int) -> list:
    """kv_dtype for each of `layers` attention layers: a list as it is (ValueError naming both lengths unless it has
    one a layer), or the one storage repeated."""
    if not isinstance(kv_dtype, (list, tuple)):
        return [kv_dtype] * layers
    if len(kv_dtype) != layers:
        raise ValueError(f"a storage per layer needs {layers} storages, one an attention layer, got {len(kv_dtype)}")
    return list(kv_dtype)


def _pair(kv_dtype: str) -> StorageFormat:
    """A K/V pair "K,V" of two different llama.cpp block formats (PAIR_CODES); one-line errors naming them."""
    names = kv_dtype.split(",")
    if len(names) != 2 or any(n not in PAIR_CODES for n in names):
        raise ValueError(f"a K/V pair kv_dtype is 'K,V' with K and V each one of llama.cpp's {', '.join(PAIR_CODES)} "
                         f"(as --cache-type-k K --cache-type-v V), got {kv_dtype!r}")
    if names[0] == names[1]:
        raise ValueError(f"kv_dtype {kv_dtype!r} names one type twice: use {names[0]!r}")
    key, value = (check_kv_dtype(n) for n in names)
    return key._replace(name=kv_dtype, value=value)


def _with_recent(kv_dtype: str, base: str, size: int) -> StorageFormat:
    """"<base>+w<N>": base's storage with the newest N rows kept plain as well; one-line errors naming what is
    refused (a plain base, a K/V pair, N < 1)."""
    fmt = check_kv_dtype(base)
    if size < 1 or fmt is not None and fmt.recent:
        raise ValueError(f"kv_dtype {kv_dtype!r}: a recent window is one '+w<N>' with N >= 1, got {kv_dtype!r}")
    if fmt is None or not fmt.quantised or fmt.value is not None:
        raise ValueError(f"kv_dtype {kv_dtype!r}: a recent window (+w{size}) keeps the newest rows of a quantised "
                         f"cache plain; {base!r} is not one attnlab's caches quantise (use int8, int4/g32+r8, "
                         "int3/g64+c4, ...)")
    return fmt._replace(name=kv_dtype, recent=size)


def _with_sink(kv_dtype: str, base: str, size: int) -> StorageFormat:
    """"<base>+s<N>": base's storage with the first N rows kept plain as well (before any "+w<N>":
    "int3/g64+c4+s1+w8"); one-line errors naming what is refused (a plain, evaluation-only or windowed base, a K/V
    pair, N outside 1..63)."""
    fmt = check_kv_dtype(base)
    if not 1 <= size < lowbit.KEY_TOKENS or fmt is not None and (fmt.sink or fmt.recent):
        raise ValueError(f"kv_dtype {kv_dtype!r}: the first rows kept plain are one '+s<N>' with 1 <= N < "
                         f"{lowbit.KEY_TOKENS}, before any '+w<N>' (as in 'int3/g64+c4+s1+w8')")
    if fmt is None or not fmt.quantised or fmt.evaluation_only or fmt.value is not None:
        raise ValueError(f"kv_dtype {kv_dtype!r}: '+s{size}' keeps the first rows of a quantised cache plain; "
                         f"{base!r} is not one attnlab's caches quantise (use int8, int4/g32+r8, int3/g64+c4, ...)")
    return fmt._replace(name=kv_dtype, sink=size)


# -- llama.cpp's rotation -------------------------------------------------------------------------
# llama.cpp's block formats (q8_0, q5_0, q4_1, q4_0, iq4_nl) of a GQA's keys and values are Hadamard-rotated as
# llama.cpp rotates a quantised cache (rotation.rotation_size): the rows stored are H x, the rows read back
# H^T Q(H x), what llama.cpp's attention computes with its rotated query and its output rotated back. An MLA's latent
# rows (role None) are never rotated, as llama.cpp's deepseek2 does not; nor are attnlab's own storages and KIVI.
# round_trip reads LLAMA_ATTN_ROT_DISABLE on each call, a cache once when it is made (as llama.cpp makes its context).
def rotation(fmt: StorageFormat | None, role: str | None, parts: tuple[int, ...]) -> int | None:
    """The Hadamard size the rows (..., W) of this storage are rotated with, None for none: llama.cpp's block
    formats of a GQA's heads, role "key" or "value" and parts the heads of a row (one part, or several of one
    size), by rotation.rotation_size; never for role None (an MLA's latent rows), plain, int8/fp8, attnlab's
    few-bit groups or KIVI. ValueError naming the role or the parts otherwise."""
    if fmt is None or fmt.low is None or fmt.low.kind != "block" or role is None:
        return None
    if role not in ("key", "value"):
        raise ValueError(f"role must be 'key', 'value' or None (an MLA's latent rows), got {role!r}")
    if not parts or len(set(parts)) != 1:
        raise ValueError(f"llama.cpp rotates a GQA's {role} heads of one size; parts {tuple(parts)} are not heads of "
                         "one size (an MLA's rows take role None)")
    return rotations.rotation_size(parts[0], role)


def _rotated(x: torch.Tensor, n: int | None) -> torch.Tensor:
    """x times H_n block by block (rotation.hadamard_transform) in float32 (float64 for float64); x when n is None."""
    return x if n is None else rotations.hadamard_transform(x.to(torch.promote_types(x.dtype, SCALE_DTYPE)), n)


# -- quantisation --------------------------------------------------------------------------------
# Tokens are quantised once, when written (a cache's `extend`), and read back dequantised to the activation dtype,
# code * s computed in float32 (float64 for float64 activations), each part times its scale by broadcasting. Readers
# that can (`QuantisedKV.foldable`) skip that copy: the GQA and the absorbed MLA decode take the codes and multiply
# the scores and the softmax weights by the scales (`attend(key_scale=, value_scale=)`). round_trip applies the same
# codes to a forward without a cache; a gradient passes straight through them (the identity's).
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


def quantise(x: torch.Tensor, parts: tuple[int, ...], fmt: StorageFormat,
             rotation: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., W) -> codes (..., W) in fmt's storage dtype and float32 scales (..., n) (the comment above KV_DTYPES).
    Few-bit formats: packed uint8 codes and float16 scales (and minima), modules/lowbit.py. rotation: the codes
    are those of x rotated by H_n, n = rotation (see rotation(); dequantise with the same n rotates back)."""
    x = _rotated(x, rotation)
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
               dtype: torch.dtype, low: lowbit.LowBit | None = None, rotation: int | None = None) -> torch.Tensor:
    """codes (..., W), scales (..., n) -> (codes * scale) (..., W) in `dtype`, multiplied in float32
    (float64 for float64); few-bit formats (low) through lowbit.decode; rotation: the rows rotated back by
    H_n (H_n^T = H_n), n = rotation, before the cast to dtype."""
    if rotation is not None:
        work = torch.promote_types(dtype, SCALE_DTYPE)
        out = _rotated(dequantise(codes, scales, parts, group, work, low), rotation)
        return out if work == dtype else out.to(dtype)
    if low is not None:
        return lowbit.decode(codes, scales, parts, low, dtype)
    work = torch.promote_types(dtype, SCALE_DTYPE)
    out = _each_scale(codes.to(work), scales.to(work), parts, group, torch.Tensor.mul_)  # (..., W)
    return out if work == dtype else out.to(dtype)


def round_trip(x: torch.Tensor, kv_dtype, parts: tuple[int, ...], role: str | None = None) -> torch.Tensor:
    """x as a cache with this kv_dtype (a spelling or a StorageFormat) returns it: quantised then
    dequantised, or rounded to a plain storage dtype. role ("key", "value"): what x (..., S, W) holds,
    for KIVI, which quantises keys along the tokens (lowbit.kivi_round_trip), and for llama.cpp's block
    formats, which a GQA's cache rotates (rotation(): H^T Q(H x) block by block; role None, an MLA's rows:
    Q(x))."""
    fmt = kv_dtype if isinstance(kv_dtype, StorageFormat) else check_kv_dtype(kv_dtype)
    if fmt is None:
        return x
    fmt = fmt.for_role(role)
    if fmt.sink:  # the first rows plain, left out of the codes (modules/sink.py)
        if x.shape[-2] <= fmt.sink:
            return x
        rest = round_trip(without_sinks(x, fmt.sink), fmt._replace(sink=None), parts, role)
        return torch.cat([x[..., :fmt.sink, :], rest[..., fmt.sink:, :]], dim=-2)
    if fmt.evaluation_only:
        engine = lowbit.kivi_round_trip if fmt.low.kind == "kivi" else lowbit.quanto_round_trip
        stored = engine(x.detach(), fmt.low, role)
    elif not fmt.quantised:
        stored = x.to(fmt.storage_dtype).to(x.dtype)
    elif fmt.low is not None:
        n = rotation(fmt, role, parts)
        stored = _rotated(lowbit.round_trip(_rotated(x.detach(), n), parts, fmt.low), n).to(x.dtype)
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
    rotation: int | None = None  # llama.cpp's rotation: the codes are of H_n x, n = rotation (read back rotated)

    @property
    def shape(self) -> torch.Size:
        """(..., S, W): the rows' shape as read back (a packed row is narrower in storage)."""
        return (*self.data.shape[:-1], sum(self.parts)) if self.low is not None else self.data.shape

    @property
    def foldable(self) -> bool:
        """Whether a reader may take the codes in the activation dtype and apply the scales per row of
        each part (one scale per part, a float32/float64 activation dtype: the same products in the same
        precision as dequantise(), in another order)."""
        return (self.low is None and self.rotation is None and num_scales(self.parts, self.group) == len(self.parts)
                and self.dtype in (torch.float32, torch.float64))

    def codes(self) -> torch.Tensor:
        """The codes in the activation dtype (exact: int8 and e4m3 codes are representable), (..., S, W)."""
        return self.data.to(self.dtype)

    def dequantise(self) -> torch.Tensor:
        return dequantise(self.data, self.scales, self.parts, self.group, self.dtype, self.low,
                          self.rotation)  # (..., S, W)


def dense(kv, room: int = 0):
    """A tensor as it is; QuantisedKV rows dequantised. room > 0: a new tensor (..., S + room, W) whose first S rows
    are those, the rest 0, for a reader to write rows after them without joining copies (hf/attention.py)."""
    if not room:
        return kv.dequantise() if isinstance(kv, QuantisedKV) else kv
    *lead, S, W = kv.shape
    device = kv.data.device if isinstance(kv, QuantisedKV) else kv.device
    out = torch.empty(*lead, S + room, W, dtype=kv.dtype, device=device)
    out[..., S:, :] = 0
    if isinstance(kv, QuantisedKV) and kv.low is not None and kv.rotation is None:
        lowbit.decode(kv.data, kv.scales, kv.parts, kv.low, kv.dtype, out=out[..., :S, :])
    else:
        out[..., :S, :] = dense(kv)
    return out


def rotated_frame(kv) -> tuple:
    """(rows, n): QuantisedKV rows rotated by llama.cpp's H_n, as read in that frame (not rotated back), and n;
    anything else as it is and None. A reader that turns its query and output by H_n gets dense(kv)'s attention."""
    if isinstance(kv, QuantisedKV) and kv.rotation is not None:
        return kv._replace(rotation=None), kv.rotation
    return kv, None


def with_row_scale(kv) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(rows, per-row factor (..., S) or None) whose product is dense(kv): the codes and their scale for
    one-part QuantisedKV rows a reader can fold (QuantisedKV.foldable), else dense(kv) and None."""
    if isinstance(kv, QuantisedKV) and kv.foldable and len(kv.parts) == 1:
        return kv.codes(), kv.scales[..., 0].to(kv.dtype)
    return dense(kv), None
