"""attnlab: multi-head attention and its KV-sharing variants (MHA, GQA, MLA).

Run them (modules with masks, RoPE and caches), convert between them
(`attnlab.convert`), and explain them (`attnlab tour`).
"""
from .attention import attend, causal_mask
from .cache import KVCache, LatentCache
from .gqa import GroupedQueryAttention, MultiHeadAttention
from .mla import MultiHeadLatentAttention
from .rope import RotaryEmbedding

__all__ = [
    "attend", "causal_mask", "KVCache", "LatentCache", "GroupedQueryAttention", "MultiHeadAttention",
    "MultiHeadLatentAttention", "RotaryEmbedding",
]
__version__ = "0.1.0"
