"""KV and latent caches: preallocated buffers that grow along the sequence axis.

A cache belongs to the module that made it (`module.init_cache(...)`) and is
passed back to that module's forward. It is a plain object, not an nn.Module:
torch.compile treats int attributes of modules as constants, which would
recompile a compiled decode step for every token; the length of a plain object
becomes a dynamic size after its first change, so a compiled step compiles
twice and then never again. Its tensors never enter a module's state_dict.

- `KVCache` (MHA, GQA): k (B, G, S_max, d) and v (B, G, S_max, dv), only the
  num_kv_heads heads, never the H query heads.
- `LatentCache` (MLA): one buffer (B, S_max, r + rope_dim) holding the latent
  c = W_DKV y (after the optional RMSNorm) and, beside it, the shared RoPE key.
  Keeping them side by side lets the absorbed decode read key and value as
  views of one tensor, with no copy per step.

Cross-attention: the first call with a context fills the cache and marks it
`static`; later calls reuse it and append nothing.
"""
from __future__ import annotations

import copy
import weakref

import torch
from torch import nn

from . import checks


class _Cache:
    """Named buffers of shape (B, ..., S_max, width) that share a length."""

    def __init__(self, owner: nn.Module, batch_size: int, max_len: int, buffers: dict[str, tuple[int, ...]],
                 dtype: torch.dtype, device):
        checks.positive_int("batch_size", batch_size)
        checks.positive_int("max_len", max_len)
        self._owner = weakref.ref(owner)
        self.batch_size, self.max_len = batch_size, max_len
        self._length = 0
        self.static = False
        for name, shape in buffers.items():
            setattr(self, name, torch.zeros(shape, dtype=dtype, device=device))
        self._names = list(buffers)

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, n) for n in self._names]

    @property
    def dtype(self) -> torch.dtype:
        return getattr(self, self._names[0]).dtype

    @property
    def device(self) -> torch.device:
        return getattr(self, self._names[0]).device

    @property
    def values_per_token(self) -> int:
        """Numbers stored per token of one sequence, counted from the allocated buffers."""
        return sum(b.numel() for b in self.tensors()) // (self.batch_size * self.max_len)

    @property
    def bytes_per_token(self) -> int:
        """Bytes stored per token of one sequence, measured from the allocated buffers."""
        return sum(b.numel() * b.element_size() for b in self.tensors()) // (self.batch_size * self.max_len)

    @property
    def length(self) -> int:
        """Tokens held so far (for a fixed_slot view: max_len - 1, see there)."""
        return self._length if self._slot is None else self.max_len - 1

    _slot: torch.Tensor | None = None

    def fixed_slot(self, slot: torch.Tensor) -> "_Cache":
        """A fixed-shape view of this cache for one-token decode steps (CUDA graphs, torch.compile).

        extend() writes the one new token at `slot`, a 1-element int64 tensor (its value is
        data, not a Python int, so every step runs the same operations on the same shapes), and
        returns the whole max_len buffers; attention must then mask the slots not yet written
        (a key-padding mask over max_len). The view shares this cache's memory and reports
        length max_len - 1, so a module attends to max_len keys; after the steps, tell this
        cache how far it is filled with mark_filled().
        """
        if not isinstance(slot, torch.Tensor) or slot.dtype != torch.int64 or slot.numel() != 1:
            raise TypeError(f"slot must be a 1-element int64 tensor, got {slot!r}")
        part = copy.copy(self)
        part._slot = slot.view(1)
        return part

    def mark_filled(self, length: int) -> None:
        """Declare the first `length` slots written (by steps through a fixed_slot view)."""
        if not 0 <= length <= self.max_len:
            raise ValueError(f"length must be between 0 and max_len {self.max_len}, got {length}")
        self._length = length

    def reset(self) -> None:
        self._length = 0
        self.static = False

    def truncate(self, length: int) -> None:
        """Forget every token after the first `length` (for example rejected draft tokens)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"length must be between 0 and the cached {self.length}, got {length}")
        self._length = length

    def check_owner(self, module: nn.Module, batch_size: int, dtype: torch.dtype) -> None:
        if self._owner() is not module:
            raise ValueError(f"this {type(self).__name__} was made by another module; "
                             f"use {type(module).__name__}.init_cache() of the module it is passed to")
        if batch_size != self.batch_size:
            raise ValueError(f"cache was made for batch_size {self.batch_size}, got a batch of {batch_size}")
        if dtype != self.dtype:
            raise ValueError(f"cache holds {self.dtype} but the input is {dtype}")

    def extend(self, **new: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Write the new tokens after the cached ones; return each buffer up to the new length."""
        n = next(iter(new.values())).shape[-2]
        if self._slot is not None:
            if n != 1:
                raise ValueError(f"a fixed_slot view writes one token per call, got {n}")
            for name, t in new.items():
                buf = getattr(self, name)
                buf.index_copy_(buf.dim() - 2, self._slot, t)
            return tuple(self.tensors())
        if self.length + n > self.max_len:
            raise ValueError(f"cannot append {n} tokens: the cache holds {self.length} of max_len {self.max_len}")
        end = self.length + n
        out = []
        for name, t in new.items():
            buf = getattr(self, name)
            buf[..., self.length:end, :] = t
            out.append(buf[..., :end, :])
        self._length = end
        return tuple(out)

    def batch_view(self, batch_size: int) -> "_Cache":
        """This cache for its first `batch_size` rows, sharing its memory (a smaller batch in a bigger cache)."""
        checks.positive_int("batch_size", batch_size)
        if batch_size > self.batch_size:
            raise ValueError(f"batch_size {batch_size} exceeds the {self.batch_size} rows this cache was made for")
        if batch_size == self.batch_size:
            return self
        part = copy.copy(self)
        for name in self._names:
            setattr(part, name, getattr(self, name)[:batch_size])
        part.batch_size = batch_size
        return part

    def view(self) -> tuple[torch.Tensor, ...]:
        return tuple(b[..., :self.length, :] for b in self.tensors())

    def __repr__(self) -> str:
        return f"{type(self).__name__}(batch_size={self.batch_size}, max_len={self.max_len}, length={self.length}, dtype={self.dtype})"


class KVCache(_Cache):
    def __init__(self, owner, batch_size: int, max_len: int, num_kv_heads: int, head_dim: int, v_head_dim: int,
                 *, dtype, device=None):
        super().__init__(owner, batch_size, max_len, {
            "k": (batch_size, num_kv_heads, max_len, head_dim),
            "v": (batch_size, num_kv_heads, max_len, v_head_dim),
        }, dtype, device)


class LatentCache(_Cache):
    def __init__(self, owner, batch_size: int, max_len: int, latent_dim: int, rope_dim: int, *, dtype, device=None):
        super().__init__(owner, batch_size, max_len, {"kv": (batch_size, max_len, latent_dim + rope_dim)},
                         dtype, device)
        self.latent_dim, self.rope_dim = latent_dim, rope_dim
