"""What a heal step lowers, and at what rate: KL(teacher || student) of the next-token distributions (the end-to-end
phase), the normalised squared error of an attention layer's output (the layer-wise phase), and the warm-up and
cosine schedule both phases follow. Both losses are computed in at least float32; over N ranks of a torchrun job,
each with an equal share of the batch, the mean of the ranks' losses (what DDP's averaged gradient follows) is the
one-process loss of the whole batch.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from . import distributed as dd


def _wide(t: torch.Tensor) -> torch.Tensor:
    """At least float32 for a loss (bf16/half go up; float32 is t itself; float64 keeps its precision)."""
    return t if t.dtype == torch.float64 else t.float()


def kl_loss(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(teacher || student), logits (..., V).

    Over N ranks with equal rows each, the mean of the ranks' losses is the whole batch's loss,
    so DDP's averaged gradient is the one-process gradient.
    """
    t = _wide(teacher_logits).log_softmax(-1).flatten(0, -2)  # (n, V)
    s = _wide(student_logits).log_softmax(-1).flatten(0, -2)
    return F.kl_div(s, t, log_target=True, reduction="batchmean")


def normalised_mse(out: torch.Tensor, target: torch.Tensor, *, world: dd.World | None = None) -> torch.Tensor:
    """mean((out - target)^2) / mean(target^2): the layer-wise phase's loss, comparable across layers. Over N ranks
    (world) the denominator is the whole batch's, so DDP's averaged gradient is the one-process one."""
    o, t = _wide(out), _wide(target)
    if world is None or not world.distributed:
        power = t.pow(2).mean()
    else:
        total = dd.all_sum(torch.stack([t.pow(2).sum(), t.new_tensor(float(t.numel()))]))  # (2,): sum, count
        power = total[0] / total[1]
    return (o - t).pow(2).mean() / power.clamp_min(1e-30)


def distill_loss(teacher, student, ids: torch.Tensor) -> float:
    """KL(teacher || student) on a batch of windows (B, T), no gradients: the quantity phase 2 lowers."""
    with torch.no_grad():
        return float(kl_loss(teacher(ids).logits, student(ids).logits))


def cosine(step: int, total: int, warmup: int, floor: float = 0.1) -> float:
    """The rate's factor at `step` of `total`: a linear warm-up over `warmup` steps, then a cosine down to `floor`."""
    if step < warmup:
        return (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t))


def warmup_steps(steps: int) -> int:
    """Warm-up of a schedule of `steps` steps (5%, at least 1): a layer cut off by the budget after a step or two
    stays near its start."""
    return max(1, steps // 20)
