"""The core: attention modules, their caches, rotary embeddings and the one attention core (torch and numpy only).

Entry points: GroupedQueryAttention (MultiHeadAttention its G = H case), MultiHeadLatentAttention, their caches
KVCache and LatentCache, RotaryEmbedding, and `attend`, the attention core. Each file's part: the comment below.
"""
# - checks.py     argument checks: one clear error naming the values
# - heads.py      which KV head each query head reads (strided, blocked) and the tilings it implies
# - rope.py       rotary position embeddings
# - cache.py      KV and latent caches: preallocated buffers written in place (a sliding layer's: its window)
# - storage.py    how a cache stores its rows: plain, int8/fp8 with scales (lowbit.py: few-bit codes)
# - lowbit.py     few-bit codes packed into bytes: llama.cpp's blocks, attnlab's groups, KIVI, quanto (spellings)
# - turbo.py      TurboQuant's codes ("tq<b>")
# - key_groups.py an MLA's rope key per channel over groups of tokens ("+c4")
# - recent.py     a recent window kept plain ("+w<N>"); sink.py: the first rows kept plain ("+s<N>")
# - rotation.py   llama.cpp's Hadamard rotation of a quantised K/V cache, which storage.py applies
# - attention.py  the attention core: grouped heads without copies, masks
# - base.py       what every attention module does before its own math
# - gqa.py        GroupedQueryAttention, and MultiHeadAttention as its G = H case
# - mla.py        MultiHeadLatentAttention: expanded, absorbed and GQA-tiled paths
# - absorbed.py   its absorbed path (Part 12): attention in the latent space, on plain rows, codes or the decode kernel
# - rope_key.py   its rope key per KV head and keys-whole layout (what Qwen3's and Gemma 3's q/k norms convert to)
# - tiling.py     the GQA tiling of an MLA (an exact conversion): found, checked, cached and attended as GQA does
from .attention import attend, causal_mask
from .cache import KVCache, LatentCache
from .gqa import GroupedQueryAttention, MultiHeadAttention
from .mla import MultiHeadLatentAttention
from .rope import RotaryEmbedding

__all__ = ["attend", "causal_mask", "KVCache", "LatentCache", "GroupedQueryAttention", "MultiHeadAttention",
           "MultiHeadLatentAttention", "RotaryEmbedding"]
