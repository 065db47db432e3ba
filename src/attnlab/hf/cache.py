"""KVCache: a transformers `Cache` whose layers hold keys and values in attnlab's storages.

Each layer keeps one attnlab `modules.cache.KVCache` (an MLA layer a `modules.cache.LatentCache`): the same codes,
scales and llama.cpp rotation as attnlab's own loop. `KVCache(model, kv_dtype)` or `KVCache.from_pretrained(folder)`
makes one. The classes are made on first use (`_classes`), so this module imports transformers only then.
"""
from __future__ import annotations

import functools

from .attention import use_on
from .latent_layer import JointLayer, LatentLayer
from .layer import CodedLayer
from .shapes import LatentShape, check_storage, joint, latent_widths, layer_shapes, layer_storages, text_config


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
        widths = latent_widths(value_bases, len(shapes))
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

    layer = type("CodedLayer", (CodedLayer, CacheLayerMixin), {"__module__": __name__})
    latent = type("LatentLayer", (LatentLayer, CacheLayerMixin), {"__module__": __name__})
    rows = type("JointLayer", (JointLayer, CacheLayerMixin), {"__module__": __name__})
    cache = type("KVCache", (_KVCacheBase, Cache), {"__module__": __name__, "__doc__": _KVCacheBase.__doc__})
    return cache, layer, latent, rows


def __getattr__(name: str):
    if name == "KVCache":
        return _classes()[0]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
