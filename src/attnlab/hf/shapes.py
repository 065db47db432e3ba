"""What each layer of attnlab.hf.KVCache holds: the shapes a transformers config gives, the storage of each layer,
and the checks and byte counts made on the meta device before any cache is built."""
from __future__ import annotations

import torch

from ..models.load import SUPPORTED as GQA_TYPES
from ..modules.cache import KVCache as _Rows
from ..modules.cache import LatentCache as _LatentRows
from ..modules.storage import check_kv_dtype, each_layer


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
    widths = latent_widths(value_bases, len(shapes))
    return sum(meta_rows(shape, storage, width).bytes_per_token
               for shape, storage, width in zip(shapes, layer_storages(kv_dtype, widths, kept_dtype), widths))


def layer_storages(kv_dtype, widths: list, kept_dtype=None) -> list:
    """Each layer's storage: kv_dtype's own where it is a list (one a layer: a plan's bits per layer), else kv_dtype
    where the layer has a value basis (or none has), kept_dtype (if given) where a plan kept the layer's own attention
    beside layers with value bases. ValueError naming the lengths for a list of another length."""
    if isinstance(kv_dtype, (list, tuple)):
        return each_layer(kv_dtype, len(widths))
    kept = kept_dtype is not None and any(w is not None for w in widths)
    return [kept_dtype if kept and w is None else kv_dtype for w in widths]


def latent_widths(value_bases, layers: int) -> list[int | None]:
    """Each layer's latent width r (its value basis U is (G dv, r)), None where it has none."""
    bases = [None] * layers if value_bases is None else list(value_bases)
    if len(bases) != layers:
        raise ValueError(f"value_bases must have one entry per layer ({layers}), got {len(bases)}")
    return [None if u is None else int(u.shape[-1]) for u in bases]


def meta_rows(shape, kv_dtype, latent: int | None = None):
    """The attnlab cache a layer of this shape holds in this storage, made on the meta device (ValueError if none).
    latent: the width of a value basis's latent (the layer then holds [latent | keys] rows)."""
    owner = object.__new__(Owner)
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
            meta_rows(shape, storage, width)
        except ValueError as err:
            raise ValueError(f"KVCache({storage!r}) for {kind} ({shape}): {err}") from None


class Owner:
    """The object a layer's attnlab cache belongs to (the cache keeps a weak reference to it)."""


def joint(kv_dtype) -> bool:
    """Whether a GQA layer stores this storage as JointLayer's rows: a few-bit code with a rope-key part."""
    fmt = check_kv_dtype(kv_dtype)
    low = None if fmt is None else fmt.low
    return low is not None and (low.rope_channel or low.rope_bits is not None)
