"""The first rows kept plain ("+s<N>", an attention sink): every query reads positions 0..N-1 unquantised.

A "+s<N>" storage (modules/storage.py) still codes every row but keeps rows 0..N-1 plain beside the codes (a fixed
cost a sequence, in fixed_bytes, like a "+w<N>" window); a "+c4" rope key leaves them out of its first group's range.
`SinkRows` holds them for one cache buffer; `without_sinks` is what the codes see (the caches and storage.round_trip).
"""
from __future__ import annotations

import torch


def without_sinks(x: torch.Tensor, size: int, start: int = 0) -> torch.Tensor:
    """Rows x (..., S, W) of positions start..start+S-1 with positions below `size` replaced by position size's row
    (which must be among them where any is): what the codes of a "+s<N>" storage see. x itself when none is."""
    if start >= size or x.shape[-2] == 0:
        return x
    if start + x.shape[-2] <= size:
        raise ValueError(f"rows of positions {start}..{start + x.shape[-2] - 1} hold no row after the {size} sink rows")
    out = x.clone()
    out[..., :size - start, :] = x[..., size - start:size - start + 1, :]
    return out


# Small models put much of their attention on a sequence's first token, so a few-bit code of that row costs more
# than any other's.
class SinkRows:
    """Positions 0..size-1 of a cache buffer (B, S_max, width), plain, as they were written."""

    def __init__(self, batch_size: int, size: int, width: int, dtype: torch.dtype, device):
        self.size = size
        self.rows = torch.zeros(batch_size, size, width, dtype=dtype, device=device)  # (B, N, width)

    def push(self, length: int, new: torch.Tensor) -> None:
        """New rows (B, n, width) written after `length` tokens: keep those of positions below size."""
        if length < self.size:
            k = min(self.size - length, new.shape[1])
            self.rows[:, length:length + k] = new[:, :k].to(self.rows.dtype)

    def patch(self, rows: torch.Tensor) -> None:
        """Write the sink positions' plain rows over rows (B, S, width) of positions 0.. as stored, in place."""
        k = min(self.size, rows.shape[1])
        rows[:, :k] = self.rows[:, :k].to(rows.dtype)

    def rows_of(self, batch_size: int) -> "SinkRows":
        part = SinkRows.__new__(SinkRows)
        part.size, part.rows = self.size, self.rows[:batch_size]
        return part
