"""Generation with attnlab's own loop: static caches, batched left-padded prompts, sampling, EOS, streaming.

`generate(model, input_ids, ...)` prefills once (generator.Generator), then feeds one token per row per step, chosen
by sampling.sample. A row that produced an EOS token is finished and gets pad tokens from then on; the loop ends when
every row has finished or max_new_tokens are out. Notation: B batch, P prompt length (padding included), V vocabulary.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from ..modules import checks
from .generator import Generator
from .sampling import check_sampling, sample


def _eos_ids(eos_token_id, device) -> torch.Tensor | None:
    if eos_token_id is None:
        return None
    ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    if not ids or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
        raise ValueError(f"eos_token_id must be a token id or a list of them, got {eos_token_id!r}")
    return torch.tensor(ids, device=device)


def generate(model,  # a Llama-family causal LM after attnlab.models.to_attnlab, possibly converted (convert_model)
             input_ids: torch.Tensor,  # (B, P), padded on the left
             attention_mask: torch.Tensor | None = None,  # (B, P): 1 real, 0 pad
             *, max_new_tokens: int,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,  # sampling.sample
             seed: int | None = None,  # seeds a torch.Generator on the model's device for the draws
             eos_token_id: int | Iterable[int] | None = None,  # one id or several; None never stops early
             pad_token_id: int | None = None,  # a finished row's token; default the config's, else the first EOS id
             stream: Callable[[torch.Tensor], None] | None = None,  # called with each new (B,) column as chosen
             max_len: int | None = None,  # tokens a row's caches hold; default P + max_new_tokens
             # a Generator of this model to reuse (its caches, and on CUDA its captured decode step) instead of a new
             # one; it must hold B rows of P + max_new_tokens tokens
             generator: Generator | None = None,
             budget=None) -> torch.Tensor:  # runtime.Budget, checked before each decode step
    """Continue a batch of left-padded prompts (B, P); returns (B, P + new) token ids.

    temperature 0 is greedy. A stop request or a spent budget raises runtime.Stopped. max_len is checked against the
    model's max_position_embeddings; bad arguments raise ValueError.
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
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if limit and P + max_new_tokens > limit:
        raise ValueError(f"{P} prompt tokens + max_new_tokens {max_new_tokens} = {P + max_new_tokens} exceed the "
                         f"model's context (max_position_embeddings {limit})")
    if limit and max_len > limit:
        raise ValueError(f"max_len {max_len} exceeds the model's context (max_position_embeddings {limit})")
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
        if budget is not None:
            budget.check()
        logits = gen.step(nxt)
    return torch.cat([input_ids.to(device), torch.stack(columns, dim=1)], dim=1)  # (B, P + new)
