"""attnlab in transformers: `KVCache`, a transformers `Cache` whose layers store keys and values in attnlab's
storages (any `--kv-dtype` spelling a GQA cache takes), for `model.generate(..., cache=KVCache(model, "q4_0"))`.

transformers is imported when a name here is first used, so `import attnlab.hf` works without it.
"""
import importlib as _importlib

__all__ = ["KVCache", "SUPPORTED_MODEL_TYPES", "TransformersRunner"]
_HOMES = {"KVCache": "cache", "SUPPORTED_MODEL_TYPES": "shapes", "TransformersRunner": "score"}


def __getattr__(name: str):
    if name in _HOMES:
        value = getattr(_importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
