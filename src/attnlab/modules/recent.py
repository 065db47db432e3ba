"""A recent window kept plain: each query reads its newest N cached rows unquantised, the older ones as stored.

A quantised latent cache ("int3/g64+c4+w16", modules/storage.py: the "+w<N>" suffix) stores every
row's codes as it is written, and beside them keeps the newest N rows in the activation dtype, the
way KIVI keeps its newest keys and values. Decoding, a query at position i then reads rows
i - N < j <= i plain and rows j <= i - N as stored. The N plain rows are a fixed cost a sequence
(N x (r + p) values a layer, whatever its length): `_Cache.fixed_bytes` counts them and the
planner prices them at a context (shrink/sizes.py), like a "+c4" rope key's newest group.

`RecentRows` is that ring for one LatentCache: it updates on every write and hands a call the
plain rows its queries need. `mixed_keys` is the attention side, one computation for every path
(a forward without a cache, a prefill, a decode step): the keys become the stored rows of
positions 0..S-1 followed by the plain rows of positions tail_start..S-1, and the mask lets query
i (the last L of the S positions) see a stored row j only where j <= i - N and a plain row only
where i - N < j <= i, on top of what the caller's mask or causality allowed. A forward without a
cache therefore computes what decoding one token at a time through the cache computes (for a
storage whose rows quantise one token at a time; a "+c4" rope key's groups differ as they do
without the window). Training through it (a heal) sees the same mix, so a healed model learns the
cache it will run with.
"""
from __future__ import annotations

import torch

from .attention import causal_mask


class RecentRows:
    """The newest `size` rows of a cache buffer (B, S_max, width), plain, oldest first: rows[:, :k] hold positions
    length - k .. length - 1 with k = min(length, size)."""

    def __init__(self, batch_size: int, size: int, width: int, dtype: torch.dtype, device):
        self.size = size
        self.rows = torch.zeros(batch_size, size, width, dtype=dtype, device=device)  # (B, N, width)

    def tail(self, length: int) -> tuple[torch.Tensor, int]:
        """(rows, start) before new rows are written after `length` tokens: the plain rows the new queries read
        that are already held (the last size - 1 of them, positions start .. length - 1), a copy."""
        keep = min(length, self.size - 1)
        k = min(length, self.size)
        return self.rows[:, k - keep:k].clone(), length - keep

    def push(self, length: int, new: torch.Tensor) -> None:
        """New rows (B, n, width) written after `length` tokens: keep the newest `size`."""
        k = min(length, self.size)
        joined = torch.cat([self.rows[:, :k], new.to(self.rows.dtype)], dim=1)[:, -self.size:]
        self.rows[:, :joined.shape[1]] = joined

    def truncate(self, length: int, old_length: int, stored: torch.Tensor, start: int = 0) -> None:
        """Keep the first `length` of `old_length` tokens: the ring's positions length - k .. length - 1, taken from
        the old ring where it still held them and otherwise from `stored` (B, rows, width), the rows held as the
        cache reads them back, from position `start` (their plain values are gone)."""
        k, k_old = min(length, self.size), min(old_length, self.size)
        first_old = old_length - k_old  # the oldest position the ring held
        rows = stored[:, length - k - start:length - start].to(self.rows.dtype).clone()  # (B, k, width)
        for n, pos in enumerate(range(length - k, length)):
            if pos >= first_old:
                rows[:, n] = self.rows[:, pos - first_old]
        self.rows[:, :k] = rows

    def rows_of(self, batch_size: int) -> "RecentRows":
        part = RecentRows.__new__(RecentRows)
        part.size, part.rows = self.size, self.rows[:batch_size]
        return part


def mixed_keys(stored: torch.Tensor, plain: torch.Tensor, tail_start: int, query_len: int, size: int,
               mask: torch.Tensor | None, is_causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows (B, S + S - tail_start, width), mask (..., L, that many)): stored rows of positions 0..S-1, then the
    plain rows (B, S - tail_start, width) of positions tail_start..S-1, and mixed_mask's mask over them."""
    joined = mixed_mask(stored.shape[1], tail_start, query_len, size, mask, is_causal, stored.device)
    return torch.cat([stored, plain.to(stored.dtype)], dim=1), joined


def mixed_mask(S: int, tail_start: int, query_len: int, size: int, mask: torch.Tensor | None, is_causal: bool,
               device=None) -> torch.Tensor:
    """The mask (..., L, 2S - tail_start) over S stored rows then the plain rows of positions tail_start..S-1: query
    l (position S - L + l) sees a plain row within its newest `size` positions and a stored row only outside them
    (module docstring). `mask` (bool, True = seen, or additive float, key axis S) and is_causal: what the call
    allowed before; the result needs is_causal False."""
    L = query_len
    if tail_start > S - L - size + 1 and tail_start > 0:
        raise ValueError(f"the plain rows start at position {tail_start}; queries {S - L}..{S - 1} with a recent "
                         f"window of {size} need them from {max(0, S - L - size + 1)}")
    i = torch.arange(S - L, S, device=device)[:, None]  # (L, 1): each query's position
    j = torch.arange(S, device=device)[None]  # (1, S)
    recent = (j > i - size) & (j <= i)  # (L, S): read plain
    if mask is None:
        base = causal_mask(L, S, device) if is_causal else None
    elif is_causal:
        c = causal_mask(L, S, device)
        base = mask & c if mask.dtype == torch.bool else mask.masked_fill(~c, float("-inf"))
    else:
        base = mask
    if base is None:
        parts = [~recent, recent[:, tail_start:]]
    elif base.dtype == torch.bool:
        parts = [base & ~recent, base[..., tail_start:] & recent[:, tail_start:]]
    else:
        parts = [base.masked_fill(recent, float("-inf")), base[..., tail_start:].masked_fill(~recent[:, tail_start:],
                                                                                          float("-inf"))]
    shape = torch.broadcast_shapes(parts[0].shape[:-1], parts[1].shape[:-1])
    return torch.cat([p.expand(*shape, p.shape[-1]) for p in parts], dim=-1)  # (..., L, 2S - tail_start)
