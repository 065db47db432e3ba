"""A cached MLA row's rope key stored per channel over groups of tokens ("+c4"), beside its per-token latent.

`RopeKeyGroups` holds that state for one cache buffer and does the writing, the reading and a truncate; `_Cache`
(cache.py) owns the packed buffer and the latent's scales and passes them in.
"""
from __future__ import annotations

import copy

import torch

from . import lowbit
from .sink import without_sinks


class RopeKeyGroups:
    """The "+c4" state of one buffer of rows (..., S_max, r + p): the rope key per channel over groups of KEY_TOKENS
    tokens (KIVI's key layout), its float16 meta in `meta`, one row per group; the latent is coded per token. A group's
    scales need all its tokens, so the newest, incomplete group stays in the activation dtype (`recent`, KEY_TOKENS
    rows a sequence) and is coded into the packed buffer when its last token arrives. Reads give dequantised rows; a
    truncate into a coded group puts its kept tokens back into `recent` at their stored values."""

    def __init__(self, shape: tuple[int, ...],  # the buffer's unpacked shape (..., S_max, r + p)
                 parts: tuple[int, int],  # (r, p)
                 low,  # the lowbit format (rope_channel)
                 max_len: int, dtype: torch.dtype, device,
                 sink: int = 0):  # a "+s<N>" storage's first rows kept plain, out of the first group's range (sink.py)
        T = lowbit.KEY_TOKENS
        self.parts, self.low, self.dtype, self.sink = tuple(parts), low, dtype, sink
        self.meta = torch.zeros(*shape[:-2], -(-max_len // T), lowbit.channel_meta(self.parts, low),
                                dtype=lowbit.META_DTYPE, device=device)  # (..., groups, meta per group)
        self.recent = torch.zeros(*shape[:-2], T, self.parts[1], dtype=dtype, device=device)  # (..., T, p)

    def tensors(self) -> list[torch.Tensor]:
        return [self.meta, self.recent]

    def meta_per_group(self) -> int:
        """Meta numbers (float16) per group of KEY_TOKENS tokens."""
        return lowbit.channel_meta(self.parts, self.low)

    def rows_of(self, batch_size: int) -> "RopeKeyGroups":
        """The state of the first `batch_size` sequences, sharing memory (for _Cache.batch_view)."""
        part = copy.copy(self)
        part.meta, part.recent = self.meta[:batch_size], self.recent[:batch_size]
        return part

    def reserve(self, max_len: int) -> None:
        """Meta rows for max_len tokens, the groups held copied (_Cache.reserve)."""
        groups = -(-max_len // lowbit.KEY_TOKENS)
        meta = self.meta.new_zeros(*self.meta.shape[:-2], groups, self.meta.shape[-1])
        kept = min(groups, self.meta.shape[-2])
        meta[..., :kept, :] = self.meta[..., :kept, :]
        self.meta = meta

    def select(self, indices: torch.Tensor) -> None:
        """Keep the sequences at `indices` (_Cache.select_batch)."""
        self.meta, self.recent = self.meta.index_select(0, indices), self.recent.index_select(0, indices)

    def _latent_width(self) -> int:
        return lowbit.packed_row(self.parts[:1], lowbit.per_token(self.low))

    def write(self, buf: torch.Tensor, scales: torch.Tensor, held: int, t: torch.Tensor) -> None:
        """New rows t (..., n, r + p) after the `held` tokens: the latent's codes and meta per token into buf and
        scales now, the rope key into the newest group, quantised per channel once the group's last token is in."""
        r, T = self.parts[0], lowbit.KEY_TOKENS
        n = t.shape[-2]
        codes, meta = lowbit.encode(t[..., :r], (r,), lowbit.per_token(self.low))
        nb = codes.shape[-1]
        buf[..., held:held + n, :nb] = codes
        scales[..., held:held + n, :] = meta
        start = held // T * T
        pending = torch.cat([self.recent[..., :held - start, :], t[..., r:].to(self.recent.dtype)], -2)
        whole = pending.shape[-2] // T * T  # (..., held + n - start, p) pending; the whole groups are quantised
        if whole:
            key = lowbit.part_formats(self.parts, self.low)[1]
            grouped = without_sinks(pending[..., :whole, :], self.sink, start).unflatten(-2, (-1, T))
            kc, km = lowbit.channel_encode(grouped, key)  # (..., g, T, pb), (..., g, 2p)
            buf[..., start:start + whole, nb:] = kc.flatten(-3, -2)
            self.meta[..., start // T:(start + whole) // T, :] = km
        self.recent[..., :pending.shape[-2] - whole, :] = pending[..., whole:, :]

    def read(self, buf: torch.Tensor, scales: torch.Tensor, held: int, rows: int, room: int = 0) -> torch.Tensor:
        """The first `rows` (<= held) rows, [c, k_R] in the activation dtype; room: that many rows of 0 after
        them (storage.dense)."""
        (r, p), T = self.parts, lowbit.KEY_TOKENS
        nb = self._latent_width()
        out = buf.new_empty(*buf.shape[:-2], rows + room, r + p, dtype=self.dtype)  # each piece written where it goes
        out[..., rows:, :] = 0
        lowbit.decode(buf[..., :rows, :nb], scales[..., :rows, :], (r,), lowbit.per_token(self.low), self.dtype,
                      out=out[..., :rows, :r])
        whole = held // T * T
        grouped = buf[..., :whole, nb:].unflatten(-2, (-1, T))  # (..., g, T, pb)
        key = lowbit.channel_decode(grouped, self.meta[..., :whole // T, :], p,
                                    lowbit.part_formats(self.parts, self.low)[1], self.dtype).flatten(-3, -2)
        out[..., :min(whole, rows), r:] = key[..., :rows, :]
        if rows > whole:  # the newest group, not yet whole: as written
            out[..., whole:rows, r:] = self.recent[..., :rows - whole, :]
        return out

    def truncate(self, buf: torch.Tensor, scales: torch.Tensor, held: int, length: int) -> None:
        """Keep the first `length` tokens: those of a group now incomplete go back into `recent` (as stored)."""
        start = length // lowbit.KEY_TOKENS * lowbit.KEY_TOKENS
        kept = self.read(buf, scales, held, held)[..., start:length, self.parts[0]:]  # (..., n, p)
        self.recent[..., :length - start, :] = kept
