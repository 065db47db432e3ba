"""One GQA layer of attnlab.hf.KVCache: an attnlab `modules.cache.KVCache` of the layer's keys and values, with a
"+w<N>" storage's newest rows kept plain; transformers' CacheLayerMixin is mixed in by hf/cache.py."""
from __future__ import annotations

import torch

from ..modules.cache import KVCache as _Rows
from ..modules.recent import RecentRows
from ..modules.rotation import turned
from ..modules.storage import check_kv_dtype, dense, rotated_frame
from .attention import NAME, Mix, Note, announce, room
from .shapes import LayerShape, Owner

GROWTH = 64  # a full layer grows to what it needs plus a 64th of it (at least MIN_ROOM rows): bytes held <= 1.02x
MIN_ROOM = 16  # from about 1,000 tokens on; a reallocation copies the rows held, every 16 tokens at most


class CodedLayer(Owner):
    """One GQA layer of KVCache; transformers' CacheLayerMixin is mixed in by hf/cache.py.

    Rows are coded once, when they arrive (the prefill included), and read back dequantised (left rotated where
    hf/attention.py reads them). A full layer grows its buffers in steps (GROWTH); a sliding layer keeps its window's
    rows. A "+w<N>" storage keeps the newest N keys and values plain too (`plain`; a call of several: `_mixed`)."""

    is_compileable = False
    supports_early_init = False

    def __init__(self, kv_dtype, shape: LayerShape, index: int):
        super().__init__()
        self.kv_dtype, self.shape, self.index = kv_dtype, shape, index
        self.attn = None  # KVCache sets the decoder config whose attention it set to hf/attention.py's
        self.is_sliding, self.is_croppable = shape.window is not None, shape.window is None
        fmt = check_kv_dtype(kv_dtype)
        self.base, self.recent = (fmt.base_name, fmt.recent) if fmt is not None else (None, None)
        self.rows: _Rows | None = None
        self.plain: list[RecentRows] = []  # a "+w<N>" storage's newest N keys and values, (B, N, G d) each
        self.keys = self.values = None  # transformers' own layers keep tensors here; this one keeps `rows`
        self.is_initialized = False

    def ours(self) -> bool:
        """Whether hf/attention.py reads what update returns (the model's attention is still the one KVCache set)."""
        return self.attn is not None and getattr(self.attn, "_attn_implementation", None) == NAME

    def _checked(self, key_states: torch.Tensor, value_states: torch.Tensor) -> LayerShape:
        """The shape of these keys and values; ValueError when it is not the one this layer was made for."""
        B, G, _, d = key_states.shape
        got = LayerShape(G, d, value_states.shape[-1], self.shape.window)
        if got != self.shape:
            raise ValueError(f"KVCache layer {self.index} was made for {self.shape}, got keys of {got}: "
                             "this cache belongs to another model")
        return got

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        got = self._checked(key_states, value_states)
        B, G, d = key_states.shape[0], got.num_kv_heads, got.head_dim
        max_len = MIN_ROOM if self.shape.window is None else 1 << 62  # a window cache allocates its window only
        self.rows = _Rows(self, B, max_len, G, d, got.v_head_dim, dtype=key_states.dtype, device=key_states.device,
                          kv_dtype=self.base, window=self.shape.window, rotate=True)
        if self.recent:
            self.plain = [RecentRows(B, self.recent, G * w, key_states.dtype, key_states.device)
                          for w in (d, got.v_head_dim)]
        self.device, self.is_initialized = key_states.device, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Code the new rows and return every row the queries read (B, G, S, d), dequantised; announced to
        hf/attention.py where it reads them (rows left rotated, a call's plain rows after its stored ones)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        rows, n = self.rows, key_states.shape[-2]
        if rows.window is None and rows.length + n > rows.max_len:
            need = rows.length + n
            rows.reserve(need + max(MIN_ROOM, need // GROWTH))
        offset, length, ours = self.get_mask_sizes(n)[1], rows.length, self.ours()
        read = [rotated_frame(t) if ours else (t, None) for t in rows.extend_stored(k=key_states, v=value_states)]
        skip = offset - rows.key_start  # a window cache may return rows older than the mask reads
        mixed = ours and n > 1 and bool(self.plain)
        extra = room(self.recent) if mixed else 0  # rows hf/attention.py writes a block's plain rows into
        out = [dense(t, extra)[..., skip:, :] for t, _ in read]  # positions offset .. length + n - 1 (+ room)
        turns = [r for _, r in read]  # H_n the rows are left in (plain rows are turned to match)
        mix = None
        if mixed:
            mix = self._mixed(out, key_states, value_states, offset, length, turns)
            out = [t[..., :t.shape[-2] - extra, :] for t in out]
        else:
            for i, (ring, new) in enumerate(zip(self.plain, (key_states, value_states))):
                ring.push(length, to_ring(new))
                held = min(rows.length, ring.size)  # the ring's rows, oldest first
                k = min(held, out[i].shape[-2])  # the newest k rows read plain
                out[i][..., -k:, :] = to_heads(turned(ring.rows[:, held - k:held], turns[i]), out[i].shape[1])
        announce(Note(mix, *turns))
        return out[0], out[1]

    def _mixed(self, out: list, key_states, value_states, offset: int, length: int, turns: list) -> Mix:
        """Note.mix of a call of several tokens with a "+w<N>" ring: `out`, the rows as stored with room after them,
        and the plain rows of the newest positions its queries read (turned as `turns` say)."""
        size = self.recent if self.shape.window is None else min(self.recent, self.shape.window)
        S, first, plain = out[0].shape[-2] - room(self.recent), offset, []
        for i, (ring, new) in enumerate(zip(self.plain, (key_states, value_states))):
            before, start = ring.tail(length)  # positions start .. length - 1
            ring.push(length, to_ring(new))
            first = max(start, offset)
            tail = turned(torch.cat([before, to_ring(new).to(before.dtype)], dim=1)[:, first - start:], turns[i])
            plain.append(to_heads(tail, out[i].shape[1]).to(out[i].dtype))
        return Mix(S, first - offset, size, tuple(out), tuple(plain))

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        past, window = self.get_seq_length(), self.shape.window
        if window is None:
            return past + query_length, 0
        offset = max(past - window + 1, 0)
        return past - offset + query_length, offset

    def get_seq_length(self) -> int:
        return 0 if self.rows is None else self.rows.length

    def get_max_length(self) -> int:
        return -1 if self.shape.window is None else self.shape.window

    def reset(self) -> None:
        if self.rows is not None:
            self.rows.reset()

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last -tokens_to_remove tokens (transformers' convention: a negative count, or 0)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of tokens to remove, got {tokens_to_remove}")
        if tokens_to_remove and self.rows is not None:
            rows, old = self.rows, self.rows.length
            rows.truncate(old + tokens_to_remove)
            for ring, stored in zip(self.plain, rows.view() if self.plain else ()):  # lost positions: as stored
                ring.truncate(rows.length, old, to_ring(stored), rows.length - rows.held)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._select(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._select(torch.as_tensor(indices).reshape(-1))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.rows is not None:
            self._select(torch.arange(self.rows.batch_size).repeat_interleave(repeats))

    def _select(self, indices: torch.Tensor) -> None:
        if self.rows is not None:
            self.rows.select_batch(indices)
            for ring in self.plain:
                ring.rows = ring.rows.index_select(0, indices.to(ring.rows.device))

    def offload(self) -> None:  # the codes stay where they are: they are already the small copy
        return None

    def prefetch(self) -> None:
        return None

    @property
    def batch_size(self) -> int:
        return 0 if self.rows is None else self.rows.batch_size

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor this layer holds (codes, scales, rows kept plain)."""
        held = [] if self.rows is None else self.rows.tensors() + [ring.rows for ring in self.plain]
        return sum(t.numel() * t.element_size() for t in held)

    @property
    def bytes_per_token(self) -> int:
        """Bytes per token held, counted from the storage's own tensors (modules.cache: bytes_per_token)."""
        return self.rows.bytes_per_token if self.rows is not None else 0


def to_ring(rows: torch.Tensor) -> torch.Tensor:
    """(B, G, n, d) -> (B, n, G d): a ring's rows."""
    return rows.transpose(1, 2).flatten(2)


def to_heads(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, n, G d) -> (B, G, n, d)."""
    return rows.unflatten(2, (heads, -1)).transpose(1, 2)
