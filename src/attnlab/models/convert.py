"""Convert every attention layer of an attnlab'd model, calibrated from one forward (`convert_model`).

RoRoPE by score chooses for the whole model at once: every layer's plane scores, then one allocation of the kept
planes (convert.transforms.shared_planes), so every layer keeps the same frequencies, as a DeepSeek config requires.
A model with per-head q/k norms (Qwen3, Gemma 3) compresses only with its keys whole; check_convertible says why not.
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
                   inputs: list | None = None, layers=None):
    """Apply fn(module, calibration or None) -> (new module, report) to every layer (or to the indices in
    `layers`: the others stay as they are, their report None); returns the reports.

    Calibration inputs of all layers come from one forward of the model as it was before the conversion (one shot,
    not layer by layer); `inputs` gives them instead when the caller already has them (attention_inputs).
    """
    modules = attnlab_modules(model)
    chosen = check_layers(layers, len(modules))
    if inputs is None:
        inputs = attention_inputs(model, calibration_ids) if calibration_ids is not None else [None] * len(modules)
    new, reports = [], []
    for i, (m, x) in enumerate(zip(modules, inputs)):
        if i not in chosen:
            new.append(m)
            reports.append(None)
            continue
        converted, report = fn(m, x)
        new.append(converted)
        reports.append(report)
        if progress:
            progress(i)
    replace_attention(model, new)
    return reports


def check_layers(layers, count: int) -> set[int]:
    """The set of layer indices to convert: all `count` for None, else each index once, in range; ValueError naming
    the value otherwise (an empty selection converts nothing and is refused too)."""
    if layers is None:
        return set(range(count))
    if isinstance(layers, (str, bytes)) or not hasattr(layers, "__iter__"):
        raise TypeError(f"layers must be None (all) or a collection of layer indices, got {layers!r}")
    chosen = list(layers)
    bad = [i for i in chosen if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < count]
    if bad or not chosen or len(set(chosen)) != len(chosen):
        why = f"{bad[0]!r} is not a layer index in 0..{count - 1}" if bad else \
            "it is empty" if not chosen else "an index repeats"
        raise ValueError(f"layers must name each converted layer once among the model's {count}: {why}")
    return set(chosen)


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


def keys_whole_rope_dim(model) -> int | None:
    """G x d, the only rope_dim a compressed conversion of a model with per-head q/k norms takes (its keys whole,
    convert.decoupled), or None for a model without them."""
    normed = [m for m in attnlab_modules(model) if getattr(m, "k_head_norm", None) is not None]
    return normed[0].num_kv_heads * normed[0].head_dim if normed else None


def check_convertible(model, exact: bool = False, *, rope_dim: int | None = None, pair_selection: str = "frequency",
                      balance: bool = False) -> None:
    """ValueError naming what no conversion carries, before any work. exact=True asks for the exact GQA -> MLA,
    which carries everything (convert.gqa_to_mla). Otherwise layers with per-head q/k norms (Qwen3, Gemma 3;
    with them Gemma's softmax scale and sliding windows) compress only with their keys whole: rope_dim G x d
    (None: that default), a per-head pair_selection, no balance; a sliding window without the norms is refused."""
    from .load import NOT_CONVERTED

    if exact:
        return
    modules = attnlab_modules(model)
    kind = getattr(getattr(model, "config", None), "model_type", "") or "this model"
    normed = [m for m in modules if getattr(m, "k_head_norm", None) is not None]
    windowed = [i for i, m in enumerate(modules)
                if getattr(m, "sliding_window", None) is not None and getattr(m, "k_head_norm", None) is None]
    if windowed:
        why = NOT_CONVERTED.get(kind, "no compressed conversion carries a sliding window without per-head q/k norms")
        raise ValueError(f"cannot convert {kind} yet ({len(windowed)} layers with a sliding window): {why} (the exact "
                         "MLA, without --latent-dim, carries it)")
    if not normed:
        return
    G, d = normed[0].num_kv_heads, normed[0].head_dim
    problem = None
    if any((m.num_kv_heads, m.head_dim) != (G, d) for m in normed):
        problem = "its layers differ in KV heads or head size"
    elif rope_dim is not None and any(r != G * d for r in (rope_dim if isinstance(rope_dim, (list, tuple))
                                                            else [rope_dim])):
        problem = f"got rope_dim {rope_dim}"
    elif pair_selection not in ("frequency", "norm"):
        problem = (f"got --rope-select {pair_selection} (RoRoPE mixes key planes across KV heads, which a per-head "
                   "key norm does not survive)")
    elif balance:
        problem = "got BKV (--balance: the latent holds only the values, nothing to balance)"
    if problem:
        raise ValueError(f"cannot convert {kind} yet ({len(normed)} layers with per-head q/k "
                         f"norms, qk_norm_eps): only its keys-whole MLA carries the norm, rope_dim = G x d = {G} x "
                         f"{d} = {G * d} with --rope-select frequency and --no-balance, {problem} (the exact MLA, "
                         "without --latent-dim, carries it too)")


def _one_per_layer(value, count: int, name: str, low: int) -> list:
    """One whole number for every layer, or a list of `count` of them, each at least `low`; TypeError/ValueError
    naming the value."""
    sizes = [value] * count if isinstance(value, int) and not isinstance(value, bool) else value
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, (list, tuple)):
        raise TypeError(f"{name} must be a whole number or a list of one per layer, got {value!r}")
    if len(sizes) != count or any(isinstance(r, bool) or not isinstance(r, int) or r < low for r in sizes):
        kind = "positive" if low > 0 else "non-negative"
        raise ValueError(f"{name} must be a {kind} whole number, or {count} of them (one per layer), got {value!r}")
    return list(sizes)


def layer_latents(latent_dim, count: int) -> list | None:
    """Each layer's latent size from convert_model's latent_dim: None (the exact conversion), one size for every
    layer, or a list of `count` sizes (a per-layer plan, shrink/plan.py); TypeError/ValueError naming the value."""
    return None if latent_dim is None else _one_per_layer(latent_dim, count, "latent_dim", 1)


def layer_ropes(rope_dim, count: int) -> list[int]:
    """Each layer's rope key from convert_model's rope_dim: one size for every layer, or a list of `count` (the
    first layers with a wider one, measured in docs/decisions.md); TypeError/ValueError naming the value."""
    return _one_per_layer(rope_dim, count, "rope_dim", 0)


def convert_model(model, to: str, *,
                  latent_dim: int | list[int] | None = None,  # one size, or a list of one a layer (a per-layer plan)
                  rope_dim: int | list[int] | None = None,  # decoupled rotary dims (default 2 G * 16); one or a list
                  num_kv_heads: int | None = None, method: str | None = None,  # BERT -> "gqa"
                  calibration_ids: torch.Tensor | None = None,  # token ids whose attention inputs whiten the SVDs
                  pair_selection: str = "frequency",  # what keeps rotating: one of convert.ROPE_SELECTIONS
                  balance: bool = False,  # BKV before the joint SVD (convert.selection_options)
                  shared_planes: bool = True,  # rorope-score: the same planes in every layer (exportable)
                  progress=None,
                  inputs: list | None = None,  # each layer's calibration inputs, where the caller has them already
                  layers=None):  # the indices of the layers to convert (default all); the others stay GQA
    """Convert every attention layer of an attnlab'd model in place; returns the per-layer reports.

    Llama (RoPE GQA) -> "mla": without latent_dim the exact gqa_to_mla (the latent holds pre-RoPE K and V), with it
    gqa_to_mla_decoupled. BERT (MHA) -> "gqa" (num_kv_heads, method) or "mla" (latent_dim). ValueError for a model
    already converted, weights not finite (checked first, naming layer and tensor) or what check_convertible refuses.
    """
    # pair_selection: frequency, norm: rope_dim a multiple of 2 G; rorope, rorope-score: any even rope_dim. A model with
    # per-head q/k norms (Qwen3, Gemma 3) takes only its keys whole: rope_dim G x d (its default), frequency.
    # rope_dim as a list (one a layer) does not go with rorope-score's shared planes. shared_planes=False lets each
    # layer choose alone; its layers then turn at different frequencies, which no export can hold.
    # inputs: attention_inputs of the model as it is, so that a planner converting one model many ways computes them
    # once. layers: a mixed model (the planner keeps a sliding-window model's sliding layers GQA, shrink/plan.py);
    # rorope-score then shares its planes among the converted layers.
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
    check_convertible(model, exact=fam == "llama" and to == "mla" and latent_dim is None, rope_dim=rope_dim,
                      pair_selection=pair_selection, balance=balance)
    chosen = check_layers(layers, len(modules))
    sizes = layer_latents(latent_dim, len(modules))
    latent = {} if sizes is None else {id(m): r for m, r in zip(modules, sizes)}  # module -> its latent size
    for i, m in enumerate(modules):
        if i in chosen:
            check_finite(i, _attention_weights(m))
    if calibration_ids is not None and calibration_ids.numel() == 0:
        raise ValueError("calibration_ids holds 0 tokens; calibration needs text")
    if fam == "llama":
        if to != "mla":
            raise ValueError(f"a Llama model converts to 'mla', not {to!r}")
        if latent_dim is None:
            if rope_dim is not None or calibration_ids is not None:
                raise ValueError("--rope-dim and calibration apply to a compressed MLA: give --latent-dim too")
            return convert_layers(model, lambda m, x: gqa_to_mla(m), progress=progress, layers=layers)
        G, d = first.num_kv_heads, first.head_dim
        if rope_dim is None:  # the keys whole for a model with per-head q/k norms
            rope_dim = keys_whole_rope_dim(model) or default_rope_dim(G, d)
        # module -> its rotary planes (RoRoPE) or pairs per KV head (per-head selections), from its rope key
        counts = {id(m): check_rope_dim(r, G, d, pair_selection)
                  for m, r in zip(modules, layer_ropes(rope_dim, len(modules)))}
        options = selection_options(pair_selection, balance)
        if pair_selection not in ROROPE_SELECTIONS:
            return convert_layers(model, lambda m, x: gqa_to_mla_decoupled(m, latent[id(m)], counts[id(m)],
                                                                           calibration=x, **options),
                                  calibration_ids=calibration_ids, progress=progress, inputs=inputs, layers=layers)
        if inputs is None:
            inputs = attention_inputs(model, calibration_ids) if calibration_ids is not None else [None] * len(modules)
        if pair_selection == "rorope-score" and shared_planes:
            picked = [(m, x) for i, (m, x) in enumerate(zip(modules, inputs)) if i in chosen]
            shared = {counts[id(m)] for m, _ in picked}
            if len(shared) > 1:
                raise ValueError(f"rorope-score with shared planes keeps the same planes in every layer: one rope_dim "
                                 f"for the converted layers, got {sorted(2 * c for c in shared)}")
            planes = plane_choice([rorope_plane_scores(m, x) for m, x in picked], shared.pop())
            by_layer = {id(m): p for (m, _), p in zip(picked, planes)}
            return convert_layers(model, lambda m, x: gqa_to_mla_decoupled(m, latent[id(m)], None, calibration=x,
                                                                           planes=by_layer[id(m)], **options),
                                  inputs=inputs, progress=progress, layers=layers)
        return convert_layers(model, lambda m, x: gqa_to_mla_decoupled(m, latent[id(m)], None, calibration=x,
                                                                       rope_planes=counts[id(m)], **options),
                              inputs=inputs, progress=progress, layers=layers)
    if rope_dim is not None:
        raise ValueError("rope_dim applies to RoPE models (Llama); BERT has no RoPE")
    return convert_layers(model, lambda m, x: convert_module(m, to, num_kv_heads=num_kv_heads, method=method,
                                                              latent_dim=latent.get(id(m)), calibration=x),
                          calibration_ids=calibration_ids, progress=progress, inputs=inputs, layers=layers)

