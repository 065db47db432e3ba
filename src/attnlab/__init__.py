"""attnlab: multi-head attention and its KV-sharing variants (MHA, GQA, MLA).

Run them (`attnlab.modules`, its names re-exported here), convert between them
(`attnlab.convert`), and explain them (`attnlab tour`). The subpackages are the
layers of docs/architecture.md, each importing only those below it:
kernels < modules < convert, io, runtime < study, models < generation < heal, bench < shrink < cli.
"""
from . import moved as _moved
from .modules.attention import attend, causal_mask
from .modules.cache import KVCache, LatentCache
from .modules.gqa import GroupedQueryAttention, MultiHeadAttention
from .modules.mla import MultiHeadLatentAttention
from .modules.rope import RotaryEmbedding

_moved.install()

__all__ = [
    "attend", "causal_mask", "KVCache", "LatentCache", "GroupedQueryAttention", "MultiHeadAttention",
    "MultiHeadLatentAttention", "RotaryEmbedding",
]
__version__ = "0.1.0"
