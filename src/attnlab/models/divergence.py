"""KL(teacher || student) between next-token distributions, summed over positions: kl_sum.

Both sides come as logits (or log-probabilities) and are read a few positions at a time, so that the work stays in
the CPU's caches and no (..., V) copy of a window is made; each block's sum is added in float64.
"""
from __future__ import annotations

import torch

KL_ROWS = 4  # positions per block: 4 MB of float32 at V = 262,144 (docs/decisions.md, "Speed")


def kl_sum(teacher: torch.Tensor, student: torch.Tensor, dtype: torch.dtype = torch.float32,
           rows: int = KL_ROWS) -> float:
    """Sum over positions of KL(teacher || student), each given as logits (..., V) of the same shape, computed in
    `dtype`. A token the teacher gives probability 0 adds nothing (0 log 0 = 0)."""
    if teacher.shape != student.shape:
        raise ValueError(f"teacher and student logits differ in shape: {tuple(teacher.shape)} and "
                         f"{tuple(student.shape)}")
    V = teacher.shape[-1]
    t_all, s_all = teacher.reshape(-1, V), student.reshape(-1, V)
    total = torch.zeros((), dtype=torch.float64, device=t_all.device)  # read once: no wait a block on a GPU
    with torch.autocast(t_all.device.type, enabled=False):
        for i in range(0, t_all.shape[0], rows):
            t = t_all[i:i + rows].to(dtype).log_softmax(-1)
            s = s_all[i:i + rows].to(device=t.device, dtype=dtype).log_softmax(-1)
            p = t.exp()
            total += torch.where(p > 0, p * (t - s), 0.0).sum(-1).double().sum()
    return float(total)
