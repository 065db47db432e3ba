"""Triton kernels of MLA's absorbed decode (imports triton; reached only through mla_decode.py).

Flash-decoding in two launches: `split_kernel` walks each split of the cache rows for a block of heads,
`combine_kernel` merges the splits' partial results. `interpreted` says whether triton runs on the CPU interpreter.
"""
from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # scores are kept in base 2 (scale * log2(e) folded in once), so exp is exp2

# Notation: B batch, H heads, S cached length, r = latent_dim, p = rope_dim, BH heads per program, BN cache rows per
# tile, BR/BP = r/p rounded up to a power of two (masked), T splits of the sequence.
#
# DOT_F32 (bfloat16 in triton's CPU interpreter only, never on a GPU) works around two interpreter gaps of triton 3.9:
# tl.dot multiplies bfloat16 bit patterns as integers, so operands are widened to float32 first (values unchanged),
# and float32 -> bfloat16 casts truncate, so values are first rounded to nearest-even by hand (_round_to_bfloat16),
# as the GPU's casts do.


@triton.jit
def _round_to_bfloat16(x):
    """float32 x rounded to the nearest bfloat16 (ties to even), still as float32; finite x only."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_to_float32(code):
    """float8_e4m3fn bytes (as uint8) -> their float32 values: sign, 4 exponent bits (bias 7), 3 mantissa bits;
    exponent 0 is subnormal (m / 8 * 2^-6). NaN (0x7F, 0xFF) is never written by the cache (it clamps)."""
    bits = code.to(tl.uint32)
    sign = (bits >> 7) << 31
    e = (bits >> 3) & 0xF
    m = bits & 0x7
    normal = (sign | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 0.001953125  # m * 2^-9
    return tl.where(e == 0, tl.where(sign != 0, -sub, sub), normal)


# Quantised caches (QUANT 1: int8 codes, 2: float8_e4m3fn codes passed as their bytes and decoded by _e4m3_to_float32,
# so the interpreter and GPUs without fp8 loads read them alike): each tile is dequantised right after its load,
# code * scale in float32, then rounded to q's dtype, as the cache's own read does. Scales cover GR latent channels
# (column j // GR) and GP rope channels (column n_lat + j // GP), powers of two, GR = BR for one scale per part:
# a tile's (BN, BR//GR) scales are loaded once and broadcast over groups, so the scales cost a few registers,
# not one gathered pointer per element.
@triton.jit
def _dequantised(code, scale_rows, first, count, row_ok, BN: tl.constexpr, WIDTH: tl.constexpr,
                 GROUP: tl.constexpr, QUANT: tl.constexpr, OUT_TY: tl.constexpr, DOT_F32: tl.constexpr):
    """A loaded (BN, WIDTH) tile of codes -> code * scale in float32, rounded to OUT_TY (float32 under DOT_F32).
    Channel j takes scale column first + j // GROUP of its row (count columns exist)."""
    if QUANT == 1:
        x = code.to(tl.float32)
    else:
        x = _e4m3_to_float32(code)
    NG: tl.constexpr = WIDTH // GROUP
    offs_g = tl.arange(0, NG)  # (NG,)
    sc = tl.load(scale_rows + first + offs_g[None, :], mask=row_ok[:, None] & (offs_g < count)[None, :],
                 other=0.0)  # (BN, NG)
    x = tl.reshape(tl.reshape(x, (BN, NG, GROUP)) * sc[:, :, None], (BN, WIDTH))  # (BN, WIDTH)
    if DOT_F32:
        return _round_to_bfloat16(x)
    return x.to(OUT_TY)


# Launch 1, grid (B, cdiv(H, BH), T): program (b, hb, t) walks its chunk of the cache rows of sequence b, tile by tile.
# The BH heads are the rows of one matrix product, so each tile of the latent (BN, r) and rope key (BN, p) is read once
# for all of them:
#     s = (q_lat c^T + q_rope k_rope^T) * scale     (BH, BN), float32
#     online softmax (running max m, running sum l), acc += p c   (BH, r)
# With T == 1 it normalises and writes the output directly; otherwise it writes the partial (m, l, acc) in float32.
# Masked or empty keys score -inf; a head with nothing to attend gets zeros.
@triton.jit
def split_kernel(Q, KV, SCALES, LENGTHS, KEEP, OUT, M_PART, L_PART, ACC_PART,
                  num_heads, latent_dim, rope_dim, chunk, qk_scale, n_lat, n_rope,
                  stride_qb, stride_qh, stride_kvb, stride_kvs, stride_sb, stride_ss, stride_keepb,
                  stride_ob, stride_oh, stride_pb, stride_ph, stride_pt,
                  BH: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr, BP: tl.constexpr,
                  HAS_ROPE: tl.constexpr, HAS_KEEP: tl.constexpr, SPLIT: tl.constexpr, QUANT: tl.constexpr,
                  GR: tl.constexpr, GP: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
    b = tl.program_id(0)
    hb = tl.program_id(1)
    t = tl.program_id(2)
    offs_h = hb * BH + tl.arange(0, BH)  # (BH,)
    offs_r = tl.arange(0, BR)  # (BR,)
    offs_n = tl.arange(0, BN)  # (BN,)
    h_ok = offs_h < num_heads
    r_ok = offs_r < latent_dim

    q_rows = Q + b * stride_qb + offs_h[:, None] * stride_qh  # (BH, 1)
    q_lat = tl.load(q_rows + offs_r[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0)  # (BH, BR)
    if HAS_ROPE:
        offs_p = tl.arange(0, BP)  # (BP,)
        p_ok = offs_p < rope_dim
        q_rope = tl.load(q_rows + latent_dim + offs_p[None, :], mask=h_ok[:, None] & p_ok[None, :],
                         other=0.0)  # (BH, BP)
        if DOT_F32:
            q_rope = q_rope.to(tl.float32)
    if DOT_F32:
        q_lat = q_lat.to(tl.float32)

    length = tl.load(LENGTHS + b)
    lo = t * chunk
    hi = tl.minimum(lo + chunk, length)
    m_i = tl.full((BH,), float("-inf"), tl.float32)
    l_i = tl.zeros((BH,), tl.float32)
    acc = tl.zeros((BH, BR), tl.float32)
    row0 = KV + b.to(tl.int64) * stride_kvb  # 64-bit: B * S_max * (r + p) may pass 2^31
    srow0 = SCALES + b.to(tl.int64) * stride_sb  # read only when QUANT
    for start in range(lo, hi, BN):
        n = start + offs_n  # (BN,)
        n_ok = n < hi
        rows = row0 + n[:, None] * stride_kvs  # (BN, 1)
        c_ok = n_ok[:, None] & r_ok[None, :]  # (BN, BR)
        c = tl.load(rows + offs_r[None, :], mask=c_ok, other=0)  # (BN, BR)
        srows = srow0 + n[:, None] * stride_ss  # (BN, 1)
        if QUANT:
            c = _dequantised(c, srows, 0, n_lat, n_ok, BN, BR, GR, QUANT, Q.dtype.element_ty, DOT_F32)  # (BN, BR)
        elif DOT_F32:
            c = c.to(tl.float32)
        s = tl.dot(q_lat, tl.trans(c), input_precision=PRECISION)  # (BH, BN)
        if HAS_ROPE:
            k_ok = n_ok[:, None] & p_ok[None, :]  # (BN, BP)
            k_rope = tl.load(rows + latent_dim + offs_p[None, :], mask=k_ok, other=0)  # (BN, BP)
            if QUANT:
                k_rope = _dequantised(k_rope, srows, n_lat, n_rope, n_ok, BN, BP, GP, QUANT, Q.dtype.element_ty,
                                      DOT_F32)  # (BN, BP)
            elif DOT_F32:
                k_rope = k_rope.to(tl.float32)
            s += tl.dot(q_rope, tl.trans(k_rope), input_precision=PRECISION)  # (BH, BN)
        s = s * qk_scale
        ok = n_ok
        if HAS_KEEP:
            keep = tl.load(KEEP + b * stride_keepb + n, mask=n_ok, other=0)  # (BN,)
            ok = ok & (keep != 0)
        s = tl.where(ok[None, :], s, float("-inf"))  # (BH, BN)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # (BH,)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: keep exp2 finite
        alpha = tl.exp2(m_i - m_safe)  # (BH,)
        w = tl.exp2(s - m_safe[:, None])  # (BH, BN)
        l_i = l_i * alpha + tl.sum(w, axis=1)
        if DOT_F32:  # the bfloat16 value, kept in float32
            w = _round_to_bfloat16(w)
        else:
            w = w.to(Q.dtype.element_ty)  # rounded to the activation dtype (the cache's, when plain) for the product
        acc = acc * alpha[:, None] + tl.dot(w, c, input_precision=PRECISION)  # (BH, BR)
        m_i = m_new

    if SPLIT:
        part = b * stride_pb + offs_h * stride_ph + t * stride_pt  # (BH,)
        tl.store(M_PART + part, m_i, mask=h_ok)
        tl.store(L_PART + part, l_i, mask=h_ok)
        tl.store(ACC_PART + part[:, None] * BR + offs_r[None, :], acc, mask=h_ok[:, None] & r_ok[None, :])
    else:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # (BH, BR)
        out = OUT + b * stride_ob + offs_h[:, None] * stride_oh + offs_r[None, :]
        if DOT_F32:
            o = _round_to_bfloat16(o)
        tl.store(out, o.to(OUT.dtype.element_ty), mask=h_ok[:, None] & r_ok[None, :])


# Launch 2, grid (B, H): merges the T partials of one head,
#     o = sum_t 2^(m_t - M) acc_t / sum_t 2^(m_t - M) l_t  with M = max_t m_t.
@triton.jit
def combine_kernel(OUT, M_PART, L_PART, ACC_PART, latent_dim, num_splits,
                    stride_ob, stride_oh, stride_pb, stride_ph, stride_pt,
                    BT: tl.constexpr, BR: tl.constexpr, DOT_F32: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_t = tl.arange(0, BT)  # (BT,)
    offs_r = tl.arange(0, BR)  # (BR,)
    t_ok = offs_t < num_splits
    part = b * stride_pb + h * stride_ph + offs_t * stride_pt  # (BT,)
    m = tl.load(M_PART + part, mask=t_ok, other=float("-inf"))  # (BT,)
    l = tl.load(L_PART + part, mask=t_ok, other=0.0)  # (BT,)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_max)  # (BT,), 0 for empty splits
    total = tl.sum(w * l, axis=0)
    acc = tl.load(ACC_PART + part[:, None] * BR + offs_r[None, :], mask=t_ok[:, None], other=0.0)  # (BT, BR)
    o = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)  # (BR,)
    if DOT_F32:
        o = _round_to_bfloat16(o)
    tl.store(OUT + b * stride_ob + h * stride_oh + offs_r, o.to(OUT.dtype.element_ty), mask=offs_r < latent_dim)


def interpreted() -> bool:
    """True when triton was imported with TRITON_INTERPRET=1: every kernel then runs on the CPU
    interpreter. Triton decides this once, when it decorates its own library at import."""
    from triton.runtime.interpreter import InterpretedFunction
    return isinstance(tl.zeros, InterpretedFunction)
