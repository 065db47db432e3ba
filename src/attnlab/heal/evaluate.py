"""A student against its teacher on held-out text: perplexity, next-token and greedy agreement.

The report that heal and shrink print before and after training. Perplexity and top-1
agreement are models.evaluate's; greedy agreement runs both models through attnlab's
generation loop.
"""
from __future__ import annotations

import torch

from ..generation.loop import generate
from ..models.evaluate import kv_bytes_per_token, perplexity, top1_agreement


def greedy_agreement(teacher, student, prompts: torch.Tensor, new_tokens: int = 64) -> dict:
    """Both models continue the same prompts (B, P) greedily for new_tokens; how alike are the continuations?

    "prefix": mean fraction of the new tokens before the first difference (strict: one
    different token ends the agreement); "tokens": mean fraction of positions that are equal.
    """
    P = prompts.shape[1]
    with torch.no_grad():
        a = generate(teacher, prompts, max_new_tokens=new_tokens)[:, P:]  # (B, new)
        b = generate(student, prompts, max_new_tokens=new_tokens)[:, P:]
    equal = a == b  # (B, new)
    prefix = equal.long().cumprod(-1).sum(-1).float() / new_tokens  # (B,)
    return {"prefix": float(prefix.mean()), "tokens": float(equal.float().mean()), "new_tokens": new_tokens}


def evaluate_pair(teacher, student, held_out: torch.Tensor, *, prompts: int = 8, prompt_len: int = 32,
                  new_tokens: int = 64, window: int = 512) -> dict:
    """The student against the teacher on held-out token ids (1, M): perplexity, top-1 and greedy agreement."""

    M = held_out.shape[1]
    if M < 2:
        raise ValueError(f"held-out text has {M} tokens; evaluation needs at least 2")
    starts = torch.linspace(0, max(0, M - prompt_len), prompts).long().unique()
    prompt_ids = torch.stack([held_out[0, s:s + prompt_len] for s in starts.tolist()]) if M >= prompt_len else None
    out = {"perplexity": perplexity(student, held_out, window=window),
           "top1_agreement": top1_agreement(teacher, student, held_out, window=window),
           "kv_bytes_per_token": kv_bytes_per_token(student, torch.float32)}
    if prompt_ids is not None:
        out["greedy_agreement"] = greedy_agreement(teacher, student, prompt_ids, new_tokens)
    return out
