"""The one attention core: `attend`, scaled dot-product attention with grouped KV heads, which are never copied.

B batch, H query heads, G key/value heads, C = H // G, L query length, S key length (cached plus new), d query/key
and dv value head size. Masks: bool, True where a query may attend (SDPA's convention), or float, added to the scores;
broadcast to (B, H, L, S) from (L, S), (B, L, S) or (B|1, H|1, L|1, S). A row with nothing to attend returns zeros.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .heads import check_grouping


def causal_mask(query_len: int, key_len: int, device=None) -> torch.Tensor:
    """Bottom-right aligned causal mask, (L, S) bool, True = may attend."""
    offset = key_len - query_len
    i = torch.arange(query_len, device=device)[:, None]
    j = torch.arange(key_len, device=device)[None, :]
    return j <= i + offset  # (L, S)


def _as_4d(mask: torch.Tensor, shape: tuple[int, int, int, int], dtype: torch.dtype) -> torch.Tensor:
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(f"mask must be bool (True = may attend) or floating (added to scores), got {mask.dtype}")
    if mask.dim() not in (2, 3, 4):
        raise ValueError(f"mask must have 2, 3 or 4 dimensions broadcastable to (B, H, L, S) = {shape}, "
                         f"got {tuple(mask.shape)}")
    m = mask
    if m.dim() == 2:
        m = m[None, None]  # (1, 1, L, S)
    elif m.dim() == 3:
        m = m[:, None]  # (B, 1, L, S)
    if m.shape[-1] != shape[-1] or any(a not in (1, b) for a, b in zip(m.shape, shape)):
        raise ValueError(f"mask of shape {tuple(mask.shape)} does not broadcast to (B, H, L, S) = {shape}")
    if m.is_floating_point():
        m = m.to(dtype)
    return m


def combine_masks(mask, is_causal: bool, shape: tuple[int, int, int, int], dtype, device):
    """Merge a user mask and causality into one attn_mask.

    Returns (attn_mask or None, native_causal): native_causal means SDPA's own
    is_causal can be used (square, no other mask).
    """
    B, H, L, S = shape
    m = _as_4d(mask, shape, dtype) if mask is not None else None
    if not is_causal or L == 1:
        # one query row after S-1 earlier keys sees them all: causality is void
        return m, False
    if m is None and L == S:
        return None, True
    c = causal_mask(L, S, device)[None, None]  # (1, 1, L, S)
    if m is None:
        return c, False
    if m.dtype == torch.bool:
        return m & c, False
    return m.masked_fill(~c, float("-inf")), False


def fused_sdpa(q, k, v, *, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
    """torch's scaled_dot_product_attention, kept on its fused kernels when head sizes differ.

    With query-key size d != value size dv (decoupled-RoPE MLA: d + p vs dv) SDPA's fused kernels refuse the call and
    its math fallback materialises every score. Zero columns change nothing: V is padded to d and the output sliced
    back (dv < d), or q and k are padded to dv (dv > d, same scores). The default scale stays 1/sqrt(d)."""
    d, dv = q.shape[-1], v.shape[-1]
    if d == dv:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=enable_gqa)
    scale = d ** -0.5 if scale is None else scale
    if dv < d:
        o = F.scaled_dot_product_attention(q, k, F.pad(v, (0, d - dv)), attn_mask=attn_mask, is_causal=is_causal,
                                           scale=scale, enable_gqa=enable_gqa)  # (B, H, L, d)
        return o[..., :dv]  # (B, H, L, dv)
    return F.scaled_dot_product_attention(F.pad(q, (0, dv - d)), F.pad(k, (0, dv - d)), v, attn_mask=attn_mask,
                                          is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)  # (B, H, L, dv)


# Fused SDPA is the wrong tool for a few rows against a long cache in two cases (docs/performance.md): on the CPU, when
# q/k and v head sizes differ (MLA's absorbed decode with RoPE: key = [latent, rope key], value = latent), SDPA falls
# back to a math path that rescales the whole key tensor on every call; on CUDA, a kernel that parallelises over query
# blocks gets one block per KV head, leaving most of the GPU idle. There _rows_attention writes the two products out
# (cuBLAS splits the long key axis across the GPU).
ROWS_WRITTEN_OUT = 64  # at most this many query rows per KV head take the plain-products route


def _part_bounds(parts: tuple[int, ...]) -> list[tuple[int, int]]:
    """[(first column, end)] of consecutive parts of these widths."""
    ends = [sum(parts[:i + 1]) for i in range(len(parts))]
    return list(zip([0] + ends[:-1], ends))


def _rows_attention(q, k, v, attn_mask, scale, key_scale=None, value_scale=None, key_parts=None):
    """Attention of the query rows that share one KV head, q (B, G, R, d) -> (B, G, R, dv); few rows (see
    ROWS_WRITTEN_OUT) as two written-out products, the scale on the query rows and the softmax in at least float32.

    key_scale (B, G, S, n), with key_parts the n column widths it covers, and value_scale (B, G, S), or None: a
    quantised cache's scales, applied to the partial scores and the weights instead of k and v (always written out)."""
    few = q.shape[-2] <= ROWS_WRITTEN_OUT
    scaled = key_scale is not None or value_scale is not None
    if not scaled and (not few or (q.device.type == "cpu" and k.shape[-1] == v.shape[-1])):
        return fused_sdpa(q, k, v, attn_mask=attn_mask, scale=scale)
    q = q * (scale if scale is not None else q.shape[-1] ** -0.5)  # (B, G, R, d)
    if key_scale is None:
        s = q @ k.transpose(-1, -2)  # (B, G, R, S)
    else:  # q . k_j = sum over parts i of (q_i . codes_ij) * key_scale_ji
        s = None
        for i, (a, b) in enumerate(_part_bounds(key_parts)):
            part = q[..., a:b] @ k[..., a:b].transpose(-1, -2)  # (B, G, R, S)
            f = key_scale[:, :, None, :, i]  # (B, G, 1, S)
            s = part.mul_(f) if s is None else s.addcmul_(part, f)  # (B, G, R, S)
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask
    p = torch.softmax(s, dim=-1, dtype=torch.promote_types(s.dtype, torch.float32))
    if attn_mask is not None:  # a row with nothing to attend gives zeros, as SDPA does
        p = p.nan_to_num(0.0)
    if value_scale is not None:
        p = p * value_scale[:, :, None, :]  # (B, G, R, S): sum_j p_j (v_j * value_scale_j)
    return p.to(v.dtype) @ v  # (B, G, R, dv)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
           grouping: str = "blocked",  # query head h reads KV head h mod G ("strided") or h // (H/G) ("blocked")
           mask: torch.Tensor | None = None,  # bool (True = may attend) or float, broadcast to (B, H, L, S)
           is_causal: bool = False,  # bottom-right aligned: query i of L sees keys j <= (S - L) + i
           scale: float | None = None,  # default 1/sqrt(d)
           key_scale: torch.Tensor | None = None,  # (B, G, S); with key_parts (B, G, S, len(key_parts))
           value_scale: torch.Tensor | None = None,  # (B, G, S)
           key_parts: tuple[int, ...] | None = None,  # widths adding up to d, scaled apart (an MLA's latent, rope key)
           ) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v with G shared KV heads: q (B, H, L, d), k (B, G, S, d), v (B, G, S, dv) ->
    (B, H, L, dv).

    key_scale, value_scale: per-row factors, as if k and v were k * key_scale[..., None] and v * value_scale[..., None]
    (int8 codes and their scales); on the few-rows route they multiply the scores and the weights instead."""
    check_grouping(grouping)
    B, H, L, d = q.shape
    G, S, dv = k.shape[1], k.shape[2], v.shape[-1]
    if H % G:
        raise ValueError(f"query heads ({H}) must be divisible by key/value heads ({G})")
    if key_parts is not None and (not key_parts or sum(key_parts) != d or min(key_parts) < 1):
        raise ValueError(f"key_parts {key_parts} must be positive widths adding up to the key size {d}")
    want = {"key_scale": (B, G, S) + ((len(key_parts),) if key_parts is not None else ()),
            "value_scale": (B, G, S)}
    for name, f in (("key_scale", key_scale), ("value_scale", value_scale)):
        if f is not None and tuple(f.shape) != want[name]:
            raise ValueError(f"{name} must have shape {want[name]}, got {tuple(f.shape)}")
    if key_scale is not None and key_parts is None:
        key_scale, key_parts = key_scale[..., None], (d,)  # (B, G, S, 1)
    C = H // G
    attn_mask, native_causal = combine_masks(mask, is_causal, (B, H, L, S), q.dtype, q.device)

    # Two routes, neither copying K or V. Folded: the C query heads of a KV head folded into the rows of one product,
    # (B, G, C*L, d) @ (B, G, d, S), when the mask is the same for every head of a group and every query row (no mask,
    # or one decode step; MLA's absorbed decode runs so). Grouped: SDPA with enable_gqa=True, which indexes the shared
    # KV head without copies, for masks that differ per row (causal prefill) or per head.
    foldable = not native_causal and (attn_mask is None or (L == 1 and attn_mask.shape[1] == 1))
    if not (foldable and C * L <= ROWS_WRITTEN_OUT):  # the factors go on the rows themselves
        if key_scale is not None:
            k = torch.cat([k[..., a:b] * key_scale[..., i, None] for i, (a, b) in enumerate(_part_bounds(key_parts))],
                          -1)  # (B, G, S, d)
        v = v if value_scale is None else v * value_scale[..., None]  # (B, G, S, dv)
        key_scale = value_scale = None
    scaled = key_scale is not None or value_scale is not None  # (only left on the few-rows route)
    if C == 1 and not scaled and not (foldable and q.device.type != "cpu" and L <= ROWS_WRITTEN_OUT):
        return fused_sdpa(q, k, v, attn_mask=attn_mask, is_causal=native_causal, scale=scale)

    strided = grouping == "strided"
    if foldable:
        if strided:  # head h = c*G + g
            qf = q.reshape(B, C, G, L, d).transpose(1, 2).reshape(B, G, C * L, d)  # (B, G, C*L, d)
        else:  # head h = g*C + c
            qf = q.reshape(B, G, C * L, d)  # (B, G, C*L, d)
        o = _rows_attention(qf, k, v, attn_mask, scale, key_scale, value_scale, key_parts)  # (B, G, C*L, dv)
        if strided:
            return o.reshape(B, G, C, L, dv).transpose(1, 2).reshape(B, H, L, dv)  # (B, H, L, dv)
        return o.reshape(B, H, L, dv)  # (B, H, L, dv)

    if strided:  # reorder query heads (and per-head masks) so that SDPA's blocked rule applies
        q = q.reshape(B, C, G, L, d).transpose(1, 2).reshape(B, H, L, d)  # (B, H, L, d) blocked order
        if attn_mask is not None and attn_mask.shape[1] == H:
            mb = attn_mask.shape[0]
            attn_mask = attn_mask.reshape(mb, C, G, *attn_mask.shape[2:]).transpose(1, 2).reshape(
                mb, H, *attn_mask.shape[2:])  # (B|1, H, L|1, S) blocked order
    o = fused_sdpa(q, k, v, attn_mask=attn_mask, is_causal=native_causal, scale=scale,
                   enable_gqa=True)  # (B, H, L, dv)
    if strided:
        o = o.reshape(B, G, C, L, dv).transpose(1, 2).reshape(B, H, L, dv)  # (B, H, L, dv) strided order
    return o


def with_key_padding(mask: torch.Tensor | None, key_padding_mask: torch.Tensor | None,
                     shape: tuple[int, int, int, int], dtype: torch.dtype) -> torch.Tensor | None:
    """Merge a (B, S) key-padding mask (True = real token, may be attended) into `mask`.

    shape is (B, H, L, S); the result is 4-D, or `mask` unchanged without padding.
    """
    if key_padding_mask is None:
        return mask
    B, S = shape[0], shape[3]
    if not isinstance(key_padding_mask, torch.Tensor) or key_padding_mask.dtype != torch.bool:
        raise TypeError("key_padding_mask must be a bool tensor (True = may attend)")
    if tuple(key_padding_mask.shape) != (B, S):
        raise ValueError(f"key_padding_mask must have shape (B, S) = {(B, S)}, got {tuple(key_padding_mask.shape)}")
    kpm = key_padding_mask[:, None, None, :]  # (B, 1, 1, S)
    if mask is None:
        return kpm
    m = _as_4d(mask, shape, dtype)
    return m & kpm if m.dtype == torch.bool else m.masked_fill(~kpm, float("-inf"))
