"""Argument checks shared by every module: one clear error naming the values."""
from __future__ import annotations

import torch


def positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def non_negative_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return value


def divides(num_heads: int, num_kv_heads: int) -> int:
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads})"
        )
    return num_heads // num_kv_heads


def sequence(name: str, t, width: int, like: torch.Tensor) -> torch.Tensor:
    """A (B, L, width) tensor with the dtype and device of the weight `like`."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 3:
        raise ValueError(f"{name} must have shape (batch, length, {width}), got {tuple(t.shape)}")
    if t.shape[-1] != width:
        raise ValueError(f"{name} has last dimension {t.shape[-1]}, expected {width}")
    if t.dtype != like.dtype:
        raise TypeError(f"{name} has dtype {t.dtype} but the module's weights are {like.dtype}")
    if t.device != like.device:
        raise ValueError(f"{name} is on {t.device} but the module's weights are on {like.device}")
    return t


def same_batch(x: torch.Tensor, context: torch.Tensor) -> None:
    if x.shape[0] != context.shape[0]:
        raise ValueError(
            f"x and context must have the same batch size, got {x.shape[0]} and {context.shape[0]}"
        )


def head_sizes(dim: int, num_heads: int, head_dim, v_head_dim, context_dim) -> tuple[int, int, int]:
    """Resolve the defaults head_dim = dim // num_heads, v_head_dim = head_dim, context_dim = dim."""
    if head_dim is None:
        if dim % num_heads:
            raise ValueError(f"dim ({dim}) is not divisible by num_heads ({num_heads}); pass head_dim")
        head_dim = dim // num_heads
    positive_int("head_dim", head_dim)
    v_head_dim = positive_int("v_head_dim", v_head_dim if v_head_dim is not None else head_dim)
    context_dim = positive_int("context_dim", context_dim if context_dim is not None else dim)
    return head_dim, v_head_dim, context_dim
