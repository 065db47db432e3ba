"""Attention sizes of real models (published configs, `PRESETS`) and their KV-cache footprint (`kv_footprint`).

The footprint is measured, not typed: each preset builds one attention layer on the meta device (no memory, no
weights), asks it for a cache and reads the allocated buffers' sizes, as Part 14 is answered for small modules.
With sliding-window layers (Gemma 3) a sliding layer caches at most its window: bytes per token depend on the context.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ..modules.gqa import GroupedQueryAttention
from ..modules.mla import MultiHeadLatentAttention


@dataclass(frozen=True)
class AttentionConfig:
    name: str
    kind: str  # "gqa" (MHA is G = H) or "mla"
    num_layers: int
    dim: int
    num_heads: int
    head_dim: int
    num_kv_heads: int = 0  # gqa
    latent_dim: int = 0  # mla: kv_lora_rank
    rope_dim: int = 0  # mla: qk_rope_head_dim
    v_head_dim: int = 0  # mla (0: head_dim)
    source: str = ""
    sliding_layers: int = 0  # gqa: layers attending to the last `window` tokens only (the others: every token)
    window: int = 0

    def module(self, device="meta", dtype=torch.bfloat16, sliding: bool = False):
        """One attention layer (a sliding one, with its window, when sliding=True)."""
        if self.kind == "gqa":
            return GroupedQueryAttention(self.dim, self.num_heads, self.num_kv_heads, head_dim=self.head_dim,
                                         sliding_window=self.window if sliding else None, device=device, dtype=dtype)
        if self.kind == "mla":
            return MultiHeadLatentAttention(self.dim, self.num_heads, self.latent_dim, head_dim=self.head_dim,
                                            v_head_dim=self.v_head_dim or self.head_dim, rope_dim=self.rope_dim,
                                            device=device, dtype=dtype)
        raise ValueError(f"kind must be 'gqa' or 'mla', got {self.kind!r}")

    def to_dict(self) -> dict:
        return asdict(self)


PRESETS: dict[str, AttentionConfig] = {c.name: c for c in [
    AttentionConfig("llama-2-7b", "gqa", 32, 4096, 32, 128, num_kv_heads=32,
                    source="meta-llama/Llama-2-7b-hf config.json"),
    AttentionConfig("llama-3-8b", "gqa", 32, 4096, 32, 128, num_kv_heads=8,
                    source="meta-llama/Meta-Llama-3-8B config.json"),
    AttentionConfig("mistral-7b", "gqa", 32, 4096, 32, 128, num_kv_heads=8,
                    source="mistralai/Mistral-7B-v0.1 config.json"),
    AttentionConfig("qwen2.5-7b", "gqa", 28, 3584, 28, 128, num_kv_heads=4,
                    source="Qwen/Qwen2.5-7B config.json"),
    AttentionConfig("smollm2-135m", "gqa", 30, 576, 9, 64, num_kv_heads=3,
                    source="HuggingFaceTB/SmolLM2-135M config.json"),
    AttentionConfig("gemma-3-270m", "gqa", 18, 640, 4, 256, num_kv_heads=1, sliding_layers=15, window=512,
                    source="the bundled gemma3-270m GGUF's metadata (5 of every 6 layers sliding)"),
    AttentionConfig("gemma-3-27b", "gqa", 62, 5376, 32, 128, num_kv_heads=16, sliding_layers=52, window=1024,
                    source="google/gemma-3-27b config.json (5 of every 6 layers sliding)"),
    AttentionConfig("deepseek-v2-lite", "mla", 27, 2048, 16, 128, latent_dim=512, rope_dim=64, v_head_dim=128,
                    source="deepseek-ai/DeepSeek-V2-Lite config.json"),
    AttentionConfig("deepseek-v3", "mla", 61, 7168, 128, 128, latent_dim=512, rope_dim=64, v_head_dim=128,
                    source="deepseek-ai/DeepSeek-V3 config.json"),
]}

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
          "float64": torch.float64, "float8": torch.float8_e4m3fn}


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def get_preset(name: str) -> AttentionConfig:
    key = name.lower()
    if key not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
    return PRESETS[key]


@dataclass(frozen=True)
class KVFootprint:
    name: str
    kind: str
    values_per_token_per_layer: int
    bytes_per_token: int  # all layers, at the context (a sliding layer's cache holds at most its window), rounded
    bytes_total: int  # what the caches of `batch` sequences of `context` tokens allocate
    bytes_per_token_held: int = 0  # all layers, each holding every token (what a model without windows pays)

    def to_dict(self) -> dict:
        return asdict(self)


def _allocated(cache) -> int:
    return sum(t.numel() * t.element_size() for t in cache.tensors())


def kv_footprint(config: AttentionConfig, *, context: int = 4096, batch: int = 1,
                 dtype: torch.dtype = torch.bfloat16) -> KVFootprint:
    """KV-cache bytes of a whole model, read from caches allocated on the meta device: per token held, and for
    `batch` sequences of `context` tokens (a sliding layer's cache allocated for that context: its window and
    some room, modules/cache.py)."""
    if context <= 0 or batch <= 0:
        raise ValueError(f"context ({context}) and batch ({batch}) must be positive")
    layer = config.module(device="meta", dtype=dtype)
    cache = layer.init_cache(1, 1, dtype=dtype, device="meta")
    held = cache.bytes_per_token * config.num_layers
    whole = layer.init_cache(batch, context, dtype=dtype, device="meta")
    total = _allocated(whole) * (config.num_layers - config.sliding_layers)
    if config.sliding_layers:
        window = config.module(device="meta", dtype=dtype, sliding=True).init_cache(batch, context, dtype=dtype,
                                                                                 device="meta")
        total += _allocated(window) * config.sliding_layers
    return KVFootprint(config.name, config.kind, cache.values_per_token, round(total / (context * batch)), total,
                       held)
