"""Convert a transformers checkpoint folder to a DeepSeek-V3 MLA checkpoint one layer at a time (`convert_checkpoint`).

Nothing holds the whole model: tensors are read lazily from the shards (`LazyTensors`), each layer is converted in
float32 and written in the source dtype into output shards as it comes, and the folder is renamed into place at the
end. The result equals the in-memory convert_model + add_latent_norms + export_deepseek (tests/test_export.py).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from ..io.folders import write_folder
from ..modules.gqa import GroupedQueryAttention
from .export.deepseek import (
    NEEDS_LATENT,
    ShardWriter,
    attnlab_entry,
    check_exportable,
    check_source_config,
    copy_tokenizer,
    deepseek_attention_tensors,
    deepseek_config,
    layer_constant,
)
from .export.latent_norm import add_latent_norm
from .load import NOT_CONVERTED, inspect_checkpoint, open_shards

F32 = torch.float32
STREAM_SHARD_BYTES = 128 * 1024 ** 2  # what waits in memory for its shard; a bigger tensor gets a shard alone


def _release_freed_memory() -> None:
    """Hand memory freed by the last layer's float64 temporaries back to the OS (glibc keeps it otherwise)."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class LazyTensors:
    """Tensors of a checkpoint by name, read one at a time (safetensors' safe_open; the shard is opened and closed per
    read)."""

    def __init__(self, folder: Path):
        self.where = open_shards(folder)
        self.bytes_read = 0

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if name not in self.where:
            raise ValueError(f"the checkpoint lacks {name}")
        path, _ = self.where[name]
        with safe_open(str(path), framework="pt") as f:
            t = f.get_tensor(name)  # backed by the file's pages (read on use), unmapped when the tensor is freed
        self.bytes_read += t.numel() * t.element_size()
        return t


def _rope(folder: Path):
    """attnlab's RoPE with the checkpoint's own rotary frequencies (transformers' rotary module, no weights)."""
    import importlib

    from transformers import AutoConfig

    from .adapters import rope_from_rotary

    cfg = AutoConfig.from_pretrained(str(folder))
    name = type(cfg).__name__.removesuffix("Config")
    module = importlib.import_module(f"transformers.models.{name.lower()}.modeling_{name.lower()}")
    return cfg, rope_from_rotary(cfg, getattr(module, f"{name}RotaryEmbedding")(cfg))


def _attention(cfg: dict, rope, tensors: LazyTensors, i: int) -> GroupedQueryAttention:
    """Layer i's attention as an attnlab GQA (float32), as adapters.to_attnlab builds it; weights checked finite."""
    from .convert import check_finite

    D, H = cfg["hidden_size"], cfg["num_attention_heads"]
    G = cfg.get("num_key_value_heads") or H
    d = cfg.get("head_dim") or D // H
    p = f"model.layers.{i}.self_attn."
    bias = p + "q_proj.bias" in tensors
    m = GroupedQueryAttention(D, H, G, head_dim=d, bias=bias, grouping="blocked", rope_base=rope.base, dtype=F32)
    m.rope = rope
    with torch.no_grad():
        for lin, name in ((m.W_Q, "q_proj"), (m.W_K, "k_proj"), (m.W_V, "v_proj"), (m.W_O, "o_proj")):
            lin.weight.copy_(tensors.get(p + name + ".weight"))
            if lin.bias is not None:
                b = p + name + ".bias"
                lin.bias.copy_(tensors.get(b) if b in tensors else torch.zeros_like(lin.bias))
    check_finite(i, {f"{name}.weight": lin.weight for lin, name in ((m.W_Q, "q_proj"), (m.W_K, "k_proj"),
                                                                      (m.W_V, "v_proj"), (m.W_O, "o_proj"))})
    return m


def _rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight.to(F32) * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))  # (N, D)


class _Block:
    """Norms and MLP of one decoder layer (float32), to carry calibration hidden states through it."""

    def __init__(self, cfg: dict, tensors: LazyTensors, i: int):
        from transformers.activations import ACT2FN

        p = f"model.layers.{i}."
        self.eps = float(cfg.get("rms_norm_eps", 1e-6))
        self.act = ACT2FN[cfg.get("hidden_act", "silu")]
        self.tensors = {k: tensors.get(p + k) for k in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                                          "mlp.gate_proj.weight", "mlp.up_proj.weight",
                                                          "mlp.down_proj.weight")}

    def attention_input(self, h: torch.Tensor) -> torch.Tensor:
        return _rms_norm(h, self.tensors["input_layernorm.weight"], self.eps)

    def forward(self, h: torch.Tensor, attn) -> torch.Tensor:
        """h (N, D) -> the layer's output, with `attn` as its attention (one causal sequence)."""
        t = {k: v.to(F32) for k, v in self.tensors.items()}
        with torch.no_grad():
            h = h + attn(self.attention_input(h)[None], is_causal=True)[0]
            x = _rms_norm(h, t["post_attention_layernorm.weight"], self.eps)
            return h + (self.act(x @ t["mlp.gate_proj.weight"].T) * (x @ t["mlp.up_proj.weight"].T)) \
                @ t["mlp.down_proj.weight"].T  # (N, D)


def calibration_ids_for(folder, text, max_tokens: int | None = None) -> torch.Tensor:
    """Token ids (1, N) of a text file, with the checkpoint's own tokenizer (at most max_tokens, positive)."""
    from transformers import AutoTokenizer

    from .evaluate import read_text_ids

    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise ValueError(f"calibration tokens must be a positive number of tokens, got {max_tokens!r}")

    try:
        tok = AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as e:
        raise ValueError(f"{folder}: calibration needs the checkpoint's tokenizer files: {e}") from None
    ids = read_text_ids(tok, text, max_tokens)
    if ids.numel() == 0:
        raise ValueError(f"{text}: 0 tokens; calibration needs text")
    return ids


def _plane_scores(cfg: dict, rope, tensors: LazyTensors, calibration_ids: torch.Tensor | None) -> torch.Tensor:
    """(layers, d/2, G) rorope_plane_scores of every layer: the first pass of a rorope-score conversion.

    Reads each layer's attention (and, with calibration, its norms and MLP to carry the hidden
    states through the original layers, as the converting pass will).
    """
    from ..convert.decoupled import rorope_plane_scores

    h = None
    if calibration_ids is not None:
        h = tensors.get("model.embed_tokens.weight")[calibration_ids.reshape(-1)].to(F32)  # (N, D)
    scores = []
    for i in range(cfg["num_hidden_layers"]):
        gqa = _attention(cfg, rope, tensors, i)
        block = _Block(cfg, tensors, i) if h is not None else None
        scores.append(rorope_plane_scores(gqa, block.attention_input(h) if h is not None else None))
        if h is not None:
            h = block.forward(h, gqa)
        del gqa, block
    return torch.stack(scores)


def _check_stream_arguments(latent_dim, latent_norm: str, calibration_ids) -> None:
    """convert_checkpoint's arguments that need no file: ValueError naming the one that does not hold."""
    if latent_dim is None:
        raise ValueError(NEEDS_LATENT)
    if latent_norm not in ("constant", "fit"):
        raise ValueError(f"latent_norm must be 'constant' or 'fit', got {latent_norm!r}")
    if latent_norm == "fit" and calibration_ids is None:
        raise ValueError("latent_norm='fit' fits the norm on calibration text: give calibration_ids (--calibration)")
    if calibration_ids is not None and calibration_ids.numel() == 0:
        raise ValueError("calibration_ids holds 0 tokens; calibration needs text")


def _source_config(folder: Path) -> dict:
    """The source folder's config, checked: a family convert_checkpoint converts, with sizes it can read."""
    cfg = inspect_checkpoint(folder)
    if cfg.get("model_type") in NOT_CONVERTED:
        raise ValueError(f"{folder}: cannot convert model_type {cfg['model_type']!r} yet: "
                         f"{NOT_CONVERTED[cfg['model_type']]}")
    check_source_config(cfg)
    return cfg


def _rope_layout(cfg: dict, rope, tensors, calibration_ids, pair_selection: str, count: int):
    """(planes, how): rorope-score's planes for every layer at once (else None), and gqa_to_mla_decoupled's
    rope_pairs or rope_planes for the others."""
    # RoRoPE by score allocates the kept planes for all layers at once (convert.transforms.shared_planes), so it reads
    # the attention weights (and carries the calibration states through the original layers) in a first pass that only
    # scores the planes (_plane_scores); the conversion is a second pass.
    from .convert import ROROPE_SELECTIONS, plane_choice

    planes = None
    if pair_selection == "rorope-score":
        planes = plane_choice(list(_plane_scores(cfg, rope, tensors, calibration_ids)), count)
    how = {"rope_pairs": count} if pair_selection not in ROROPE_SELECTIONS else {"rope_pairs": None,
                                                                                "rope_planes": count}
    return planes, how


def convert_checkpoint(source, out, *, latent_dim: int | None, rope_dim: int | None = None,
                       calibration_ids: torch.Tensor | None = None, pair_selection: str = "frequency",
                       balance: bool = False, force: bool = False, shard_bytes: int = STREAM_SHARD_BYTES,
                       latent_norm: str = "constant", progress=None) -> dict:
    """Stream a Llama/Mistral/Qwen2 folder into a DeepSeek-V3 MLA checkpoint at `out`; returns a summary.

    latent_dim, rope_dim (default 2 * num_kv_heads * 16), pair_selection, balance: as convert_model. calibration_ids
    (1, N): ids whose activations whiten the SVDs and fit the latent norms. latent_norm: "constant" (exact, latent + 1
    cached: export.constant_channel) or "fit" (add_latent_norm, lossy; needs calibration_ids). progress(i, n): a layer.
    """
    from ..convert.decoupled import gqa_to_mla_decoupled, selection_options
    from .convert import check_rope_dim, default_rope_dim
    from .export.latent_norm import kv_values_in_export

    folder, out = Path(str(source)), Path(str(out))
    _check_stream_arguments(latent_dim, latent_norm, calibration_ids)
    options = selection_options(pair_selection, balance)
    cfg = _source_config(folder)
    from ..io.folders import check_output
    check_output(out, force=force, sources=[folder])
    tensors = LazyTensors(folder)
    hf_cfg, rope = _rope(folder)
    L, G = cfg["num_hidden_layers"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    rope_dim = default_rope_dim(G, d) if rope_dim is None else rope_dim
    count = check_rope_dim(rope_dim, G, d, pair_selection, positive=True)  # DeepSeek needs qk_rope_head_dim > 0
    if any(f"model.layers.{i}.self_attn.q_proj.bias" in tensors for i in range(L)):
        raise ValueError(f"{folder}: query bias (Qwen2's q_proj bias): DeepSeek's q_proj has none, and the bias's "
                         "product with each key varies from key to key, so it cannot be folded")
    dtype = tensors.get("model.layers.0.self_attn.q_proj.weight").dtype
    tied = bool(getattr(hf_cfg, "tie_word_embeddings", False))
    errors: list[float] = []
    constants: list[float] = []  # each layer's constant channel K (models/export/deepseek.py: attnlab_entry)
    planes, how = _rope_layout(cfg, rope, tensors, calibration_ids, pair_selection, count)

    def write(tmp: Path) -> None:
        shards = ShardWriter(tmp, shard_bytes)
        embed = tensors.get("model.embed_tokens.weight")
        # Calibration: the ids' hidden states are carried through the layers as they are read, twice: through the
        # original layers (their inputs whiten each layer's SVD, as convert_model does from one forward of the original
        # model) and through the converted ones (their inputs fit the latent norm, as add_latent_norms does).
        h_orig = h_conv = None
        if calibration_ids is not None:
            h_orig = h_conv = embed[calibration_ids.reshape(-1)].to(F32)  # (N, D)
        shards.add("model.embed_tokens.weight", embed)
        del embed
        shards.flush()
        first = None
        for i in range(L):
            gqa = _attention(cfg, rope, tensors, i)
            block = _Block(cfg, tensors, i)
            x_orig = block.attention_input(h_orig) if h_orig is not None else None
            x_conv = block.attention_input(h_conv) if h_conv is not None else None
            layer = how if planes is None else {"rope_pairs": None, "planes": planes[i]}
            mla, _ = gqa_to_mla_decoupled(gqa, latent_dim, calibration=x_orig, **layer, **options)
            mla, err = add_latent_norm(mla, x_conv) if latent_norm == "fit" else (mla, 0.0)
            check_exportable([first or mla, mla])
            first = first or mla
            errors.append(err)
            constants.extend(layer_constant(mla))
            p = f"model.layers.{i}."
            for k, v in deepseek_attention_tensors(mla, p + "self_attn.").items():
                shards.add(k, v.to(dtype))
            for k, v in block.tensors.items():
                shards.add(p + k, v)
            if h_orig is not None:
                h_orig, h_conv = block.forward(h_orig, gqa), block.forward(h_conv, mla)
            del gqa, mla, block
            _release_freed_memory()
            if progress:
                progress(i, L)
        shards.add("model.norm.weight", tensors.get("model.norm.weight"))
        if not tied:
            shards.add("lm_head.weight", tensors.get("lm_head.weight"))
        shards.close()
        src = dict(cfg, tie_word_embeddings=tied)
        config = {**deepseek_config(src, first, dtype=str(dtype).removeprefix("torch.")),
                  "attnlab": attnlab_entry([first], constants)}
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        copy_tokenizer(folder, tmp)

    write_folder(out, write, force=force, sources=[folder], info={"what": "DeepSeek-V3 export (streamed)"})
    return {"source": str(folder), "out": str(out), "layers": L, "latent_dim": latent_dim, "rope_dim": rope_dim,
            "kv_values_per_token_per_layer": [2 * G * d, kv_values_in_export(latent_dim, rope_dim,
                                                                              latent_norm == "fit")],
            "latent_norm_output_errors": errors, "bytes_read": tensors.bytes_read,
            "calibration_tokens": 0 if calibration_ids is None else int(calibration_ids.numel()),
            "rms_latent_norm_error": math.sqrt(sum(e * e for e in errors) / max(len(errors), 1))}
