"""Write a converted Llama-family model as a GGUF file that llama.cpp runs as `deepseek2` (MLA).

llama.cpp's deepseek2 graph attends inside the latent (it caches the normalised latent and
the rotated rope key, r + p numbers per token and layer) and differs from attnlab's MLA in
three places; each is handled exactly or refused with the reason:

- softmax scale 1/sqrt(qk_nope + qk_rope): the ratio to attnlab's scale multiplies the
  query weights (as for the DeepSeek-V3 export; the tensors come from
  export.deepseek_attention_tensors, so the two exports share one mapping);
- rotary frequencies: pair i of the shared rope key turns at rope_theta^(-2i/p), in
  consecutive pairs (ggml's "normal" rope), and deepseek2 reads no per-pair factors. The
  kept frequencies, sorted fastest first, must be exactly such a sequence: then the rope
  rows are permuted into that order and rope_theta is fitted to them. Keeping the fastest
  p/2 distinct frequencies does this (RoRoPE by frequency with p <= head_dim;
  `--rope-select rorope`); per-head selection repeats each frequency G times and is refused;
- the latent RMSNorm (kv_a_norm) always runs and kv_a_mqa has no bias, so the
  constant-channel trick of the DeepSeek export is not available here. An MLA without a
  latent norm is written through export.linear_latent_norm instead: the latent rows of
  kv_a_mqa are scaled down (a power of two) until mean(c^2) is below 2^-24 eps for every
  input the layer can see (its input is RMS-normalised, so its norm is bounded), and the
  norm, which then divides by sqrt(eps) to float32 precision, gets the weight that undoes
  both. Exact to float32 rounding; kv_a_mqa is written in F32 (float16 would flush the small
  latent to zero; quantise it and the same happens). An MLA with a latent norm of its own
  (`--latent-norm fit`, trained by heal) is written as it is; llama.cpp's norm then uses the
  model's rms_norm_eps where attnlab's used its norm_eps.

The tokenizer comes from the source GGUF (every tokenizer.* field, copied), or from a
byte-level BPE tokenizer.json beside a source folder (pre-tokenizer "gpt-2" when it is plain
ByteLevel; otherwise name llama.cpp's pre-tokenizer with `pre_tokenizer=`). Needs `gguf`.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from ..modules.mla import MultiHeadLatentAttention
from .adapters import _layers
from .export import (
    check_exportable,
    deepseek_attention_tensors,
    export_preflight,
    linear_latent_norm,
)

ARCH = "deepseek2"


# -- rotary frequencies ---------------------------------------------------------------------------
def rope_order(m: MultiHeadLatentAttention, rtol: float = 1e-6) -> tuple[torch.Tensor, float]:
    """(perm, rope_theta): rope dims reordered into consecutive pairs, fastest first, and the base that gives them.

    perm[k] is the attnlab rope dim that becomes llama.cpp's rope dim k. Raises a ValueError
    naming the frequencies when llama.cpp cannot turn them. rtol: transformers computes a
    source's frequencies in float32 (and llama.cpp its angles), so they agree to float32
    rounding; rope_theta is the least-squares fit of log f_i = -(2i/p) log theta.
    """
    p = m.rope_dim
    kept = m.rope.inv_freq.to(torch.float64)  # (p/2,)
    order = torch.argsort(kept, descending=True)
    f = kept[order]
    if m.rope.scaling != 1.0:
        raise ValueError(f"the rotary embedding scales cos/sin by {m.rope.scaling} (the source's rope scaling); "
                         "llama.cpp's deepseek2 has no such factor")
    i = torch.arange(p // 2, dtype=torch.float64)
    slope = float((i * f.log()).sum() / (i * i).sum()) if p > 2 else -1.0  # log f_i = slope * i
    theta = float(torch.exp(torch.tensor(-slope * p / 2, dtype=torch.float64)))
    want = theta ** (-2 * i / p)
    bad = ((f - want).abs() > rtol * want).nonzero().flatten()
    if len(bad):
        j = int(bad[0])
        raise ValueError(
            f"llama.cpp's deepseek2 turns rope pair i at rope_theta^(-2i/{p}) with no per-pair factors, but the kept "
            f"frequencies (fastest first) are not such a sequence: pair {j} turns at {float(f[j]):.6g}, not "
            f"{float(want[j]):.6g}{' (a frequency kept twice)' if len(torch.unique(f)) < len(f) else ''}; convert "
            f"with --rope-select rorope and --rope-dim <= head_dim ({m.head_dim}), which keeps the fastest distinct pairs")
    half = p // 2
    a = order * 2 if m.rope.interleaved else order  # (p/2,) first dim of each pair, fastest first
    b = a + 1 if m.rope.interleaved else order + half
    return torch.stack([a, b], dim=1).reshape(-1), theta  # (p,)


def check_gguf_exportable(modules) -> None:
    """Refuse, naming the layer and the reason, what llama.cpp's deepseek2 cannot hold."""
    check_exportable(modules)
    _check_gguf_only(modules)


def _check_gguf_only(modules) -> None:
    """What llama.cpp refuses beyond check_exportable (which export_preflight has run)."""
    for i, m in enumerate(modules):
        if m.W_O.bias is not None:
            raise ValueError(f"layer {i} has an output bias; llama.cpp's deepseek2 attn_output has none")
    rope_order(modules[0])


def gguf_ready(m: MultiHeadLatentAttention, input_norm: torch.Tensor, eps: float) -> MultiHeadLatentAttention:
    """The layer as llama.cpp will run it: an MLA without a latent norm gets export.linear_latent_norm.

    input_norm: the weight of the RMSNorm before the attention (its input has norm at most
    max|weight| sqrt(dim)); eps: the model's rms_norm_eps, which llama.cpp's latent norm uses.
    """
    if m.kv_norm is not None:
        return m
    bound = float(input_norm.detach().abs().max()) * math.sqrt(m.dim)
    return linear_latent_norm(m, bound, eps)[0]


# -- one layer ------------------------------------------------------------------------------------------
def gguf_attention_tensors(m: MultiHeadLatentAttention, block: int) -> dict[str, torch.Tensor]:
    """llama.cpp deepseek2 tensors of one layer (PyTorch (out, in) orientation; GGUF reverses the dims)."""
    H, d, dv, p = m.num_heads, m.head_dim, m.v_head_dim, m.rope_dim
    r = m.latent_dim
    t = deepseek_attention_tensors(m, "")
    perm, _ = rope_order(m)
    q_rows = torch.cat([torch.arange(d), d + perm])  # per head: nope rows, then rope rows in llama.cpp's order
    pre = f"blk.{block}."
    out = {}
    if "q_proj.weight" in t:
        out["attn_q.weight"] = t["q_proj.weight"].reshape(H, d + p, -1)[:, q_rows].reshape(H * (d + p), -1)
    else:
        out["attn_q_a.weight"] = t["q_a_proj.weight"]
        out["attn_q_a_norm.weight"] = t["q_a_layernorm.weight"]
        out["attn_q_b.weight"] = t["q_b_proj.weight"].reshape(H, d + p, -1)[:, q_rows].reshape(H * (d + p), -1)
    kv_a = t["kv_a_proj_with_mqa.weight"]  # (r + p, D)
    out["attn_kv_a_mqa.weight"] = torch.cat([kv_a[:r], kv_a[r:][perm]])
    out["attn_kv_a_norm.weight"] = t["kv_a_layernorm.weight"]
    kv_b = t["kv_b_proj.weight"].reshape(H, d + dv, r)
    out["attn_k_b.weight"] = kv_b[:, :d].transpose(1, 2)  # (H, r, d): ggml {d, r, H}
    out["attn_v_b.weight"] = kv_b[:, d:]  # (H, dv, r): ggml {r, dv, H}
    out["attn_output.weight"] = t["o_proj.weight"]
    return {pre + k: v.contiguous() for k, v in out.items()}


# -- the tokenizer ----------------------------------------------------------------------------------------
def copy_gguf_fields(writer, reader, keep) -> None:
    """Copy the metadata fields of a GGUFReader whose key passes keep(key) into a GGUFWriter, types and all."""
    import gguf

    for key, field in reader.fields.items():
        if not keep(key):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub)


def _folder_tokenizer(writer, folder: Path, tokenizer, pre_tokenizer: str | None) -> None:
    import gguf

    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"no tokenizer.json beside the source ({folder}): a GGUF needs the tokenizer inside it")
    spec = json.loads(path.read_text(encoding="utf-8"))
    model = spec.get("model", {})
    if model.get("type") != "BPE" or model.get("byte_fallback") or (spec.get("decoder") or {}).get("type") != "ByteLevel":
        raise ValueError(f"{path}: only byte-level BPE tokenizers are written to GGUF here "
                         f"(model {model.get('type')!r}); export from a GGUF source to copy its tokenizer")
    if pre_tokenizer is None:
        pt = spec.get("pre_tokenizer") or {}
        if pt.get("type") == "ByteLevel" and pt.get("use_regex", True):
            pre_tokenizer = "gpt-2"
        else:
            raise ValueError(f"{path}: its pre-tokenizer ({pt.get('type')!r}) is not plain ByteLevel; name "
                             "llama.cpp's pre-tokenizer for it (pre_tokenizer=, --gguf-pre: llama-bpe, qwen2, "
                             "smollm, ...)")
    size = len(tokenizer)
    tokens = tokenizer.convert_ids_to_tokens(list(range(size)))
    special = set(tokenizer.all_special_ids)
    types = [gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for name, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                      ("pad_token_id", writer.add_pad_token_id)):
        if getattr(tokenizer, name, None) is not None:
            add(int(getattr(tokenizer, name)))
    writer.add_add_bos_token(False)


# -- writing -----------------------------------------------------------------------------------------------
def _array(t: torch.Tensor, f32: bool = False) -> tuple[np.ndarray, object]:
    """(numpy array, raw GGML type or None) in the tensor's precision: F32 for 1-D tensors, float32/64 and f32."""
    import gguf

    t = t.detach().cpu()
    if f32 or t.dim() == 1 or t.dtype in (torch.float32, torch.float64):
        return t.to(torch.float32).numpy(), None
    if t.dtype == torch.float16:
        return t.numpy(), None
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16), gguf.GGMLQuantizationType.BF16
    raise ValueError(f"cannot write a {t.dtype} tensor to GGUF")


def export_gguf(model, path, tokenizer=None, *, force: bool = False, pre_tokenizer: str | None = None) -> Path:
    """Write an attnlab'd, converted Llama-family model as one GGUF file (llama.cpp `deepseek2`), atomically.

    Every layer must be a decoupled-RoPE MLA with a latent norm and frequencies llama.cpp
    can turn (check_gguf_exportable says why not). The tokenizer comes from the source
    (model.attnlab_source, set when loading a checkpoint or bundled model): a GGUF's
    tokenizer fields are copied; a folder's tokenizer.json is written with `tokenizer`.
    """
    import gguf

    path = Path(path)
    modules = export_preflight(model, path, force, "export_gguf")
    _check_gguf_only(modules)
    cfg = model.config
    source = getattr(model, "attnlab_source", None)
    if source is None:
        raise ValueError("the model does not know the checkpoint it came from (attnlab_source): the GGUF needs its "
                         "tokenizer; load it with attnlab.models.load_model")
    source = Path(source)
    if source.suffix != ".gguf" and tokenizer is None:
        raise ValueError("a folder source needs its tokenizer (tokenizer=) to write the GGUF vocabulary")
    m0 = modules[0]
    _, theta = rope_order(m0)
    L, base = len(modules), model.model
    tied = bool(getattr(cfg, "tie_word_embeddings", False))

    def build(writer) -> None:
        writer.add_name(f"{source.stem} (attnlab MLA)")
        writer.add_context_length(int(getattr(cfg, "max_position_embeddings", 4096) or 4096))
        writer.add_embedding_length(cfg.hidden_size)
        writer.add_block_count(L)
        writer.add_feed_forward_length(cfg.intermediate_size)
        writer.add_head_count(m0.num_heads)
        writer.add_head_count_kv(1)
        writer.add_rope_freq_base(theta)
        writer.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
        writer.add_vocab_size(cfg.vocab_size)
        writer.add_leading_dense_block_count(L)
        writer.add_q_lora_rank(m0.q_latent_dim or 0)
        writer.add_kv_lora_rank(m0.latent_dim)
        writer.add_key_length(m0.latent_dim + m0.rope_dim)
        writer.add_value_length(m0.latent_dim)
        writer.add_key_length_mla(m0.head_dim + m0.rope_dim)
        writer.add_value_length_mla(m0.v_head_dim)
        writer.add_expert_feed_forward_length(cfg.intermediate_size)
        writer.add_expert_shared_count(0)
        writer.add_rope_dimension_count(m0.rope_dim)
        writer.add_file_type(gguf.LlamaFileType.ALL_F32 if m0._anchor.dtype in (torch.float32, torch.float64)
                             else gguf.LlamaFileType.MOSTLY_F16 if m0._anchor.dtype == torch.float16
                             else gguf.LlamaFileType.MOSTLY_BF16)
        if source.suffix == ".gguf":
            copy_gguf_fields(writer, gguf.GGUFReader(str(source)), lambda key: key.startswith("tokenizer."))
        else:
            _folder_tokenizer(writer, source, tokenizer, pre_tokenizer)

        def add(name, t):  # the small pre-norm latent (linear_latent_norm) needs float32's exponent range
            arr, raw = _array(t, f32=name.endswith("attn_kv_a_mqa.weight"))
            writer.add_tensor(name, arr, raw_dtype=raw)
        add("token_embd.weight", base.embed_tokens.weight)
        for i, (layer, m) in enumerate(zip(_layers(model), modules)):
            add(f"blk.{i}.attn_norm.weight", layer.input_layernorm.weight)
            ready = gguf_ready(m, layer.input_layernorm.weight, float(cfg.rms_norm_eps))
            for k, v in gguf_attention_tensors(ready, i).items():
                add(k, v)
            add(f"blk.{i}.ffn_norm.weight", layer.post_attention_layernorm.weight)
            for ours, theirs in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down")):
                add(f"blk.{i}.{theirs}.weight", getattr(layer.mlp, ours).weight)
        add("output_norm.weight", base.norm.weight)
        if not tied:
            add("output.weight", model.lm_head.weight)

    return write_gguf(path, ARCH, build)


def write_gguf(path: Path, arch: str, build) -> Path:
    """build(writer) fills a GGUFWriter; the file is written beside `path` under a temporary name, then renamed."""
    import gguf

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        writer = gguf.GGUFWriter(tmp, arch)
        build(writer)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
