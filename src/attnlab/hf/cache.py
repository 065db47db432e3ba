"""KVCache: a transformers `Cache` whose layers hold keys and values in attnlab's storages.

Each layer keeps one attnlab `modules.cache.KVCache` (an MLA layer a `modules.cache.LatentCache`): the same codes,
scales and llama.cpp rotation as attnlab's own loop. `KVCache(model, kv_dtype)` or `KVCache.from_pretrained(folder)`
makes one. The classes are made on first use (`_classes`), so this module imports transformers only then.
"""
from __future__ import annotations

import functools

import torch

from ..models.load import SUPPORTED as GQA_TYPES
from ..modules.cache import KVCache as _Rows
from ..modules.cache import LatentCache as _LatentRows
from ..modules.recent import RecentRows
from ..modules.rope_key import by_head
from ..modules.rotation import hadamard_transform, turned
from ..modules.storage import check_kv_dtype, dense, each_layer, rotated_frame
from .attention import NAME, Mix, Note, announce, room, use_on

GROWTH = 64  # a full layer grows to what it needs plus a 64th of it (at least MIN_ROOM rows): bytes held <= 1.02x
MIN_ROOM = 16  # from about 1,000 tokens on; a reallocation copies the rows held, every 16 tokens at most


class LayerShape:
    """What one layer's cache holds: KV heads, key and value head sizes, its sliding window (None: full)."""

    def __init__(self, num_kv_heads: int, head_dim: int, v_head_dim: int, window: int | None):
        self.num_kv_heads, self.head_dim, self.v_head_dim, self.window = num_kv_heads, head_dim, v_head_dim, window

    def __eq__(self, other) -> bool:
        return vars(self) == vars(other)

    def __repr__(self) -> str:
        return (f"{self.num_kv_heads} KV heads of {self.head_dim}/{self.v_head_dim}"
                + ("" if self.window is None else f", window {self.window}"))


class LatentShape:
    """What one MLA layer's cache holds: the latent (its first `coded` channels kept) and the rope key; constant:
    the K of an export's constant channel (channel `coded`), None without one."""

    def __init__(self, latent_dim: int, rope_dim: int, coded: int, constant: float | None = None):
        self.latent_dim, self.rope_dim, self.coded, self.constant = latent_dim, rope_dim, coded, constant
        self.window = None

    def __eq__(self, other) -> bool:
        return vars(self) == vars(other)

    def __repr__(self) -> str:
        return f"a latent of {self.latent_dim} ({self.coded} kept) and a rope key of {self.rope_dim}"


MLA_TYPES = ("deepseek_v3",)
SUPPORTED_MODEL_TYPES = (*GQA_TYPES, *MLA_TYPES)  # GQA families attnlab loads; MLA: its DeepSeek exports


def text_config(model_or_config):
    """The decoder config of a transformers model or config; TypeError for anything else."""
    config = getattr(model_or_config, "config", model_or_config)
    if not hasattr(config, "get_text_config"):
        raise TypeError(f"KVCache needs a transformers model or its config, got {type(model_or_config).__name__}")
    return config.get_text_config(decoder=True)


def layer_shapes(config) -> list[LayerShape]:
    """Each layer's LayerShape from a decoder config; ValueError naming the model type attnlab does not know."""
    kind = getattr(config, "model_type", None)
    if kind not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"KVCache knows the attention of {', '.join(SUPPORTED_MODEL_TYPES)}; got model_type {kind!r}")
    if kind in MLA_TYPES:
        return latent_shapes(config)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    return [LayerShape(kv_heads, head_dim, head_dim, window if t == "sliding_attention" else None) for t in types]


def latent_shapes(config) -> list[LatentShape]:
    """Each layer's LatentShape from a DeepSeek-V3 config and its "attnlab" entry
    (models/export/deepseek.py: attnlab_entry)."""
    r, L = config.kv_lora_rank, config.num_hidden_layers
    entry = getattr(config, "attnlab", None) or {}
    coded = entry.get("latent_channels", r)
    if not isinstance(coded, int) or not 0 < coded <= r:
        raise ValueError(f"config's attnlab latent_channels must be an int in 1..{r} (kv_lora_rank), got {coded!r}")
    constants = entry.get("latent_constants", [None] * L)
    if len(constants) != L or (constants[0] is not None and coded != r - 1):
        raise ValueError(f"config's attnlab latent_constants must be {L} numbers, one a layer, with latent_channels "
                         f"= kv_lora_rank - 1 = {r - 1}; got {len(constants)} with latent_channels {coded}")
    return [LatentShape(r, config.qk_rope_head_dim, coded, k) for k in constants]


def storage_bytes(model_or_config, kv_dtype, value_bases=None, kept_dtype=None) -> int:
    """Bytes per token of one sequence KVCache(model, kv_dtype, value_bases, kept_dtype) holds in every layer (steady
    state; a window cache's and the plain rows' fixed bytes left out), counted from caches made on the meta device."""
    shapes = layer_shapes(text_config(model_or_config))
    widths = _latent_widths(value_bases, len(shapes))
    return sum(_meta_rows(shape, storage, width).bytes_per_token
               for shape, storage, width in zip(shapes, layer_storages(kv_dtype, widths, kept_dtype), widths))


def layer_storages(kv_dtype, widths: list, kept_dtype=None) -> list:
    """Each layer's storage: kv_dtype's own where it is a list (one a layer: a plan's bits per layer), else kv_dtype
    where the layer has a value basis (or none has), kept_dtype (if given) where a plan kept the layer's own attention
    beside layers with value bases. ValueError naming the lengths for a list of another length."""
    if isinstance(kv_dtype, (list, tuple)):
        return each_layer(kv_dtype, len(widths))
    kept = kept_dtype is not None and any(w is not None for w in widths)
    return [kept_dtype if kept and w is None else kv_dtype for w in widths]


def _latent_widths(value_bases, layers: int) -> list[int | None]:
    """Each layer's latent width r (its value basis U is (G dv, r)), None where it has none."""
    bases = [None] * layers if value_bases is None else list(value_bases)
    if len(bases) != layers:
        raise ValueError(f"value_bases must have one entry per layer ({layers}), got {len(bases)}")
    return [None if u is None else int(u.shape[-1]) for u in bases]


def _meta_rows(shape, kv_dtype, latent: int | None = None):
    """The attnlab cache a layer of this shape holds in this storage, made on the meta device (ValueError if none).
    latent: the width of a value basis's latent (the layer then holds [latent | keys] rows)."""
    owner = object.__new__(_Owner)
    if isinstance(shape, LatentShape):
        return _LatentRows(owner, 1, 1, shape.coded, shape.rope_dim, dtype=torch.float32, device="meta",
                           kv_dtype=kv_dtype)
    G = shape.num_kv_heads
    if joint(kv_dtype) or latent is not None:
        return _LatentRows(owner, 1, 1, latent or G * shape.v_head_dim, G * shape.head_dim, dtype=torch.float32,
                           device="meta", kv_dtype=kv_dtype)
    fmt = check_kv_dtype(kv_dtype)
    return _Rows(owner, 1, 1, G, shape.head_dim, shape.v_head_dim, dtype=torch.float32, device="meta",
                 kv_dtype=fmt.base_name if fmt else None, window=shape.window, rotate=True)


def check_storage(kv_dtype, shapes: list[LayerShape], kind: str, widths=None, storages=None) -> None:
    """ValueError in one line unless every layer's cache can hold its storage (kv_dtype, or each of `storages`; made on
    the meta device)."""
    n = len(shapes)
    layers = zip(shapes, storages or [kv_dtype] * n, widths or [None] * n)
    for shape, storage, width in {(repr(s), k, w): (s, k, w) for s, k, w in layers}.values():
        try:
            _meta_rows(shape, storage, width)
        except ValueError as err:
            raise ValueError(f"KVCache({storage!r}) for {kind} ({shape}): {err}") from None


class _Owner:
    """The object a layer's attnlab cache belongs to (the cache keeps a weak reference to it)."""


class _CodedLayer(_Owner):
    """One GQA layer of KVCache; transformers' CacheLayerMixin is mixed in by _classes().

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
                ring.push(length, _flat(new))
                held = min(rows.length, ring.size)  # the ring's rows, oldest first
                k = min(held, out[i].shape[-2])  # the newest k rows read plain
                out[i][..., -k:, :] = _heads(turned(ring.rows[:, held - k:held], turns[i]), out[i].shape[1])
        announce(Note(mix, *turns))
        return out[0], out[1]

    def _mixed(self, out: list, key_states, value_states, offset: int, length: int, turns: list) -> Mix:
        """Note.mix of a call of several tokens with a "+w<N>" ring: `out`, the rows as stored with room after them,
        and the plain rows of the newest positions its queries read (turned as `turns` say)."""
        size = self.recent if self.shape.window is None else min(self.recent, self.shape.window)
        S, first, plain = out[0].shape[-2] - room(self.recent), offset, []
        for i, (ring, new) in enumerate(zip(self.plain, (key_states, value_states))):
            before, start = ring.tail(length)  # positions start .. length - 1
            ring.push(length, _flat(new))
            first = max(start, offset)
            tail = turned(torch.cat([before, _flat(new).to(before.dtype)], dim=1)[:, first - start:], turns[i])
            plain.append(_heads(tail, out[i].shape[1]).to(out[i].dtype))
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
                ring.truncate(rows.length, old, _flat(stored), rows.length - rows.held)

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


class _JointLayer(_CodedLayer):
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
        values, keys = _flat(value_states), _flat(key_states)  # (B, n, G dv), (B, n, G d)
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
        return _heads(keys, G), _heads(values, G)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0  # every row held; a sliding layer's mask keeps its window


VALUE_ROTATION = True  # rotate each value head (Hadamard) before its codes: one outlier spreads over the head


def _rotation_size(width: int) -> int:
    """The largest power of two dividing a head's width: the Hadamard block its values rotate in."""
    return width & -width


def joint(kv_dtype) -> bool:
    """Whether a GQA layer stores this storage as _JointLayer's rows: a few-bit code with a rope-key part."""
    fmt = check_kv_dtype(kv_dtype)
    low = None if fmt is None else fmt.low
    return low is not None and (low.rope_channel or low.rope_bits is not None)


class _LatentLayer(_CodedLayer):
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


def _flat(rows: torch.Tensor) -> torch.Tensor:
    """(B, G, n, d) -> (B, n, G d): a ring's rows."""
    return rows.transpose(1, 2).flatten(2)


def _heads(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, n, G d) -> (B, G, n, d)."""
    return rows.unflatten(2, (heads, -1)).transpose(1, 2)


class _KVCacheBase:
    """KVCache(model, kv_dtype): a transformers Cache of attnlab's storages, one layer per decoder layer.

    model: a transformers model (or config) of a family attnlab knows; kv_dtype: a GQA cache storage ("int8", "q4_0",
    "q8_0,q4_0", "int4/g32"; None: plain) or a list, one a layer. ValueError when made, for another family or a
    storage the head size cannot take. Made with a model, it sets the model's attention to hf/attention.py's."""

    def __init__(self, model, kv_dtype=None,
                 value_bases=None,  # a keys-whole plan's value basis for each converted layer (from_pretrained)
                 kept_dtype=None):  # a keys-whole plan's storage for the layers it kept
        config = text_config(model)
        shapes = layer_shapes(config)
        widths = _latent_widths(value_bases, len(shapes))
        storages = layer_storages(kv_dtype, widths, kept_dtype)
        check_storage(kv_dtype, shapes, config.model_type, widths, storages)
        self.kv_dtype, self.kept_dtype, self.model_type = kv_dtype, kept_dtype, config.model_type
        _, layer_class, latent_class, joint_class = _classes()
        bases = [None] * len(shapes) if value_bases is None else list(value_bases)
        super().__init__(layers=[
            latent_class(k, s, i) if isinstance(s, LatentShape) else
            joint_class(k, s, i, u) if joint(k) or u is not None else layer_class(k, s, i)
            for i, (s, u, k) in enumerate(zip(shapes, bases, storages))])
        # a model, not its config: its attention becomes hf/attention.py's, so each query reads its own newest N rows
        # plain, as decoding does, rotated rows are read turned, and a long call's queries go BLOCK at a time. Made
        # from a config, a call of several tokens reads the newest N plain for every query, as its last does, and
        # every row is rotated back.
        if hasattr(model, "set_attn_implementation"):
            use_on(model)
            for layer in self.layers:
                layer.attn = config

    @classmethod
    def from_pretrained(cls, folder, model=None):
        """The cache a `attnlab shrink --format transformers` folder was planned for (its config.json's "attnlab"
        entry). model: the model it will serve, refused in one line when its sizes are not the folder's."""
        from .folder import check_same, planned, planned_entry, value_bases

        config, storage = planned(folder)
        if model is not None:
            check_same(text_config(model), config, folder)
        return cls(config if model is None else model, storage, value_bases(folder, config.num_hidden_layers),
                   planned_entry(folder).get("kept_dtype"))

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last -tokens_to_remove tokens in every layer, or in none (ValueError naming the layer that
        cannot: a sliding layer that dropped those rows)."""
        for i, layer in enumerate(self.layers):
            if layer.rows is not None and tokens_to_remove < 0:
                try:
                    layer.rows.check_truncate(layer.rows.length + tokens_to_remove)
                except ValueError as err:
                    raise ValueError(f"KVCache layer {i}: {err}") from None
        super().crop(tokens_to_remove)

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor the cache holds, all layers."""
        return sum(layer.nbytes for layer in self.layers)

    def __repr__(self) -> str:
        kept = "" if self.kept_dtype is None else f", kept_dtype={self.kept_dtype!r}"
        return f"KVCache({self.model_type}, kv_dtype={self.kv_dtype!r}{kept}, tokens={self.get_seq_length()})"


@functools.cache
def _classes():
    """(KVCache, its GQA layer class, its MLA layer class, its GQA layer of [values | keys] rows), each with
    transformers' base mixed in (imported here, on first use)."""
    from transformers.cache_utils import Cache, CacheLayerMixin

    layer = type("CodedLayer", (_CodedLayer, CacheLayerMixin), {"__module__": __name__})
    latent = type("LatentLayer", (_LatentLayer, CacheLayerMixin), {"__module__": __name__})
    rows = type("JointLayer", (_JointLayer, CacheLayerMixin), {"__module__": __name__})
    cache = type("KVCache", (_KVCacheBase, Cache), {"__module__": __name__, "__doc__": _KVCacheBase.__doc__})
    return cache, layer, latent, rows


def __getattr__(name: str):
    if name == "KVCache":
        return _classes()[0]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
