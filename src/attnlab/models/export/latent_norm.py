"""A latent norm for a converted MLA, fitted on calibration text: what DeepSeek-V3 and llama.cpp's deepseek2 apply to
the latent (kv_a_layernorm) and attnlab's MLA does not; the exporters write either kind as it is.
`add_steady_channels`: one more, nearly constant latent channel, so the norm is nearly a fixed scale (lossy, small,
survives llama.cpp's quantisers). `add_latent_norm(s)`: a plain norm on the r channels (lossy, large before training:
each token is rescaled by its own latent's size; heal can train it)."""
from __future__ import annotations

import math

import torch

from ...modules.mla import MultiHeadLatentAttention
from ..adapters import attnlab_modules


# -- one module ---------------------------------------------------------
def _check_no_latent_norm(mla: MultiHeadLatentAttention, what: str) -> None:
    if mla.kv_norm is not None:
        raise ValueError("the MLA already normalises its latent")
    if mla.W_DKV.bias is not None:
        raise ValueError(f"{what} needs an MLA without a latent bias")


def _with_latent_norm(mla: MultiHeadLatentAttention, eps: float) -> MultiHeadLatentAttention:
    """A copy of `mla` with an RMSNorm (weight 1, `eps`) on its latent, every other weight the same."""
    cfg = mla.config()
    cfg.update(latent_norm=True, norm_eps=eps, kv_tiling=None)
    new = MultiHeadLatentAttention(**cfg, device=mla._anchor.device, dtype=mla._anchor.dtype)
    new.load_state_dict(mla.state_dict(), strict=False)  # everything but kv_norm.weight (ones)
    return new


def kv_values_in_export(latent_dim: int, rope_dim: int, latent_norm: bool) -> int:
    """Numbers a DeepSeek export caches per token and layer: the latent, plus the constant channel when the MLA has
    no latent norm (constant_channel), plus the rope key."""
    return latent_dim + (not latent_norm) + rope_dim


def add_latent_norm(mla: MultiHeadLatentAttention, calibration: torch.Tensor | None = None, *, eps: float = 1e-6):
    """A copy of `mla` with an RMSNorm on its latent, and the relative output error it introduces.

    Per latent channel j the weight w_j = sum(c_j n_j) / sum(n_j^2) (n = c / rms(c) over the calibration inputs
    (..., context_dim)) makes w * n the least-squares fit of c; w is folded, exactly, into the columns of W_UK and W_UV
    (the norm's own weight stays 1). The error: the normed module's against `mla` on the calibration inputs (float64).
    """
    # Calibration is required: Gaussian stand-ins say nothing about a real model's latents. The norm is not linear, so
    # a token whose latent is larger or smaller than typical has its key and value rescaled; the error measures that.
    from ...convert.report import probe_error

    _check_no_latent_norm(mla, "add_latent_norm")
    if calibration is None or calibration.numel() == 0:
        raise ValueError("add_latent_norm fits the norm on calibration inputs (..., context_dim): give calibration "
                         "(--calibration)")
    x = calibration.reshape(-1, mla.context_dim).to(torch.float64)
    c = x @ mla.W_DKV.weight.detach().to(torch.float64).T  # (N, r)
    n = c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + eps)  # (N, r)
    w = (c * n).sum(0) / n.pow(2).sum(0).clamp_min(1e-300)  # (r,)
    new = _with_latent_norm(mla, eps)
    dt = new._anchor.dtype
    with torch.no_grad():
        for lin in (new.W_UK, new.W_UV):
            lin.weight.copy_((lin.weight.to(torch.float64) * w.to(lin.weight.device)).to(dt))
    probe = calibration.reshape(1, -1, mla.context_dim)[:, :512]
    return new, probe_error(mla, new, probe)


def linear_latent_norm(mla: MultiHeadLatentAttention, input_bound: float, eps: float, tol: float = 2.0 ** -24):
    """A copy of `mla` with a latent RMSNorm that is a fixed scale to within `tol` (relative), and the scale s.

    For engines that always normalise the latent and give the down-projection no bias (llama.cpp's deepseek2). W_DKV is
    multiplied by s, a power of two so small that the norm divides by the constant sqrt(eps); its weight sqrt(eps) / s
    gives the latent back. eps: the engine's (rounded to float32). Needs float32's or bfloat16's exponent range.
    """
    # s makes mean(c^2) <= tol * eps for every input x with ||x|| <= input_bound (|c_j| <= ||W_DKV_j|| ||x||), so the
    # norm divides by sqrt(mean(c^2) + eps) = sqrt(eps) (1 + at most tol / 2). float16 (or a quantisation with float16
    # block scales) would flush the small pre-norm latent to zero.
    import numpy as np

    _check_no_latent_norm(mla, "linear_latent_norm")
    eps = float(np.float32(eps))
    w = mla.W_DKV.weight.detach().to(torch.float64)
    worst = float(w.norm(dim=1).max()) * float(input_bound)  # largest |c_j| over the inputs
    s = 2.0 ** math.floor(math.log2(math.sqrt(tol * eps) / max(worst, 1e-300)))
    new = _with_latent_norm(mla, eps)
    with torch.no_grad():
        new.W_DKV.weight.copy_((w * s).to(new._anchor.dtype))
        new.kv_norm.weight.fill_(math.sqrt(eps) / s)
    return new, s


# The steady channel's fit (chosen on SmolLM2, 50% cut, perplexity on GPL-3 with MPL-2.0 calibration; without a
# norm 43.51): ridge 1e-2 44.98, 1e-3 45.20, 1e-1 46.36 (sink weight 16); sink weight 16 44.98, 64 44.74, the
# sequence length (512) 44.71 (ridge 1e-2); no sink weighting (1, ridge 1e-3) 49.42.
STEADY_RIDGE = 1e-2  # ridge of the steady channel's least squares, times the inputs' mean energy per dim
STEADY_MARGIN = 32.0  # the steady channel's size over the largest calibration latent


def steady_channel(mla: MultiHeadLatentAttention, calibration: torch.Tensor, *, eps: float = 1e-6,
                   ridge: float = STEADY_RIDGE, sink_weight: float | None = None, margin: float = STEADY_MARGIN):
    """A copy of `mla` with a latent RMSNorm that is nearly a fixed scale, its latent one channel wider, and its error.

    The extra channel is e = K u.x: u the ridge least-squares fit of u.x = 1 over the calibration inputs (..., L, D)
    (each sequence's first token weighted `sink_weight`, default L), K a power of two `margin` times the largest latent
    |c|, so the norm scales each token by about 1 / |u.x|. Error: the relative output error against `mla` (causal)."""
    # For engines that always normalise the latent and give the down-projection no bias (llama.cpp's deepseek2), and
    # whose quantisers (block scales in float16) would flush linear_latent_norm's tiny down-projection to zero.
    # The first token is the attention sink every other token reads: weighted as much as the rest of its sequence, since
    # its state is far from the others' and a plain fit would let its scale drift. mean(latent^2) = (|c|^2 + e^2) /
    # (r + 1) is K^2 (u.x)^2 / (r + 1) to within 1 / margin^2, so the error is how far u.x strays from 1.
    # The latent weights w (least squares of c by the normed latent, as add_latent_norm) fold into the columns of W_UK
    # and W_UV; the extra channel's columns are zero; the norm's weight is 1 on the latent and 0 on the extra channel,
    # its eps `eps` (the engine's). The engines cache the normed latent, so the zero weight keeps the channel (K times
    # larger than the rest before the norm) out of the cache: in one of llama.cpp's q8_0 cache blocks of 32 it would set
    # the block's scale and flush its neighbours. Every weight keeps a usual size, so Q8_0 and Q4_K keep their usual
    # precision. Costs one cached number per token (r + 1 + rope_dim).
    _check_no_latent_norm(mla, "steady_channel")
    x = calibration.detach().to(torch.float64)
    x = x.reshape(-1, *x.shape[-2:]) if x.dim() >= 2 else x
    if x.dim() == 2:
        x = x[None]
    if x.shape[-1] != mla.context_dim or x.shape[1] == 0:
        raise ValueError(f"calibration must be (..., L >= 1, {mla.context_dim}), got {tuple(calibration.shape)}")
    flat = x.reshape(-1, x.shape[-1])  # (N, D)
    weight = torch.ones(x.shape[:2], dtype=torch.float64)
    weight[:, 0] = x.shape[1] if sink_weight is None else sink_weight
    weight = weight.reshape(-1, 1) / weight.sum()
    gram = (flat * weight).T @ flat  # (D, D)
    lam = ridge * float(torch.diagonal(gram).mean().clamp_min(1e-30))
    u = torch.linalg.solve(gram + lam * torch.eye(gram.shape[0], dtype=gram.dtype), (flat * weight).sum(0))  # (D,)
    w_dkv = mla.W_DKV.weight.detach().to(torch.float64)  # (r, D)
    c = flat @ w_dkv.T  # (N, r)
    K = 2.0 ** math.ceil(math.log2(max(margin * float(c.norm(dim=1).max()), 1e-30)))
    down = torch.cat([w_dkv, K * u[None]])  # (r + 1, D)
    latent = flat @ down.T
    n = latent * torch.rsqrt(latent.pow(2).mean(-1, keepdim=True) + eps)  # (N, r + 1)
    r = mla.latent_dim
    w = (c * n[:, :r]).sum(0) / n[:, :r].pow(2).sum(0).clamp_min(1e-300)  # (r,)
    cfg = mla.config()
    cfg.update(latent_dim=r + 1, latent_norm=True, norm_eps=eps, kv_tiling=None)
    new = MultiHeadLatentAttention(**cfg, device=mla._anchor.device, dtype=mla._anchor.dtype)
    state = dict(mla.state_dict())
    dt = new._anchor.dtype
    state["W_DKV.weight"] = down.to(dt)
    for name in ("W_UK", "W_UV"):
        up = getattr(mla, name).weight.detach().to(torch.float64) * w  # (rows, r)
        state[f"{name}.weight"] = torch.cat([up, torch.zeros(up.shape[0], 1, dtype=torch.float64)], 1).to(dt)
    norm_weight = torch.ones(r + 1, dtype=dt)
    norm_weight[r] = 0.0  # the cached copy of the extra channel: zero (its up-projection columns are zero)
    state["kv_norm.weight"] = norm_weight
    new.load_state_dict(state)
    return new, _causal_error(mla, new, x)


def _causal_error(old, new, x: torch.Tensor) -> float:
    """Relative output error of new against old on the sequences x (B, L, D), causal self-attention, float64."""
    import copy

    a, b = copy.deepcopy(old).to(torch.float64), copy.deepcopy(new).to(torch.float64)
    with torch.no_grad():
        ya, yb = a(x, is_causal=True), b(x, is_causal=True)
    return float((ya - yb).norm() / ya.norm().clamp_min(1e-300))


# -- every layer of a model ------------------------------------------------------------------------------------
def add_latent_norms(model, calibration_ids: torch.Tensor) -> list[float]:
    """add_latent_norm on every layer of a converted model (in place); returns each layer's output error.

    Layer i fits on what it reads in the converted model with layers < i already normed (the norms' errors compound
    as they will in use), all from one forward: each layer fits its norm on its input, then runs with it.
    """
    return _fit_layers(model, calibration_ids, lambda m, x: add_latent_norm(m, x.reshape(-1, m.dim)),
                       "add_latent_norms")


def add_steady_channels(model, calibration_ids: torch.Tensor, *, eps: float | None = None,
                        window: int = 512) -> list[float]:
    """steady_channel on every layer of a converted model (in place); returns each layer's output error.

    The calibration ids (1, N) are cut into N // window windows (one of N when shorter), run as one batch, so every
    window's first token is an attention sink the fit sees; layer i fits on what it reads with layers < i changed.
    eps: the norm's eps, by default the model's rms_norm_eps (what llama.cpp's latent norm uses).
    """
    from ...modules import checks

    checks.positive_int("window", window)
    eps = float(getattr(model.config, "rms_norm_eps", 1e-6)) if eps is None else float(eps)
    _check_calibration_ids(calibration_ids, "add_steady_channels")
    ids = calibration_ids.reshape(1, -1)
    n = ids.shape[1]
    ids = ids[:, :n // window * window].reshape(-1, window) if n >= window else ids
    return _fit_layers(model, ids, lambda m, x: steady_channel(m, x, eps=eps), "add_steady_channels")


def _check_calibration_ids(ids, what: str) -> None:
    if ids is None or not isinstance(ids, torch.Tensor) or ids.numel() == 0:
        n = 0 if ids is None or not isinstance(ids, torch.Tensor) else ids.numel()
        raise ValueError(f"{what} fits on calibration text: calibration_ids holds {n} tokens (give --calibration)")


def _fit_layers(model, calibration_ids, fit, what: str) -> list[float]:
    """Replace every layer by fit(module, its input (B, L, D)) -> (module, error), from one forward (in place)."""
    from ..adapters import replace_attention

    _check_calibration_ids(calibration_ids, what)
    modules = list(attnlab_modules(model))
    fitted = []
    replace_attention(model, [_FitNorm(m, fitted, fit) for m in modules])
    try:
        with torch.no_grad():
            model(calibration_ids)
    finally:
        replace_attention(model, modules)
    if len(fitted) != len(modules):
        raise ValueError(f"the calibration forward reached {len(fitted)} of {len(modules)} layers")
    replace_attention(model, [m for m, _ in fitted])
    return [err for _, err in fitted]


class _FitNorm(torch.nn.Module):
    """Stands in for one layer during a fitting forward: fits on its input, then runs with the result."""

    def __init__(self, mla, out: list, fit):
        super().__init__()
        self.mla, self.out, self.fit = mla, out, fit
        self.dim = mla.dim

    def forward(self, x, *args, **kwargs):
        normed, err = self.fit(self.mla, x.detach())
        self.out.append((normed, err))
        return normed(x, *args, **kwargs)
