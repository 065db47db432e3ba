"""Grouped-query attention, and multi-head attention as its G = H case (Part 8): `GroupedQueryAttention`.

B batch, L query length, S key length, H = num_heads, G = num_kv_heads, d = head_dim, dv = v_head_dim. Weights
(Parts 2, 4, 7), each an nn.Linear: W_Q (H*d, dim), W_K (G*d, context_dim), W_V (G*dv, context_dim), W_O (dim, H*dv).
Head h owns rows [h*d, (h+1)*d) of W_Q and reads KV head h mod G ("strided") or h // (H/G) ("blocked", Llama's).
"""
from __future__ import annotations

import torch
from torch import nn

from . import checks
from .attention import attend
from .base import AttentionModule
from .cache import KVCache, window_for
from .rotation import turned
from .storage import rotated_frame, with_row_scale
from .heads import check_grouping
from .recent import mixed_mask
from .rope import RotaryEmbedding


class GroupedQueryAttention(AttentionModule):
    """Attention with `num_kv_heads` key/value heads shared by `num_heads` query heads.

    The arguments are described beside them in __init__'s signature. The exact gqa_to_mla carries qk_norm_eps,
    softmax_scale and sliding_window; the other conversions refuse a module with qk_norm_eps."""

    def __init__(self, dim: int,  # width of the attending sequence x (the study's D_1)
                 num_heads: int,  # query heads H
                 num_kv_heads: int, *,  # key/value heads G, a divisor of H
                 head_dim: int | None = None,  # query/key size per head (default dim // num_heads)
                 v_head_dim: int | None = None,  # value size per head (default head_dim)
                 context_dim: int | None = None,  # width of the attended sequence (default dim)
                 bias: bool = False,  # biases on all four projections (as BERT and Qwen2 carry them)
                 grouping: str = "strided",  # query head h reads KV head h mod G ("strided") or h // (H/G) ("blocked")
                 rope_base: float | None = None,  # rotary embeddings of this base on q and k (None: no RoPE)
                 rope_interleaved: bool = False,  # rotate pairs (2i, 2i+1) instead of (i, i + d/2)
                 kv_dtype: str | None = None,  # K and V's storage in a cache (modules/storage.py; None: plain)
                 qk_norm_eps: float | None = None,  # an RMSNorm over each query and each key head, before RoPE (Qwen3,
                 # Gemma 3): one gain vector for the queries, one for the keys, shared by the heads; None: none
                 softmax_scale: float | None = None,  # the scores' scale, default head_dim ** -0.5 (Gemma 3:
                 # query_pre_attn_scalar ** -0.5)
                 sliding_window: int | None = None,  # key j seen from query i when i - sliding_window < j <= i (Gemma
                 # 3's sliding layers), without a cache or with this module's; transformers' cache passes its own mask
                 device=None, dtype=None):
        super().__init__()
        self.kv_dtype = kv_dtype
        checks.positive_int("dim", dim)
        checks.positive_int("num_heads", num_heads)
        checks.positive_int("num_kv_heads", num_kv_heads)
        checks.divides(num_heads, num_kv_heads)
        head_dim, v_head_dim, context_dim = checks.head_sizes(dim, num_heads, head_dim, v_head_dim, context_dim)
        self.dim, self.context_dim = dim, context_dim
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim, self.v_head_dim = head_dim, v_head_dim
        self.grouping = check_grouping(grouping)
        kw = dict(device=device, dtype=dtype)
        self.W_Q = nn.Linear(dim, num_heads * head_dim, bias=bias, **kw)
        self.W_K = nn.Linear(context_dim, num_kv_heads * head_dim, bias=bias, **kw)
        self.W_V = nn.Linear(context_dim, num_kv_heads * v_head_dim, bias=bias, **kw)
        self.W_O = nn.Linear(num_heads * v_head_dim, dim, bias=bias, **kw)
        self.rope = None if rope_base is None else RotaryEmbedding(head_dim, rope_base, interleaved=rope_interleaved)
        self._head_options(head_dim, qk_norm_eps, softmax_scale, sliding_window, **kw)

    @property
    def _anchor(self) -> torch.Tensor:
        return self.W_Q.weight

    def config(self) -> dict:
        """Constructor arguments that rebuild this module's shape (see attnlab.io)."""
        return dict(dim=self.dim, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                    v_head_dim=self.v_head_dim, context_dim=self.context_dim, bias=self.W_Q.bias is not None,
                    grouping=self.grouping, rope_base=None if self.rope is None else self.rope.base,
                    rope_interleaved=False if self.rope is None else self.rope.interleaved, kv_dtype=self.kv_dtype,
                    **self._head_config())

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5 if self.softmax_scale is None else self.softmax_scale

    @property
    def kv_values_per_token(self) -> int:
        """Numbers a KV cache stores per token (Part 14): G*(d + dv); 2*D for MHA with d = D/H."""
        return self.num_kv_heads * (self.head_dim + self.v_head_dim)

    def init_cache(self, batch_size: int, max_len: int, *, dtype=None, device=None, kv_dtype=None,
                   sliding: bool = True) -> KVCache:
        """A preallocated cache of K and V for num_kv_heads heads.

        dtype: the activation dtype it takes and returns (default the weights'); kv_dtype: its storage
        (default self.kv_dtype; None: plain in dtype). With a sliding_window, the cache keeps only the
        tokens a later query can see (modules/cache.py); sliding=False keeps every token (a fixed-shape step)."""
        return KVCache(self, batch_size, max_len, self.num_kv_heads, self.head_dim, self.v_head_dim,
                       dtype=dtype or self._anchor.dtype, device=device or self._anchor.device,
                       kv_dtype=kv_dtype if kv_dtype is not None else self.kv_dtype,
                       window=window_for(self.sliding_window, kv_dtype or self.kv_dtype, sliding))

    def project_kv(self, source: torch.Tensor, positions: torch.Tensor | None = None):
        """K (B, G, S, d) and V (B, G, S, dv) of a sequence, RoPE applied to K at `positions`."""
        B, S, _ = source.shape
        k = self.W_K(source).view(B, S, self.num_kv_heads, self.head_dim)
        if self.k_head_norm is not None:
            k = self.k_head_norm(k)
        k = k.transpose(1, 2)  # (B, G, S, d)
        v = self.W_V(source).view(B, S, self.num_kv_heads, self.v_head_dim).transpose(1, 2)  # (B, G, S, dv)
        if self.rope is not None:
            k = self.rope(k, positions if positions is not None else torch.arange(S, device=source.device))
        return k, v

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None, *,
                mask: torch.Tensor | None = None,  # bool (True = may attend) or additive float, to (B, H, L, S)
                key_padding_mask: torch.Tensor | None = None,  # (B, S) bool, True for real tokens
                is_causal: bool = False,  # bottom-right aligned
                cache: KVCache | None = None, positions: torch.Tensor | None = None) -> torch.Tensor:
        """x (B, L, dim), context (B, S, context_dim) or None for self-attention -> (B, L, dim).

        cache: from init_cache(); the new K/V are appended and everything cached is attended. Without one (or with
        transformers' cache), K/V go through self.kv_dtype's storage first. positions: RoPE positions of x, (L,) or
        (B, L); default cache.length + arange(L)."""
        source, positions, mask = self._prepare(x, context, cache, positions, mask,
                                                key_padding_mask, self.num_heads)
        B, L, _ = x.shape
        q = self.W_Q(x).view(B, L, self.num_heads, self.head_dim)
        if self.q_head_norm is not None:
            q = self.q_head_norm(q)
        q = q.transpose(1, 2)  # (B, H, L, d)
        if self.rope is not None:
            q = self.rope(q, positions)
        ours = isinstance(cache, KVCache)  # else no cache, or transformers' (adapters.TransformersCache)
        plain = None  # K, V before their storage: an evaluation-only storage's "+w<N>" (KIVI's residual)
        # k, v below: tensors, or QuantisedKV rows of a quantised cache of ours
        if cache is not None and cache.static:
            k, v = cache.view_stored() if ours else cache.view()  # (B, G, S, d), (B, G, S, dv)
        else:
            k, v = self.project_kv(source, positions if context is None else None)  # (B, G, S_new, *)
            if not ours:  # no storage of ours: quantise and read back as it would
                plain = self._residual(k, v)
                k, v = self._as_stored(k, (self.head_dim,), "key"), self._as_stored(v, (self.v_head_dim,), "value")
            if cache is not None:
                k, v = cache.extend_stored(k=k, v=v) if ours else cache.extend(k=k, v=v)  # (B, G, S, *)
                cache.static = context is not None
        if self.sliding_window is not None and context is None and (cache is None or ours):
            (mask, _), is_causal = self._windowed(positions, k.shape[-2], mask, cache, ours), False
        if plain is not None:  # each query reads its newest N keys and values plain (modules/recent.py)
            S = k.shape[-2]
            mask = mixed_mask(S, S - plain[0].shape[-2], L, self._kv_format.recent, mask, is_causal, k.device)
            k, v, is_causal = torch.cat([k, plain[0]], -2), torch.cat([v, plain[1]], -2), False
        # llama.cpp's rotated rows read as stored: the query and the output turned instead, as llama.cpp does
        (k, turn_k), (v, turn_v) = rotated_frame(k), rotated_frame(v)
        # int8 codes with one scale per token and head: the scales multiply scores and weights, not the rows
        (k, key_scale), (v, value_scale) = with_row_scale(k), with_row_scale(v)
        o = attend(turned(q, turn_k), k, v, grouping=self.grouping, mask=mask, is_causal=is_causal, scale=self.scale,
                   key_scale=key_scale, value_scale=value_scale)  # (B, H, L, dv)
        o = turned(o, turn_v)
        o = o.transpose(1, 2).reshape(B, L, self.num_heads * self.v_head_dim)  # (B, L, H*dv)
        return self.W_O(o)  # (B, L, dim)

    def _residual(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(K, V) as they came where the storage keeps a recent window plain (an evaluation-only one's "+w<N>", KIVI's
        residual: a call's own rows, so a prefill or a forward without a cache; recent.mixed_mask refuses a later
        chunk whose queries need older plain rows), else None."""
        return None if self._kv_format is None or not self._kv_format.recent else (k, v)

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, context_dim={self.context_dim}, num_heads={self.num_heads}, "
                f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, v_head_dim={self.v_head_dim}, "
                f"grouping={self.grouping!r}")


class MultiHeadAttention(GroupedQueryAttention):
    """Multi-head attention: grouped-query attention with num_kv_heads = num_heads (Part 8)."""

    def __init__(self, dim: int, num_heads: int, *, head_dim: int | None = None, v_head_dim: int | None = None,
                 context_dim: int | None = None, bias: bool = False, rope_base: float | None = None,
                 rope_interleaved: bool = False, kv_dtype: str | None = None, qk_norm_eps: float | None = None,
                 softmax_scale: float | None = None, sliding_window: int | None = None, device=None, dtype=None):
        super().__init__(dim, num_heads, num_heads, head_dim=head_dim, v_head_dim=v_head_dim,
                         context_dim=context_dim, bias=bias, rope_base=rope_base,
                         rope_interleaved=rope_interleaved, kv_dtype=kv_dtype, qk_norm_eps=qk_norm_eps,
                         softmax_scale=softmax_scale, sliding_window=sliding_window, device=device, dtype=dtype)
