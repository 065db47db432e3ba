"""transformers' attention over KVCache's recent window: each query of a call reads its own newest N rows plain.

A "+w<N>" layer of KVCache returns a call's S rows as stored, then the newest positions' plain rows
(modules/recent.py), and says so through `announce`. `attention` (registered as "attnlab" by `use_on`, which KVCache
calls for a windowed storage) masks them as recent.mixed_mask does, so a chunk scores what one-token decoding scores.
"""
from __future__ import annotations

import threading

import torch

from ..modules.recent import mixed_mask

NAME = "attnlab"
BLOCK = 256  # queries a call at most: a long prefill's mask stays (256, rows) instead of (L, 2 rows)
_pending = threading.local()  # the last announcement: made by a layer's update, read by the attention after it


def announce(stored: int, tail_start: int, size: int) -> None:
    """A cache layer returned `stored` rows as stored, then the plain rows of positions tail_start..stored - 1."""
    _pending.mix = (stored, tail_start, size)


def forget() -> None:
    """A cache layer returned its rows as one-token decoding reads them: no earlier announcement holds any more
    (one made by an update that no attention followed, such as a cache filled by hand)."""
    _pending.mix = None


def attention(module, query, key, value, attention_mask, **kwargs):
    """sdpa, over the mixed rows a cache layer announced for this call (module docstring), BLOCK queries at a time."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    mix, _pending.mix = getattr(_pending, "mix", None), None
    if mix is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    S, tail_start, size = mix
    if key.shape[-2] != 2 * S - tail_start:
        raise ValueError(f"layer {getattr(module, 'layer_idx', '?')}: {key.shape[-2]} keys, but its cache "
                         f"announced {S} stored rows and {S - tail_start} plain ones")
    kwargs["is_causal"] = False
    L, outs = query.shape[-2], []
    for b0 in range(0, L, BLOCK):
        b1 = min(L, b0 + BLOCK)
        end = S - L + b1  # the block's queries read stored rows 0..end - 1
        first = max(tail_start, S - L + b0 - size + 1)  # and the plain rows first..end - 1
        plain = slice(S + first - tail_start, S + end - tail_start)
        rows = [torch.cat([t[..., :end, :], t[..., plain, :]], dim=-2) for t in (key, value)]
        base = None if attention_mask is None else attention_mask[..., b0:b1, :end]
        mask = mixed_mask(end, first, b1 - b0, size, base, base is None, query.device)
        outs.append(sdpa_attention_forward(module, query[..., b0:b1, :], *rows, mask, **kwargs)[0])
    return torch.cat(outs, dim=1), None  # (B, L, H, d), as sdpa's


def use_on(model) -> None:
    """Register the "attnlab" attention (and sdpa's masks under its name) and set it on `model`, when `model` is a
    transformers model (a config alone is left as it is)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(NAME, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    if hasattr(model, "set_attn_implementation") and getattr(model.config, "_attn_implementation", None) != NAME:
        model.set_attn_implementation(NAME)
