"""Few-bit cache storages packed into bytes: llama.cpp's block formats, attnlab's asymmetric groups, KIVI, quanto.

`parse(spelling)` gives a storage's `LowBit`; `encode` and `decode` write and read rows of b-bit codes packed into
uint8 (`pack`) with a float16 scale (and minimum) per group, so a cache's tensors are the bytes it costs. Spellings
and byte layouts: the comments beside SPELLING, BLOCK_FORMATS, CLIP_RATIOS, KEY_TOKENS, KIVI_FORMATS, QUANTO_FORMATS.
"""
from __future__ import annotations

import re
from typing import NamedTuple

import torch

from . import turbo

META_DTYPE = torch.float16
BLOCK = 32  # llama.cpp's block, KIVI's group
# attnlab's own groups ("int<b>/g<N>", 2 to 7 bits, N = 32 when not given): asymmetric round-to-nearest over groups of
# N channels of each part of a row (a part's last group may be short). For a range [lo, hi]: m = float16(lo),
# d = float16((hi - m) / (2^b - 1)), code = clamp(round((x - m) / d), 0, 2^b - 1); x = code * d + m. The range is the
# group's [min, max] shrunk about its middle by the first of CLIP_RATIOS whose read-back has the least squared error
# over the group (in float32), so that one outlier does not spend the few levels on the gap between it and the rest.
# The codes use the stored m and d (a value outside the range reads back as its end); the bytes are min-max's.
CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6)  # the ranges tried, largest first (a tie keeps the
# larger); below 0.6 measured no better (the 12.5% plan: the same 2.15x) and worse for 2-bit keys (1.83x -> 1.88x)
# An MLA's rope key per channel ("+c4", e.g. "int3/g64+c4"; KIVI's layout for keys): the latent per token as above,
# the rope key k_R in b asymmetric bits per channel over groups of KEY_TOKENS tokens (a RoPE'd key's outlier channels
# keep their size from token to token). A cache keeps the newest, incomplete group in its activation dtype and codes
# it when its last token arrives (modules/cache.py); bytes per token count the steady state: the codes and
# 1/KEY_TOKENS of each channel's scale and minimum.
KEY_TOKENS = 64  # tokens per group of a rope key stored per channel ("+c4"): with 3-bit values it keeps every value
# of SmolLM2 in 25% of the bytes (groups of 32 would not fit); groups of 128 measured worse (1.090x against 1.073x)


class LowBit(NamedTuple):
    """A few-bit storage: its code, bits per value, channels per group, whether it stores a minimum, the kind
    ("block": llama.cpp's arithmetic, "asym": attnlab's groups, "kivi": the KIVI baseline, "channel": per
    channel over groups of `group` tokens), and for an MLA row the bits of its rope key where they differ from
    the latent's ("+r8": 8, per token) or its layout ("+c4": 4 bits per channel, rope_channel True; "+c2",
    "+c3" likewise), and whether a group's range is searched (attnlab's own groups: CLIP_RATIOS)."""
    code: str
    bits: int
    group: int
    zero: bool
    kind: str
    rope_bits: int | None = None
    rope_channel: bool = False
    search: bool = False
    segments: tuple[tuple[int, int], ...] = ()  # transform coding: (bits, channels) runs of the latent, in order

    @property
    def meta_per_group(self) -> int:
        return 2 if self.zero else 1


# llama.cpp's block formats (groups of 32 channels; a row must be whole blocks), as its reference quantisers write
# them (ggml-quants.c, quantize_row_*_ref), bytes per 32 values in brackets. The codes are computed with the float32
# d; the stored d (and min) are float16, what llama.cpp reads back. Its rotation of a quantised cache: rotation.py.
# - q8_0 [34]: d = amax / 127, code = round(x / d) (half away from zero); x = code * d.
# - q4_0 [18]: m = the value of largest magnitude (first on ties), d = m / -8, code = min(15, trunc(x / d + 8.5));
#   x = (code - 8) * d.
# - q5_0 [22]: as q4_0 with d = m / -16, code = min(31, trunc(x / d + 16.5)); x = (code - 16) * d.
# - q4_1 [20]: d = (max - min) / 15, code = min(15, trunc((x - min) / d + 0.5)); x = code * d + min.
# - iq4_nl [18]: non-linear, x = d * IQ4_NL_VALUES[code] (16 levels from -127 to 113); _iq4_nl_codes.
BLOCK_FORMATS = {"q8_0": LowBit("q8_0", 8, BLOCK, False, "block"), "q5_0": LowBit("q5_0", 5, BLOCK, False, "block"),
                 "q4_0": LowBit("q4_0", 4, BLOCK, False, "block"), "q4_1": LowBit("q4_1", 4, BLOCK, True, "block"),
                 "iq4_nl": LowBit("iq4_nl", 4, BLOCK, False, "block")}
# KIVI ("kivi4", "kivi2"; Liu et al. 2024): asymmetric b-bit codes, a float16 scale and zero per group of 32 over its
# [min, max] (no range search); keys per channel over groups of 32 tokens, values per token over 32 channels. KIVI
# keeps the newest, incomplete group of keys in 16 bits; attnlab applies it as an evaluation baseline of a GQA cache
# (a forward without a cache: whole groups of tokens coded, a trailing partial group kept as it is) and counts the
# steady state, (b + 1) bits a value.
KIVI_FORMATS = {"kivi4": LowBit("kivi4", 4, BLOCK, True, "kivi"), "kivi2": LowBit("kivi2", 2, BLOCK, True, "kivi")}
# transformers' QuantizedCache, quanto backend ("quanto4", "quanto2"; optimum-quanto's MaxOptimizer and
# quantize_weight as QuantoQuantizedLayer calls them: axis 0, q_group_size 64): keys and values alike, the (B, H, S, D)
# tensor read in order as groups of 64 consecutive values, min-max with no range search, in the tensor's own dtype:
# scale = (max - min) / (2^b - 1), code = clamp(round((x - min) / scale), 0, 2^b - 1), x = scale * code + min.
# transformers keeps the newest tokens (up to residual_length, 128) and a prefill's own attention unquantised; attnlab
# codes every key and value of a forward without a cache and counts the steady state: b bits a value and a 16-bit
# scale and minimum per group (transformers stores them in the model's dtype). A storage to heal for and to score.
# tests/test_transformers_cache.py compares it with optimum-quanto's own.
QUANTO_GROUP = 64  # transformers' QuantizedCache default q_group_size
QUANTO_FORMATS = {"quanto4": LowBit("quanto4", 4, QUANTO_GROUP, True, "quanto"),
                  "quanto2": LowBit("quanto2", 2, QUANTO_GROUP, True, "quanto")}
ENGINE_FORMATS = {**KIVI_FORMATS, **QUANTO_FORMATS}  # applied in a forward without a cache; attnlab's caches refuse them
# Spellings (parse): llama.cpp's "q8_0", "q5_0", "q4_0", "q4_1", "iq4_nl"; attnlab's "int<b>[/g<N>]" (b in 2..7, N
# channels a group, 32 when not given); an MLA row's rope key by a suffix, "+r8" (8 bits per token) or "+c<b>" (b in
# 2..4, per channel over KEY_TOKENS tokens); "kivi4", "kivi2", "quanto4", "quanto2" (ENGINE_FORMATS); TurboQuant's
# "tq1".."tq4" and "tqp2".."tqp5" (modules/turbo.py); transform coding "tc<b>x<n>[-<b>x<n>...][/g<N>][+r8|+c<b>]"
# (TC_SPELLING).
SPELLING = re.compile(r"(q8_0|q5_0|q4_0|q4_1|iq4_nl|kivi4|kivi2|quanto4|quanto2)"
                      r"|int([2-7])(?:/g([1-9][0-9]*))?(?:\+(r8|c[234]))?")
# TurboQuant's codes (modules/turbo.py): "tq<b>", b bits a value and a norm a head; "tqp<b>", b - 1 of them and the
# residual's 1-bit sketch, and two norms a head
TQ_SPELLING = re.compile(r"tq([1-4])|tqp([2-5])")
# Transform coding of an MLA's latent ("tc4x40-3x56-2x16+c4"): runs of the latent's channels in their own bits (here
# 40 in 4, 56 in 3, 16 in 2), each stored as attnlab's groups of that many bits (N = 32 within a run, /g<N> to change
# it), the runs' codes packed one after another; the rope key by its suffix (required for a row with one). The runs
# are the latent's components by decreasing variance; the storage reads only the widths and bits (pieces()).
TC_SPELLING = re.compile(r"tc([2-8]x[1-9][0-9]*(?:-[2-8]x[1-9][0-9]*)*)(?:/g([1-9][0-9]*))?(?:\+(r8|c[234]))?")
IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # ggml's kvalues_iq4nl
IQ4_NL_TINY = 1e-15  # GROUP_MAX_EPS: a block whose largest magnitude is below it stores d = 0


def parse(spelling: str) -> LowBit | None:
    """The LowBit of a spelling ("q4_0", "int4", "int2/g64", "int4/g32+r8", "int3/g64+c4", "kivi2",
    "tc4x40-3x56+c4", ...), None for any other."""
    tq = TQ_SPELLING.fullmatch(spelling)
    if tq is not None:  # its group is the part: one norm (two with the sketch) per head (pieces)
        sketched = tq.group(2) is not None
        return LowBit(spelling, int(tq.group(1) or tq.group(2)), 0, sketched, "qjl" if sketched else "lloyd")
    coded = TC_SPELLING.fullmatch(spelling)
    if coded is not None:
        runs = tuple((int(b), int(n)) for b, n in (run.split("x") for run in coded.group(1).split("-")))
        rope = coded.group(3)
        return LowBit(f"tc{coded.group(1)}", max(b for b, _ in runs), int(coded.group(2) or BLOCK), True, "asym",
                      int(rope[1:]) if rope else None, bool(rope) and rope[0] == "c", True, runs)
    found = SPELLING.fullmatch(spelling)
    if found is None:
        return None
    if found.group(1):
        return BLOCK_FORMATS.get(found.group(1)) or ENGINE_FORMATS[found.group(1)]
    bits = int(found.group(2))
    rope = found.group(4)
    return LowBit(f"int{bits}", bits, int(found.group(3)) if found.group(3) else BLOCK, True, "asym",
                  int(rope[1:]) if rope else None, bool(rope) and rope[0] == "c", True)


def pieces(parts: tuple[int, ...], fmt: LowBit) -> list[tuple[int, LowBit]]:
    """(width, storage) of each piece of a row, in order: its parts (part_formats), a transform-coded latent cut into
    its runs, each asymmetric groups of its own bits. ValueError naming the widths where the runs do not make up the
    latent, or a transform-coded row with a rope key and no storage for it."""
    out = []
    for i, (w, f) in enumerate(zip(parts, part_formats(parts, fmt))):
        if f.kind in ("lloyd", "qjl"):
            if w & (w - 1):
                raise ValueError(f"{f.code} rotates each head by a Hadamard transform of its size; parts of widths "
                                 f"{parts} are not all powers of two")
            out.append((w, f._replace(group=w)))
            continue
        if not f.segments:
            out.append((w, f))
            continue
        if i:
            raise ValueError(f"{f.code} codes an MLA's latent (the first part); rows of parts {parts} have a rope key "
                             f"too: add its storage, {f.code}+r8 (8 bits per token) or {f.code}+c4 (4 bits per channel)")
        total = sum(n for _, n in f.segments)
        if total != w:
            raise ValueError(f"{f.code} codes {total} latent channels ({' + '.join(str(n) for _, n in f.segments)}); "
                             f"this row's latent has {w}")
        out.extend((n, f._replace(code=f"int{b}", bits=b, segments=())) for b, n in f.segments)
    return out


def part_formats(parts: tuple[int, ...], fmt: LowBit) -> list[LowBit]:
    """The storage of each part of a row: fmt for every part, or with rope_bits fmt for an MLA's latent and
    one asymmetric group of rope_bits for its rope key (the second and last part)."""
    if fmt.rope_bits is None:
        return [fmt] * len(parts)
    suffix = f"+{'c' if fmt.rope_channel else 'r'}{fmt.rope_bits}"
    if len(parts) != 2:
        raise ValueError(f"'{suffix}' stores an MLA's rope key in {fmt.rope_bits} bits; rows of parts "
                         f"{parts} have no rope key (use {fmt.code}/g{fmt.group})")
    if fmt.rope_channel:
        return [fmt, LowBit(f"int{fmt.rope_bits}", fmt.rope_bits, KEY_TOKENS, True, "channel", search=fmt.search)]
    return [fmt, LowBit(f"int{fmt.rope_bits}", fmt.rope_bits, parts[1], True, "asym", search=fmt.search)]


# -- packing ------------------------------------------------------------------------------------------
# Codes of b in (1, 2, 4, 8) bits sit 8/b to a byte, the first in the low bits. A code of other b is cut into b's
# binary digits, low bits first (chunks()), each chunk packed so: 5-bit codes are their low 4 bits packed as 4-bit
# codes, then their fifth bits 8 to a byte (5/8 of a byte a value, as llama.cpp's q5_0); 3-bit codes 2 + 1, 6-bit
# 4 + 2, 7-bit 4 + 2 + 1. A row whose width is not a multiple of 8 is padded with zero codes, so b-bit codes take
# exactly b/8 bytes a value.
def packed_width(width: int, bits: int) -> int:
    """Bytes of one packed row of `width` b-bit codes."""
    return -(-width // 8) * bits


def _pack_plain(codes: torch.Tensor, bits: int) -> torch.Tensor:
    per = 8 // bits
    c = codes.unflatten(-1, (-1, per)).to(torch.int32)  # (..., W/per, per)
    shifts = torch.arange(per, device=codes.device, dtype=torch.int32) * bits
    return (c << shifts).sum(-1).to(torch.uint8)  # (..., W/per)


def _unpack_plain(packed: torch.Tensor, bits: int) -> torch.Tensor:
    mask = (1 << bits) - 1  # a shift by a number, not by a tensor of shifts: about twice as fast on a CPU
    return torch.stack([(packed >> s) & mask for s in range(0, 8, bits)], -1).flatten(-2)  # (..., W)


def chunks(bits: int) -> tuple[int, ...]:
    """The widths a b-bit code is packed in, low bits first: b's binary digits from the largest (5 -> 4, 1;
    6 -> 4, 2; 7 -> 4, 2, 1; 3 -> 2, 1; 1, 2, 4, 8 -> themselves)."""
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"codes of {bits!r} bits have no packing here (1 to 8)")
    return tuple(w for w in (8, 4, 2, 1) if bits & w)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes (..., W) of values below 2^bits -> (..., packed_width(W, bits)) uint8: each chunk of bits (chunks())
    packed as codes of its width, the lowest first (the comment at "packing")."""
    widths = chunks(bits)
    W = codes.shape[-1]
    pad = -W % 8
    if bits == 8 and not pad:  # a byte a code: nothing to pack
        return codes.to(torch.uint8)
    if pad:
        codes = torch.cat([codes, codes.new_zeros(*codes.shape[:-1], pad)], -1)
    out, shift = [], 0
    for w in widths:
        out.append(_pack_plain((codes >> shift) & ((1 << w) - 1), w))
        shift += w
    return out[0] if len(out) == 1 else torch.cat(out, -1)


def unpack(packed: torch.Tensor, bits: int, width: int) -> torch.Tensor:
    """(..., packed_width(width, bits)) uint8 -> the codes (..., width) as uint8 (for 8 bits a view of packed:
    read it, do not write it)."""
    if bits == 8:
        return packed[..., :width]
    per_bit = packed.shape[-1] // bits  # bytes each bit of the codes takes: W / 8 (W padded to a multiple of 8)
    codes, start, shift = None, 0, 0
    for w in chunks(bits):  # a chunk's bytes made contiguous first: shifts over a strided slice take twice as long
        part = _unpack_plain(packed[..., start:start + per_bit * w].contiguous(), w) << shift
        codes = part if codes is None else codes | part
        start += per_bit * w
        shift += w
    return codes[..., :width]


# -- groups ---------------------------------------------------------------------------------------------
def _groups(w: int, fmt: LowBit) -> int:
    return -(-w // fmt.group)


def num_groups(parts: tuple[int, ...], fmt: LowBit) -> int:
    """Groups of channels per row: ceil(width / group) for each part stored per token."""
    return sum(_groups(w, f) for w, f in pieces(parts, fmt) if f.kind != "channel")


def packed_row(parts: tuple[int, ...], fmt: LowBit) -> int:
    """Bytes of a row's packed codes (each part packed on its own)."""
    return sum(packed_width(w, f.bits) for w, f in pieces(parts, fmt))


def meta_row(parts: tuple[int, ...], fmt: LowBit) -> int:
    """float16 numbers of a row's own meta: a scale (and a minimum) per group of channels (a part stored per
    channel keeps its meta per group of tokens instead: channel_meta)."""
    return sum(_groups(w, f) * f.meta_per_group for w, f in pieces(parts, fmt) if f.kind != "channel")


def channel_meta(parts: tuple[int, ...], fmt: LowBit) -> int:
    """float16 numbers of meta per group of KEY_TOKENS tokens: a scale and a minimum per channel of a part
    stored per channel (0 for every other storage)."""
    return sum(w * f.meta_per_group for w, f in pieces(parts, fmt) if f.kind == "channel")


def row_bytes(parts: tuple[int, ...], fmt: LowBit) -> int:
    """Bytes one stored row costs in the steady state: packed codes, float16 meta, and a row's share of the
    meta per group of tokens (rounded up to a byte)."""
    return packed_row(parts, fmt) + 2 * meta_row(parts, fmt) + -(-2 * channel_meta(parts, fmt) // KEY_TOKENS)


def check_parts(parts: tuple[int, ...], fmt: LowBit) -> None:
    """llama.cpp's block formats take rows that are whole blocks, '+r8' an MLA row; ValueError naming the widths."""
    if fmt.kind == "block" and any(w % BLOCK for w in parts):
        raise ValueError(f"{fmt.code} stores rows in blocks of {BLOCK} values; parts of widths {parts} are not all "
                         f"multiples of {BLOCK} (llama.cpp refuses such rows too): use int4/g<N> or int8")
    pieces(parts, fmt)


def _grouped(part: torch.Tensor, g: int) -> torch.Tensor:
    """part (..., w) -> (..., n, g), a short last group padded with the part's last value (which changes
    neither its min, its max nor its largest magnitude)."""
    pad = -part.shape[-1] % g
    if pad:
        part = torch.cat([part, part[..., -1:].expand(*part.shape[:-1], pad)], -1)
    return part.unflatten(-1, (-1, g))


def _round_half_away(t: torch.Tensor) -> torch.Tensor:
    return torch.sign(t) * torch.floor(t.abs() + 0.5)


def _codes_and_meta(xg: torch.Tensor, fmt: LowBit, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Groups xg (..., n, g) float32 -> integer codes (..., n, g) uint8 and meta (..., n, k) float16; `width`, the
    part's channels before _grouped padded its last group (the padding counts in no group's error)."""
    top = (1 << fmt.bits) - 1
    if fmt.kind == "lloyd":
        return turbo.encode(xg, fmt.bits)
    if fmt.kind == "qjl":
        return turbo.encode_sketched(xg, fmt.bits)
    if fmt.code == "iq4_nl":
        return _iq4_nl_codes(xg)
    if fmt.kind == "block" and not fmt.zero:
        if fmt.code == "q8_0":
            d = xg.abs().amax(-1, keepdim=True) / 127  # (..., n, 1)
            inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
            codes = (_round_half_away(xg * inv) + 128).to(torch.uint8)  # stored offset by 128
        else:
            half = 1 << (fmt.bits - 1)  # 8 for q4_0, 16 for q5_0
            imax = xg.abs().argmax(-1, keepdim=True)  # the first of the largest magnitudes
            d = torch.take_along_dim(xg, imax, -1) / -half  # (..., n, 1)
            inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
            codes = torch.trunc(xg.double() * inv.double() + (half + 0.5)).clamp(0, top).to(torch.uint8)
        return codes, d.to(META_DTYPE)
    lo, hi = xg.amin(-1, keepdim=True), xg.amax(-1, keepdim=True)  # (..., n, 1)
    if fmt.kind == "block":  # q4_1
        d = (hi - lo) / top
        inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
        codes = torch.trunc((xg - lo) * inv + 0.5).clamp(0, top).to(torch.uint8)
        return codes, torch.cat([d, lo], -1).to(META_DTYPE)
    m, d = _range_meta(lo, hi, top)
    if fmt.search:  # the range of least squared error, err = d^2 sum (code - t)^2 with t = (x - m) / d
        real = None  # (n, g): 0 on the padding of a short last group
        if width is not None and width % xg.shape[-1]:
            real = torch.ones(xg.shape[-2:], dtype=xg.dtype, device=xg.device)
            real[-1, width % xg.shape[-1]:] = 0
        search = _search_at_once if xg.numel() <= AT_ONCE else _search_in_turn
        m, d = search(xg, lo, hi, m, d, top, real)
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    codes = torch.round((xg - m) * inv).clamp(0, top).to(torch.uint8)
    return codes, torch.cat([d, m], -1).to(META_DTYPE)


AT_ONCE = 1 << 15  # values up to which the clip search tries every ratio in one pass (a decode step's rows)


def _clip_error(xg, lo, hi, mid, ratio, top: int, real):
    """(m, d, err) of the range clipped to `ratio` (a float, or a tensor of them on a leading axis): err, the
    squared error of the codes, d^2 sum (code - t)^2 with t = (x - m) / d, over each group's real values."""
    mm, dd = _range_meta(mid + (lo - mid) * ratio, mid + (hi - mid) * ratio, top)
    t = (xg - mm).mul_(torch.where(dd == 0, torch.zeros_like(dd), 1 / dd))
    miss = t.round().clamp_(0, top).sub_(t).square_()  # in place: this search is most of a few-bit write
    return mm, dd, (miss if real is None else miss.mul_(real)).sum(-1, keepdim=True).mul_(dd.square())


def _search_in_turn(xg, lo, hi, m, d, top: int, real):
    """The clip search one ratio after another: a ratio is taken where its error is below every larger one's (a tie
    keeps the larger range); the first ratio's error is compared with but its range is (lo, hi)'s own (m, d)."""
    mid, err = (lo + hi) / 2, None
    for ratio in CLIP_RATIOS:
        mm, dd, e = _clip_error(xg, lo, hi, mid, ratio, top, real)
        if err is None:
            err = e
            continue
        better = e < err
        m, d, err = torch.where(better, mm, m), torch.where(better, dd, d), torch.where(better, e, err)
    return m, d


def _search_at_once(xg, lo, hi, m, d, top: int, real):
    """_search_in_turn's choice with every ratio on a leading axis: the first ratio of least error (argmin's first
    index), for a few rows, where the per-operation cost of the loop outweighs its arithmetic."""
    ratios = torch.tensor(CLIP_RATIOS, dtype=xg.dtype, device=xg.device).view(-1, *([1] * lo.dim()))
    mm, dd, e = _clip_error(xg, lo, hi, (lo + hi) / 2, ratios, top, real)  # (R, ..., n, 1) each
    best = e.argmin(0, keepdim=True)  # the first of the least: the larger range on a tie
    keep = best[0] == 0  # the first ratio stands for (lo, hi) themselves
    return (torch.where(keep, m, mm.gather(0, best)[0]), torch.where(keep, d, dd.gather(0, best)[0]))


def _iq4_nl_codes(xg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks xg (..., n, 32) float32 -> codes (..., n, 32) uint8 (indices into IQ4_NL_VALUES) and d (..., n, 1)
    float16 as ggml's quantize_row_iq4_nl_ref (a CPU cache's from_float) writes them, in float32: m the value of
    largest magnitude (first on ties), d0 = m / -127, code the level nearest x / d0 (the upper on a tie), then
    d = sum(x^2 q x) / sum(x^2 q^2), q the codes' levels, summed in the block's order; no search over other scales
    (quantize_iq4_nl's, ntry = 7, for weights). A block whose largest magnitude is below IQ4_NL_TINY stores d = 0."""
    levels = torch.tensor(IQ4_NL_VALUES, dtype=torch.float32, device=xg.device)
    imax = xg.abs().argmax(-1, keepdim=True)  # the first of the largest magnitudes
    m = torch.take_along_dim(xg, imax, -1)  # (..., n, 1)
    tiny = m.abs() < IQ4_NL_TINY
    inv = torch.where(tiny, torch.zeros_like(m), 1 / (m / IQ4_NL_VALUES[0]))  # 1 / d0, d0 = m / -127
    t = xg * inv  # (..., n, 32)
    upper = torch.searchsorted(levels, t.contiguous(), right=True).clamp_(1, len(IQ4_NL_VALUES) - 1)
    below, above = levels[upper - 1], levels[upper]
    codes = torch.where(t - below < above - t, upper - 1, upper)  # best_index_int8: the upper level on a tie
    q = levels[codes]
    wq = xg * xg * q  # the weight x^2 times the level, as ggml multiplies them: (w * q) * x, (w * q) * q
    sum_qx, sum_q2 = wq * xg, wq * q
    sqx, sq2 = sum_qx[..., 0], sum_q2[..., 0]
    for j in range(1, xg.shape[-1]):  # ggml's order of the float32 sums, one value after another
        sqx, sq2 = sqx + sum_qx[..., j], sq2 + sum_q2[..., j]
    d = torch.where(sq2 > 0, sqx / torch.where(sq2 > 0, sq2, torch.ones_like(sq2)), torch.zeros_like(sq2))[..., None]
    d = torch.where(tiny, torch.zeros_like(d), d)
    return codes.to(torch.uint8), d.to(META_DTYPE)


def _range_meta(lo: torch.Tensor, hi: torch.Tensor, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """m and d of the range [lo, hi] as stored (float16 values, in float32)."""
    m = lo.to(META_DTYPE).float()
    return m, ((hi - m) / top).to(META_DTYPE).float()


def _values(codes: torch.Tensor, meta: torch.Tensor, fmt: LowBit, work: torch.dtype) -> torch.Tensor:
    """codes (..., n, g) and meta (..., n, k) -> values (..., n, g) in `work`."""
    if fmt.kind == "lloyd":
        return turbo.decode(codes, meta, fmt.bits, work)
    if fmt.kind == "qjl":
        return turbo.decode_sketched(codes, meta, fmt.bits, work)
    if fmt.code == "iq4_nl":
        return torch.tensor(IQ4_NL_VALUES, dtype=work, device=codes.device)[codes.long()] * meta.to(work)
    c, meta = codes.to(work, copy=True), meta.to(work)  # a copy of its own, worked in place: no more allocations
    if fmt.zero:
        return c.mul_(meta[..., :1]).add_(meta[..., 1:])
    offset = 128 if fmt.code == "q8_0" else 1 << (fmt.bits - 1)
    return c.sub_(offset).mul_(meta)


def per_token(fmt: LowBit) -> LowBit:
    """The storage of an MLA row's latent under fmt (fmt less its rope key's own bits or layout)."""
    return fmt._replace(rope_bits=None, rope_channel=False)


def _row_wise(fmt: LowBit) -> None:
    if fmt.rope_channel:
        raise ValueError(f"{fmt.code}/g{fmt.group}+c{fmt.rope_bits} keeps the rope key per channel over groups "
                         f"of {KEY_TOKENS} tokens: rows are stored by a LatentCache (channel_encode), not one by one")


def encode(x: torch.Tensor, parts: tuple[int, ...], fmt: LowBit) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows x (..., W) -> packed codes (..., packed_row) uint8 and meta (..., meta_row) float16, part by part."""
    check_parts(parts, fmt)
    _row_wise(fmt)
    packed, meta, start = [], [], 0
    for w, f in pieces(parts, fmt):
        codes, m = _codes_and_meta(_grouped(x[..., start:start + w].float(), f.group), f, w)  # (..., n, g), (..., n, k)
        packed.append(pack(codes.flatten(-2)[..., :w], f.bits))
        meta.append(m.flatten(-2))
        start += w
    return torch.cat(packed, -1), torch.cat(meta, -1)


def decode(packed: torch.Tensor, meta: torch.Tensor, parts: tuple[int, ...], fmt: LowBit,
           dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """The inverse of encode, read back in `dtype` (computed in float32, float64 for float64). out: a tensor
    (..., S, sum(parts)) of `dtype` written in place, each part where it goes (no joined copy)."""
    _row_wise(fmt)
    work = torch.promote_types(dtype, torch.float32)
    whole = list(pieces(parts, fmt))
    if out is None and len(whole) > 1:
        out = torch.empty(*packed.shape[:-1], sum(parts), dtype=dtype, device=packed.device)
    byte, col, start = 0, 0, 0
    for w, f in whole:
        nb, nm = packed_width(w, f.bits), _groups(w, f) * f.meta_per_group
        codes = _grouped(unpack(packed[..., byte:byte + nb], f.bits, w), f.group)  # (..., n, g)
        m = meta[..., col:col + nm].unflatten(-1, (-1, f.meta_per_group))  # (..., n, k)
        values = _values(codes, m, f, work).flatten(-2)[..., :w]
        if out is None:  # one part: its values are the rows
            return values if work == dtype else values.to(dtype)
        out[..., start:start + w] = values
        byte, col, start = byte + nb, col + nm, start + w
    return out


def round_trip(x: torch.Tensor, parts: tuple[int, ...], fmt: LowBit) -> torch.Tensor:
    """decode(encode(x)) without the packing (the same values; what a forward without a cache reads)."""
    check_parts(parts, fmt)
    work = torch.promote_types(x.dtype, torch.float32)
    out, start = [], 0
    for w, f in pieces(parts, fmt):
        if f.kind == "channel":  # x (..., S, W): the part's whole groups of tokens per channel
            out.append(channel_round_trip(x[..., start:start + w], f).to(work))
        else:
            codes, m = _codes_and_meta(_grouped(x[..., start:start + w].float(), f.group), f, w)
            out.append(_values(codes, m, f, work).flatten(-2)[..., :w])
        start += w
    out = torch.cat(out, -1)
    return out if work == x.dtype else out.to(x.dtype)


# -- a part per channel over groups of tokens ("+c4") ------------------------------------------------------
def channel_encode(x: torch.Tensor, f: LowBit) -> tuple[torch.Tensor, torch.Tensor]:
    """One whole group of tokens x (..., T, w) -> packed codes (..., T, packed_width(w)) uint8 and meta
    (..., 2 w) float16: each channel's scale and minimum over the T tokens, interleaved (d_0, m_0, d_1, ...)."""
    codes, meta = _codes_and_meta(x.float().transpose(-1, -2)[..., None, :], f)  # (..., w, 1, T), (..., w, 1, 2)
    return pack(codes[..., 0, :].transpose(-1, -2), f.bits), meta.flatten(-3)


def channel_decode(packed: torch.Tensor, meta: torch.Tensor, width: int, f: LowBit, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of channel_encode: (..., T, packed) codes and (..., 2 w) meta -> (..., T, w) in dtype."""
    work = torch.promote_types(dtype, torch.float32)
    m = meta.to(work).unflatten(-1, (width, 2))  # (..., w, 2)
    out = unpack(packed, f.bits, width).to(work).mul_(m[..., None, :, 0]).add_(m[..., None, :, 1])  # (..., T, w)
    return out if work == dtype else out.to(dtype)


def channel_round_trip(x: torch.Tensor, f: LowBit) -> torch.Tensor:
    """x (..., S, w) stored per channel over whole groups of f.group tokens; a trailing partial group as it is
    (a cache holds it unquantised until its last token arrives). Returned in x's dtype."""
    S = x.shape[-2]
    whole = S // f.group * f.group
    if whole == 0:
        return x
    groups = x[..., :whole, :].float().unflatten(-2, (-1, f.group)).transpose(-1, -2)  # (..., n, w, T)
    codes, meta = _codes_and_meta(groups, f)  # (..., n, w, T), (..., n, w, 2)
    stored = _values(codes, meta, f, torch.promote_types(x.dtype, torch.float32))  # (..., n, w, T)
    stored = stored.transpose(-1, -2).flatten(-3, -2).to(x.dtype)  # (..., whole, w)
    return torch.cat([stored, x[..., whole:, :]], -2) if whole < S else stored


def kivi_round_trip(x: torch.Tensor, fmt: LowBit, role: str) -> torch.Tensor:
    """x (..., S, W) as KIVI stores it: role "key" per channel over whole groups of 32 tokens (a trailing
    partial group as it is, KIVI's 16-bit residual), role "value" per token over groups of 32 channels."""
    asym = LowBit(fmt.code, fmt.bits, BLOCK, True, "asym")
    if role == "value":
        return round_trip(x, (x.shape[-1],), asym)
    if role != "key":
        raise ValueError(f"KIVI quantises a GQA's keys per channel and its values per token; role {role!r} has "
                         "neither (an MLA cache takes int4/g<N>, int2/g<N> or a q-block format)")
    return channel_round_trip(x, asym._replace(kind="channel"))  # per channel over whole groups of BLOCK tokens


def kivi_bytes(values_per_token: int, fmt: LowBit) -> int:
    """Steady-state bytes per token of `values_per_token` keys and values in KIVI: (b + 1) bits a value
    (a float16 scale and zero per 32 values, along tokens for keys, along channels for values)."""
    return values_per_token * (fmt.bits + 1) // 8


# -- transformers' QuantizedCache, quanto backend -----------------------------------------------------------
def quanto_round_trip(x: torch.Tensor, fmt: LowBit, role: str | None = None) -> torch.Tensor:
    """x (B, H, S, D) as transformers' quanto QuantizedCache stores it (QUANTO_GROUP's comment): groups of fmt.group
    consecutive values in x's order, min-max codes in x's dtype, read back in x's dtype. role: keys and values
    are stored alike (accepted for round_trip's call)."""
    if x.numel() % fmt.group:
        raise ValueError(f"{fmt.code} stores groups of {fmt.group} values: a tensor of shape {tuple(x.shape)} "
                         f"({x.numel()} values) does not divide into them")
    g = x.reshape(-1, fmt.group)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = (hi - lo) / ((1 << fmt.bits) - 1)
    shift = -lo
    codes = torch.round((g + shift) / torch.where(scale == 0, torch.ones_like(scale), scale))
    codes = torch.where(scale == 0, torch.zeros_like(codes), codes).clamp(0, (1 << fmt.bits) - 1)
    return (scale * codes - shift).reshape(x.shape)


def engine_bytes(values_per_token: int, fmt: LowBit) -> float:
    """Steady-state bytes per token of `values_per_token` keys and values in an evaluation-only storage: KIVI
    (b + 1) bits a value; quanto b bits and a 16-bit scale and minimum per group of fmt.group values."""
    if fmt.kind == "kivi":
        return kivi_bytes(values_per_token, fmt)
    return values_per_token * (fmt.bits + 32 / fmt.group) / 8
