"""A rope key per KV head, and the keys-whole layout (MultiHeadLatentAttention's `rope_kv_heads`; modules/mla.py).

`RopeKeyPerHead`, a mixin of MultiHeadLatentAttention: where each KV head's part of the rope key lies, and each query
head's own part. It reads the module's num_heads, rope_dim, rope_kv_heads, rope_grouping, rope and q_head_norm, and
keeps each head's own part (index and mask, per device) in _rope_own. `by_head`, `from_heads`: the parts' order.
"""
from __future__ import annotations

import torch

from . import checks
from .heads import kv_head_of


class RopeKeyPerHead:
    """A rope key per KV head (`rope_kv_heads=G`): G parts of w = rope_dim / G dims, as a rotary embedding holds them
    (KV head g's rotary pairs are the rope key's pairs g w/2 ... (g+1) w/2 - 1). Each query head reads only its own KV
    head's part (`rope_grouping`; the other dims are masked to zero, so training cannot make them matter). A decoupled
    conversion keeping each KV head's pairs (convert.gqa_to_mla_decoupled) gives it: the expanded path dots d + w dims
    a head, not d + rope_dim; the absorbed path reads the whole rope key (the masked dims add zeros)."""

    @staticmethod
    def _rope_part(num_heads, rope_dim, rope_kv_heads, rope_after_up, kv_tiling) -> int:
        """w, each KV head's width in the rope key, for rope_kv_heads=G; ValueError naming the values otherwise."""
        checks.positive_int("rope_kv_heads", rope_kv_heads)
        G = rope_kv_heads
        if not rope_dim or rope_dim % G or (rope_dim // G) % 2:
            raise ValueError(f"rope_kv_heads ({G}) needs rope_dim = G x w with w even (each KV head's part of the "
                             f"rope key, in rotary pairs), got rope_dim {rope_dim}")
        if num_heads % G:
            raise ValueError(f"num_heads ({num_heads}) must be divisible by rope_kv_heads ({G})")
        if rope_after_up or kv_tiling is not None:
            raise ValueError("rope_kv_heads (a decoupled rope key per KV head) excludes rope_after_up and kv_tiling")
        return rope_dim // G

    @property
    def keys_whole(self) -> bool:
        """The keys-whole layout (rope_kv_heads=G, head_dim 0): the rope key is G KV heads' whole keys (rope_dim = G x
        d, each as a rotary embedding of d dims holds it), a query head reads only its own KV head's d dims, and the
        latent holds only the values. Per-head q/k norms (Qwen3, Gemma 3) convert to it: `qk_norm_eps` normalises each
        query head and KV head of the rope key over d dims before RoPE, as the GQA did; the cache holds it normed and
        rotated, so every path (expanded, absorbed, the Triton kernel, every kv_dtype) reads it as any rope key."""
        return self.rope_kv_heads is not None and not self.head_dim

    def _rope_mask(self, like: torch.Tensor) -> torch.Tensor:
        """rope_kv_heads: (H, 1, p) ones on each query head's own part of the rope key, zeros elsewhere (made once per
        device and dtype)."""
        key = ("mask", like.device, like.dtype)
        made = self._rope_own or {}
        mask = made.get(key)
        if mask is None:
            mask = torch.zeros(self.num_heads, self.rope_dim, dtype=like.dtype, device=like.device)
            mask = mask.scatter_(1, self._rope_index(like.device), 1.0)[:, None]  # (H, 1, p)
            self._rope_own = {**(self._rope_own or {}), key: mask}
        return mask

    def _rope_index(self, device) -> torch.Tensor:
        """rope_kv_heads: (H, w) the rope-key dims of each query head's own KV head, in that part's rotary order
        (made once per device)."""
        made = self._rope_own or {}  # None in a replica (distributed.replica drops held tensors)
        cached = made.get(("index", device))
        if cached is None:
            parts = self._by_head(torch.arange(self.rope_dim))  # (G, w): the rope key's dims, by KV head
            own = kv_head_of(self.num_heads, self.rope_kv_heads, self.rope_grouping)  # (H,)
            cached = parts[own].to(device)  # (H, w)
            self._rope_own = {**made, ("index", device): cached}
        return cached

    def _by_head(self, t: torch.Tensor) -> torch.Tensor:
        """A rope key per KV head: (..., rope_dim) -> (..., G, w), each KV head's dims in its own rotary order."""
        return by_head(t, self.rope_kv_heads, self.rope.interleaved)

    def _from_heads(self, t: torch.Tensor) -> torch.Tensor:
        """The inverse of _by_head: (..., G, d) -> (..., rope_dim)."""
        return from_heads(t, self.rope.interleaved)

    def _own_heads(self, q_rope: torch.Tensor) -> torch.Tensor:
        """A rope key per KV head: each query head's rope part (B, H, L, p) with the other KV heads' dims set to zero
        (never read, so that training cannot make them matter); keys whole: normalised over its own w dims."""
        if self.q_head_norm is not None:
            q_rope = self._from_heads(self.q_head_norm(self._by_head(q_rope)))  # (B, H, L, p), each part normed
        return q_rope * self._rope_mask(q_rope)  # (B, H, L, p): one product


def by_head(t: torch.Tensor, heads: int, interleaved: bool) -> torch.Tensor:
    """A rope key of `heads` KV heads' parts: (..., p) -> (..., heads, w), each part in its own rotary order."""
    if interleaved:  # pairs (2i, 2i + 1): KV head g holds dims g w ... (g + 1) w - 1
        return t.unflatten(-1, (heads, -1))
    return t.unflatten(-1, (2, heads, -1)).transpose(-3, -2).flatten(-2)  # pairs (i, i + p/2): halves per head


def from_heads(t: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The inverse of by_head: (..., heads, w) -> (..., p)."""
    if interleaved:
        return t.flatten(-2)
    return t.unflatten(-1, (2, -1)).transpose(-3, -2).flatten(-3)
