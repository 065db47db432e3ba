"""The GQA tiling of an MLA (MultiHeadLatentAttention's `kv_tiling`; modules/mla.py says what it is): what finds
and checks it, what its cache holds (the GQA's K and V, in a GQA's KVCache), and attention on it as GQA attends.

A mixin of MultiHeadLatentAttention: it reads the module's W_DKV, W_UK, W_UV, kv_norm, k_head_norm, rope, and sets
kv_tiling and its verdict cache.
"""
from __future__ import annotations

import torch

from .attention import attend
from .storage import dense, with_row_scale
from .heads import gqa_block, tile_heads


def _weights_key(tensors) -> tuple:
    """Changes whenever one of the tensors is replaced or modified in place (identity, version counter)."""
    return tuple((id(t), t._version, t.data_ptr(), t.dtype, t.device) for t in tensors)


class GQATiling:
    """The tiled layout's methods (module docstring). The module sets kv_tiling and _tiling_verdict itself."""

    def _tiling_groups(self) -> int | None:
        """G with latent_dim = G * (head_dim + v_head_dim) and G | num_heads, else None."""
        G, rest = divmod(self.latent_dim, self.head_dim + self.v_head_dim)
        return G if not rest and G and not self.num_heads % G else None

    def _tiling_weights(self, G: int, grouping: str):
        """The 0/1 W_UK (H*d, r) and W_UV (H*dv, r) that hand query head h its group's slices."""
        H, d = self.num_heads, self.head_dim
        w = self.W_UK.weight
        eye = torch.eye(self.latent_dim, dtype=w.dtype, device=w.device)  # latent entry j = row j
        return tile_heads(eye[:G * d], H, G, grouping), tile_heads(eye[G * d:], H, G, grouping)

    def _is_tiling(self, grouping: str) -> bool:
        G = self._tiling_groups()
        if G is None or self.rope_dim:
            return False
        up_k, up_v = self._tiling_weights(G, grouping)
        if not (torch.equal(self.W_UK.weight, up_k) and torch.equal(self.W_UV.weight, up_v)):
            return False
        return all(lin.bias is None or gqa_block(lin.bias.detach(), self.num_heads, G, grouping=grouping, rtol=0.0)
                   is not None for lin in (self.W_UK, self.W_UV))

    def detect_kv_tiling(self) -> str | None:
        """Set (and return) kv_tiling if W_UK/W_UV are a GQA tiling of the latent, else None."""
        self.kv_tiling = next((g for g in ("blocked", "strided") if self._is_tiling(g)), None)
        self._tiling_verdict = None
        return self.kv_tiling

    def kv_tiling_holds(self) -> bool:
        """kv_tiling is set and the weights still are that tiling (re-checked when they change)."""
        if self.kv_tiling is None:
            return False
        if torch.compiler.is_compiling() and self._tiling_verdict is not None:
            return self._tiling_verdict[1]  # traced code keeps the verdict of the last eager call
        tensors = [t for lin in (self.W_UK, self.W_UV) for t in (lin.weight, lin.bias) if t is not None]
        key = _weights_key(tensors)
        if self._tiling_verdict is None or self._tiling_verdict[0] != key:
            self._tiling_verdict = (key, self._is_tiling(self.kv_tiling))
        return self._tiling_verdict[1]

    def _tiled_kv(self, source: torch.Tensor, positions: torch.Tensor | None) -> torch.Tensor:
        """What a tiled cache stores: the GQA's K (rotated, with bias) and V (with bias), (B, S, r)."""
        G, d, dv = self._tiling_groups(), self.head_dim, self.v_head_dim
        c = self.W_DKV(source)  # (B, S, r)
        if self.kv_norm is not None:
            c = self.kv_norm(c)
        k, v = c.split([G * d, G * dv], dim=-1)  # (B, S, G*d), (B, S, G*dv)
        block = lambda b: gqa_block(b, self.num_heads, G, grouping=self.kv_tiling, rtol=0.0)  # noqa: E731
        if self.W_UK.bias is not None:
            k = k + block(self.W_UK.bias)  # (B, S, G*d)
        if self.k_head_norm is not None:
            k = self.k_head_norm(k.unflatten(-1, (G, d))).flatten(-2)  # (B, S, G*d)
        if self.W_UV.bias is not None:
            v = v + block(self.W_UV.bias)  # (B, S, G*dv)
        if self.rope_after_up:
            B, S, _ = k.shape
            if positions is None:
                positions = torch.arange(S, device=source.device)
            k = self.rope(k.view(B, S, G, d).transpose(1, 2), positions).transpose(1, 2).reshape(B, S, G * d)
        return torch.cat([k, v], dim=-1)  # (B, S, r)

    def _heads(self, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tiled rows (B, S, r) as the GQA's K (B, G, S, d) and V (B, G, S, dv), views."""
        G, d, dv = self._tiling_groups(), self.head_dim, self.v_head_dim
        return (kv[..., :G * d].unflatten(-1, (G, d)).transpose(1, 2),
                kv[..., G * d:].unflatten(-1, (G, dv)).transpose(1, 2))

    @staticmethod
    def _rows(k, v) -> torch.Tensor:
        """A tiled module's KVCache read back as latent rows (B, S, r) = [K of every head, V of every head]."""
        return torch.cat([dense(k).transpose(1, 2).flatten(2), dense(v).transpose(1, 2).flatten(2)], dim=-1)

    def _tiled(self, q, kv, mask, is_causal):
        """Attention on the GQA's K and V, grouped heads folded as GQA does: kv is tiled rows (B, S, r), or (K, V)
        from the module's KVCache (int8 codes with a scale per token and head: folded into the scores and weights,
        as the GQA does)."""
        if isinstance(kv, tuple):
            (k, key_scale), (v, value_scale) = with_row_scale(kv[0]), with_row_scale(kv[1])
        else:
            (k, v), key_scale, value_scale = self._heads(dense(kv)), None, None
        return attend(q, k, v, grouping=self.kv_tiling, mask=mask, is_causal=is_causal, scale=self.scale,
                      key_scale=key_scale, value_scale=value_scale)

    def _choose_tiled(self, cache, absorbed) -> bool:
        """Use the tiled path? Checks that a cache was filled in the layout this call reads."""
        tiled = absorbed is None and self.kv_tiling_holds() and not (
            torch.is_grad_enabled() and (self.W_UK.weight.requires_grad or self.W_UV.weight.requires_grad))
        if cache is None:
            return tiled
        holder = getattr(cache, "hf_cache", cache)  # a TransformersCache is made anew for every call
        layouts = getattr(holder, "_attnlab_tiled", None)  # not __dict__.setdefault: torch 2.11's dynamo cannot trace it
        if layouts is None:
            layouts = holder._attnlab_tiled = {}
        slot = getattr(cache, "layer_idx", None)
        if cache.length == 0:
            layouts[slot] = tiled
        elif layouts.get(slot, False) and not tiled:
            why = ("absorbed= asks for a general path" if absorbed is not None else
                   "W_UK/W_UV are no longer the GQA tiling" if not self.kv_tiling_holds() else
                   "autograd records and W_UK/W_UV require grad")
            raise ValueError(f"this cache holds GQA-tiled keys and values but {why}; start a fresh cache")
        return layouts.get(slot, False)
