"""What every attention module does before its own math: check inputs, find positions; its KV storage."""
from __future__ import annotations

import torch
from torch import nn

from . import checks
from .attention import with_key_padding
from .cache import _Cache
from .storage import StorageFormat, check_kv_dtype, round_trip
from .rope import default_positions


class AttentionModule(nn.Module):
    """Base of GroupedQueryAttention and MultiHeadLatentAttention.

    Subclasses set dim, context_dim, num_heads and `_anchor`, a weight whose
    dtype and device inputs must match.
    """

    dim: int
    context_dim: int
    _kv_format: StorageFormat | None = None

    @property
    def kv_dtype(self) -> str | None:
        """How this module's caches store keys and values ("fp32", "bf16", "int8", "fp8", "int8/g<N>",
        "fp8/g<N>"; None: plain, in the activation dtype). init_cache defaults to it, and a forward without
        one of attnlab's caches passes what it would cache through that storage (quantised and read back),
        so that it equals cached decode. Part of config(); see modules/cache.py."""
        return None if self._kv_format is None else self._kv_format.name

    @kv_dtype.setter
    def kv_dtype(self, value) -> None:
        fmt = check_kv_dtype(value)
        if fmt is not None and fmt.evaluation_only and not self.separate_keys:
            what = "KIVI) quantises separate keys per channel and values per token" if fmt.low.kind == "kivi" else \
                "transformers' QuantizedCache) codes a GQA's separate keys and values"
            raise ValueError(f"kv_dtype {value!r} ({what}; a {type(self).__name__} caches one latent row: use "
                             "int4/g<N>, int2/g<N> or q4_0")
        if fmt is not None and fmt.value is not None and not self.separate_keys:
            key = fmt.for_role("key").name
            raise ValueError(f"kv_dtype {value!r} stores keys and values in different types, and a "
                             f"{type(self).__name__} caches one latent row: use one type, e.g. {key!r}")
        if fmt is not None and fmt.recent and self.separate_keys and not fmt.evaluation_only:
            raise ValueError(f"kv_dtype {value!r}: a recent window (+w{fmt.recent}) keeps an MLA's newest latent rows "
                             f"plain; a {type(self).__name__} caches keys and values apart: use "
                             f"{fmt.base_name!r}")
        self._kv_format = fmt

    separate_keys = True  # whether the cache holds keys and values apart (KIVI treats them differently)
    sliding_window: int | None = None  # self-attention to the last sliding_window positions (set by subclasses)
    softmax_scale: float | None = None
    # q_head_norm, k_head_norm: set by _head_options (no class defaults: they would hide registered submodules)

    def _head_options(self, head_dim: int, qk_norm_eps, softmax_scale, sliding_window, **kw) -> None:
        """Validate and set the per-head options GQA and MLA share: q/k RMSNorms over each head (qk_norm_eps),
        the scores' scale, the sliding window. One-line ValueErrors naming the value."""
        for name, value in (("qk_norm_eps", qk_norm_eps), ("softmax_scale", softmax_scale)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
                raise ValueError(f"{name} must be a positive number or None, got {value!r}")
        if sliding_window is not None:
            checks.positive_int("sliding_window", sliding_window)
        self.softmax_scale = None if softmax_scale is None else float(softmax_scale)
        self.sliding_window = sliding_window
        self.q_head_norm = self.k_head_norm = None
        if qk_norm_eps is not None:
            self.q_head_norm = nn.RMSNorm(head_dim, eps=float(qk_norm_eps), **kw)
            self.k_head_norm = nn.RMSNorm(head_dim, eps=float(qk_norm_eps), **kw)

    def _head_config(self) -> dict:
        return dict(qk_norm_eps=None if self.k_head_norm is None else self.k_head_norm.eps,
                    softmax_scale=self.softmax_scale, sliding_window=self.sliding_window)

    def _window(self, positions: torch.Tensor, S: int, mask: torch.Tensor | None, start: int = 0) -> torch.Tensor:
        """The sliding window as a mask over keys at positions start..start+S-1, (L, S) or (B, 1, L, S), merged
        with `mask`: key j is seen from query position i when i - sliding_window < j <= i (causal by
        construction). start: the position of the first key (a window cache's key_start; 0 otherwise)."""
        q = positions[..., :, None]  # (L, 1) or (B, L, 1)
        j = torch.arange(start, start + S, device=positions.device)
        band = (j <= q) & (j > q - self.sliding_window)  # (L, S) or (B, L, S)
        if band.dim() == 3:
            band = band[:, None]  # (B, 1, L, S)
        if mask is None:
            return band
        if mask.dtype == torch.bool:
            return mask & band
        return mask.masked_fill(~band, float("-inf"))

    def _windowed(self, positions: torch.Tensor, S: int, mask: torch.Tensor | None, cache, ours: bool):
        """(mask, key_start) for S keys of a self-attention call with the sliding window: the window's band merged
        with `mask`, whose key axis (every position so far, as _prepare made it) is cut to the S keys a window
        cache returned."""
        start = cache.key_start if ours and cache is not None else 0
        if mask is not None and mask.shape[-1] > S:
            mask = mask[..., mask.shape[-1] - S:]
        return self._window(positions, S, mask, start), start

    def _as_stored(self, t, parts: tuple[int, ...], role: str | None = None):
        """t (..., W) as a cache of this module's kv_dtype would return it (t itself when kv_dtype is None);
        role: "key" or "value" where the storage treats them apart (KIVI)."""
        return t if self._kv_format is None else round_trip(t, self._kv_format, parts, role)

    def _prepare(self, x, context, cache: _Cache | None, positions, mask, key_padding_mask, query_heads: int):
        """Validate; return (source of keys, query positions, merged mask or None)."""
        anchor = self._anchor
        checks.sequence("x", x, self.dim, anchor)
        B, L, _ = x.shape
        if context is not None:
            checks.sequence("context", context, self.context_dim, anchor)
            checks.same_batch(x, context)
        elif self.context_dim != self.dim:
            raise ValueError(f"this module attends to a context of width {self.context_dim} "
                             f"(context_dim != dim = {self.dim}); pass context=")
        offset = 0
        if cache is not None:
            if not isinstance(cache, _Cache):
                raise TypeError(f"cache must come from init_cache(), got {type(cache).__name__}")
            cache.check_owner(self, B, x.dtype)
            if context is None and cache.static:
                raise ValueError("this cache holds a cross-attention context; pass context= as when it was filled")
            if context is not None and cache.length and not cache.static:
                raise ValueError(f"this cache holds {cache.length} self-attention tokens; "
                                 "a cross-attention call needs a fresh cache")
            if context is None:
                offset = cache.length
        if positions is None:
            positions = default_positions(offset, L, x.device)
        elif tuple(positions.shape) not in ((L,), (B, L)):
            raise ValueError(f"positions must have shape (L,) = ({L},) or (B, L) = ({B}, {L}), "
                             f"got {tuple(positions.shape)}")
        source = x if context is None else context
        if cache is not None and cache.static:
            S = cache.length
        else:
            S = source.shape[1] + (cache.length if cache is not None and context is None else 0)
        mask = with_key_padding(mask, key_padding_mask, (B, query_heads, L, S), x.dtype)
        return source, positions, mask
