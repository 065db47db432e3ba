"""Write a model whose attention kept the original's shape back into its source GGUF's own architecture.

A shrink that keeps every value (a heal through llama.cpp's own cache codes, shrink/plan.py) changes only attention
weights: the model stays a llama, qwen3 or gemma3 model llama.cpp runs, with its smaller cache as --cache-type-k/v.
`export_native` copies the source GGUF, rewriting only the attention tensors the heal moved; `check_native`: why not.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..adapters import attnlab_modules, check_own_attention

NATIVE = ("llama", "qwen3", "gemma3")  # what llama.cpp runs that attnlab loads from a GGUF
ARCHITECTURE = {"llama": "llama", "qwen3": "qwen3", "gemma3_text": "gemma3"}  # transformers' model_type -> GGUF's
CACHE_KEYS = ("attnlab.cache_type_k", "attnlab.cache_type_v")


def permute_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's order of a llama query or key projection's rows (or bias) for `heads` heads: within each head, the
    rows of the first rotary half and of the second are interleaved (row j of half h goes to 2 j + h), as its
    converter writes them. ValueError unless the rows are whole heads of an even size."""
    rows = w.shape[0]
    if rows % heads or (rows // heads) % 2:
        raise ValueError(f"{rows} rows are not {heads} heads of an even size")
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _attention_tensors(m, i: int, arch: str) -> dict[str, torch.Tensor]:
    """GGUF name -> the value llama.cpp should read, for layer i's attnlab module."""
    # llama's query and key rows go back into llama.cpp's order (permute_rows), which transformers' GGUF reader undoes
    # when it loads the file; Qwen3 and Gemma 3 store them as they are. The per-head norms are stored as the factor they
    # multiply by, which is what attnlab's modules hold (Gemma's 1 + w included).
    out = {}
    for ours, theirs in (("W_Q", "attn_q"), ("W_K", "attn_k"), ("W_V", "attn_v"), ("W_O", "attn_output")):
        lin = getattr(m, ours)
        for kind in ("weight", "bias"):
            t = getattr(lin, kind, None)
            if t is None:
                continue
            t = t.detach().float().cpu()
            if arch == "llama" and theirs in ("attn_q", "attn_k"):
                t = permute_rows(t, m.num_heads if theirs == "attn_q" else m.num_kv_heads)
            out[f"blk.{i}.{theirs}.{kind}"] = t
    for ours, theirs in (("q_head_norm", "attn_q_norm"), ("k_head_norm", "attn_k_norm")):
        norm = getattr(m, ours, None)
        if norm is not None:
            out[f"blk.{i}.{theirs}.weight"] = norm.weight.detach().float().cpu()
    return out


def source_values(tensor) -> torch.Tensor:
    """A GGUFReader tensor as float32 in transformers' shape (gguf's own de-quantiser)."""
    from gguf.quants import dequantize

    shape = tuple(int(s) for s in reversed(tensor.shape))
    return torch.from_numpy(np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32, copy=True)
                            ).reshape(shape)


# The model must come from a GGUF (model.attnlab_source) of an architecture in NATIVE, every layer an attnlab
# GroupedQueryAttention of the source's head counts and sizes (no MLA: those go to export_gguf's deepseek2).
def check_native(model) -> tuple[Path, str]:
    """(the source GGUF, its architecture) when export_native can write this model; ValueError saying why not. From
    the model alone (its source's name, its config, its modules): the file itself is read by export_native, which
    checks that it holds that architecture (a GGUF's metadata with a large vocabulary takes seconds to parse)."""
    source = getattr(model, "attnlab_source", None)
    if source is None or Path(source).suffix != ".gguf":
        raise ValueError("a GGUF in the model's own architecture is written by copying the GGUF it was loaded from; "
                         f"this model came from {source or 'no file'}: load a .gguf (or use --format attnlab)")
    source = Path(source)
    cfg = model.config
    arch = ARCHITECTURE.get(getattr(cfg, "model_type", None))
    if arch is None:
        raise ValueError(f"{source} holds a {getattr(cfg, 'model_type', '?')} model; attnlab writes "
                         f"{', '.join(NATIVE)} GGUFs back in their own architecture")
    check_own_attention(model, "a model converted to MLA is written as deepseek2 (export_gguf)")
    return source, arch


def export_native(model, path, *, force: bool = False, cache_types: tuple[str, str] | None = None) -> dict:
    """Write the model as its source GGUF with its changed attention tensors, atomically.

    cache_types: (K, V) llama.cpp cache types the model was healed for, recorded in the metadata. Returns
    {"path", "architecture", "rewritten": [GGUF names written from the model], "copied": count}."""
    from .deepseek_gguf import WRITTEN_BY, copy_gguf_fields, write_gguf
    from ..load import read_gguf
    from ..store import sources_of

    source, arch = check_native(model)
    reader = read_gguf(source)
    written = reader.fields["general.architecture"].contents()
    if written != arch:
        raise ValueError(f"{source} is a {written} GGUF, but the model is a {model.config.model_type} model: "
                         "not the file it was loaded from")
    ours = {}
    for i, m in enumerate(attnlab_modules(model)):
        ours.update(_attention_tensors(m, i, arch))
    by_name = {t.name: t for t in reader.tensors}
    missing = sorted(set(ours) - set(by_name))
    if missing:
        raise ValueError(f"{source} has no tensor {missing[0]} for the model's attention ({len(missing)} missing): "
                         "the model is not the one this file holds")
    # Each attention tensor (blk.N.attn_q/k/v/output weights and biases, Qwen3's and Gemma 3's per-head attn_q_norm and
    # attn_k_norm) whose value in the model differs from the source's as gguf's own de-quantiser reads it is written in
    # F32 from the model (llama-quantize then makes the type one serves); an untouched model writes none. Every other
    # metadata field and tensor is the source's, byte for byte (its own quantisation kept), the tokenizer with them.
    rewritten = []
    for name, value in ours.items():
        old = source_values(by_name[name])
        if old.shape != value.shape:
            raise ValueError(f"{name}: the model's is {list(value.shape)}, the source's {list(old.shape)}")
        if not torch.equal(old, value):
            rewritten.append(name)
    skip = {"general.architecture", WRITTEN_BY, *CACHE_KEYS}
    changed = set(rewritten)

    def build(writer) -> None:
        if "general.alignment" in reader.fields:  # copied below; the tensors are padded to it
            writer.data_alignment = int(reader.fields["general.alignment"].contents())
        copy_gguf_fields(writer, reader, lambda key: not key.startswith("GGUF.") and key not in skip)
        writer.add_string(WRITTEN_BY, "attnlab")
        if cache_types is not None:
            for key, kind in zip(CACHE_KEYS, cache_types):
                writer.add_string(key, kind)
        for t in reader.tensors:
            if t.name in changed:
                writer.add_tensor(t.name, np.ascontiguousarray(ours[t.name].numpy()))
            else:
                writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)

    out = write_gguf(Path(path), arch, build, force=force, sources=sources_of(model))
    return {"path": str(out), "architecture": arch, "rewritten": rewritten,
            "copied": len(reader.tensors) - len(rewritten)}
