"""The layers of attnlab.hf.KVCache that hold one attnlab `modules.cache.LatentCache` of joined rows: a GQA layer's
[values | keys] (a few-bit storage with a rope-key part, or a keys-whole plan's latent) and an MLA's [latent, rope key].
"""
from __future__ import annotations

import torch

from ..modules.cache import LatentCache as _LatentRows
from ..modules.rope_key import by_head
from ..modules.rotation import hadamard_transform
from ..modules.storage import dense
from .attention import Mix, Note, announce, room
from .layer import GROWTH, MIN_ROOM, CodedLayer, to_heads, to_ring
from .shapes import LatentShape, LayerShape


def _extend_rows(rows: _LatentRows, new: torch.Tensor, mixed: bool, extra: int = 0) -> tuple:
    """Write new rows (B, n, w) into a LatentCache, grown as needed; return (every row it holds (B, S, w) as queries
    read them: dequantised, a "+w<N>" storage's newest N plain; None; None). mixed, for a call of several tokens:
    (the S rows as stored, with `extra` rows of 0 after them; the plain rows its queries read; their first position)."""
    need = rows.length + new.shape[1]
    if need > rows.max_len:
        rows.reserve(need + max(MIN_ROOM, need // GROWTH))
    if not rows.recent:
        return rows.extend(kv=new)[0], None, None
    if mixed and new.shape[1] > 1:
        stored, plain, start = rows.extend_recent(new, extra)
        return dense(stored), plain, start
    stored, plain, _ = rows.extend_recent(new)
    out = dense(stored)
    if any(out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for t in rows.tensors()):
        out = out.clone()  # rows held as they are: the plain rows go on a copy
    k = min(rows.recent, out.shape[1])
    out[:, -k:] = plain[:, -k:].to(out.dtype)
    return out, None, None


class JointLayer(CodedLayer):
    """A GQA layer of KVCache whose rows are [values | keys] in one LatentCache, the values coded as an MLA's latent
    and the keys as its rope key (per channel over groups of 64 tokens with "+c4": KIVI's key layout). In a storage
    with a rope-key part ("int3/g256+c4+w16") the values are Hadamard-rotated per head. With a value basis U (G dv, r)
    (a keys-whole plan's: convert/keys_whole.py) the row is the MLA's own [c = U^+ v | rope key], read back as U c."""

    def __init__(self, kv_dtype, shape: LayerShape, index: int, basis: torch.Tensor | None = None):
        super().__init__(kv_dtype, shape, index)
        self.basis = None if basis is None else basis.detach().to(torch.float64)
        self.maps = None  # with a basis: (U^+ and U transposed, the rope key's order and its inverse), on the device

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        got = self._checked(key_states, value_states)
        B, G, d = key_states.shape[0], got.num_kv_heads, got.head_dim
        width = G * got.v_head_dim if self.basis is None else self.basis.shape[1]
        self.rows = _LatentRows(self, B, MIN_ROOM, width, G * d, dtype=key_states.dtype,
                                device=key_states.device, kv_dtype=self.kv_dtype)
        if self.basis is not None:
            if self.basis.shape[0] != G * got.v_head_dim:
                raise ValueError(f"KVCache layer {self.index}: a value basis of {self.basis.shape[0]} rows for "
                                 f"{G} x {got.v_head_dim} values")
            like = dict(dtype=key_states.dtype, device=key_states.device)
            order = by_head(torch.arange(G * d), G, False).reshape(-1).to(key_states.device)
            self.maps = (torch.linalg.pinv(self.basis).T.to(**like), self.basis.T.to(**like), order,
                         torch.argsort(order))
        self.device, self.is_initialized = key_states.device, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Code the new rows; return every row's keys and values (B, G, S, d), as queries read them (the values left
        rotated where hf/attention.py reads them, announced)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        dv, ours = self.shape.v_head_dim, self.ours()
        values, keys = to_ring(value_states), to_ring(key_states)  # (B, n, G dv), (B, n, G d)
        if self.maps is not None:
            down, _, _, to_rope = self.maps
            values, keys = values @ down, keys[..., to_rope]  # the latent; keys as the rope key
        elif VALUE_ROTATION:
            values = hadamard_transform(values, _rotation_size(dv))
        mixed = ours and key_states.shape[-2] > 1
        extra = room(self.rows.recent) if mixed and self.rows.recent else 0
        out, plain, start = _extend_rows(self.rows, torch.cat([values, keys], dim=-1), mixed, extra)
        keys, values = self._read_back(out)
        turn = _rotation_size(dv) if VALUE_ROTATION and ours and self.maps is None else None  # the output turned
        mix = None
        if plain is not None:  # (B, S + extra, .): the stored rows, then room for hf/attention.py's plain rows
            S = out.shape[1] - extra
            mix = Mix(S, start, self.rows.recent, (keys, values), self._read_back(plain.to(out.dtype)))
            keys, values = keys[..., :S, :], values[..., :S, :]
        announce(Note(mix, None, turn))
        return keys, values

    def _read_back(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [values | keys] (B, S, .) as update returns them: keys (B, G, S, d) and values (B, G, S, dv), the
        values left rotated where hf/attention.py reads them."""
        G = self.shape.num_kv_heads
        values, keys = rows[..., :self.rows.latent_dim], rows[..., self.rows.latent_dim:]
        if self.maps is not None:
            _, up, order, _ = self.maps
            values, keys = values @ up, keys[..., order]
        elif VALUE_ROTATION and not self.ours():
            values = hadamard_transform(values, _rotation_size(self.shape.v_head_dim))  # H is its own inverse
        return to_heads(keys, G), to_heads(values, G)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0  # every row held; a sliding layer's mask keeps its window


VALUE_ROTATION = True  # rotate each value head (Hadamard) before its codes: one outlier spreads over the head


def _rotation_size(width: int) -> int:
    """The largest power of two dividing a head's width: the Hadamard block its values rotate in."""
    return width & -width


class LatentLayer(CodedLayer):
    """One MLA layer of KVCache: update(latent (B, 1, S, r), rope key (B, 1, S, p)) as DeepSeek-V3 passes them.

    It holds `modules.cache.LatentCache` rows [latent, rope key] in the MLA's storage ("int3/g256+c4+w8"), the
    latent's first `coded` channels only (config's `latent_channels`): an export's constant channel, which
    kv_b_proj ignores, reads back as 0."""

    def __init__(self, kv_dtype, shape: LatentShape, index: int):
        super().__init__(kv_dtype, shape, index)
        self.recent = None  # the LatentCache keeps its own window (modules/recent.py)
        self.factor = None  # with a constant channel: the norm's factor (B, 1, 1), from the first token written

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, heads, _, r = key_states.shape
        got = (heads, r, value_states.shape[-1])
        if got != (1, self.shape.latent_dim, self.shape.rope_dim):
            raise ValueError(f"KVCache layer {self.index} was made for {self.shape}, got (heads, latent, rope key) "
                             f"{got}: this cache belongs to another model")
        self.rows = _LatentRows(self, B, MIN_ROOM, self.shape.coded, self.shape.rope_dim, dtype=key_states.dtype,
                                device=key_states.device, kv_dtype=self.kv_dtype)
        self.device, self.is_initialized = key_states.device, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Code the new [latent, rope key] rows; return every row's latent (B, 1, S, r) and rope key (B, 1, S, p)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        rows, shape = self.rows, self.shape
        latent = key_states[:, 0, :, :shape.coded]
        if shape.constant is not None:  # the MLA's own latent: the norm's factor undone by the constant channel
            held = key_states[:, 0, :, shape.coded:shape.coded + 1] / shape.constant  # (B, n, 1): the factor
            latent = latent / held
            if self.factor is None:  # every token's factor is this one to within 2^-24 (models/export/deepseek.py)
                self.factor = held[:, :1]
        out, plain, start = _extend_rows(rows, torch.cat([latent, value_states[:, 0]], dim=-1), self.ours())
        mix = None if plain is None else Mix(out.shape[1], start, rows.recent)  # the model up-projects them: joined
        if plain is not None:
            out = torch.cat([out, plain.to(out.dtype)], dim=1)  # (B, S + M, r + p)
        latent = out.new_zeros(out.shape[0], 1, out.shape[1], shape.latent_dim)
        latent[:, 0, :, :shape.coded] = out[..., :shape.coded] if self.factor is None else \
            out[..., :shape.coded] * self.factor
        announce(Note(mix))
        return latent, out[:, None, :, shape.coded:]

    def reset(self) -> None:
        super().reset()
        self.factor = None

    def _select(self, indices: torch.Tensor) -> None:
        super()._select(indices)
        if self.factor is not None:
            self.factor = self.factor.index_select(0, indices.to(self.factor.device))
