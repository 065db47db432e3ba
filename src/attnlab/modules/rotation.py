"""The Hadamard rotation llama.cpp applies to a quantised K/V cache, as attnlab's caches apply it (storage.py).

llama.cpp (since its PR #21038; src/llama-kv-cache.cpp, llama-graph.cpp) multiplies blocks of each quantised key and
value head by an orthonormal Walsh-Hadamard matrix H and rotates the query and the output alike: it reads H^T Q(H k)
and H^T Q(H v). `hadamard_transform` is that product and `rotation_size` the rule; the details: the comment below.
"""
from __future__ import annotations

import functools
import math
import os
import re

import torch

# llama.cpp rotates when the K cache type is quantised and the key head size a multiple of 64: each block of n values
# of every key head times H_n (entries +-1/sqrt(n)), n the largest power of two dividing the head size, the query
# alike (H is symmetric and its own inverse). Values likewise when the V type is quantised, always n = 64, and the
# output is rotated back. LLAMA_ATTN_ROT_DISABLE (a nonzero integer, as C's atoi reads it) turns both off. llama.cpp
# decides once per model (its layers' one head size), attnlab per module: the same where layers share a head size.
# storage.py applies it by role ("key", "value") to a GQA's rows; a cache rotates when it writes, back when it reads.
# An MLA's row is never rotated: llama.cpp runs attnlab's GGUF export as deepseek2 with MLA, whose cache holds K only
# (the latent and the rope key; V is a view of it) and whose attention (build_attn with the K-only input,
# llm_graph_input_attn_k) builds no rotation, whatever the row's width.
# Not copied: llama.cpp's CPU flash attention rounds the rotated query to q8_0 for its dot products with quantised
# keys, and a Llama-family GGUF holds each key's RoPE pairs side by side (its q/k weights permuted for llama.cpp's
# interleaved RoPE) where attnlab holds transformers' halves, so llama.cpp's blocks of 32 group other channels of a
# key. Rotated, neither moves perplexity beyond the codes' own spread (tests/test_llama_cpp_cache.py); with
# LLAMA_ATTN_ROT_DISABLE=1 the channel order does (SmolLM2, q4_0 keys: llama.cpp 4% above attnlab, level once
# attnlab's keys are permuted into llama.cpp's order).
ROTATION_ENV = "LLAMA_ATTN_ROT_DISABLE"  # llama.cpp's switch: a nonzero integer turns the cache rotation off
ROTATION_STEP = 64  # llama.cpp rotates a head whose size is a multiple of 64; V always in blocks of 64


def hadamard_transform(x: torch.Tensor, n: int) -> torch.Tensor:
    """x (..., W) with every block of n consecutive values (n a power of two dividing W) times the orthonormal
    Sylvester Walsh-Hadamard matrix H_n (H_1 = 1, H_2m = [[H_m, H_m], [H_m, -H_m]] / sqrt(2)), in x's dtype, as
    log2(n) butterflies H_2m [a; b] = [H_m (a + b); H_m (a - b)] / sqrt(2), the 1/sqrt(n) applied once at the end:
    elementwise only, so a row's result does not depend on the rows with it (a one-token write and a whole window
    rotate a row alike). H_n is symmetric and its own inverse: applying it twice gives x (to rounding)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1 or n & (n - 1):
        raise ValueError(f"a Sylvester Hadamard matrix needs a power-of-two size, got {n!r}")
    if x.shape[-1] % n:
        raise ValueError(f"rows of width {x.shape[-1]} are not whole blocks of {n} values to rotate")
    if n == 1:
        return x
    y = x.unflatten(-1, (-1, n))  # (..., W/n, n)
    half = n // 2
    while half:
        pairs = y.unflatten(-1, (-1, 2, half))  # (..., W/n, n / 2half, 2, half)
        a, b = pairs.unbind(-2)
        y = torch.stack([a + b, a - b], -2).flatten(-3)  # (..., W/n, n)
        half //= 2
    return (y * (1 / math.sqrt(n))).flatten(-2)


def turned(x: torch.Tensor, n: int | None) -> torch.Tensor:
    """x times H_n block by block, computed in float32 at least (float64 for float64), in x's dtype; x when n is
    None. A reader of rows kept rotated turns its query and its output with it (hf/attention.py): one product with
    H_n, where the butterflies' thirty small operations cost a decode step more than its few rows."""
    if n is None:
        return x
    work = torch.promote_types(x.dtype, torch.float32)
    return (x.to(work).unflatten(-1, (-1, n)) @ _matrix(n, work, x.device)).flatten(-2).to(x.dtype)


@functools.lru_cache(maxsize=16)
def _matrix(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return hadamard(n, torch.float64).to(dtype=dtype, device=device)  # symmetric: x @ H = (H x^T)^T


def hadamard(n: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The orthonormal Sylvester Walsh-Hadamard matrix H_n (n a power of two), symmetric, H_n H_n = I: the matrix
    hadamard_transform multiplies by (its rows, the transform of the identity's). llama.cpp's ggml_gen_hadamard
    builds the same matrix."""
    return hadamard_transform(torch.eye(n, dtype=dtype), n)


def _atoi(text: str) -> int:
    """C's atoi: leading blanks, an optional sign, then the digits up to the first other character (0 if none)."""
    found = re.match(r"[ \t\n\v\f\r]*([+-]?[0-9]+)", text)
    return int(found.group(1)) if found else 0


def rotation_disabled() -> bool:
    """Whether LLAMA_ATTN_ROT_DISABLE turns llama.cpp's rotation off now: set to a nonzero integer (as its atoi
    reads it: "1", "2", " 1x"; not "0", "", "yes")."""
    return _atoi(os.environ.get(ROTATION_ENV, "")) != 0


def rotation_size(head_dim: int, role: str) -> int | None:
    """The Hadamard size llama.cpp rotates a quantised cache's heads of `head_dim` values with, None for none:
    a key head whose size is a multiple of 64 in blocks of the largest power of two dividing it (64 -> 64,
    96 -> none, 128 -> 128, 192 -> 64, 256 -> 256), a value head whose size is a multiple of 64 in blocks of 64;
    None whenever LLAMA_ATTN_ROT_DISABLE is set (rotation_disabled). ValueError naming a role other than "key"
    or "value" or a head size that is not a positive int."""
    if role not in ("key", "value"):
        raise ValueError(f"llama.cpp rotates a cache's keys or values; role must be 'key' or 'value', got {role!r}")
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1:
        raise ValueError(f"head_dim must be a positive int, got {head_dim!r}")
    if head_dim % ROTATION_STEP or rotation_disabled():
        return None
    if role == "value":
        return ROTATION_STEP
    return head_dim & -head_dim  # the largest power of two dividing it (>= 64 here)
