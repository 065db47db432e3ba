"""Sampling the next token (sample): temperature, top-k, top-p, one seeded draw per row.

In this order: temperature (0 = greedy argmax), top-k (the k most likely tokens, ties at the k-th kept), top-p (the
smallest set of most likely tokens whose probability reaches p), then one draw per row from a seeded torch.Generator.
Notation: B batch, V vocabulary.
"""
from __future__ import annotations

import math

import torch

from ..modules import checks


def check_sampling(temperature, top_k, top_p) -> None:
    """ValueError/TypeError naming a bad temperature, top_k or top_p."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature must be a number, got {type(temperature).__name__} ({temperature!r})")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature}")
    if top_k is not None:
        checks.positive_int("top_k", top_k)
    if top_p is not None:
        if isinstance(top_p, bool) or not isinstance(top_p, (int, float)):
            raise TypeError(f"top_p must be a number, got {type(top_p).__name__} ({top_p!r})")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")



def filtered_probs(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                   top_p: float | None = None) -> torch.Tensor:
    """The distribution a draw samples from: logits (B, V) -> probabilities (B, V), float32, zero outside the
    support."""
    if temperature <= 0:
        raise ValueError(f"filtered_probs needs temperature > 0 (0 is greedy argmax), got {temperature}")
    scores = logits.float() / temperature  # (B, V)
    if top_k is not None and top_k < scores.shape[-1]:
        kth = scores.topk(top_k, dim=-1).values[:, -1:]  # (B, 1)
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_scores, order = scores.sort(dim=-1, descending=True)  # (B, V)
        p = sorted_scores.softmax(dim=-1)
        before = p.cumsum(dim=-1) - p  # probability of the more likely tokens
        drop = before >= top_p  # the most likely token is always kept (before = 0 < top_p)
        scores = scores.scatter(-1, order, sorted_scores.masked_fill(drop, float("-inf")))
    return scores.softmax(dim=-1)  # (B, V)


CANDIDATES = 1024  # top-k / top-p draws look at the most likely tokens first (exact: see sample)


def sample(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token ids (B,) from logits (B, V): argmax at temperature 0, else one draw from filtered_probs.

    With top-k or top-p the draw reads only the CANDIDATES most likely tokens (a topk, not a sort of the vocabulary).
    Exact: each row is checked, and one whose nucleus is wider (or whose k-th score is tied beyond the candidates) is
    drawn from the whole vocabulary (filtered_probs). From `generator`: the other rows first, then those.
    """
    if temperature == 0:
        return logits.argmax(dim=-1)
    V = logits.shape[-1]
    if (top_k is None or top_k > CANDIDATES) and (top_p is None or top_p >= 1) or V <= CANDIDATES:
        probs = filtered_probs(logits, temperature, top_k, top_p)
        return torch.multinomial(probs, 1, generator=generator)[:, 0]
    scores = logits.float() / temperature  # (B, V)
    c = min(CANDIDATES, top_k) if top_k is not None else CANDIDATES
    values, index = scores.topk(c, dim=-1)  # (B, c), most likely first
    full = torch.zeros(scores.shape[0], dtype=torch.bool, device=scores.device)  # rows drawn from the whole vocabulary
    if top_k is not None:  # ties at the k-th score are kept, as filtered_probs keeps them
        kth = values[:, -1:]
        full |= (scores == kth).sum(-1).gt((values == kth).sum(-1))
    if top_p is not None and top_p < 1:
        total = (scores.masked_fill(scores < values[:, -1:], float("-inf")) if top_k is not None else scores)
        p = (values - total.logsumexp(dim=-1, keepdim=True)).exp()  # (B, c): probabilities within the top-k set
        before = p.cumsum(dim=-1) - p
        full |= p.sum(-1) < top_p  # the nucleus reaches beyond the candidates
        values = values.masked_fill(before >= top_p, float("-inf"))
    if not bool(full.any()):
        return index.gather(-1, torch.multinomial(values.softmax(dim=-1), 1, generator=generator))[:, 0]
    out = torch.empty(scores.shape[0], dtype=torch.long, device=scores.device)
    near = ~full
    if bool(near.any()):
        pick = torch.multinomial(values[near].softmax(dim=-1), 1, generator=generator)  # (b, 1)
        out[near] = index[near].gather(-1, pick)[:, 0]
    out[full] = torch.multinomial(filtered_probs(logits[full], temperature, top_k, top_p), 1, generator=generator)[:, 0]
    return out
