"""Measure whole models: perplexity, sentence embeddings, KV bytes per token, attention inputs."""
from __future__ import annotations

import torch

from .adapters import attnlab_modules


def sentence_embeddings(model, tok, sentences: list[str], batch_size: int = 32) -> torch.Tensor:
    """Mean-pooled, L2-normalised embeddings, as sentence-transformers computes them for all-MiniLM-L6-v2."""
    out = []
    for i in range(0, len(sentences), batch_size):
        enc = tok(sentences[i:i + batch_size], padding=True, truncation=True, max_length=256, return_tensors="pt")
        with torch.no_grad():
            hidden = model(**enc).last_hidden_state  # (B, L, dim)
        out.append(mean_pooled(hidden, enc["attention_mask"]))
    return torch.cat(out)

def mean_pooled(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Sentence embeddings (B, dim) from token states (B, L, dim): mean over real tokens, L2-normalised."""
    m = attention_mask[..., None].to(hidden.dtype)
    return torch.nn.functional.normalize((hidden * m).sum(1) / m.sum(1), dim=-1)

def attention_inputs(model, input_ids: torch.Tensor) -> list[torch.Tensor]:
    """What each attention layer reads, (N, dim) per layer, from one forward of the (attnlab'd) model."""
    seen: list[torch.Tensor] = []
    hooks = [m.register_forward_pre_hook(lambda mod, args, kwargs: seen.append(
        (args[0] if args else kwargs["hidden_states"]).detach().reshape(-1, mod.dim)), with_kwargs=True)
        for m in attnlab_modules(model)]
    try:
        with torch.no_grad():
            model(input_ids)
    finally:
        for h in hooks:
            h.remove()
    return seen

def perplexity(model, input_ids: torch.Tensor, window: int = 512, stride: int | None = None) -> float:
    """exp(mean next-token loss) over non-overlapping windows of the token ids (1, N)."""
    stride = stride or window
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, input_ids.shape[1] - 1, stride):
            chunk = input_ids[:, start:start + window]
            if chunk.shape[1] < 2:
                break
            logits = model(chunk).logits.float()
            loss = torch.nn.functional.cross_entropy(logits[0, :-1], chunk[0, 1:], reduction="sum")
            total += float(loss)
            count += chunk.shape[1] - 1
    return float(torch.exp(torch.tensor(total / count)))

def kv_bytes_per_token(model, dtype: torch.dtype | None = None) -> int:
    """KV-cache bytes per token for the whole model, read from caches the attnlab modules allocate."""
    total = 0
    for m in attnlab_modules(model):
        cache = m.init_cache(1, 1, dtype=dtype or m._anchor.dtype, device="meta")
        total += cache.bytes_per_token
    return total

def read_text_ids(tok, path, max_tokens: int | None = None) -> torch.Tensor:
    """Token ids (1, N) of a text file."""
    from pathlib import Path

    p = Path(path)
    if not p.is_file():
        raise ValueError(f"no such text file: {path}")
    try:
        text = p.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError) as e:
        raise ValueError(f"cannot read {path} as text: {e}") from None
    ids = tok(text, return_tensors="pt").input_ids
    return ids[:, :max_tokens] if max_tokens else ids


def top1_agreement(teacher, student, input_ids: torch.Tensor, window: int = 512) -> float:
    """Fraction of positions of the token ids (1, N) where both models' most likely next token is the same."""
    same, count = 0, 0
    with torch.no_grad():
        for start in range(0, input_ids.shape[1], window):
            chunk = input_ids[:, start:start + window]
            a, b = teacher(chunk).logits.argmax(-1), student(chunk).logits.argmax(-1)  # (1, n)
            same += int((a == b).sum())
            count += chunk.numel()
    return same / max(count, 1)

