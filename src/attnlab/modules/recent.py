"""A recent window kept plain ("+w<N>"): each query reads its newest N cached rows unquantised, older ones as stored.

`RecentRows` is the ring of a LatentCache's newest N rows, as KIVI keeps its newest keys and values (a fixed cost a
sequence: `_Cache.fixed_bytes`, priced by shrink/sizes.py). `mixed_keys`/`mixed_mask`, the attention side, serve every
path, so a forward without a cache (a heal too) computes what one-token decoding does (a "+c4" key's groups aside).
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
    (i - size < j <= i). `mask` (bool, True = seen, or additive float, key axis S) and is_causal: what the call
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
