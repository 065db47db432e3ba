"""Write a converted Llama-family model as a standard DeepSeek-V3 checkpoint (transformers loads it alone).

The folder holds config.json (model_type deepseek_v3, every layer dense:
first_k_dense_replace = num_hidden_layers, no query low-rank unless the MLA has one),
safetensors shards with an index, and the source's tokenizer files. Mapping of one
layer (attnlab -> DeepSeek):

    W_Q * (attnlab scale / DeepSeek scale)  -> q_proj        (the scale difference, exact)
    [W_DKV; W_KR]                           -> kv_a_proj_with_mqa
    kv_norm, or the constant channel        -> kv_a_layernorm
    per head [W_UK_h; W_UV_h]               -> kv_b_proj
    W_O                                     -> o_proj

DeepSeek's softmax scale is 1/sqrt(qk_nope + qk_rope); attnlab's conversions keep the
original 1/sqrt(head_dim), so the ratio multiplies q_proj. DeepSeek derives the rotary
frequencies from rope_theta and qk_rope_head_dim, while a conversion keeps each original
pair's own frequency: they are carried exactly by a "longrope" rope type whose
short_factor = long_factor = default / kept (one factor per pair), with factor 1,
attention_factor = the source's rotary scaling, and original_max_position_embeddings ==
max_position_embeddings (so the long set is never switched to and no extra scale applies).

Only the decoupled-RoPE layout (`gqa_to_mla_decoupled`) maps to DeepSeek: the exact
`rope_after_up` layout rotates keys after the up-projection, which DeepSeek cannot
express. DeepSeek always normalises the latent (kv_a_layernorm): an MLA without a norm is
exported exactly through one extra constant latent channel that makes the norm a fixed
scale (constant_channel). Engines without a latent bias (llama.cpp) need the norm in the model:
`add_steady_channels` gives every layer a norm whose latent carries one more channel, a fitted
linear function of the layer's input that is nearly constant over calibration text, so the
norm is nearly a fixed scale (lossy, small, reported, and it survives llama.cpp's quantisers);
`add_latent_norm(s)` fits a plain norm on the r channels (lossy, large before training: the
norm rescales every token by its own latent's size; heal can train it). Either is then exported
as it is.
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch

from ..modules.mla import MultiHeadLatentAttention
from .adapters import _layers, attnlab_modules, family

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json")
SHARD_BYTES = 2 * 1024 ** 3
NEEDS_LATENT = ("--format deepseek needs --latent-dim: the exact conversion's rope_after_up layout rotates keys "
                "after the up-projection, which DeepSeek cannot express (decoupled RoPE only)")


# -- the latent norm DeepSeek always applies ---------------------------------------------------------
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

    The norm divides each token's latent c by rms(c); per latent channel j the weight
    w_j = sum(c_j n_j) / sum(n_j^2) (n = c / rms(c), over the calibration inputs (..., context_dim))
    makes w * n the least-squares fit of c. The weight is then folded into the columns of
    W_UK and W_UV (the norm's own weight stays 1), which is exact. Calibration is required
    (Gaussian stand-ins say nothing about a real model's latents). The error is the output error of the normed
    module against `mla` on the calibration inputs (float64): the norm is not linear, so a
    token whose latent is larger or smaller than typical has its key and value rescaled.
    """
    from ..convert.report import probe_error

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

    For engines that always normalise the latent and give the down-projection no bias
    (llama.cpp's deepseek2), where export.constant_channel cannot be used. W_DKV is multiplied
    by s, a power of two so small that mean(c^2) <= tol * eps for every input x with
    ||x|| <= input_bound (|c_j| <= ||W_DKV_j|| ||x||); the norm then divides by
    sqrt(mean(c^2) + eps) = sqrt(eps) (1 + at most tol / 2), a constant, and its weight
    sqrt(eps) / s gives the latent back. eps is the engine's (rounded to float32, as it adds
    it). The small pre-norm latent needs float32's or bfloat16's exponent range: float16
    (or a quantisation with float16 block scales) would flush it to zero.
    """
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

    For engines that always normalise the latent and give the down-projection no bias (llama.cpp's
    deepseek2), and whose quantisers (block scales in float16) would flush linear_latent_norm's tiny
    down-projection to zero. The extra channel is e = K u.x: u is the ridge least-squares fit of
    u.x = 1 over the calibration inputs (..., L, D) (each sequence's first token, the attention
    sink that every other token reads, weighted `sink_weight`, by default L: as much as the rest of
    its sequence; its state is far from the others', and a plain fit would let its scale drift),
    and K a power of two `margin` times
    the largest calibration latent |c|. Then mean(latent^2) = (|c|^2 + e^2) / (r + 1) is
    K^2 (u.x)^2 / (r + 1) to within 1 / margin^2, and the norm scales each token by 1 / |u.x|,
    near 1: the error is how far u.x strays from 1. The latent weights w (least squares of c by
    the normed latent, as add_latent_norm) fold into the columns of W_UK and W_UV, the extra
    channel's columns are zero, the norm's own weight is 1 on the latent and 0 on the extra channel,
    and its eps is `eps` (the engine's). The engines cache the normed latent, so the zero weight
    keeps the channel (K times larger than the rest before the norm) out of the cache: in one of
    llama.cpp's q8_0 cache blocks of 32 it would set the block's scale and flush its neighbours
    (measured: 1.106x perplexity on SmolLM2 with it, docs/conversions.md).
    Every weight keeps a usual size, so Q8_0 and Q4_K keep their usual precision. Costs one
    cached number per token (r + 1 + rope_dim). The error returned is the relative output error
    against `mla` on the calibration sequences (causal, float64).
    """
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


# -- checks ---------------------------------------------------------------------------------------------
NO_KEY_NORM = ("layer {i} normalises every query and key head (per-head q/k norms, qk_norm_eps={eps}: Qwen3, "
               "Gemma 3), and DeepSeek-V3's MLA (llama.cpp's deepseek2 too) has no per-head key norm: keep attnlab's "
               "format")


def check_exportable(modules) -> None:
    """Refuse, naming the layer and the reason, what DeepSeek's layout cannot hold."""
    first = modules[0]
    for i, m in enumerate(modules):
        if getattr(m, "k_head_norm", None) is not None:
            raise ValueError(NO_KEY_NORM.format(i=i, eps=m.k_head_norm.eps))
        if not isinstance(m, MultiHeadLatentAttention):
            raise ValueError(f"layer {i} is {type(m).__name__}, not an MLA: convert with --to mla first")
        if m.rope_after_up:
            raise ValueError(f"layer {i} has the exact rope_after_up layout (keys rotated after the up-projection), "
                             "which DeepSeek cannot express; convert with --latent-dim (decoupled RoPE)")
        if not m.rope_dim:
            raise ValueError(f"layer {i} has no decoupled rope key (rope_dim 0); DeepSeek needs qk_rope_head_dim > 0")
        q = m.W_Q if m.W_Q is not None else m.W_UQ
        if q.bias is not None and bool(q.bias.detach().any()):
            raise ValueError(f"layer {i} has a query bias (Qwen2's q_proj bias): DeepSeek's q_proj has none, and "
                             "the bias's product with each key varies from key to key, so it cannot be folded")
        if m.W_UV.bias is not None and bool(m.W_UV.bias.detach().any()) or \
                m.W_DKV.bias is not None and bool(m.W_DKV.bias.detach().any()):
            raise ValueError(f"layer {i} has latent or value biases; this export does not fold them")
        shape, first_shape = _shape(m), _shape(first)  # the cache's storage may differ (config.json names each)
        if shape != first_shape:
            raise ValueError(f"layer {i}'s shape differs from layer 0's ({shape} vs {first_shape}); "
                             "a DeepSeek config holds one shape for all layers")
        if not torch.equal(m.rope.inv_freq, first.rope.inv_freq) or m.rope.scaling != first.rope.scaling:
            raise ValueError(f"layer {i} keeps other rotary frequencies than layer 0 (chosen layer by layer: "
                             "--rope-select norm, or rorope-score with shared_planes=False); DeepSeek has one rotary "
                             "embedding for all layers: convert with --rope-select frequency, rorope or rorope-score "
                             "(whole models: one allocation for all layers)")


def _shape(m: MultiHeadLatentAttention) -> dict:
    """m's config() without its cache storage: what a DeepSeek config must hold alike in every layer."""
    return {k: v for k, v in m.config().items() if k != "kv_dtype"}


# -- one layer ----------------------------------------------------------------------------------------
def deepseek_scale(m: MultiHeadLatentAttention) -> float:
    return (m.head_dim + m.rope_dim) ** -0.5


def deepseek_attention_tensors(m: MultiHeadLatentAttention, prefix: str) -> dict[str, torch.Tensor]:
    """DeepseekV3Attention's tensors for one attnlab MLA (names under `prefix`, source dtype kept).

    An MLA without a latent norm gets the constant channel (see constant_channel): latent r + 1.
    """
    H, d, dv, r = m.num_heads, m.head_dim, m.v_head_dim, m.latent_dim
    ratio = m.scale / deepseek_scale(m)
    w = lambda lin: lin.weight.detach()  # noqa: E731
    scaled = lambda lin: (w(lin).to(torch.float64) * ratio).to(w(lin).dtype)  # noqa: E731
    out = {}
    if m.W_Q is not None:
        out["q_proj.weight"] = scaled(m.W_Q)
    else:
        out["q_a_proj.weight"] = w(m.W_DQ)
        out["q_a_layernorm.weight"] = m.q_norm.weight.detach()
        out["q_b_proj.weight"] = scaled(m.W_UQ)
    kv_b = torch.cat([w(m.W_UK).reshape(H, d, r), w(m.W_UV).reshape(H, dv, r)], 1)  # (H, d + dv, r)
    dt = m.W_DKV.weight.dtype
    kv_a_bias = torch.zeros(r + m.rope_dim, dtype=dt)
    if m.kv_norm is not None:
        out["kv_a_proj_with_mqa.weight"] = torch.cat([w(m.W_DKV), w(m.W_KR)])  # (r + p, D)
        out["kv_a_layernorm.weight"] = m.kv_norm.weight.detach()
    else:  # the constant channel: rms(latent) ~ K / sqrt(r + 1) for every token, so the norm is a fixed scale
        K, weight, fold = constant_channel(m)
        zero = torch.zeros(1, m.dim if m.context_dim is None else m.context_dim, dtype=dt)
        out["kv_a_proj_with_mqa.weight"] = torch.cat([w(m.W_DKV), zero, w(m.W_KR)])  # (r + 1 + p, D)
        kv_a_bias = torch.cat([kv_a_bias[:r], torch.tensor([K], dtype=dt), kv_a_bias[r:]])
        out["kv_a_layernorm.weight"] = torch.full((r + 1,), weight, dtype=dt)
        kv_b = torch.cat([(kv_b.to(torch.float64) * fold).to(dt), torch.zeros(H, d + dv, 1, dtype=dt)], -1)
        r = r + 1
    out["kv_b_proj.weight"] = kv_b.reshape(H * (d + dv), r)
    out["o_proj.weight"] = w(m.W_O)
    if m.W_O.bias is not None or m.kv_norm is None:  # attention_bias: o_proj, kv_a_proj (and q_a_proj) biases
        out["o_proj.bias"] = m.W_O.bias.detach() if m.W_O.bias is not None else torch.zeros(m.dim, dtype=dt)
        out["kv_a_proj_with_mqa.bias"] = kv_a_bias
        if m.W_Q is None:
            out["q_a_proj.bias"] = torch.zeros(m.q_latent_dim, dtype=dt)
    return {prefix + k: v.contiguous() for k, v in out.items()}


def constant_channel(m: MultiHeadLatentAttention, margin: float = 2.0 ** 12):
    """(K, norm weight, fold) for exporting an MLA without a latent norm through DeepSeek's kv_a_layernorm.

    One extra latent channel holds the constant K (a kv_a_proj_with_mqa bias; its kv_b_proj
    column is zero). K is 2^12 times a bound on |c| for inputs of rms 1 per entry scaled by the
    largest W_DKV row norm times sqrt(dim), so mean(latent^2) = (|c|^2 + K^2) / (r + 1) is
    K^2 / (r + 1) to within |c|^2 / K^2 (float32 cannot tell the difference) and the norm
    multiplies every token's latent by the same sqrt(r + 1) / K: a linear map. The norm
    weight is the power of two nearest K / sqrt(r + 1) (exact in bfloat16 too) and the rest
    of the undo, `fold`, multiplies kv_b_proj. Costs one cached number per token.
    """
    w = m.W_DKV.weight.detach().to(torch.float64)
    bound = float(w.norm(dim=1).max() * math.sqrt(m.context_dim)) * 16  # post-norm inputs of a few x rms 1
    K = 2.0 ** math.ceil(math.log2(max(bound, 1.0) * margin))
    exact = K / math.sqrt(m.latent_dim + 1)
    weight = 2.0 ** round(math.log2(exact))
    return K, weight, exact / weight


def rope_parameters(m: MultiHeadLatentAttention, max_position_embeddings: int) -> dict:
    """DeepSeek rope parameters that reproduce the MLA's kept per-pair frequencies exactly."""
    p, base = m.rope_dim, m.rope.base
    default = base ** (-torch.arange(0, p, 2, dtype=torch.float64) / p)  # (p/2,)
    kept = m.rope.inv_freq.to(torch.float64)
    if torch.allclose(kept, default, rtol=1e-12, atol=0) and m.rope.scaling == 1.0:
        return {"rope_type": "default", "rope_theta": base}
    factors = (default / kept).tolist()
    return {"rope_type": "longrope", "rope_theta": base, "short_factor": factors, "long_factor": factors,
            "factor": 1.0, "attention_factor": m.rope.scaling,
            "original_max_position_embeddings": max_position_embeddings}


def deepseek_config(src: dict, m: MultiHeadLatentAttention, *, dtype: str) -> dict:
    """config.json of the exported model, from the source's (dict) and one layer's MLA."""
    L = src["num_hidden_layers"]
    max_pos = int(src.get("max_position_embeddings") or 4096)
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": src["vocab_size"], "hidden_size": src["hidden_size"],
        "intermediate_size": src["intermediate_size"], "moe_intermediate_size": src["intermediate_size"],
        "num_hidden_layers": L, "first_k_dense_replace": L, "n_routed_experts": 1, "n_shared_experts": 1,
        "num_experts_per_tok": 1, "n_group": 1, "topk_group": 1, "num_mtp_layers": 0,
        "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_heads,
        "kv_lora_rank": m.latent_dim + (m.kv_norm is None), "q_lora_rank": m.q_latent_dim, "qk_rope_head_dim": m.rope_dim,
        "qk_nope_head_dim": m.head_dim, "v_head_dim": m.v_head_dim,
        "hidden_act": src.get("hidden_act", "silu"), "max_position_embeddings": max_pos,
        "rms_norm_eps": src.get("rms_norm_eps", 1e-6), "tie_word_embeddings": bool(src.get("tie_word_embeddings")),
        "rope_parameters": rope_parameters(m, max_pos), "rope_interleave": bool(m.rope.interleaved),
        "attention_bias": m.W_O.bias is not None or m.kv_norm is None, "attention_dropout": 0.0,
        "bos_token_id": src.get("bos_token_id"), "eos_token_id": src.get("eos_token_id"),
        "pad_token_id": src.get("pad_token_id"), "dtype": dtype, "use_cache": True,
    }


def attnlab_entry(modules: list[MultiHeadLatentAttention], constants: list[float]) -> dict:
    """config.json's "attnlab" entry, which attnlab.hf.KVCache reads: the latent channels a cache keeps (not the
    constant one, which kv_b_proj ignores), each layer's constant K where it has one (its cache codes latent * K /
    constant channel: the MLA's own latent) and the storage the caches were planned in (a list, one a layer, where
    the layers' differ)."""
    entry = {"written_by": "attnlab", "latent_channels": modules[0].latent_dim}
    if constants:
        entry["latent_constants"] = constants
    storages = [m.kv_dtype for m in modules]
    if all(k is None for k in storages):
        return entry
    return {**entry, "kv_dtype": storages[0] if len(set(storages)) == 1 else storages}


def layer_constant(m: MultiHeadLatentAttention) -> list[float]:
    """[K] of a layer exported with the constant channel (constant_channel), [] for one with a latent norm."""
    return [] if m.kv_norm is not None else [constant_channel(m)[0]]


def check_source_config(src: dict) -> None:
    if src.get("mlp_bias"):
        raise ValueError("the source MLP has biases (mlp_bias); DeepSeek's dense MLP has none")


def export_preflight(model, target: Path, force: bool, what: str, ours=None) -> list:
    """What every export checks before writing: the target (io.folders.check_output: never the model's own
    sources, an existing one only with force and only if attnlab wrote it: ours(path) for a file), the
    family, the layers (check_exportable)."""
    from ..io.folders import check_output
    from .store import sources_of

    check_output(target, force=force, sources=sources_of(model), ours=ours)
    if family(model) != "llama":
        raise ValueError(f"{what} takes a Llama-family causal LM (Llama, Mistral, Qwen2)")
    modules = attnlab_modules(model)
    check_exportable(modules)
    check_source_config(model.config.to_dict())
    return modules


# -- writing ------------------------------------------------------------------------------------------
class ShardWriter:
    """Write tensors into safetensors shards of at most max_bytes as they come, then an index."""

    def __init__(self, folder: Path, max_bytes: int = SHARD_BYTES):
        self.folder, self.max_bytes = Path(folder), max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.size, self.files, self.weight_map, self.total = 0, [], {}, 0

    def add(self, name: str, t: torch.Tensor) -> None:
        n = t.numel() * t.element_size()
        if self.pending and self.size + n > self.max_bytes:
            self.flush()
        self.pending[name] = t.detach().contiguous().cpu()
        self.size += n
        self.total += n

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        name = f"part-{len(self.files):05d}.safetensors"
        save_file(self.pending, str(self.folder / name), metadata={"format": "pt"})
        self.files.append(name)
        self.weight_map.update({k: name for k in self.pending})
        self.pending, self.size = {}, 0

    def close(self) -> None:
        """Name the shards model(-0000i-of-0000n).safetensors and write the index when there are several."""
        self.flush()
        n = len(self.files)
        final = {f: ("model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors")
                 for i, f in enumerate(self.files)}
        for old, new in final.items():
            (self.folder / old).rename(self.folder / new)
        if n > 1:
            index = {"metadata": {"total_size": self.total},
                     "weight_map": {k: final[v] for k, v in sorted(self.weight_map.items())}}
            (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def copy_tokenizer(source, folder: Path) -> None:
    """Copy the tokenizer (and generation config) files that sit beside the source checkpoint."""
    if source is None:
        return
    src = Path(source)
    src = src.parent if src.is_file() else src
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, folder / name)


def export_deepseek(model, folder, tokenizer=None, *, force: bool = False,
                    shard_bytes: int = SHARD_BYTES) -> Path:
    """Write an attnlab'd, converted Llama-family model as a DeepSeek-V3 checkpoint folder (atomically).

    Every layer must be a decoupled-RoPE MLA with a latent norm (see check_exportable).
    tokenizer: saved with save_pretrained; without it, tokenizer files beside the source
    checkpoint (model.attnlab_source, set by load_checkpoint) are copied.
    """
    from ..io.folders import write_folder

    folder = Path(folder)
    modules = export_preflight(model, folder, force, "export_deepseek")
    src = model.config.to_dict()
    src["tie_word_embeddings"] = bool(getattr(model.config, "tie_word_embeddings", False))
    dtype = str(modules[0]._anchor.dtype).removeprefix("torch.")
    constants = [k for m in modules for k in layer_constant(m)]
    config = {**deepseek_config(src, modules[0], dtype=dtype), "attnlab": attnlab_entry(modules, constants)}
    base = model.model

    def write(tmp: Path) -> None:
        shards = ShardWriter(tmp, shard_bytes)
        shards.add("model.embed_tokens.weight", base.embed_tokens.weight)
        for i, (layer, m) in enumerate(zip(_layers(model), modules)):
            prefix = f"model.layers.{i}."
            for k, v in deepseek_attention_tensors(m, prefix + "self_attn.").items():
                shards.add(k, v)
            for name in ("input_layernorm", "post_attention_layernorm"):
                shards.add(f"{prefix}{name}.weight", getattr(layer, name).weight)
            for name in ("gate_proj", "up_proj", "down_proj"):
                shards.add(f"{prefix}mlp.{name}.weight", getattr(layer.mlp, name).weight)
        shards.add("model.norm.weight", base.norm.weight)
        if not config["tie_word_embeddings"]:
            shards.add("lm_head.weight", model.lm_head.weight)
        shards.close()
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        else:
            copy_tokenizer(getattr(model, "attnlab_source", None), tmp)
    from .store import sources_of

    return write_folder(folder, write, force=force, sources=sources_of(model), info={"what": "DeepSeek-V3 export"})


def add_latent_norms(model, calibration_ids: torch.Tensor) -> list[float]:
    """add_latent_norm on every layer of a converted model (in place); returns each layer's output error.

    Calibration inputs of layer i are what layer i reads in the converted model with
    layers < i already normed (the norms' errors compound as they will in use), all from
    one forward: each layer fits its norm on its input, then runs with it.
    """
    return _fit_layers(model, calibration_ids, lambda m, x: add_latent_norm(m, x.reshape(-1, m.dim)),
                       "add_latent_norms")


def add_steady_channels(model, calibration_ids: torch.Tensor, *, eps: float | None = None,
                        window: int = 512) -> list[float]:
    """steady_channel on every layer of a converted model (in place); returns each layer's output error.

    The calibration ids (1, N) are cut into windows of `window` tokens (N // window of them, or one
    window of N when shorter), run as one batch, so every window's first token is an attention sink
    the fit sees. Layer i fits on what it reads with layers < i already changed, as add_latent_norms.
    eps: the norm's eps, by default the model's rms_norm_eps (what llama.cpp's latent norm uses).
    """
    from ..modules import checks

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
    from .adapters import replace_attention

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


def check_deepseek_request(model, to: str, latent_dim: int | None) -> None:
    """Before converting: refuse what cannot end as a DeepSeek checkpoint, with the reason."""
    if to != "mla":
        raise ValueError(f"--format deepseek writes an MLA: use --to mla, not {to!r}")
    if family(model) != "llama":
        raise ValueError("--format deepseek takes a Llama-family causal LM (Llama, Mistral, Qwen2)")
    if latent_dim is None:
        raise ValueError(NEEDS_LATENT)
    for i, m in enumerate(attnlab_modules(model)):
        if getattr(m, "k_head_norm", None) is not None:
            raise ValueError(NO_KEY_NORM.format(i=i, eps=m.k_head_norm.eps))
        q = getattr(m, "W_Q", None)
        if q is not None and q.bias is not None and bool(q.bias.detach().any()):
            raise ValueError(f"layer {i} has a query bias (Qwen2's q_proj bias): DeepSeek's q_proj has none, and "
                             "the bias's product with each key varies from key to key, so it cannot be folded")
