"""Convert every attention layer of an attnlab'd model (calibrated from one forward).

RoRoPE by score (`pair_selection="rorope-score"`) chooses for the whole model at once: every
layer's plane scores first, then one allocation of the kept planes to frequencies
(convert.transforms.shared_planes), so that every layer keeps the same frequencies, which is
what a DeepSeek config (one rotary embedding) can hold.
"""
from __future__ import annotations

import torch

from .adapters import attnlab_modules, family, replace_attention
from .evaluate import attention_inputs

DEFAULT_ROPE_PAIRS = 16  # per KV head when only a latent size is given: half the pairs (rope_dim 2 * G * 16)


def default_rope_dim(G: int, d: int) -> int:
    """rope_dim when only a latent size is given: 2 G DEFAULT_ROPE_PAIRS, at most half of each head's pairs
    (head_dim 64: 2 G * 16; a smaller head keeps half its own)."""
    return 2 * G * min(DEFAULT_ROPE_PAIRS, max(1, d // 4))
ROROPE_SELECTIONS = ("rorope", "rorope-score")


def convert_layers(model, fn, *, calibration_ids: torch.Tensor | None = None, progress=None,
                   inputs: list | None = None):
    """Apply fn(module, calibration or None) -> (new module, report) to every layer; returns the reports.

    Calibration inputs of all layers come from one forward of the model as it was
    before the conversion (one shot, not layer by layer); `inputs` gives them instead
    when the caller already has them (attention_inputs).
    """
    modules = attnlab_modules(model)
    if inputs is None:
        inputs = attention_inputs(model, calibration_ids) if calibration_ids is not None else [None] * len(modules)
    new, reports = [], []
    for i, (m, x) in enumerate(zip(modules, inputs)):
        converted, report = fn(m, x)
        new.append(converted)
        reports.append(report)
        if progress:
            progress(i)
    replace_attention(model, new)
    return reports


def check_finite(layer: int, tensors: dict) -> None:
    """Refuse NaN/inf weights before converting, naming the layer and the tensor (an SVD would fail on them)."""
    for name, t in tensors.items():
        if t is not None and not bool(torch.isfinite(t.detach()).all()):
            bad = int((~torch.isfinite(t.detach())).sum())
            raise ValueError(f"layer {layer}'s {name} has {bad} non-finite values (NaN or inf): the source "
                             "checkpoint is damaged; nothing was converted")


def _attention_weights(m) -> dict:
    out = {}
    for name in ("W_Q", "W_K", "W_V", "W_O"):
        lin = getattr(m, name, None)
        if lin is not None:
            out[f"{name}.weight"] = lin.weight
            out[f"{name}.bias"] = lin.bias
    return out


def check_rope_dim(rope_dim: int, num_kv_heads: int, head_dim: int, selection: str, *, positive: bool = False) -> int:
    """The number of rotary planes (RoRoPE) or pairs per KV head (per-head selections) a rope_dim asks for.

    RoRoPE (rorope, rorope-score) keeps any number of mixed planes: rope_dim need only be even
    (at most num_kv_heads * head_dim, everything rotating). Per-head selections (frequency,
    norm) keep the same pairs in every KV head: a multiple of 2 * num_kv_heads.
    """
    G = num_kv_heads
    low = "positive" if positive else "non-negative"
    if not isinstance(rope_dim, int) or isinstance(rope_dim, bool) or rope_dim < int(positive):
        raise ValueError(f"rope_dim must be a {low} integer, got {rope_dim!r}")
    if selection in ROROPE_SELECTIONS:
        if rope_dim % 2 or rope_dim > G * head_dim:
            raise ValueError(f"rope_dim ({rope_dim}) must be even and at most num_kv_heads x head_dim "
                             f"({G * head_dim}) for --rope-select {selection} (RoRoPE keeps any number of mixed "
                             "planes, two dims each)")
        return rope_dim // 2
    if rope_dim % (2 * G):
        raise ValueError(f"rope_dim ({rope_dim}) must be a {low} multiple of 2 * num_kv_heads ({2 * G}) for "
                         f"--rope-select {selection} (the same pairs in every KV head); RoRoPE "
                         "(--rope-select rorope or rorope-score) takes any even rope_dim")
    return rope_dim // (2 * G)


def plane_choice(scores: list[torch.Tensor], planes: int) -> torch.Tensor:
    """(layers, planes, 2): transforms.shared_planes of every layer's rorope_plane_scores."""
    from ..convert.transforms import shared_planes

    return shared_planes(torch.stack(scores), planes)


def check_convertible(model, exact: bool = False) -> None:
    """ValueError naming what no conversion carries yet (per-head q/k norms, sliding windows: Qwen3, Gemma 3),
    before any work; exact=True asks only for the exact GQA -> MLA, which carries them (convert.gqa_to_mla)."""
    from .load import NOT_CONVERTED

    if exact:
        return
    normed = [i for i, m in enumerate(attnlab_modules(model))
              if getattr(m, "k_head_norm", None) is not None or getattr(m, "sliding_window", None) is not None]
    if normed:
        kind = getattr(getattr(model, "config", None), "model_type", "")
        why = NOT_CONVERTED.get(kind, "its attention normalises each query and key head before RoPE, and no "
                                      "conversion carries that norm yet")
        raise ValueError(f"cannot convert {kind or 'this model'} yet ({len(normed)} layers with per-head q/k "
                         f"norms, qk_norm_eps): {why} (the exact MLA, without --latent-dim, carries them)")


def convert_model(model, to: str, *, latent_dim: int | None = None, rope_dim: int | None = None,
                  num_kv_heads: int | None = None, method: str | None = None,
                  calibration_ids: torch.Tensor | None = None, pair_selection: str = "frequency",
                  balance: bool = False, shared_planes: bool = True, progress=None, inputs: list | None = None):
    """Convert every attention layer of an attnlab'd model in place; returns the per-layer reports.

    Llama (RoPE GQA) -> "mla": without latent_dim, the exact gqa_to_mla (the latent holds
    pre-RoPE K and V); with latent_dim, gqa_to_mla_decoupled with rope_dim decoupled rotary dims
    (default 2 G * 16, half the pairs). BERT (MHA) -> "gqa" (num_kv_heads, method)
    or "mla" (latent_dim). calibration_ids: token ids whose attention inputs whiten the SVDs;
    pair_selection: what keeps rotating in a compressed Llama MLA, one of convert.ROPE_SELECTIONS
    (frequency, norm: rope_dim a multiple of 2 G; rorope, rorope-score: any even rope_dim);
    balance: BKV before the joint SVD (convert.selection_options). rorope-score chooses the
    kept planes for all layers at once (shared_planes=True: the same frequencies in every layer,
    exportable); shared_planes=False lets each layer choose alone (a little better before
    training, but the layers then turn at different frequencies and no export can hold them).
    Weights must be finite (checked first, naming the layer and tensor). inputs: each layer's
    calibration inputs, when the caller has them already (attention_inputs of the model as it is):
    a planner converting one model many ways computes them once.
    """
    from ..convert.choose import convert as convert_module
    from ..convert.decoupled import gqa_to_mla_decoupled, rorope_plane_scores, selection_options
    from ..convert.exact import gqa_to_mla
    from ..modules.gqa import GroupedQueryAttention

    fam = family(model)
    modules = attnlab_modules(model)
    first = modules[0]
    if not isinstance(first, GroupedQueryAttention):
        what = "an MLA" if type(first).__name__ == "MultiHeadLatentAttention" else "converted"
        raise ValueError(f"the model is already {what} (layer 0 is a {type(first).__name__}, not a GQA/MHA): "
                         "convert its source model instead")
    check_convertible(model, exact=fam == "llama" and to == "mla" and latent_dim is None)
    for i, m in enumerate(modules):
        check_finite(i, _attention_weights(m))
    if calibration_ids is not None and calibration_ids.numel() == 0:
        raise ValueError("calibration_ids holds 0 tokens; calibration needs text")
    if fam == "llama":
        if to != "mla":
            raise ValueError(f"a Llama model converts to 'mla', not {to!r}")
        if latent_dim is None:
            if rope_dim is not None or calibration_ids is not None:
                raise ValueError("--rope-dim and calibration apply to a compressed MLA: give --latent-dim too")
            return convert_layers(model, lambda m, x: gqa_to_mla(m), progress=progress)
        G, d = first.num_kv_heads, first.head_dim
        rope_dim = default_rope_dim(G, d) if rope_dim is None else rope_dim
        count = check_rope_dim(rope_dim, G, d, pair_selection)
        options = selection_options(pair_selection, balance)
        if pair_selection not in ROROPE_SELECTIONS:
            return convert_layers(model, lambda m, x: gqa_to_mla_decoupled(m, latent_dim, count, calibration=x,
                                                                           **options),
                                  calibration_ids=calibration_ids, progress=progress, inputs=inputs)
        if inputs is None:
            inputs = attention_inputs(model, calibration_ids) if calibration_ids is not None else [None] * len(modules)
        if pair_selection == "rorope-score" and shared_planes:
            chosen = plane_choice([rorope_plane_scores(m, x) for m, x in zip(modules, inputs)], count)
            by_layer = {id(m): p for m, p in zip(modules, chosen)}
            return convert_layers(model, lambda m, x: gqa_to_mla_decoupled(m, latent_dim, None, calibration=x,
                                                                           planes=by_layer[id(m)], **options),
                                  inputs=inputs, progress=progress)
        return convert_layers(model, lambda m, x: gqa_to_mla_decoupled(m, latent_dim, None, calibration=x,
                                                                       rope_planes=count, **options),
                              inputs=inputs, progress=progress)
    if rope_dim is not None:
        raise ValueError("rope_dim applies to RoPE models (Llama); BERT has no RoPE")
    return convert_layers(model, lambda m, x: convert_module(m, to, num_kv_heads=num_kv_heads, method=method,
                                                              latent_dim=latent_dim, calibration=x),
                          calibration_ids=calibration_ids, progress=progress, inputs=inputs)

