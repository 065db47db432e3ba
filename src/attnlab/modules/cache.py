"""KV and latent caches: preallocated buffers that grow along the sequence axis, stored plain or quantised.

`KVCache` (MHA, GQA): k (B, G, S_max, d) and v (B, G, S_max, dv), the KV heads only. `LatentCache` (MLA): one buffer
(B, S_max, r + rope_dim) of the latent c = W_DKV y and the shared RoPE key side by side. A module makes its cache
(`module.init_cache(...)`) and gets it back in its forward; the storage (`kv_dtype`) is modules/storage.py's.
"""
from __future__ import annotations

import copy
import weakref

import torch
from torch import nn

from . import checks, lowbit
from .key_groups import RopeKeyGroups
from .recent import RecentRows
from .sink import SinkRows
from .storage import SCALE_DTYPE, QuantisedKV, check_kv_dtype, dense, num_scales, quantise, rotation

# Sliding window (`window=W`, what init_cache gives a module with a sliding_window, Gemma 3's sliding layers): a query
# at position i sees keys i - W < j <= i, so between calls the cache needs only the last W - 1 tokens. It allocates
# window_rows(W, max_len) rows, the tokens held in order and room for new ones; when the room runs out the last W - 1
# rows move to the front (W = 512: 511 rows copied every 65 tokens). A chunk longer than the room (a long prompt) is
# attended whole from the returned rows and only its last W - 1 are kept. `length` stays the number of tokens written
# (the next position); `key_start` is the position of the first row the last extend() returned, which the module's
# window mask and a RoPE applied after the cache read. Dropped tokens are gone: truncate() cannot go back before what
# a later query needs and a fixed_slot view needs every slot, so init_cache(sliding=False) keeps every token and
# leaves the window to the mask; so does a "+c4" or "+s<N>" storage (window_for).
WINDOW_ROOM = 64  # rows a window cache allocates beyond its window (at most the window itself)


def window_rows(window: int, max_len: int) -> int:
    """Rows a cache of that window allocates for sequences of up to max_len tokens (the comment above WINDOW_ROOM)."""
    return min(max_len, window + min(window, WINDOW_ROOM))


def window_for(sliding_window: int | None, kv_dtype, sliding: bool = True) -> int | None:
    """The window a module's cache keeps: its sliding_window, unless sliding is False or the storage keeps a rope
    key per channel over groups of tokens ("+c4"), which cannot drop one token at a time, or the first rows plain
    ("+s<N>") (then every token is kept and the module's mask applies the window)."""
    fmt = check_kv_dtype(kv_dtype)
    if not sliding or (fmt is not None and (fmt.sink or fmt.low is not None and fmt.low.rope_channel)):
        return None
    return sliding_window


# -- the caches ----------------------------------------------------------------------------------
# A cache is a plain object, not an nn.Module: torch.compile treats a module's int attributes as constants and would
# recompile a decode step for every token, while a plain object's length becomes a dynamic size after its first change.
# Its tensors never enter a module's state_dict.
class _Cache:
    """Named buffers of shape (B, ..., S_max, width) that share a length; quantised ones with scales beside them.

    parts[name]: the widths each scale covers in a row of buffer `name` (storage.py: one scale per part). roles[name]:
    "key" or "value" where buffer `name` holds a GQA's keys or values, which llama.cpp's block formats rotate
    (storage.rotation) and a K/V pair stores each in its own type (StorageFormat.for_role); absent for an MLA's rows."""

    key_start = 0  # position of the first row the last extend() returned (a window cache drops older ones)
    _recent: RecentRows | None = None  # "+w<N>": the newest N rows plain (LatentCache; modules/recent.py)
    _sink: SinkRows | None = None  # "+s<N>": the first N rows plain (LatentCache; modules/sink.py)

    def __init__(self, owner: nn.Module, batch_size: int, max_len: int, buffers: dict[str, tuple[int, ...]],
                 dtype: torch.dtype, device, *, kv_dtype=None, parts: dict[str, tuple[int, ...]] | None = None,
                 window: int | None = None, roles: dict[str, str] | None = None):
        checks.positive_int("batch_size", batch_size)
        checks.positive_int("max_len", max_len)
        if window is not None:
            checks.positive_int("window", window)
        fmt = check_kv_dtype(kv_dtype)
        if fmt is not None and fmt.evaluation_only:
            what = ("KIVI, an evaluation baseline (keys quantised per channel over whole groups of tokens, in a "
                    "forward without a cache)") if fmt.low.kind == "kivi" else \
                "transformers' QuantizedCache code (applied in a forward without a cache; served by transformers)"
            raise ValueError(f"kv_dtype {kv_dtype!r} is {what}; attnlab's caches store "
                             "q8_0, q5_0, q4_0, q4_1, iq4_nl, int4/g<N>, int2/g<N>, int8 or fp8")
        if window is not None and fmt is not None and fmt.low is not None and fmt.low.rope_channel:
            raise ValueError(f"kv_dtype {kv_dtype!r} keeps the rope key per channel over groups of "
                             f"{lowbit.KEY_TOKENS} tokens, which a sliding-window cache (window {window}) cannot "
                             "drop a token at a time; use a kv_dtype without +c4, or sliding=False")
        self._owner = weakref.ref(owner)
        self.batch_size, self.max_len, self.window = batch_size, max_len, window
        self.capacity = max_len if window is None else window_rows(window, max_len)  # rows allocated
        buffers = {name: (*shape[:-2], self.capacity, shape[-1]) for name, shape in buffers.items()}
        self._length = 0
        self._start = 0  # tokens dropped from the front (a window cache): row 0 holds position _start
        self.static = False  # cross-attention: filled by the first call with a context, then reused, nothing appended
        self._dtype, self.kv_dtype = dtype, kv_dtype
        roles = roles or {}
        # each buffer's storage (a K/V pair: the key's or the value's), ValueError for a pair's rows of no role
        self._formats = {name: None if fmt is None else fmt.for_role(roles.get(name)) for name in buffers}
        self._parts = {name: (parts or {}).get(name, (shape[-1],)) for name, shape in buffers.items()}
        # llama.cpp's rotation of each buffer's rows (None: not rotated), decided once, as llama.cpp's context does
        self._rotation = {name: rotation(self._formats[name], roles.get(name), self._parts[name]) for name in buffers}
        self._names = list(buffers)
        self._scale_names = {}
        self._channel: dict[str, RopeKeyGroups] = {}  # "+c4": a rope key per channel over groups of tokens
        for name, shape in buffers.items():
            parts_n, fmt = self._parts[name], self._formats[name]
            stored = dtype if fmt is None else fmt.storage_dtype
            if fmt is not None and fmt.quantised and sum(parts_n) != shape[-1]:
                raise ValueError(f"scale parts {parts_n} of {name} do not add up to its width {shape[-1]}")
            if fmt is not None and fmt.low is not None:  # packed codes, float16 meta per group
                lowbit.check_parts(parts_n, fmt.low)
                if fmt.low.rope_channel:  # the rope key's meta per group of tokens, its newest group unquantised
                    self._channel[name] = RopeKeyGroups(shape, parts_n, fmt.low, max_len, dtype, device, fmt.sink or 0)
                setattr(self, name, torch.zeros(*shape[:-1], lowbit.packed_row(parts_n, fmt.low), dtype=stored,
                                                device=device))
                self._scale_names[name] = name + "_scales"
                setattr(self, name + "_scales", torch.zeros(*shape[:-1], lowbit.meta_row(parts_n, fmt.low),
                                                            dtype=lowbit.META_DTYPE, device=device))
                continue
            setattr(self, name, torch.zeros(shape, dtype=stored, device=device))
            if fmt is not None and fmt.quantised:
                self._scale_names[name] = name + "_scales"
                setattr(self, name + "_scales", torch.zeros(
                    *shape[:-1], num_scales(parts_n, fmt.group), dtype=SCALE_DTYPE, device=device))

    def _row_names(self) -> list[str]:
        """The tensors with one row per token: the buffers and, for quantised storage, their scales."""
        return self._names + list(self._scale_names.values())

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the cache allocated: the buffers and, for quantised storage, their scales (and for a rope key
        per channel its meta per group of tokens and its newest group, unquantised; a recent window's rows)."""
        return [getattr(self, n) for n in self._row_names()] + [t for g in self._channel.values() for t in g.tensors()] \
            + self._plain_rows()

    def _plain_rows(self) -> list[torch.Tensor]:
        """The rows kept plain beside the codes: a recent window's, the first rows' ("+w<N>", "+s<N>")."""
        return [r.rows for r in (self._recent, self._sink) if r is not None]

    def _per_token_share(self, numbers: bool) -> int:
        """A rope key per channel: each token's share of its group's meta (rounded up), in numbers or bytes."""
        per_group = sum(g.meta_per_group() for g in self._channel.values())
        return -(-per_group * (1 if numbers else 2) // lowbit.KEY_TOKENS)

    @property
    def dtype(self) -> torch.dtype:
        """The activation dtype the cache takes and returns (its storage is `kv_dtype`)."""
        return self._dtype

    @property
    def storage_dtype(self) -> torch.dtype:
        return getattr(self, self._names[0]).dtype

    @property
    def quantised(self) -> bool:
        return bool(self._scale_names)

    @property
    def device(self) -> torch.device:
        return getattr(self, self._names[0]).device

    @property
    def values_per_token(self) -> int:
        """Numbers stored per token of one sequence (scales included), counted from the allocated tensors."""
        rows = [getattr(self, n) for n in self._row_names()]
        return sum(b.numel() for b in rows) // (self.batch_size * self.capacity) + self._per_token_share(True)

    @property
    def bytes_per_token(self) -> int:
        """Bytes stored per token held of one sequence (scales included), measured from the allocated tensors; a
        rope key per channel counts in the steady state (a share of its group's meta; its newest, incomplete
        group is a fixed KEY_TOKENS rows a sequence, not a cost per token: fixed_bytes). A window cache holds at
        most `capacity` tokens whatever the context (bytes_at)."""
        rows = [getattr(self, n) for n in self._row_names()]
        per_row = sum(b.numel() * b.element_size() for b in rows) // (self.batch_size * self.capacity)
        return per_row + self._per_token_share(False)

    @property
    def recent(self) -> int | None:
        """The rows a "+w<N>" storage keeps plain (N, or a window cache's window where shorter); None without one."""
        return None if self._recent is None else self._recent.size

    @property
    def fixed_bytes(self) -> int:
        """Bytes a sequence holds whatever its length, not per token (bytes_per_token leaves them out): the rope key
        per channel's newest group, KEY_TOKENS rows kept unquantised in the activation dtype ("+c4"), and a recent
        window's N plain rows ("+w<N>") and the first N rows plain ("+s<N>"); 0 for others."""
        fixed = [g.recent for g in self._channel.values()] + self._plain_rows()
        return sum(t.numel() * t.element_size() for t in fixed) // self.batch_size

    def bytes_at(self, context: int) -> float:
        """Bytes per token of one sequence of `context` tokens: bytes_per_token (for a window cache the rows a cache
        made for that context allocates, window_rows, spread over the context) plus fixed_bytes spread over it."""
        checks.positive_int("context", context)
        rows = context if self.window is None else window_rows(self.window, context)
        return (self.bytes_per_token * rows + self.fixed_bytes) / context

    @property
    def held(self) -> int:
        """Tokens in the buffers now (length, less what a window cache dropped)."""
        return self.length - self._start

    @property
    def length(self) -> int:
        """Tokens held so far (for a fixed_slot view: max_len - 1, see there)."""
        return self._length if self._slot is None else self.max_len - 1

    _slot: torch.Tensor | None = None

    def fixed_slot(self, slot: torch.Tensor) -> "_Cache":
        """A fixed-shape view for one-token decode steps (CUDA graphs, torch.compile), sharing this cache's memory.

        extend() writes the new token at `slot` (a 1-element int64 tensor: data, so every step runs the same shapes) and
        returns the whole max_len buffers (length max_len - 1), whose unwritten slots attention must mask; afterwards
        call mark_filled(). TypeError for another slot; ValueError for "+c4", "+w<N>", "+s<N>" and window caches."""
        if not isinstance(slot, torch.Tensor) or slot.dtype != torch.int64 or slot.numel() != 1:
            raise TypeError(f"slot must be a 1-element int64 tensor, got {slot!r}")
        if self._channel:
            raise ValueError(f"kv_dtype {self.kv_dtype!r} quantises the rope key a group of {lowbit.KEY_TOKENS} "
                             "tokens at a time, which a fixed-shape step cannot: decode without fixed_shape")
        if self._recent is not None or self._sink is not None:
            raise ValueError(f"kv_dtype {self.kv_dtype!r} keeps rows plain beside the codes, which a fixed-shape step "
                             "does not: decode without fixed_shape")
        if self.window is not None:
            raise ValueError(f"this cache keeps a sliding window of {self.window} tokens, and a fixed-shape step "
                             "needs every slot: make it with init_cache(..., sliding=False)")
        part = copy.copy(self)
        part._slot = slot.view(1)
        return part

    def mark_filled(self, length: int) -> None:
        """Declare the first `length` slots written (by steps through a fixed_slot view)."""
        if not 0 <= length <= self.max_len:
            raise ValueError(f"length must be between 0 and max_len {self.max_len}, got {length}")
        self._length = length

    def reset(self) -> None:
        self._length = self._start = self.key_start = 0
        self.static = False

    def truncate(self, length: int) -> None:
        """Forget every token after the first `length` (for example rejected draft tokens)."""
        self.check_truncate(length)
        if self._recent is not None:  # positions the ring no longer held come back as stored
            self._recent.truncate(length, self.length, dense(self.stored(self.held)[0]), self._start)
        for name, groups in self._channel.items():  # the kept tokens of a group now incomplete go back unquantised
            groups.truncate(getattr(self, name), getattr(self, self._scale_names[name]), self.length, length)
        self._length = length

    def check_truncate(self, length: int) -> None:
        """ValueError naming the numbers unless truncate(length) can go back there (a window cache drops rows)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"length must be between 0 and the cached {self.length}, got {length}")
        if self.window is not None and self._start > max(0, length - self.window + 1):
            raise ValueError(f"this sliding-window cache dropped the tokens before {self._start}; going back to "
                             f"{length} needs them from {max(0, length - self.window + 1)}")

    def check_owner(self, module: nn.Module, batch_size: int, dtype: torch.dtype) -> None:
        if self._owner() is not module:
            raise ValueError(f"this {type(self).__name__} was made by another module; "
                             f"use {type(module).__name__}.init_cache() of the module it is passed to")
        if batch_size != self.batch_size:
            raise ValueError(f"cache was made for batch_size {self.batch_size}, got a batch of {batch_size}")
        if dtype != self.dtype:
            raise ValueError(f"cache holds {self.dtype} but the input is {dtype}")

    # -- writing and reading -----------------------------------------------------------------
    def _encode(self, name: str, t: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(buffer, rows to write into it) pairs for new rows t of buffer `name`: codes and scales, or t in storage."""
        buf = getattr(self, name)
        if name not in self._scale_names:
            return [(buf, t.to(buf.dtype))]
        codes, scales = quantise(t, self._parts[name], self._formats[name], self._rotation[name])
        return [(buf, codes), (getattr(self, self._scale_names[name]), scales)]

    def _room_for(self, n: int) -> None:
        """ValueError naming the numbers unless n more tokens fit the sequence length the cache was made for."""
        if self.length + n > self.max_len:
            raise ValueError(f"cannot append {n} tokens: the cache holds {self.length} of max_len {self.max_len}")

    def write(self, **new: torch.Tensor) -> None:
        """Write the new tokens after the cached ones (at the slot, for a fixed_slot view), quantised if so stored."""
        n = next(iter(new.values())).shape[-2]
        if self._slot is not None:
            if n != 1:
                raise ValueError(f"a fixed_slot view writes one token per call, got {n}")
            for name, t in new.items():
                for buf, rows in self._encode(name, t):
                    if buf.element_size() == 1 and buf.is_floating_point():  # index_copy_ lacks float8: copy bytes
                        buf, rows = buf.view(torch.uint8), rows.view(torch.uint8)
                    buf.index_copy_(buf.dim() - 2, self._slot, rows)
            return
        self._room_for(n)
        if self._recent is not None:
            self._recent.push(self.length, new[self._names[0]])
        if self._sink is not None:
            self._sink.push(self.length, new[self._names[0]])
        if self.window is not None:
            self._extend_window(new, n)
            return
        end = self.length + n
        for name, t in new.items():
            if name in self._channel:
                self._channel[name].write(getattr(self, name), getattr(self, self._scale_names[name]), self.length, t)
                continue
            for buf, rows in self._encode(name, t):
                buf[..., self.length:end, :] = rows
        self._length = end

    def stored(self, rows: int | None = None, room: int = 0) -> tuple:
        """Each buffer's first `rows` rows (default: the tokens held; a fixed_slot view: all max_len) as stored:
        a tensor in the activation dtype for plain storage, QuantisedKV for quantised storage. room > 0: each
        dequantised into a new tensor with that many rows of 0 after them (storage.dense)."""
        if rows is None:
            rows = self.max_len if self._slot is not None else self.held
        out = []
        for name in self._names:
            if name in self._channel:  # dequantised here: the rope key's groups have their meta apart
                out.append(self._channel[name].read(getattr(self, name), getattr(self, self._scale_names[name]),
                                                    self._length, rows, room))
                continue
            scales = getattr(self, self._scale_names[name])[..., :rows, :] if name in self._scale_names else None
            read = self._as_read(getattr(self, name)[..., :rows, :], scales, name)
            out.append(dense(read, room) if room else read)
        if self._sink is not None:  # the first rows plain, so read back dequantised (a LatentCache's one buffer)
            first = dense(out[0])
            own = room or first is not out[0] or self._names[0] in self._channel  # not the buffer held: in place
            out[0] = first if own else first.clone()
            self._sink.patch(out[0][..., :rows, :])
        return tuple(out)

    def _as_read(self, rows: torch.Tensor, scales: torch.Tensor | None, name: str):
        """Rows of buffer `name` as stored() gives them: QuantisedKV with their scales, or in the activation dtype."""
        if scales is not None:
            fmt = self._formats[name]
            return QuantisedKV(rows, scales, self._parts[name], fmt.group, self.dtype, fmt.low, self._rotation[name])
        return rows if rows.dtype == self.dtype else rows.to(self.dtype)

    def _extend_window(self, new: dict[str, torch.Tensor], n: int, room: int = 0) -> tuple:
        """A window cache's write (the comment above WINDOW_ROOM); returns the rows this call attends, as stored()."""
        keep_max = self.window - 1
        held = self.held
        if held + n > self.capacity and held > keep_max:  # drop what no later query sees, keep the order
            drop = held - keep_max
            for name in self._row_names():
                buf = getattr(self, name)
                buf[..., :keep_max, :] = buf[..., drop:held, :].clone()
            self._start, held = self._start + drop, keep_max
        self.key_start = self._start
        if held + n <= self.capacity:
            for name, t in new.items():
                for buf, rows in self._encode(name, t):
                    buf[..., held:held + n, :] = rows
            self._length += n
            return self.stored(room=room)
        out = []  # a chunk longer than the room: attend the held rows and all new ones, keep the last W - 1
        keep = min(keep_max, held + n)
        for name, t in new.items():
            pairs = self._encode(name, t)  # (buffer, new rows): the codes or values, then the scales if quantised
            joined = [torch.cat([buf[..., :held, :], rows], dim=-2) for buf, rows in pairs]
            read = self._as_read(joined[0], joined[1] if len(joined) > 1 else None, name)
            out.append(dense(read, room) if room else read)
            for (buf, _), rows in zip(pairs, joined):
                buf[..., :keep, :] = rows[..., rows.shape[-2] - keep:, :]
        self._length += n
        self._start = self._length - keep
        return tuple(out)

    def extend(self, **new: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Write the new tokens after the cached ones; return each buffer up to the new length (the
        whole buffers for a fixed_slot view; a window cache: from key_start), in the activation dtype (dequantised)."""
        return tuple(dense(t) for t in self.extend_stored(**new))

    def extend_stored(self, room: int = 0, **new: torch.Tensor) -> tuple:
        """As extend, but quantised buffers come back as stored (QuantisedKV), for readers that dequantise
        themselves (the absorbed-decode kernel); room > 0: dequantised with room after them (stored())."""
        if self.window is not None and self._slot is None:
            n = next(iter(new.values())).shape[-2]
            self._room_for(n)
            if self._recent is not None:
                self._recent.push(self.length, new[self._names[0]])
            return self._extend_window(new, n, room)
        self.write(**new)
        return self.stored(room=room)

    def _check_reshapable(self, what: str) -> None:
        """ValueError for a fixed_slot view, whose rows reserve() and select_batch() would leave behind."""
        if self._slot is not None:
            raise ValueError(f"{what} needs the cache itself, not a fixed_slot view of it")

    def reserve(self, max_len: int) -> None:
        """Room for max_len tokens in place: the buffers reallocated and the rows held copied (a window cache keeps its
        window's rows and only raises max_len). ValueError when max_len is below the tokens held."""
        self._check_reshapable("reserve")
        if max_len < self.length:
            raise ValueError(f"max_len {max_len} is below the {self.length} tokens this cache holds")
        capacity = max_len if self.window is None else window_rows(self.window, max_len)
        if capacity != self.capacity:
            held = self.held
            for name in self._row_names():
                old = getattr(self, name)
                new = old.new_zeros(*old.shape[:-2], capacity, old.shape[-1])
                new[..., :held, :] = old[..., :held, :]
                setattr(self, name, new)
            for groups in self._channel.values():
                groups.reserve(max_len)
        self.max_len, self.capacity = max_len, capacity

    def select_batch(self, indices: torch.Tensor) -> None:
        """Keep the sequences at `indices` (1-D int64, repeats allowed), in that order: beam search's reorder and
        expansion. IndexError for an index outside the batch."""
        self._check_reshapable("select_batch")
        indices = indices.to(self.device)
        if indices.dim() != 1 or indices.numel() == 0:
            raise ValueError(f"indices must be a non-empty 1-D tensor, got shape {tuple(indices.shape)}")
        for name in self._row_names():
            setattr(self, name, getattr(self, name).index_select(0, indices))
        for groups in self._channel.values():
            groups.select(indices)
        for plain in (self._recent, self._sink):
            if plain is not None:
                plain.rows = plain.rows.index_select(0, indices)
        self.batch_size = indices.numel()

    def batch_view(self, batch_size: int) -> "_Cache":
        """This cache for its first `batch_size` rows, sharing its memory (a smaller batch in a bigger cache)."""
        checks.positive_int("batch_size", batch_size)
        if batch_size > self.batch_size:
            raise ValueError(f"batch_size {batch_size} exceeds the {self.batch_size} rows this cache was made for")
        if batch_size == self.batch_size:
            return self
        part = copy.copy(self)
        for name in self._row_names():
            setattr(part, name, getattr(self, name)[:batch_size])
        part._channel = {name: groups.rows_of(batch_size) for name, groups in self._channel.items()}
        part._recent = None if self._recent is None else self._recent.rows_of(batch_size)
        part._sink = None if self._sink is None else self._sink.rows_of(batch_size)
        part.batch_size = batch_size
        return part

    def view(self) -> tuple[torch.Tensor, ...]:
        """The tokens held, in the activation dtype (dequantised)."""
        return tuple(dense(t) for t in self.stored(self.held))

    def view_stored(self) -> tuple:
        """The tokens held, as stored (see stored())."""
        return self.stored(self.held)

    def __repr__(self) -> str:
        window = "" if self.window is None else f", window={self.window}"
        return (f"{type(self).__name__}(batch_size={self.batch_size}, max_len={self.max_len}, length={self.length}, "
                f"dtype={self.dtype}, kv_dtype={self.kv_dtype!r}{window})")


class KVCache(_Cache):
    """K (B, G, S_max, d) and V (B, G, S_max, dv); quantised: scales per token and KV head (or per group).

    A K/V pair kv_dtype ("q8_0,q4_0") stores K in its first type and V in its second (only where rotate). rotate:
    whether llama.cpp's block formats rotate K and V here (storage.rotation); by default where the owner keeps keys and
    values apart (owner.separate_keys), not for a GQA-tiled MLA (llama.cpp runs its GGUF as deepseek2, unrotated)."""

    def __init__(self, owner, batch_size: int, max_len: int, num_kv_heads: int, head_dim: int, v_head_dim: int,
                 *, dtype, device=None, kv_dtype=None, window: int | None = None, rotate: bool | None = None):
        fmt = check_kv_dtype(kv_dtype)
        if fmt is not None and fmt.recent:
            raise ValueError(f"kv_dtype {kv_dtype!r}: a recent window (+w{fmt.recent}) is an MLA latent cache's; "
                             f"a KVCache stores {fmt.base_name!r} without it")
        if fmt is not None and fmt.sink:
            raise ValueError(f"kv_dtype {kv_dtype!r}: the first rows kept plain (+s{fmt.sink}) are an MLA latent "
                             "cache's; a KVCache stores its storage without them")
        if rotate is None:
            rotate = bool(getattr(owner, "separate_keys", True))
        super().__init__(owner, batch_size, max_len, {
            "k": (batch_size, num_kv_heads, max_len, head_dim),
            "v": (batch_size, num_kv_heads, max_len, v_head_dim),
        }, dtype, device, kv_dtype=kv_dtype, window=window, roles={"k": "key", "v": "value"} if rotate else None)


class LatentCache(_Cache):
    """[c, k_R] rows (B, S_max, r + p); quantised: a scale per token for c and one for k_R (or per group),
    or, for a GQA-tiled MLA, `parts` = its KV heads' widths (one scale per token and head of K and of V).
    Side by side, the absorbed decode reads key and value as views of one tensor, with no copy per step. A "+w<N>"
    storage also keeps the newest N rows plain (RecentRows, in fixed_bytes): see extend_recent."""

    def __init__(self, owner, batch_size: int, max_len: int, latent_dim: int, rope_dim: int, *, dtype, device=None,
                 kv_dtype=None, parts: tuple[int, ...] | None = None, window: int | None = None):
        if parts is None:
            parts = (latent_dim, rope_dim) if rope_dim else (latent_dim,)
        super().__init__(owner, batch_size, max_len, {"kv": (batch_size, max_len, latent_dim + rope_dim)},
                         dtype, device, kv_dtype=kv_dtype, parts={"kv": tuple(parts)}, window=window)
        self.latent_dim, self.rope_dim = latent_dim, rope_dim
        fmt = check_kv_dtype(kv_dtype)
        if fmt is not None and fmt.recent:  # a sliding window's queries see at most its rows: no more kept plain
            size = fmt.recent if window is None else min(fmt.recent, window)
            self._recent = RecentRows(batch_size, size, latent_dim + rope_dim, dtype, device)
        if fmt is not None and fmt.sink:
            if window is not None:
                raise ValueError(f"kv_dtype {kv_dtype!r} keeps its first {fmt.sink} rows plain, which a sliding-window "
                                 f"cache (window {window}) drops; make it without a window (cache.window_for)")
            self._sink = SinkRows(batch_size, fmt.sink, latent_dim + rope_dim, dtype, device)

    def extend_recent(self, kv: torch.Tensor, room: int = 0) -> tuple:
        """For a "+w<N>" storage: write the new rows kv (B, n, r + p) as extend_stored(room) does and return (the
        rows it returns; the plain rows the new queries read (B, M, r + p); the index of the first of them among the
        rows returned, which a window cache starts at key_start); the module mixes them (recent.py: mixed_keys)."""
        if self._recent is None:
            raise ValueError(f"kv_dtype {self.kv_dtype!r} keeps no recent window (a '+w<N>' storage does)")
        self._room_for(kv.shape[-2])
        plain, start = self._recent.tail(self.length)
        (stored,) = self.extend_stored(room, kv=kv)
        return stored, torch.cat([plain, kv.to(plain.dtype)], dim=1), start - self.key_start
