"""Convert every attention layer of an attnlab'd model (calibrated from one forward)."""
from __future__ import annotations

import torch

from .adapters import attnlab_modules, family, replace_attention
from .evaluate import attention_inputs


def convert_layers(model, fn, *, calibration_ids: torch.Tensor | None = None, progress=None):
    """Apply fn(module, calibration or None) -> (new module, report) to every layer; returns the reports.

    Calibration inputs of all layers come from one forward of the model as it was
    before the conversion (one shot, not layer by layer).
    """
    modules = attnlab_modules(model)
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


DEFAULT_ROPE_PAIRS = 16  # per KV head when only a latent size is given: half the pairs (rope_dim 2 * G * 16)


def convert_model(model, to: str, *, latent_dim: int | None = None, rope_dim: int | None = None,
                  num_kv_heads: int | None = None, method: str | None = None,
                  calibration_ids: torch.Tensor | None = None, pair_selection: str = "frequency",
                  balance: bool = False, progress=None):
    """Convert every attention layer of an attnlab'd model in place; returns the per-layer reports.

    Llama (RoPE GQA) -> "mla": without latent_dim, the exact gqa_to_mla (the latent holds
    pre-RoPE K and V); with latent_dim, gqa_to_mla_decoupled keeping rope_dim / (2 G) rotary
    pairs per KV head (default rope_dim = 2 G * 16, half the pairs). BERT (MHA) -> "gqa" (num_kv_heads, method)
    or "mla" (latent_dim). calibration_ids: token ids whose attention inputs whiten the SVDs;
    pair_selection: what keeps rotating in a compressed Llama MLA, one of convert.ROPE_SELECTIONS
    (frequency, norm, rorope, rorope-score); balance: BKV before the joint SVD (convert.selection_options).
    """
    from ..convert.choose import convert as convert_module
    from ..convert.decoupled import gqa_to_mla_decoupled, selection_options
    from ..convert.exact import gqa_to_mla

    fam = family(model)
    first = attnlab_modules(model)[0]
    if fam == "llama":
        if to != "mla":
            raise ValueError(f"a Llama model converts to 'mla', not {to!r}")
        if latent_dim is None:
            if rope_dim is not None or calibration_ids is not None:
                raise ValueError("--rope-dim and calibration apply to a compressed MLA: give --latent-dim too")
            return convert_layers(model, lambda m, x: gqa_to_mla(m), progress=progress)
        G = first.num_kv_heads
        rope_dim = 2 * G * DEFAULT_ROPE_PAIRS if rope_dim is None else rope_dim
        if rope_dim < 0 or rope_dim % (2 * G):
            raise ValueError(f"rope_dim ({rope_dim}) must be a non-negative multiple of 2 * num_kv_heads ({2 * G})")
        pairs, options = rope_dim // (2 * G), selection_options(pair_selection, balance)
        return convert_layers(model, lambda m, x: gqa_to_mla_decoupled(m, latent_dim, pairs, calibration=x, **options),
                              calibration_ids=calibration_ids, progress=progress)
    if rope_dim is not None:
        raise ValueError("rope_dim applies to RoPE models (Llama); BERT has no RoPE")
    return convert_layers(model, lambda m, x: convert_module(m, to, num_kv_heads=num_kv_heads, method=method,
                                                              latent_dim=latent_dim, calibration=x),
                          calibration_ids=calibration_ids, progress=progress)
