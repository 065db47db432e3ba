"""What every conversion shares: argument checks and building a new module like the old one."""
from __future__ import annotations

import copy

import torch
from torch import nn

from ..modules.gqa import GroupedQueryAttention
from ..modules.mla import MultiHeadLatentAttention

F64 = torch.float64



# -- helpers ---------------------------------------------------------------------------------------
def _expect(module, cls, fn: str, carries: bool = False):
    """TypeError unless module is a cls; unless the conversion `carries` them (the exact gqa_to_mla), ValueError
    for the per-head options no conversion carries yet: q/k norms, a sliding window, a softmax scale of its own."""
    if not isinstance(module, cls):
        raise TypeError(f"{fn} takes a {cls.__name__}, got {type(module).__name__}")
    if carries:
        return
    if getattr(module, "k_head_norm", None) is not None:
        raise ValueError(f"{fn} does not support modules with per-head q/k norms yet (qk_norm_eps="
                         f"{module.k_head_norm.eps}, as Qwen3's q_norm/k_norm): no conversion carries the norm")
    # an MLA's own softmax scale (DeepSeek's) is part of its math, which absorb carries; a GQA's is not carried
    for name in ("sliding_window",) + (() if isinstance(module, MultiHeadLatentAttention) else ("softmax_scale",)):
        if getattr(module, name, None) is not None:
            raise ValueError(f"{fn} does not support modules with {name}={getattr(module, name)!r} yet (as Gemma 3's "
                             "layers): no conversion carries it")



def _no_rope(module, fn: str):
    if getattr(module, "rope", None) is not None:
        raise ValueError(f"{fn} does not support modules with RoPE yet "
                         f"(rotary embeddings do not commute with the maps this conversion folds)")



def _linear_mla(mla: MultiHeadLatentAttention, fn: str, allow_rope_after_up: bool = False):
    problems = [name for name, bad in (("latent_norm", mla.kv_norm is not None), ("rope_dim > 0", mla.rope_dim > 0),
                                       ("q_latent_dim", mla.W_DQ is not None),
                                       ("rope_after_up", mla.rope_after_up and not allow_rope_after_up)) if bad]
    if problems:
        raise ValueError(f"{fn} needs an MLA whose keys and values are linear in the input; "
                         f"this one has {', '.join(problems)}")



def _like(m: nn.Module) -> dict:
    w = m._anchor
    return dict(device=w.device, dtype=w.dtype)



def _bias(lin: nn.Linear):
    return None if lin.bias is None else lin.bias.detach()



def _set(lin: nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    with torch.no_grad():
        lin.weight.copy_(weight)
        if lin.bias is not None:
            lin.bias.copy_(bias if bias is not None else torch.zeros_like(lin.bias))



def _gqa(src, num_kv_heads: int, *, bias: bool, grouping: str, head_dim=None, v_head_dim=None):
    """A new GroupedQueryAttention with the geometry of src (RoPE copied when present)."""
    new = GroupedQueryAttention(src.dim, src.num_heads, num_kv_heads, head_dim=head_dim or src.head_dim,
                                v_head_dim=v_head_dim or src.v_head_dim, context_dim=src.context_dim, bias=bias,
                                grouping=grouping, **_like(src))
    new.rope = copy.deepcopy(getattr(src, "rope", None))
    return new



def _mla(src, latent_dim: int, bias: bool) -> MultiHeadLatentAttention:
    """An MLA with src's geometry; a RoPE'd src gives rope_after_up with src's rotary embedding."""
    import warnings
    with warnings.catch_warnings():  # exact conversions may need a latent as wide as the input
        warnings.simplefilter("ignore", UserWarning)
        mla = MultiHeadLatentAttention(src.dim, src.num_heads, latent_dim, head_dim=src.head_dim,
                                       v_head_dim=src.v_head_dim, context_dim=src.context_dim, bias=bias,
                                       rope_after_up=src.rope is not None, **src._head_config(), **_like(src))
    mla.rope = copy.deepcopy(src.rope)
    copy_head_norms(mla, src)  # the same RMSNorm on every head: on the up-projected keys here
    return mla


def copy_head_norms(dst, src) -> None:
    """src's per-head q/k norm gains into dst's (both made with src's qk_norm_eps); nothing without norms."""
    for name in ("q_head_norm", "k_head_norm"):
        if getattr(src, name) is not None:
            getattr(dst, name).load_state_dict(getattr(src, name).state_dict())
