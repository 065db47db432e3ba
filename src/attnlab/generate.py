"""Generation with attnlab's own loop: static caches, batched left-padded prompts, sampling, EOS, streaming.

Notation: B batch, P prompt length (padding included), V vocabulary.

`generate(model, input_ids, ...)` prefills once (decoder.Generator), then feeds one
token per row per step. Sampling, in this order: temperature (0 = greedy argmax),
top-k (keep the k most likely tokens, ties at the k-th kept), top-p (keep the
smallest set of most likely tokens whose probability reaches p), then one draw per
row from a seeded torch.Generator. Rows that produced an EOS token are finished:
they receive pad tokens from then on, and the loop ends when every row has finished
or max_new_tokens are out.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from . import checks
from .decoder import Generator

__all__ = ["Generator", "check_sampling", "filtered_probs", "sample", "generate"]


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
    """The distribution a draw samples from: logits (B, V) -> probabilities (B, V), float32, zero outside the support."""
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


def sample(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token ids (B,) from logits (B, V): argmax at temperature 0, else one draw from filtered_probs."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = filtered_probs(logits, temperature, top_k, top_p)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def _eos_ids(eos_token_id, device) -> torch.Tensor | None:
    if eos_token_id is None:
        return None
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    if not ids or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
        raise ValueError(f"eos_token_id must be a token id or a list of them, got {eos_token_id!r}")
    return torch.tensor(ids, device=device)


def generate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *, max_new_tokens: int,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             seed: int | None = None, eos_token_id: int | Iterable[int] | None = None,
             pad_token_id: int | None = None, stream: Callable[[torch.Tensor], None] | None = None,
             max_len: int | None = None, generator: Generator | None = None) -> torch.Tensor:
    """Continue a batch of left-padded prompts (B, P); returns (B, P + new) token ids.

    model: a Llama-family causal LM after attnlab.models.to_attnlab (GQA), possibly converted
    (convert_model: exact or compressed MLA, absorbed or not). attention_mask: (B, P), 1 real,
    0 pad, padding on the left. temperature 0 is greedy; top_k, top_p and seed (a
    torch.Generator on the model's device) shape sampling. eos_token_id: one id or several;
    None never stops early. A finished row gets pad_token_id (default the model config's
    pad_token_id, else the first EOS id). stream(column) is called with each new (B,) column
    as it is chosen. max_len: tokens per row the caches hold, default P + max_new_tokens.
    generator: a decoder.Generator of this model to reuse (its caches, and on CUDA its captured
    decode step) instead of making one; it must hold B rows of P + max_new_tokens tokens.
    """
    checks.positive_int("max_new_tokens", max_new_tokens)
    check_sampling(temperature, top_k, top_p)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"input_ids must be a (batch, length) tensor, got {shape}")
    B, P = input_ids.shape
    if generator is not None:
        if max_len is not None and max_len != generator.max_len:
            raise ValueError(f"max_len {max_len} differs from the given generator's max_len {generator.max_len}")
        if generator.model is not model:
            raise ValueError("the given generator was made for another model")
        max_len = generator.max_len
    elif max_len is None:
        max_len = P + max_new_tokens
    checks.positive_int("max_len", max_len)
    if P > max_len:
        raise ValueError(f"a prompt of {P} tokens does not fit max_len {max_len}")
    if P + max_new_tokens > max_len:
        raise ValueError(f"{P} prompt tokens + max_new_tokens {max_new_tokens} = {P + max_new_tokens} exceed "
                         f"max_len {max_len}")
    gen = Generator(model, B, max_len) if generator is None else generator
    device = gen.device
    eos = _eos_ids(eos_token_id, device)
    if pad_token_id is None and eos is not None:
        pad_token_id = getattr(model.config, "pad_token_id", None)
        pad_token_id = int(eos[0]) if pad_token_id is None else pad_token_id
    rng = None
    if seed is not None:
        rng = torch.Generator(device=device)
        rng.manual_seed(seed)
    logits = gen.prefill(input_ids, attention_mask)  # (B, V)
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    columns = []
    for i in range(max_new_tokens):
        nxt = sample(logits, temperature, top_k, top_p, rng)  # (B,)
        if eos is not None:
            nxt = nxt.masked_fill(finished, pad_token_id)
            finished |= torch.isin(nxt, eos)
        columns.append(nxt)
        if stream is not None:
            stream(nxt)
        if i + 1 == max_new_tokens or (eos is not None and bool(finished.all())):
            break
        logits = gen.step(nxt)
    return torch.cat([input_ids.to(device), torch.stack(columns, dim=1)], dim=1)  # (B, P + new)
