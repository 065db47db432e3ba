"""Multi-head latent attention (DeepSeek-V2/V3's MLA), with the study's absorbed form (Part 12).

Keys and values of every head come from one latent per position, c = W_DKV y (r numbers, optionally RMS-normalised);
with rope_dim p > 0 a shared key k_R = RoPE(W_KR y) of p numbers sits beside it (DeepSeek's decoupled RoPE), so a
cache holds r + p numbers a token. `MultiHeadLatentAttention`; its paths and layouts: the comments above the class.
"""
from __future__ import annotations

import warnings

import torch
from torch import nn

from . import checks
from .absorbed import AbsorbedPath
from .attention import attend
from .base import AttentionModule
from .cache import KVCache, LatentCache, window_for
from .storage import check_kv_dtype, dense
from .heads import check_grouping
from .recent import mixed_keys
from .rope import RotaryEmbedding
from .rope_key import RopeKeyPerHead
from .tiling import GQATiling


# Notation: B batch, L query length, S key length, H heads, d = head_dim (the no-RoPE part of a query/key head),
# p = rope_dim, dv = v_head_dim, r = latent_dim. Two ways to attend, with the same result:
# - expanded: K_h = W_UK_h c and V_h = W_UV_h c for every head, then ordinary attention (S*r*H*(d + dv) a call just
#   to rebuild K and V).
# - absorbed (Part 12, modules/absorbed.py): q_nope_h . (W_UK_h c) = (W_UK_h^T q_nope_h) . c, so all H heads attend to
#   the one latent in a single product (heads folded into rows) and W_UV_h is applied to the r-dim result afterwards;
#   nothing is up-projected per cached token. A key bias on W_UK adds the same number to every score of a query row,
#   which softmax ignores; a value bias on W_UV is added back after attention.
# `rope_after_up=True`, what an exact conversion of a RoPE'd GQA gives: the latent holds the keys before rotation, and
# RoPE over the whole head_dim is applied to queries and up-projected keys. The rotation sits between W_UK and the dot
# product, so only the expanded path: it saves cache memory, not the up-projection. Cached keys sit at 0, 1, ..., S-1.
# The GQA tiling (`kv_tiling`, found by `detect_kv_tiling`, set by the exact convert.gqa_to_mla; modules/tiling.py):
# the latent is [K of G heads, V of G heads] (r = G*(d + dv)) and W_UK, W_UV are 0/1 matrices that hand each query
# head its group's slices, so nothing is up-projected: the cache stores what the GQA's would (keys rotated at their
# positions and with their bias, values with theirs: selection commutes with RoPE), in a GQA's KVCache from
# init_cache (K (B, G, S, d) and V (B, G, S, dv)), read as GQA reads it; the general paths read it as latent rows.
# The tiling is checked against the weights before every call (by version counter): once W_UK/W_UV stop being it
# (training) the general paths take over, and a cache filled in the tiled layout is refused. An explicit `absorbed=`
# also takes the general paths.
# A rope key per KV head and the keys-whole layout (`rope_kv_heads=G`, what Qwen3's and Gemma 3's per-head q/k norms
# convert to): modules/rope_key.py.
# Quantised storage (`kv_dtype`, modules/storage.py): codes and scales, one scale per token for c and one for k_R (a
# tiled module's KVCache: one per token and KV head of K and of V). Every path reads the rows dequantised, except the
# absorbed decode kernel (kernels/mla_decode.py), which dequantises in its tile load. Without a cache the new [c, k_R]
# go through the same quantisation before attention, so a whole-sequence forward equals cached decode.
class MultiHeadLatentAttention(GQATiling, RopeKeyPerHead, AbsorbedPath, AttentionModule):
    """Attention whose keys and values are up-projected from a shared low-rank latent (the comments above).

    The arguments are described beside them in __init__'s signature; dim, num_heads, head_dim, v_head_dim,
    context_dim, softmax_scale and sliding_window are as in GroupedQueryAttention. A latent_dim above
    min(H*(d + dv), context_dim) compresses nothing; it is allowed (exact conversions make it) with a warning."""

    separate_keys = False  # one latent row per token: KIVI's key/value split does not apply

    def __init__(self, dim: int, num_heads: int,
                 latent_dim: int, *,  # r, the size of the latent c = W_DKV y shared by keys and values
                 head_dim: int | None = None, v_head_dim: int | None = None, context_dim: int | None = None,
                 rope_dim: int = 0,  # p > 0: DeepSeek's decoupled RoPE, p more query dims a head and one shared p-dim
                 # rotary key a position, cached beside the latent
                 q_latent_dim: int | None = None,  # queries through a low-rank bottleneck W_UQ RMSNorm(W_DQ x)
                 latent_norm: bool = False,  # an RMSNorm on the latent before it is cached (as DeepSeek's)
                 bias: bool = False,  # biases on W_Q (or W_UQ), W_UK, W_UV and W_O
                 latent_bias: bool = False,  # biases on the down-projections W_DKV, W_KR and W_DQ
                 softmax_scale: float | None = None,  # default 1/sqrt(head_dim + rope_dim)
                 rope_base: float = 10000.0, rope_interleaved: bool = False,  # the rope dims' rotary embedding
                 rope_after_up: bool = False,  # instead of decoupled RoPE, rotate queries and up-projected keys over
                 # the whole head_dim (exact GQA -> MLA of RoPE models; expanded path only)
                 norm_eps: float = 1e-6,  # the eps of latent_norm's and the query bottleneck's RMSNorms
                 kv_tiling: str | None = None,  # "strided" or "blocked": W_UK/W_UV set to the 0/1 GQA tiling of a
                 # latent [K of G heads, V of G heads], G = latent_dim / (head_dim + v_head_dim)
                 kv_dtype: str | None = None,  # the cache's storage (modules/storage.py; None: plain)
                 qk_norm_eps: float | None = None,  # an RMSNorm over each query and key head before RoPE (body)
                 sliding_window: int | None = None,
                 rope_kv_heads: int | None = None,  # G: a rope key per KV head (modules/rope_key.py; body)
                 rope_grouping: str = "strided",  # which KV head each query head reads, as GQA's grouping
                 device=None, dtype=None):
        super().__init__()
        self.kv_dtype = kv_dtype
        checks.positive_int("dim", dim)
        checks.positive_int("num_heads", num_heads)
        checks.positive_int("latent_dim", latent_dim)
        checks.non_negative_int("rope_dim", rope_dim)
        if rope_dim % 2:
            raise ValueError(f"rope_dim must be even (RoPE rotates pairs), got {rope_dim}")
        if rope_after_up and rope_dim:
            raise ValueError(f"rope_after_up rotates the whole head; it excludes a decoupled rope_dim ({rope_dim})")
        # rope_kv_heads=G: G rope-key parts of w = rope_dim / G dims each (w even), each query head reading its own.
        # With head_dim 0 (the keys-whole layout) the parts are the KV heads' whole keys; v_head_dim defaults to w.
        if rope_kv_heads is not None and not head_dim:  # keys whole: no no-RoPE query/key dims
            norm_dim = self._rope_part(num_heads, rope_dim, rope_kv_heads, rope_after_up, kv_tiling)
            _, v_head_dim, context_dim = checks.head_sizes(dim, num_heads, norm_dim, v_head_dim, context_dim)
            head_dim = 0
            check_grouping(rope_grouping)
        elif rope_kv_heads is not None:  # a rope key per KV head beside a no-RoPE part
            self._rope_part(num_heads, rope_dim, rope_kv_heads, rope_after_up, kv_tiling)
            head_dim, v_head_dim, context_dim = checks.head_sizes(dim, num_heads, head_dim, v_head_dim, context_dim)
            norm_dim = head_dim
            check_grouping(rope_grouping)
            if qk_norm_eps is not None:
                raise ValueError(f"qk_norm_eps with rope_kv_heads ({rope_kv_heads}) needs head_dim 0 (each KV head's "
                                 f"whole key in the rope key), got head_dim {head_dim}")
        else:
            head_dim, v_head_dim, context_dim = checks.head_sizes(dim, num_heads, head_dim, v_head_dim, context_dim)
            norm_dim = head_dim
        if q_latent_dim is not None:
            checks.positive_int("q_latent_dim", q_latent_dim)
        useful = min(num_heads * (head_dim + v_head_dim), context_dim)
        if latent_dim > useful:
            warnings.warn(f"latent_dim ({latent_dim}) exceeds min(H*(head_dim + v_head_dim), context_dim) = "
                          f"{useful}: the latent cannot have full rank and saves nothing", stacklevel=2)
        self.dim, self.context_dim, self.num_heads = dim, context_dim, num_heads
        self.head_dim, self.v_head_dim, self.rope_dim = head_dim, v_head_dim, rope_dim
        self.latent_dim, self.q_latent_dim = latent_dim, q_latent_dim
        kw = dict(device=device, dtype=dtype)
        # qk_norm_eps: with rope_after_up or no RoPE it normalises the up-projected key heads, which is not linear in
        # the latent: no absorbed path (the expanded and GQA-tiled ones carry it). With a decoupled rope_dim, keys
        # whole only: it normalises each KV head's d dims of the rope key before RoPE and the cache, and each query
        # head's own d rope dims. Elsewhere the key norm would be a per-token scalar the latent cache does not hold.
        if qk_norm_eps is not None and rope_dim and rope_kv_heads is None:
            raise ValueError(f"qk_norm_eps with a decoupled rope_dim ({rope_dim}) needs the keys-whole layout: "
                             f"rope_kv_heads=G with rope_dim = G x d (each KV head's whole key of d dims) and "
                             f"head_dim 0, got rope_kv_heads=None and head_dim={head_dim}; elsewhere the key norm "
                             "is a per-token scalar the latent cache does not hold")
        self.rope_kv_heads = rope_kv_heads
        self.rope_grouping = rope_grouping if rope_kv_heads is not None else None
        self._rope_own: dict = {}  # each head's own rope part: ("index", device), ("mask", device, dtype)
        self._head_options(norm_dim, qk_norm_eps, softmax_scale, sliding_window, **kw)
        q_out = num_heads * (head_dim + rope_dim)
        if q_latent_dim is None:
            self.W_Q = nn.Linear(dim, q_out, bias=bias, **kw)
            self.W_DQ = self.q_norm = self.W_UQ = None
        else:
            self.W_Q = None
            self.W_DQ = nn.Linear(dim, q_latent_dim, bias=latent_bias, **kw)
            self.q_norm = nn.RMSNorm(q_latent_dim, eps=norm_eps, **kw)
            self.W_UQ = nn.Linear(q_latent_dim, q_out, bias=bias, **kw)
        self.W_DKV = nn.Linear(context_dim, latent_dim, bias=latent_bias, **kw)
        self.W_KR = nn.Linear(context_dim, rope_dim, bias=latent_bias, **kw) if rope_dim else None
        self.kv_norm = nn.RMSNorm(latent_dim, eps=norm_eps, **kw) if latent_norm else None
        with warnings.catch_warnings():  # keys whole: W_UK has no rows (head_dim 0), torch warns on empty init
            warnings.filterwarnings("ignore", message="Initializing zero-element tensors")
            self.W_UK = nn.Linear(latent_dim, num_heads * head_dim, bias=bias, **kw)
        self.W_UV = nn.Linear(latent_dim, num_heads * v_head_dim, bias=bias, **kw)
        self.W_O = nn.Linear(num_heads * v_head_dim, dim, bias=bias, **kw)
        self.rope_after_up = bool(rope_after_up)
        rotated = head_dim if rope_after_up else rope_dim
        self.rope = RotaryEmbedding(rotated, rope_base, interleaved=rope_interleaved) if rotated else None
        self._absorbed_cache: tuple | None = None
        self._tiling_verdict: tuple | None = None
        self.kv_tiling = None
        if kv_tiling is not None:
            check_grouping(kv_tiling)
            G = self._tiling_groups()
            if G is None or rope_dim:
                raise ValueError(f"kv_tiling needs rope_dim 0 (got {rope_dim}) and latent_dim ({latent_dim}) = G * "
                                 f"(head_dim + v_head_dim) = G * {head_dim + v_head_dim} with G dividing num_heads "
                                 f"({num_heads})")
            up_k, up_v = self._tiling_weights(G, kv_tiling)
            with torch.no_grad():
                self.W_UK.weight.copy_(up_k)
                self.W_UV.weight.copy_(up_v)
            self.kv_tiling = kv_tiling

    @property
    def _anchor(self) -> torch.Tensor:
        return self.W_DKV.weight

    def config(self) -> dict:
        """Constructor arguments that rebuild this module's shape (see attnlab.io)."""
        q_proj = self.W_Q if self.W_Q is not None else self.W_UQ
        norm = self.kv_norm or self.q_norm
        return dict(dim=self.dim, num_heads=self.num_heads, latent_dim=self.latent_dim, head_dim=self.head_dim,
                    v_head_dim=self.v_head_dim, context_dim=self.context_dim, rope_dim=self.rope_dim,
                    q_latent_dim=self.q_latent_dim, latent_norm=self.kv_norm is not None,
                    bias=q_proj.bias is not None, latent_bias=self.W_DKV.bias is not None,
                    rope_base=self.rope.base if self.rope else 10000.0,
                    rope_interleaved=bool(self.rope and self.rope.interleaved), rope_after_up=self.rope_after_up,
                    norm_eps=norm.eps if norm is not None else 1e-6, kv_tiling=self.kv_tiling,
                    kv_dtype=self.kv_dtype, **self._head_config(),
                    **(dict(rope_kv_heads=self.rope_kv_heads, rope_grouping=self.rope_grouping)
                       if self.rope_kv_heads is not None else {}))

    @property
    def scale(self) -> float:
        if self.softmax_scale is not None:
            return self.softmax_scale
        return (self.head_dim + self.rope_dim) ** -0.5

    @property
    def kv_values_per_token(self) -> int:
        """Numbers the cache stores per token (Part 14): r, plus rope_dim for the shared rotary key."""
        return self.latent_dim + self.rope_dim

    def init_cache(self, batch_size: int, max_len: int, *, dtype=None, device=None, kv_dtype=None,
                   sliding: bool = True) -> LatentCache | KVCache:
        """A preallocated cache of the latent (and the shared rotary key) only; with kv_tiling, the GQA's K and V
        as a GQA's KVCache holds them (the comments above the class).

        dtype: the activation dtype it takes and returns (default the weights'); kv_dtype: its storage
        (default self.kv_dtype; None: plain in dtype). sliding: as in GroupedQueryAttention.init_cache."""
        kw = dict(dtype=dtype or self._anchor.dtype, device=device or self._anchor.device,
                  kv_dtype=kv_dtype if kv_dtype is not None else self.kv_dtype,
                  window=window_for(self.sliding_window, kv_dtype or self.kv_dtype, sliding))
        if self.kv_tiling is not None:
            return KVCache(self, batch_size, max_len, self._tiling_groups(), self.head_dim, self.v_head_dim, **kw)
        return LatentCache(self, batch_size, max_len, self.latent_dim, self.rope_dim, parts=self._kv_parts(), **kw)

    def _kv_parts(self) -> tuple[int, ...]:
        """The widths a quantised cache row gives a scale each: (r, p), or with kv_tiling the KV heads of K and V."""
        G = self._tiling_groups() if self.kv_tiling is not None else None
        if G is not None:
            return (self.head_dim,) * G + (self.v_head_dim,) * G
        return (self.latent_dim, self.rope_dim) if self.rope_dim else (self.latent_dim,)

    # -- projections ---------------------------------------------------------------------------
    def project_query(self, x: torch.Tensor, positions: torch.Tensor):
        """(q_nope (B, H, L, d), q_rope (B, H, L, p)) with RoPE applied."""
        B, L, _ = x.shape
        q = self.W_Q(x) if self.W_Q is not None else self.W_UQ(self.q_norm(self.W_DQ(x)))  # (B, L, H*(d+p))
        q = q.view(B, L, self.num_heads, self.head_dim + self.rope_dim).transpose(1, 2)  # (B, H, L, d+p)
        q_nope, q_rope = q.split([self.head_dim, self.rope_dim], dim=-1)  # (B, H, L, d), (B, H, L, p)
        if self.rope_kv_heads is not None:
            q_rope = self._own_heads(q_rope)  # its own KV head's dims (keys whole: normalised); the rest zero
        elif self.q_head_norm is not None:
            q_nope = self.q_head_norm(q_nope)
        if self.rope_after_up:
            q_nope = self.rope(q_nope, positions)
        elif self.rope is not None:
            q_rope = self.rope(q_rope, positions)
        return q_nope, q_rope

    def compress(self, source: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """What the cache stores for a sequence: [c, k_R], shape (B, S, r + p)."""
        c = self.W_DKV(source)  # (B, S, r)
        if self.kv_norm is not None:
            c = self.kv_norm(c)
        if self.W_KR is None:
            return c  # (B, S, r); with rope_after_up the keys are rotated after the up-projection
        if positions is None:
            positions = torch.arange(source.shape[1], device=source.device)
        k_rope = self.W_KR(source)  # (B, S, p)
        if self.k_head_norm is not None:  # keys whole: each KV head's key normalised before RoPE, as the GQA did
            k_rope = self._from_heads(self.k_head_norm(self._by_head(k_rope)))  # (B, S, p)
        k_rope = self.rope(k_rope[:, None], positions)[:, 0]  # (B, S, p)
        return torch.cat([c, k_rope], dim=-1)  # (B, S, r+p)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None, *, mask: torch.Tensor | None = None,
                key_padding_mask: torch.Tensor | None = None, is_causal: bool = False,
                cache: LatentCache | None = None, positions: torch.Tensor | None = None,
                absorbed: bool | None = None) -> torch.Tensor:
        """x (B, L, dim), context (B, S, context_dim) or None -> (B, L, dim).

        Masks, cache and positions as in GroupedQueryAttention.forward.
        absorbed: True for Part 12's latent-space path, False for the expanded
        path, None to choose by cost (absorbed when decoding against a cache).
        """
        source, positions, mask = self._prepare(x, context, cache, positions, mask,
                                                key_padding_mask, self.num_heads)
        B, L, _ = x.shape
        q_nope, q_rope = self.project_query(x, positions)  # (B, H, L, d), (B, H, L, p)
        tiled = self._choose_tiled(cache, absorbed)
        ours = isinstance(cache, (LatentCache, KVCache))  # else no cache, or transformers' (adapters.TransformersCache)
        heads = isinstance(cache, KVCache)  # a tiled module's cache: the GQA's K and V (kv_tiling)
        # kv below: a tensor (B, S, r+p) in x's dtype, or QuantisedKV rows of a quantised cache (read by dense()); or,
        # from a tiled module's KVCache, (K (B, G, S, d), V (B, G, S, dv)), tensors or QuantisedKV
        recent = None if context is not None else self._recent_window(cache, ours)  # "+w<N>": N, else None
        tail = tail_start = None  # with a recent window: the plain rows its queries read, from position tail_start
        if cache is not None and cache.static:
            kv = cache.view_stored() if heads else cache.view_stored()[0] if ours else cache.view()[0]
        else:
            if tiled:
                kv = self._tiled_kv(source, positions if context is None else None)  # (B, S_new, r)
            else:
                kv = self.compress(source, positions if context is None else None)  # (B, S_new, r+p)
            # one of five: a recent window without a cache of ours (none, or transformers' holding plain rows), or in
            # ours (its plain rows beside the stored ones); a tiled module's K and V (never with a window); no cache
            # of ours (quantised and read back as ours would, then transformers' cache holds that); our latent cache
            sink = context is None and getattr(self._kv_format, "sink", None)  # "+s<N>": the first N rows plain
            if (recent or sink) and not ours:  # every row kept plain and read as stored too, from position 0
                if cache is not None:
                    (kv,) = cache.extend(kv=kv)  # (B, S, r+p)
                if recent:
                    tail, tail_start = kv, 0  # (B, S, r+p) plain, beside the stored rows
                kv = self._as_stored(kv, self._kv_parts())  # (B, S, r+p)
            elif recent:
                kv, tail, tail_start = cache.extend_recent(kv)  # stored (B, S, r+p); plain (B, M, r+p)
            elif heads:
                k, v = self._heads(kv)
                kv = cache.extend_stored(k=k, v=v)  # (K, V)
            elif not ours:
                kv = self._as_stored(kv, self._kv_parts())  # (B, S_new, r+p)
                if cache is not None:
                    (kv,) = cache.extend(kv=kv)  # (B, S, r+p)
            else:
                (kv,) = cache.extend_stored(kv=kv)  # (B, S, r+p)
            if cache is not None:
                cache.static = context is not None
        if heads and not tiled:  # the general paths read latent rows
            kv = self._rows(*kv)  # (B, S, r)
        S = kv[0].shape[-2] if isinstance(kv, tuple) else kv.shape[1]
        key_start = 0
        if self.sliding_window is not None and context is None and (cache is None or ours):
            (mask, key_start), is_causal = self._windowed(positions, S, mask, cache, ours), False
        if tail is not None:  # each query reads its newest rows plain, the older ones as stored (modules/recent.py)
            kv, mask = mixed_keys(dense(kv), tail, tail_start, L, recent, mask, is_causal)  # (B, 2S - tail_start, r+p)
            is_causal = False
        key_positions = None
        if tiled:
            o = self._tiled(q_nope, kv, mask, is_causal)  # (B, H, L, dv)
            return self.W_O(o.transpose(1, 2).reshape(B, L, self.num_heads * self.v_head_dim))  # (B, L, dim)
        if self.k_head_norm is not None and not self.rope_after_up and not self.rope_dim:  # no RoPE: only the key norm
            if absorbed:
                raise ValueError("qk_norm_eps has no absorbed path: the key norm sits between W_UK and the scores")
            absorbed = False
        if self.rope_after_up:
            if absorbed:
                raise ValueError("rope_after_up has no absorbed path: RoPE sits between W_UK and the scores")
            absorbed = False
            key_positions = positions if cache is None and context is None else None
            if key_start:  # a window cache returned its keys from key_start on
                key_positions = torch.arange(key_start, key_start + kv.shape[1], device=kv.device)
        if absorbed is None:
            absorbed = self.prefers_absorbed(L, kv.shape[1])
        if absorbed:
            o = self._absorbed(q_nope, q_rope, kv, mask, is_causal)  # (B, H, L, dv)
        else:
            o = self._expanded(q_nope, q_rope, dense(kv), mask, is_causal, key_positions)  # (B, H, L, dv)
        o = o.transpose(1, 2).reshape(B, L, self.num_heads * self.v_head_dim)  # (B, L, H*dv)
        return self.W_O(o)  # (B, L, dim)

    def _recent_window(self, cache, ours: bool) -> int | None:
        """N where the storage keeps a recent window of N plain rows ("+w<N>": the cache's own, or without one of
        attnlab's caches the module's kv_dtype; transformers' cache then holds plain rows, read as stored but the
        newest N; a sliding window shorter than N: its size, all its queries see), else None; ValueError where this
        module cannot read one."""
        if cache is not None and ours:  # the cache's own (read without parsing: a compiled step traces this)
            size, name = cache.recent, cache.kv_dtype
        else:
            fmt = self._kv_format
            size, name = (None, None) if fmt is None else (fmt.recent, fmt.name)
        if not size:
            return None
        if self.kv_tiling is not None or self.rope_after_up:
            raise ValueError(f"kv_dtype {name!r}: a recent window is read from latent rows; this module "
                             f"{'caches GQA-tiled K and V' if self.kv_tiling else 'rotates keys after W_UK'}: use "
                             f"{check_kv_dtype(name).base_name!r}")
        return size if self.sliding_window is None else min(size, self.sliding_window)

    def _expanded(self, q_nope, q_rope, kv, mask, is_causal, key_positions=None):
        B, S, _ = kv.shape
        H, r = self.num_heads, self.latent_dim
        c = kv[..., :r]  # (B, S, r)
        k = self.W_UK(c).view(B, S, H, self.head_dim)  # (B, S, H, d)
        if self.k_head_norm is not None and not self.rope_dim:  # keys whole: the rope key was normed in compress()
            k = self.k_head_norm(k)
        k = k.transpose(1, 2)  # (B, H, S, d)
        if self.rope_after_up:
            k = self.rope(k, key_positions if key_positions is not None else torch.arange(S, device=kv.device))
        v = self.W_UV(c).view(B, S, H, self.v_head_dim).transpose(1, 2)  # (B, H, S, dv)
        if self.rope_kv_heads is not None:  # each head dots only its own KV head's w rope dims
            idx = self._rope_index(kv.device)  # (H, w)
            w = idx.shape[1]
            k_rope = kv[..., r:][..., idx.flatten()].view(B, S, H, w).transpose(1, 2)  # (B, H, S, w)
            k = torch.cat([k, k_rope], dim=-1)  # (B, H, S, d+w)
            q_own = q_rope.gather(-1, idx[None, :, None, :].expand(B, H, q_rope.shape[2], w))  # (B, H, L, w)
            q = torch.cat([q_nope, q_own], dim=-1)  # (B, H, L, d+w)
        elif self.rope_dim:
            k_rope = kv[:, None, :, r:].expand(B, H, S, self.rope_dim)  # (B, H, S, p)
            k = torch.cat([k, k_rope], dim=-1)  # (B, H, S, d+p)
            q = torch.cat([q_nope, q_rope], dim=-1)  # (B, H, L, d+p)
        else:
            q = q_nope
        return attend(q, k, v, mask=mask, is_causal=is_causal, scale=self.scale)  # (B, H, L, dv)

    @classmethod
    def from_transformers(cls, attn: nn.Module,
                          rotary: nn.Module | None = None,  # model.model.rotary_emb: its inverse frequencies and
                          # scaling are copied; None: the default RoPE of rope_theta
                          ) -> "MultiHeadLatentAttention":
        """Copy a transformers DeepseekV3Attention or DeepseekV2Attention (same weights and outputs; read by attribute).

        kv_a_proj_with_mqa splits into W_DKV (its first kv_lora_rank rows) and W_KR; kv_b_proj, per head [k_nope
        (qk_nope_head_dim rows), v (v_head_dim rows)], into W_UK and W_UV. With rope_interleave transformers stores
        rotated keys de-interleaved ([even dims, odd dims]), attnlab keeps the pairs in place: the same scores."""
        cfg = attn.config
        H, r, p = attn.num_heads, attn.kv_lora_rank, attn.qk_rope_head_dim
        d, dv = attn.qk_nope_head_dim, attn.v_head_dim
        w = attn.kv_a_proj_with_mqa.weight
        rope_params = getattr(cfg, "rope_parameters", None) or {}
        if rope_params.get("rope_type", "default") != "default" and rotary is None:
            raise ValueError(f"rope_type {rope_params.get('rope_type')!r} needs rotary=<the model's rotary_emb>")
        has_bias = attn.o_proj.bias is not None
        m = cls(attn.hidden_size, H, r, head_dim=d, v_head_dim=dv, rope_dim=p, q_latent_dim=attn.q_lora_rank,
                latent_norm=True, bias=has_bias, latent_bias=attn.kv_a_proj_with_mqa.bias is not None,
                softmax_scale=float(attn.scaling), rope_base=float(rope_params.get("rope_theta", 10000.0)),
                rope_interleaved=bool(getattr(cfg, "rope_interleave", True)),
                norm_eps=float(attn.kv_a_layernorm.variance_epsilon), device=w.device, dtype=w.dtype)
        if rotary is not None and m.rope is not None:
            m.rope = RotaryEmbedding(p, m.rope.base, interleaved=m.rope.interleaved, inv_freq=rotary.inv_freq,
                                     scaling=float(getattr(rotary, "attention_scaling", 1.0)))
        kv_b = attn.kv_b_proj.weight.view(H, d + dv, r)
        with torch.no_grad():
            for lin in (m.W_Q, m.W_UQ, m.W_UK, m.W_UV):  # attnlab's biases that DeepSeek does not have
                if lin is not None and lin.bias is not None:
                    lin.bias.zero_()
            if m.W_Q is not None:
                m.W_Q.weight.copy_(attn.q_proj.weight)
            else:
                m.W_DQ.load_state_dict(attn.q_a_proj.state_dict())
                m.q_norm.weight.copy_(attn.q_a_layernorm.weight)
                m.W_UQ.weight.copy_(attn.q_b_proj.weight)
            m.W_DKV.weight.copy_(w[:r])
            m.W_KR.weight.copy_(w[r:])
            if m.W_DKV.bias is not None:
                m.W_DKV.bias.copy_(attn.kv_a_proj_with_mqa.bias[:r])
                m.W_KR.bias.copy_(attn.kv_a_proj_with_mqa.bias[r:])
            m.kv_norm.weight.copy_(attn.kv_a_layernorm.weight)
            m.W_UK.weight.copy_(kv_b[:, :d].reshape(H * d, r))
            m.W_UV.weight.copy_(kv_b[:, d:].reshape(H * dv, r))
            m.W_O.load_state_dict(attn.o_proj.state_dict())
        return m

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, context_dim={self.context_dim}, num_heads={self.num_heads}, "
                f"latent_dim={self.latent_dim}, head_dim={self.head_dim}, v_head_dim={self.v_head_dim}, "
                f"rope_dim={self.rope_dim}, q_latent_dim={self.q_latent_dim}")
