"""What a conversion must preserve, measured: the ConversionReport every conversion returns.

Per query head it compares the score form scale W_Q_h^T W_K_h ("QK"), the value path W_O_h W_V_h ("OV"), both D_1 x
D_2 (dim x context_dim), and where head bases are kept the effective K and V projections; its output error runs both
modules on a probe batch in float64. Inside `unreported()` conversions return no report (the shrink planner's).
"""
from __future__ import annotations

import contextlib
import contextvars
import copy
import json
import math
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from ..modules.gqa import GroupedQueryAttention
from ..modules.heads import tile_heads
from ..modules.mla import MultiHeadLatentAttention

F64 = torch.float64
_UNREPORTED = contextvars.ContextVar("attnlab_unreported", default=False)


@contextlib.contextmanager
def unreported():
    """Conversions inside this block return None for their report (nothing else differs). For the shrink planner,
    which scores a candidate by its KL and drops it; the conversion a run keeps is reported."""
    token = _UNREPORTED.set(True)
    try:
        yield
    finally:
        _UNREPORTED.reset(token)


@dataclass
class ConversionReport:
    source: str
    target: str
    exact: bool
    matrix_errors: dict[str, float]
    output_error: float
    kv_values_before: int
    kv_values_after: int
    energy_kept: float | None = None
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        worst = max(self.matrix_errors.items(), key=lambda kv: kv[1], default=("-", 0.0))
        energy = f", energy kept {self.energy_kept:.4f}" if self.energy_kept is not None else ""
        return (f"{self.source} -> {self.target}: {'exact' if self.exact else 'lossy'}, output error "
                f"{self.output_error:.2e}, worst matrix {worst[0]} {worst[1]:.2e}{energy}, KV values/token "
                f"{self.kv_values_before} -> {self.kv_values_after}")

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def _describe(m: nn.Module) -> str:
    if isinstance(m, MultiHeadLatentAttention):
        return f"MLA(H={m.num_heads}, r={m.latent_dim})"
    if isinstance(m, GroupedQueryAttention):
        return f"MHA(H={m.num_heads})" if m.num_heads == m.num_kv_heads else \
            f"GQA(H={m.num_heads}, G={m.num_kv_heads})"
    return type(m).__name__


def _is_probe(calibration, module) -> bool:
    return calibration is not None and calibration.dim() == 3 and module.context_dim == module.dim


def _heads(m: nn.Module):
    """Per-query-head (RoPE and norms left out) (scale * W_Q_h, W_K_h, W_V_h, W_O_h): (H, d, D_1), (H, d, D_2),
    (H, dv, D_2), (H, D_1, dv)."""
    H = m.num_heads
    if isinstance(m, MultiHeadLatentAttention):  # a decoupled rotary key joins every head's key rows
        d, dv = m.head_dim + m.rope_dim, m.v_head_dim
        wq = m.W_Q.weight if m.W_Q is not None else m.W_UQ.weight @ m.W_DQ.weight
        wk = (m.W_UK.weight @ m.W_DKV.weight).reshape(H, m.head_dim, m.context_dim)  # head_dim 0: keys whole
        if m.W_KR is not None:
            wk = torch.cat([wk, m.W_KR.weight.expand(H, -1, -1)], dim=1)
        wv = m.W_UV.weight @ m.W_DKV.weight
    else:
        d, dv = m.head_dim, m.v_head_dim
        wq = m.W_Q.weight
        wk = tile_heads(m.W_K.weight, H, m.num_kv_heads, m.grouping)
        wv = tile_heads(m.W_V.weight, H, m.num_kv_heads, m.grouping)
    q = wq.detach().to(F64).reshape(H, d, -1) * m.scale
    k = wk.detach().to(F64).reshape(H, d, -1)
    v = wv.detach().to(F64).reshape(H, dv, -1)
    o = m.W_O.weight.detach().to(F64).reshape(-1, H, dv).transpose(0, 1)
    return q, k, v, o


def _product_error(a1, b1, a2, b2) -> float:
    """sqrt(sum_h ||a1_h^T b1_h - a2_h^T b2_h||^2) / sqrt(sum_h ||a1_h^T b1_h||^2), one head at a time."""
    diff = ref = 0.0
    for h in range(a1.shape[0]):
        p1 = a1[h].T @ b1[h]
        diff += float(torch.linalg.norm(p1 - a2[h].T @ b2[h]) ** 2)
        ref += float(torch.linalg.norm(p1) ** 2)
    return math.sqrt(diff) / math.sqrt(max(ref, 1e-300))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.norm(a - b) / torch.linalg.norm(a).clamp_min(1e-300))


def matrix_errors(old: nn.Module, new: nn.Module, *, bases: bool = True) -> dict[str, float]:
    q1, k1, v1, o1 = _heads(old)
    q2, k2, v2, o2 = _heads(new)
    out = {"QK": _product_error(q1, k1, q2, k2),
           "OV": _product_error(o1.transpose(1, 2), v1, o2.transpose(1, 2), v2)}
    if bases and k1.shape == k2.shape and v1.shape == v2.shape:
        out["K"], out["V"] = _rel(k1, k2), _rel(v1, v2)
    return out


def probe_error(old: nn.Module, new: nn.Module, probe: torch.Tensor | None = None,
                context: torch.Tensor | None = None, *, seed: int = 0) -> float:
    """Relative output error of new against old on a probe batch, both run in float64."""
    g = torch.Generator().manual_seed(seed)
    a, b = copy.deepcopy(old).to(F64), copy.deepcopy(new).to(F64)
    x = probe if probe is not None else torch.randn(2, 16, old.dim, generator=g, dtype=F64)
    x = x.to(F64).reshape(-1, *x.shape[-2:]) if x.dim() >= 2 else x
    if x.dim() == 2:
        x = x[None]
    if context is None and old.context_dim != old.dim:
        context = torch.randn(x.shape[0], 24, old.context_dim, generator=g, dtype=F64)
    c = None if context is None else context.to(F64)
    with torch.no_grad():
        ya, yb = a(x, c), b(x, c)
    return _rel(ya, yb)


def _report(old, new, exact, *, bases=True, calibration=None, energy=None, notes=()) -> ConversionReport:
    """The report (None inside unreported()); calibration inputs of a self-attention module double as the probe
    batch."""
    if _UNREPORTED.get():
        return None
    probe = calibration if _is_probe(calibration, old) else None
    return ConversionReport(_describe(old), _describe(new), exact, matrix_errors(old, new, bases=bases),
                            probe_error(old, new, probe), old.kv_values_per_token, new.kv_values_per_token,
                            energy, list(notes))
