"""Heal a converted encoder (BERT, e.g. all-MiniLM-L6-v2) by distillation: cosine loss on sentence embeddings.

heal_encoder trains only the student's converted attention modules (AdamW, cosine learning rate) against the
unconverted teacher; the loss is 1 - cos between their mean-pooled, normalised sentence embeddings
(models.evaluate.mean_pooled, as sentence-transformers pools all-MiniLM-L6-v2).
"""
from __future__ import annotations

import torch

from .data import batch_generator as _generator
from .losses import cosine, warmup_steps
from .trainable import freeze_all_but_attention


def heal_encoder(teacher, student, tok, sentences: list[str], *, steps: int = 200, batch_size: int = 16,
                 lr: float = 2e-4, seed: int = 0, progress=None) -> list[float]:
    """Train the student's attention so its sentence embeddings match the teacher's; returns the losses."""
    from ..models.evaluate import mean_pooled

    if len(sentences) < batch_size:
        raise ValueError(f"{len(sentences)} training sentences; at least batch_size ({batch_size}) are needed")
    params = freeze_all_but_attention(student)
    for p in teacher.parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    teacher.eval(), student.eval()
    losses = []
    for step in range(steps):
        idx = torch.randint(len(sentences), (batch_size,), generator=_generator(seed, 3, step)).tolist()
        enc = tok([sentences[i] for i in idx], padding=True, truncation=True, max_length=128, return_tensors="pt")
        with torch.no_grad():
            target = mean_pooled(teacher(**enc).last_hidden_state, enc["attention_mask"])  # (B, dim)
        emb = mean_pooled(student(**enc).last_hidden_state, enc["attention_mask"])  # (B, dim)
        loss = 1 - (emb * target).sum(-1).mean()
        for g in opt.param_groups:
            g["lr"] = lr * cosine(step, steps, warmup_steps(steps))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if progress:
            progress(step + 1, steps, losses[-1])
    for p in student.parameters():
        p.requires_grad_(False)
    return losses
