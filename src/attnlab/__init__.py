"""attnlab: multi-head attention and its KV-sharing variants (MHA, GQA, MLA).

Run them (`attnlab.modules`, its names re-exported here), convert between them (`attnlab.convert`), and explain them
(`attnlab tour`). The subpackages are the layers of docs/architecture.md (see _SUBPACKAGES). Names and subpackages
load on first use (PEP 562), so `import attnlab` and the command line's `--help` do not pay for torch.
"""
import importlib as _importlib

_NAMES = {  # name: the module that defines it
    "attend": "attnlab.modules.attention", "causal_mask": "attnlab.modules.attention",
    "KVCache": "attnlab.modules.cache", "LatentCache": "attnlab.modules.cache",
    "GroupedQueryAttention": "attnlab.modules.gqa", "MultiHeadAttention": "attnlab.modules.gqa",
    "MultiHeadLatentAttention": "attnlab.modules.mla", "RotaryEmbedding": "attnlab.modules.rope",
}
# The layers of docs/architecture.md, each importing only those below it:
# kernels < modules < convert, io, runtime < study, models < generation, hf < heal, bench < shrink < cli.
_SUBPACKAGES = ("kernels", "modules", "convert", "io", "runtime", "study", "models", "generation", "hf", "heal",
                "bench", "shrink", "cli")

__all__ = list(_NAMES)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _NAMES:
        value = getattr(_importlib.import_module(_NAMES[name]), name)
        globals()[name] = value
        return value
    if name in _SUBPACKAGES:
        return _importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_NAMES) | set(_SUBPACKAGES))
