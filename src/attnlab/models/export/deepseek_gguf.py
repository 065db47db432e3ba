"""Write a converted Llama-family model as a GGUF file that llama.cpp runs as `deepseek2` (MLA): `export_gguf`.

deepseek2 attends inside the latent (it caches the normalised latent and the rotated rope key, r + p numbers per token
and layer) and differs from attnlab's MLA in its softmax scale, rotary frequencies and latent norm; each is handled or
refused with the reason and a way out (check_gguf_exportable; the comments of each section). Needs `gguf`.
"""
from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import numpy as np
import torch

from ...modules.mla import MultiHeadLatentAttention
from ..adapters import _layers
from .deepseek import check_exportable, deepseek_attention_tensors, export_preflight
from .latent_norm import linear_latent_norm

ARCH = "deepseek2"


# -- rotary frequencies ---------------------------------------------------------------------------------
# Pair i of the shared rope key turns at rope_theta^(-2i/p), in consecutive pairs (ggml's "normal" rope), and deepseek2
# reads no per-pair factors. The kept frequencies, sorted fastest first, must be exactly such a sequence: then the rope
# rows are permuted into that order and rope_theta is fitted to them (rope_order). gguf_rope_limit says, from the
# source's own frequencies, the largest rope_dim RoRoPE by frequency (`--rope-select rorope`) can keep that way.
# Per-head selection repeats each frequency G times and RoRoPE by score keeps repeated or skipped frequencies: refused,
# pointing to --format deepseek (per-pair factors) or rorope within the limit.
def _geometric_theta(f: torch.Tensor, rtol: float) -> tuple[float, int]:
    """(rope_theta, bad): the base whose sequence theta^(-2i/p) (p = 2 len(f)) fits f (fastest first) in log space,
    and the first i where f misses it by more than rtol (len(f) where none does)."""
    n = len(f)
    i = torch.arange(n, dtype=torch.float64)
    slope = float((i * f.log()).sum() / (i * i).sum()) if n > 1 else -1.0  # log f_i = slope * i
    theta = float(torch.exp(torch.tensor(-slope * n, dtype=torch.float64)))
    want = theta ** (-2 * i / (2 * n))
    bad = ((f - want).abs() > rtol * want).nonzero().flatten()
    return theta, int(bad[0]) if len(bad) else n


def gguf_rope_limit(source, *, scaling: float = 1.0, rtol: float = 1e-6) -> int:
    """The largest rope_dim llama.cpp's deepseek2 can turn with a source's rotary frequencies (0: none).

    source: a transformers model (its rotary frequencies before any conversion, with their rope scaling), an attnlab
    RotaryEmbedding, or the frequencies (1-D tensor); scaling: the cos/sin factor (read from a RotaryEmbedding or a
    model). RoRoPE by frequency (`--rope-select rorope`) with rope_dim at most this keeps exactly those pairs.
    """
    # deepseek2 turns pair i at rope_theta^(-2i/p) with no per-pair factor and no cos/sin factor, so the limit is 2 x
    # the number of the fastest distinct source frequencies that form such a sequence from the fastest one, which must
    # be 1: without rope scaling every pair (head_dim); with Llama 3's, the unscaled fast pairs (and one more, since
    # two frequencies from 1 always fit).
    freq = source
    if hasattr(source, "config") and hasattr(source, "model"):  # a transformers causal LM
        from ..adapters import rope_from_rotary
        rot = getattr(source.model, "rotary_emb", None)
        if rot is None:
            raise ValueError("gguf_rope_limit needs a Llama-family model (its rotary embedding)")
        freq = rope_from_rotary(source.config, rot)
    if hasattr(freq, "inv_freq"):
        scaling, freq = float(freq.scaling), freq.inv_freq
    f = torch.unique(torch.as_tensor(freq, dtype=torch.float64).flatten()).flip(0)  # distinct, fastest first
    if scaling != 1.0 or not len(f) or abs(float(f[0]) - 1.0) > rtol:
        return 0
    n = 1
    for k in range(2, len(f) + 1):
        if _geometric_theta(f[:k], rtol)[1] < k:
            break
        n = k
    return 2 * n


def _rope_advice(limit: int | None) -> str:
    if limit is None:
        return ("export with --format deepseek (which carries per-pair frequencies), or convert with "
                "--rope-select rorope and a rope_dim within deepseek_gguf.gguf_rope_limit(model)")
    if limit == 0:
        return ("this source's rotary embedding has no such sequence (its fastest pair does not turn at 1, or "
                "cos/sin are scaled): export with --format deepseek, which carries per-pair frequencies")
    return (f"export with --format deepseek (which carries per-pair frequencies), or convert with --rope-select "
            f"rorope --rope-dim <= {limit} (this source's limit for llama.cpp: deepseek_gguf.gguf_rope_limit)")


def rope_order(m: MultiHeadLatentAttention,
               rtol: float = 1e-6,  # transformers computes the frequencies (llama.cpp its angles) in float32
               *, limit: int | None = None) -> tuple[torch.Tensor, float]:
    """(perm, rope_theta): rope dims reordered into consecutive pairs, fastest first, and the base that gives them.

    perm[k] is the attnlab rope dim that becomes llama.cpp's rope dim k; rope_theta is the least-squares fit of
    log f_i = -(2i/p) log theta. ValueError naming the frequencies when llama.cpp cannot turn them, with the way out
    (limit: the source's gguf_rope_limit, named in it).
    """
    p = m.rope_dim
    kept = m.rope.inv_freq.to(torch.float64)  # (p/2,)
    order = torch.argsort(kept, descending=True)
    f = kept[order]
    if m.rope.scaling != 1.0:
        raise ValueError(f"the rotary embedding scales cos/sin by {m.rope.scaling} (the source's rope scaling); "
                         f"llama.cpp's deepseek2 has no such factor: {_rope_advice(0)}")
    theta, j = _geometric_theta(f, rtol)
    if j < len(f) or abs(float(f[0]) - 1.0) > rtol:
        want = theta ** (-2 * j / p) if j < len(f) else 1.0
        j = j if j < len(f) else 0
        twice = " (a frequency kept twice)" if len(torch.unique(f)) < len(f) else ""
        raise ValueError(
            f"llama.cpp's deepseek2 turns rope pair i at rope_theta^(-2i/{p}) with no per-pair factors, but the kept "
            f"frequencies (fastest first) are not such a sequence: pair {j} turns at {float(f[j]):.6g}, not "
            f"{float(want):.6g}{twice}; {_rope_advice(limit)}")
    half = p // 2
    a = order * 2 if m.rope.interleaved else order  # (p/2,) first dim of each pair, fastest first
    b = a + 1 if m.rope.interleaved else order + half
    return torch.stack([a, b], dim=1).reshape(-1), theta  # (p,)


def check_gguf_exportable(modules, *, limit: int | None = None, exact_f32: bool = False) -> None:
    """Refuse, naming the layer and the reason, what llama.cpp's deepseek2 cannot hold (limit: gguf_rope_limit)."""
    check_exportable(modules)
    _check_gguf_only(modules, limit, exact_f32)


def _check_gguf_only(modules, limit: int | None = None, exact_f32: bool = False) -> None:
    """What llama.cpp refuses beyond check_exportable (which export_preflight has run)."""
    rope_order(modules[0], limit=limit)
    for i, m in enumerate(modules):
        if m.W_O.bias is not None:
            raise ValueError(f"layer {i} has an output bias; llama.cpp's deepseek2 attn_output has none")
        if m.kv_norm is None and not exact_f32:
            raise ValueError(NEEDS_NORM.format(i=i))


# The latent RMSNorm (kv_a_norm) always runs and kv_a_mqa has no bias, so the DeepSeek export's constant channel is not
# available here. An MLA with a latent norm is written as it is (gguf_ready matches its eps to llama.cpp's). One without
# a norm needs one first: latent_norm.add_steady_channels (fitted on calibration text, one more cached number per token,
# survives llama.cpp's Q8_0/Q4_K quantisers), or, with exact_f32=True, latent_norm.linear_latent_norm: exact, written
# in F32, but any quantiser with float16 block scales (llama-quantize's Q8_0, Q4_K, ...) flushes that tensor to zero.
NEEDS_NORM = ("layer {i}'s MLA has no latent norm, which llama.cpp always applies (and attn_kv_a_mqa has no bias for "
              "the DeepSeek export's constant channel): give calibration text to fit one (--calibration FILE; "
              "latent_norm.add_steady_channels), or convert with --latent-norm steady; exact_f32=True (--exact-f32) "
              "writes the exact linear form instead, which llama.cpp's quantisers (Q8_0, Q4_K_M) destroy")


def gguf_ready(m: MultiHeadLatentAttention, input_norm: torch.Tensor, eps: float) -> MultiHeadLatentAttention:
    """The layer as llama.cpp will run it, with the model's rms_norm_eps `eps` in its latent norm.

    An MLA with a latent norm of eps e gets its W_DKV rows times sqrt(eps / e): the norm k c / sqrt(mean((k c)^2) + eps)
    equals c / sqrt(mean(c^2) + e) exactly when k^2 = eps / e. One without gets latent_norm.linear_latent_norm (exact,
    F32); input_norm: the weight of the RMSNorm before the attention (its input's norm is <= max|weight| sqrt(dim)).
    """
    import numpy as np

    if m.kv_norm is not None:
        ours, theirs = float(m.kv_norm.eps), float(np.float32(eps))  # llama.cpp adds eps in float32
        if float(np.float32(ours)) == theirs:
            return m
        new = copy.deepcopy(m)
        with torch.no_grad():
            new.W_DKV.weight.copy_((m.W_DKV.weight.detach().to(torch.float64) * math.sqrt(theirs / ours))
                                   .to(m.W_DKV.weight.dtype))
            new.kv_norm.eps = theirs
        return new
    bound = float(input_norm.detach().abs().max()) * math.sqrt(m.dim)
    return linear_latent_norm(m, bound, eps)[0]


# -- one layer ------------------------------------------------------------------------------------------
def gguf_attention_tensors(m: MultiHeadLatentAttention, block: int) -> dict[str, torch.Tensor]:
    """llama.cpp deepseek2 tensors of one layer (PyTorch (out, in) orientation; GGUF reverses the dims)."""
    # from deepseek.deepseek_attention_tensors, so the two exports share one mapping: the ratio of deepseek2's softmax
    # scale 1/sqrt(qk_nope + qk_rope) to attnlab's multiplies the query weights
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
# From the source GGUF (every tokenizer.* field, copied), or from a byte-level BPE tokenizer.json beside a source folder
# (pre-tokenizer "gpt-2" when it is plain ByteLevel; otherwise name llama.cpp's pre-tokenizer with `pre_tokenizer=`).
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


def export_gguf(model, path, tokenizer=None, *, force: bool = False, pre_tokenizer: str | None = None,
                exact_f32: bool = False) -> Path:
    """Write an attnlab'd, converted Llama-family model as one GGUF file (llama.cpp `deepseek2`), atomically.

    Every layer must be a decoupled-RoPE MLA with frequencies within gguf_rope_limit(model) and a latent norm (with
    exact_f32=True one without is written in the exact linear F32 form, which llama.cpp's quantisers destroy);
    check_gguf_exportable says why not. The tokenizer: the source GGUF's (model.attnlab_source), else `tokenizer`.
    """
    import gguf

    path = Path(path)
    modules = export_preflight(model, path, force, "export_gguf", ours=is_attnlab_gguf)
    _check_gguf_only(modules, gguf_rope_limit(model), exact_f32)
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
        writer.add_string(WRITTEN_BY, "attnlab")  # what --force recognises as attnlab's own file
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

        def add(name, t, f32=False):
            arr, raw = _array(t, f32=f32)
            writer.add_tensor(name, arr, raw_dtype=raw)
        add("token_embd.weight", base.embed_tokens.weight)
        for i, (layer, m) in enumerate(zip(_layers(model), modules)):
            add(f"blk.{i}.attn_norm.weight", layer.input_layernorm.weight)
            ready = gguf_ready(m, layer.input_layernorm.weight, float(cfg.rms_norm_eps))
            for k, v in gguf_attention_tensors(ready, i).items():  # linear_latent_norm's small pre-norm latent
                add(k, v, f32=m.kv_norm is None and k.endswith("attn_kv_a_mqa.weight"))  # needs float32's range
            add(f"blk.{i}.ffn_norm.weight", layer.post_attention_layernorm.weight)
            for ours, theirs in (("gate_proj", "ffn_gate"), ("up_proj", "ffn_up"), ("down_proj", "ffn_down")):
                add(f"blk.{i}.{theirs}.weight", getattr(layer.mlp, ours).weight)
        add("output_norm.weight", base.norm.weight)
        if not tied:
            add("output.weight", model.lm_head.weight)

    from ..store import sources_of

    return write_gguf(path, ARCH, build, force=force, sources=sources_of(model))


WRITTEN_BY = "attnlab.written_by"


def is_attnlab_gguf(path) -> bool:
    """True for a GGUF file attnlab wrote (its metadata carries WRITTEN_BY): what --force may replace."""
    try:
        from gguf import GGUFReader

        return WRITTEN_BY in GGUFReader(str(path)).fields
    except Exception:  # noqa: BLE001 - not a GGUF at all, or unreadable: not ours
        return False


def write_gguf(path: Path, arch: str, build, *, force: bool = False, sources=()) -> Path:
    """build(writer) fills a GGUFWriter; written under a temporary name beside `path`, then renamed
    (io.folders.write_file: an existing file is replaced only with force and only if attnlab wrote it)."""
    import gguf

    from ...io.folders import write_file

    def write(tmp: Path) -> None:
        writer = gguf.GGUFWriter(str(tmp), arch)
        build(writer)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return write_file(path, write, force=force, sources=sources, ours=is_attnlab_gguf)
