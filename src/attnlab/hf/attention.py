"""transformers' attention over KVCache's rows: a recent window read plain, rotated rows read as stored.

A KVCache layer says through `announce` how its update's rows read: a "+w<N>" call's S stored rows then the newest
positions' plain rows (masked per query as recent.mixed_mask does), and rows left in llama.cpp's rotated frame (H_n),
for which `attention` turns the query and the output instead, as llama.cpp does. `use_on` registers it ("attnlab").
"""
from __future__ import annotations

import threading
from typing import NamedTuple

import torch

from ..modules.recent import mixed_mask
from ..modules.rotation import turned

NAME = "attnlab"
BLOCK = 256  # rows of scores a call at most (queries times heads a KV head): a long prefill's mask stays (256, S)
_pending = threading.local()  # the last announcement: made by a layer's update, read by the attention after it


class Mix(NamedTuple):
    """A call's rows of a "+w<N>" storage: S rows as stored, then the plain rows of positions tail_start..S - 1.
    rows: (keys, values) (B, G, S + room, d) whose first S rows update returned, room (`room`) for the plain rows a
    block reads; plain: those plain rows (B, G, S - tail_start, d). Both None: the plain rows follow the S rows in
    what update returned (an MLA's, which the model up-projects before its attention)."""
    stored: int
    tail_start: int
    size: int
    rows: tuple | None = None
    plain: tuple | None = None


class Note(NamedTuple):
    """What a layer's update returned. mix: Mix, or None; keys, values: the H_n the rows are left turned by, or
    None."""
    mix: Mix | None = None
    keys: int | None = None
    values: int | None = None


def room(size: int) -> int:
    """Rows after a call's stored ones that _mixed writes a block's plain rows into (a window of `size`)."""
    return BLOCK + size - 1


def announce(note: Note) -> None:
    """The rows a cache layer's update just returned are read as `note` says (Note(): as plain rows). Every update
    announces, so a note made by an update that no attention followed (a cache filled by hand) ends at the next."""
    _pending.note = None if note == Note() else note


def attention(module, query, key, value, attention_mask, **kwargs):
    """sdpa over the rows a cache layer announced (module docstring); a long or mixed call a block at a time."""
    note, _pending.note = getattr(_pending, "note", None), None
    if note is None:
        note = Note()
    if note == Note() and query.shape[-2] <= _block(module):
        return _sdpa(module, query, key, value, attention_mask, **kwargs), None
    query = turned(query, note.keys)  # (H q) . (H k) = q . k
    if note.mix is None:
        out = _blocks(module, query, key, value, attention_mask, **kwargs)
    else:
        out = _mixed(module, query, key, value, attention_mask, note.mix, **kwargs)
    return turned(out, note.values), None  # sum a H v = H (sum a v); (B, L, H, d), as sdpa's


def _blocks(module, query, key, value, attention_mask, **kwargs):
    """sdpa a block of queries at a time (_block): a long prefill's scores are (BLOCK, S), not (L, S). Without a
    mask the call is causal (transformers leaves the mask out only where queries and keys end together)."""
    (L, S), step = (query.shape[-2], key.shape[-2]), _block(module)
    if L <= step:
        return _sdpa(module, query, key, value, attention_mask, **kwargs)
    flag = kwargs.get("is_causal")
    causal = attention_mask is None and (getattr(module, "is_causal", True) if flag is None else flag)
    kwargs["is_causal"] = False
    outs = []
    for b0 in range(0, L, step):
        b1 = min(L, b0 + step)
        if attention_mask is not None:
            mask = attention_mask[..., b0:b1, :]
        elif causal:  # query i of L reads keys 0 .. S - L + i
            mask = torch.ones(b1 - b0, S, dtype=torch.bool, device=query.device).tril(S - L + b0)
        else:
            mask = None
        outs.append(_sdpa(module, query[..., b0:b1, :], key, value, mask, **kwargs))
    return torch.cat(outs, dim=1)


def _mixed(module, query, key, value, attention_mask, mix: Mix, **kwargs):
    """sdpa over S stored rows and the plain rows of the newest positions (Mix), a block of queries at a time, the
    last first: each block's plain rows go right after the stored rows it reads, over rows only later blocks read."""
    S, tail_start, size = mix.stored, mix.tail_start, mix.size
    if mix.rows is None and key.shape[-2] == 2 * S - tail_start:  # the plain rows after the stored ones: copied out
        rows, plain = (key, value), tuple(t[..., S:, :].clone() for t in (key, value))
    elif mix.rows is not None and key.shape[-2] == S and key.data_ptr() == mix.rows[0].data_ptr():
        rows, plain = mix.rows, mix.plain
    else:
        raise ValueError(f"layer {getattr(module, 'layer_idx', '?')}: {key.shape[-2]} keys, but its cache "
                         f"announced {S} stored rows and {S - tail_start} plain ones")
    kwargs["is_causal"] = False
    L, step, outs = query.shape[-2], _block(module), []
    for b0 in reversed(range(0, L, step)):
        b1 = min(L, b0 + step)
        end = S - L + b1  # the block's queries read stored rows 0..end - 1
        first = max(tail_start, S - L + b0 - size + 1)  # and the plain rows first..end - 1, written after them
        for t, p in zip(rows, plain):
            t[..., end:2 * end - first, :] = p[..., first - tail_start:end - tail_start, :]
        base = None if attention_mask is None else attention_mask[..., b0:b1, :end]
        mask = mixed_mask(end, first, b1 - b0, size, base, base is None, query.device)
        outs.append(_sdpa(module, query[..., b0:b1, :], *(t[..., :2 * end - first, :] for t in rows), mask,
                          **kwargs))
    return torch.cat(outs[::-1], dim=1)


def _block(module) -> int:
    """Queries a block: BLOCK rows of scores a head once a GQA's queries sit side by side (_sdpa)."""
    return max(1, BLOCK // getattr(module, "num_key_value_groups", 1))


class _OneGroup:
    """What transformers' sdpa reads of a module, for queries already packed by KV head (_sdpa)."""
    num_key_value_groups = 1
    is_causal = False


def _sdpa(module, query, key, value, mask, **kwargs):
    """transformers' sdpa over one call's rows, (B, L, H, d) out. A GQA's several queries go side by side under their
    KV head, (B, G, rep L, d), its mask repeated to match, instead of every key and value repeated rep times
    (repeat_kv: rep float copies of a layer's rows, the largest thing a long prefill holds beside the cache)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    rep = getattr(module, "num_key_value_groups", 1)
    (B, H, L, d), S = query.shape, key.shape[-2]
    if mask is not None and mask.dim() < 4:
        mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    if rep == 1 or L == 1 or (mask is not None and mask.shape[1] != 1):
        return sdpa_attention_forward(module, query, key, value, mask, **kwargs)[0]
    flag = kwargs.get("is_causal")
    if mask is None and (getattr(module, "is_causal", True) if flag is None else flag):  # query i reads 0..S-L+i
        mask = torch.ones(L, S, dtype=torch.bool, device=query.device).tril(S - L)[None, None]
    kwargs["is_causal"] = False
    G, rows = H // rep, rep * L
    if mask is not None:
        mask = mask[:, :, None].expand(mask.shape[0], 1, rep, L, mask.shape[-1]).reshape(mask.shape[0], 1, rows, -1)
    out = sdpa_attention_forward(_OneGroup(), query.reshape(B, G, rows, d), key, value, mask, **kwargs)[0]
    return out.transpose(1, 2).reshape(B, H, L, -1).transpose(1, 2)  # (B, rep L, G, dv) -> (B, L, H, dv)


def use_on(model) -> None:
    """Register the "attnlab" attention (and sdpa's masks under its name) and set it on `model`, when `model` is a
    transformers model (a config alone is left as it is)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(NAME, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    if hasattr(model, "set_attn_implementation") and getattr(model.config, "_attn_implementation", None) != NAME:
        model.set_attn_implementation(NAME)
