"""Scoring in transformers' own forward: a runner with CacheRunner's interface (reset, feed) over KVCache."""
from __future__ import annotations

import torch

from ..models.adapters import cache_keyword


class TransformersRunner:
    """A transformers causal LM in its own attention, fed through KVCache(model, kv_dtype, value_bases, kept_dtype)
    any number of tokens a call, as decoding reads the cache; models.evaluate.score_windows(..., runner=) scores with
    it. Batch of one."""

    def __init__(self, model, kv_dtype=None, value_bases=None, kept_dtype=None):
        self.model, self.kv_dtype, self.value_bases, self.kept_dtype = model, kv_dtype, value_bases, kept_dtype
        self.reset()  # KVCache refuses what is not a transformers model of a family attnlab knows
        self._keyword = cache_keyword(model.forward)

    def reset(self) -> None:
        """A fresh cache: every token forgotten."""
        from .cache import KVCache

        self.cache = KVCache(self.model, self.kv_dtype, self.value_bases, self.kept_dtype)
        self.length = 0

    @torch.no_grad()
    def feed(self, ids: torch.Tensor, *, last_only: bool = False) -> torch.Tensor:
        """Append token ids (1, n) to the cache; logits (1, n, V) of every position fed (last_only: (1, 1, V))."""
        out = self.model(ids, use_cache=True, logits_to_keep=1 if last_only else 0, **{self._keyword: self.cache})
        self.length += ids.shape[1]
        return out.logits
