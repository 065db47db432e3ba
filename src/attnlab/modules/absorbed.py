"""Part 12's absorbed form of MLA (MultiHeadLatentAttention's absorbed path; modules/mla.py says what the module is).

q_nope_h . (W_UK_h c) = (W_UK_h^T q_nope_h) . c: each head's query moves into the latent space, all H heads attend
to the one latent row per token in a single product (heads folded into rows), and W_UV_h is applied to the r-dim
result afterwards, so nothing is up-projected per cached token. `AbsorbedPath` is a mixin of MultiHeadLatentAttention.
"""
from __future__ import annotations

import torch

from ..kernels import mla_decode
from .attention import attend
from .storage import QuantisedKV, dense
from .tiling import _weights_key


class AbsorbedPath:
    """The absorbed path's methods. A value bias on W_UV is added back after attention (weighted by each row's softmax
    sum). On int8/fp8 codes the scales fold into the scores and weights instead of a dequantised copy; one decode row
    per sequence on CUDA goes to the Triton kernel (kernels/mla_decode.py). It reads the module's W_UK, W_UV, head
    sizes, latent_dim, rope_dim and scale; the module sets _absorbed_cache (the per-head weights) itself."""

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK per head (H, d, r) and W_UV^T per head (H, r, dv), contiguous for batched products.

        Recomputed whenever either weight is replaced or changed in place (an optimizer step, load_state_dict): the key
        is each tensor's identity and version counter. Not cached while autograd records (the copy would hold a stale
        graph) or under torch.compile (which traces the computation)."""
        wk, wv = self.W_UK.weight, self.W_UV.weight
        cacheable = not torch.compiler.is_compiling() and not (
            torch.is_grad_enabled() and (wk.requires_grad or wv.requires_grad))
        key = _weights_key((wk, wv)) if cacheable else None
        if cacheable and self._absorbed_cache is not None and self._absorbed_cache[0] == key:
            return self._absorbed_cache[1]
        H, d, dv, r = self.num_heads, self.head_dim, self.v_head_dim, self.latent_dim
        w_uk = wk.reshape(H, d, r)  # (H, d, r)
        w_uv_t = wv.reshape(H, dv, r).transpose(1, 2).contiguous()  # (H, r, dv)
        if cacheable:
            self._absorbed_cache = (key, (w_uk, w_uv_t))
        return w_uk, w_uv_t

    def prefers_absorbed(self, query_len: int, key_len: int) -> bool:
        """Pick the path with fewer multiply-adds for these lengths (absorbed for decode)."""
        H, d, dv, r, p = self.num_heads, self.head_dim, self.v_head_dim, self.latent_dim, self.rope_dim
        expanded = key_len * r * H * (d + dv) + query_len * key_len * H * (d + p + dv)
        absorbed = query_len * H * r * (d + dv) + query_len * key_len * H * (2 * r + p)
        return absorbed < expanded

    def _absorbed(self, q_nope, q_rope, kv, mask, is_causal):
        """kv: (B, S, r+p) tensor, or QuantisedKV rows that the kernel reads as stored."""
        r = self.latent_dim
        w_uk, w_uv_t = self.absorbed_weights()  # (H, d, r), (H, r, dv)
        q = q_nope @ w_uk  # (B, H, L, r): W_UK_h^T q_h
        if self.rope_dim:
            q = torch.cat([q, q_rope], dim=-1)  # (B, H, L, r+p)
        b_v = self.W_UV.bias
        if b_v is None:  # one decode row per sequence on CUDA: the Triton kernel (kernels/mla_decode.py)
            if not isinstance(kv, QuantisedKV):
                o = mla_decode.try_decode(q, kv, mask, self.scale, r)  # (B, H, 1, r) or None where it does not apply
            elif kv.low is None and kv.parts == ((r, self.rope_dim) if self.rope_dim else (r,)):  # what it reads
                o = mla_decode.try_decode(q, kv.data, mask, self.scale, r, kv_scales=kv.scales, scale_group=kv.group)
            else:
                o = None
            if o is not None:
                return o @ w_uv_t  # (B, H, 1, dv)
        if isinstance(kv, QuantisedKV) and kv.foldable and b_v is None:
            return self._absorbed_codes(q, kv, mask, is_causal) @ w_uv_t  # (B, H, L, dv)
        kv = dense(kv)  # (B, S, r+p)
        k = kv[:, None]  # (B, 1, S, r+p): one latent "KV head" for all H query heads
        v = kv[:, None, :, :r]  # (B, 1, S, r)
        if b_v is not None:  # carry the softmax weight sum (1, or 0 on a fully masked row) for the value bias
            v = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)  # (B, 1, S, r+1)
        o = attend(q, k, v, mask=mask, is_causal=is_causal, scale=self.scale)  # (B, H, L, r[+1])
        out = o[..., :r] @ w_uv_t  # (B, H, L, dv)
        if b_v is not None:
            out = out + o[..., r:] * b_v.view(self.num_heads, 1, self.v_head_dim)  # (B, H, L, dv)
        return out

    def _absorbed_codes(self, q, kv: QuantisedKV, mask, is_causal):
        """The absorbed attention on int8/fp8 codes with their scales folded into the scores and the
        weights (attend's key_scale/value_scale) instead of a dequantised copy of the cache:
        q . [c s_c, k_R s_R] = (q_c . c) s_c + (q_R . k_R) s_R, and the value is c s_c.
        q (B, H, L, r+p) -> (B, H, L, r)."""
        r = self.latent_dim
        rows = kv.codes()[:, None]  # (B, 1, S, r+p)
        s = kv.scales.to(kv.dtype)[:, None]  # (B, 1, S, 1 or 2): the latent's scale, the rope key's
        return attend(q, rows, rows[..., :r], mask=mask, is_causal=is_causal, scale=self.scale,
                      key_scale=s, key_parts=kv.parts, value_scale=s[..., 0])  # (B, H, L, r)
