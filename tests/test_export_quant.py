"""A GGUF that `attnlab export --format gguf` writes keeps its quality under llama.cpp's quantisers.

The bound is independent of the export: what the same quantisation does to the ORIGINAL model. Two peers
apply it: gguf's own quants (quantize/dequantize, Q8_0 and the 4-bit Q4_0; gguf-py has no Q4_K quantiser),
read back through the float64 MLA oracle of tests/reference.py with llama.cpp's conventions; and, where
llama-cpp-python is installed, llama.cpp's own quantiser (llama_model_quantize, Q8_0 and Q4_K_M) and
runtime. The steady-channel export (export.add_steady_channels) must stay within a small factor of the
original's loss; the exact F32 linear form (linear_latent_norm, --exact-f32) demonstrably does not.
"""
import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from attnlab import models as hf  # noqa: E402
from attnlab.models.export.latent_norm import add_steady_channels  # noqa: E402
from attnlab.models.export.deepseek_gguf import export_gguf  # noqa: E402
from attnlab.models.load import load_checkpoint  # noqa: E402
from reference import gqa_reference, mla_reference, rel_err  # noqa: E402
from tiny_checkpoints import TEXT, make_checkpoint  # noqa: E402

Q = gguf.GGMLQuantizationType
# The converted layer runs its input through five quantised products (q, kv_a, k_b, v_b, o) where the original
# runs four (q, k, v, o), each adding about the same relative rounding; twice the original's error leaves room
# for that and for the tensors' different block statistics, and none for a flushed tensor (error ~1).
FACTOR = 2.0


def _quantised(a: np.ndarray, kind) -> np.ndarray:
    """a quantised and de-quantised along its last axis (ggml's rows), as llama.cpp stores it; rows whose length
    the block does not divide stay as they are (llama.cpp gives such a tensor a fallback type)."""
    from gguf.quants import dequantize, quantize

    block = gguf.GGML_QUANT_SIZES[kind][0]
    if a.shape[-1] % block:
        return a
    return dequantize(quantize(np.ascontiguousarray(a, dtype=np.float32), kind), kind).reshape(a.shape)


def _tensors(path, kind=None):
    reader = gguf.GGUFReader(str(path))
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml.merges")}
    out = {}
    for t in reader.tensors:
        a = np.array(t.data, dtype=np.float32)
        if kind is not None and a.ndim >= 2 and t.name.endswith(".weight") and "_norm" not in t.name:
            a = _quantised(a, kind)
        out[t.name] = torch.from_numpy(a).to(torch.float64)
    return meta, out


def _mla_out(meta, t, i, x):
    """Layer i of a deepseek2 GGUF on x (1, L, dim) by the oracle, with llama.cpp's conventions."""
    H, r = meta["deepseek2.attention.head_count"], meta["deepseek2.attention.kv_lora_rank"]
    b = f"blk.{i}."
    kv_a = t[b + "attn_kv_a_mqa.weight"]
    params = {"W_Q": t[b + "attn_q.weight"], "W_DKV": kv_a[:r], "W_KR": kv_a[r:],
              "kv_norm": t[b + "attn_kv_a_norm.weight"], "W_UK": t[b + "attn_k_b.weight"].transpose(1, 2).reshape(-1, r),
              "W_UV": t[b + "attn_v_b.weight"].reshape(-1, r), "W_O": t[b + "attn_output.weight"],
              "rope": (meta["deepseek2.rope.freq_base"], True), "eps": meta["deepseek2.attention.layer_norm_rms_epsilon"]}
    return mla_reference(x, x, params, H, causal=True)


def _act_q8(x: torch.Tensor) -> torch.Tensor:
    """What ggml's CPU matmul does to the activations of a Q8_0/Q4_0 product: Q8_0 them (float16 block scales)."""
    return torch.from_numpy(_quantised(x.numpy(), Q.Q8_0)).to(torch.float64)


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """A tiny Llama (no rope scaling, rms_norm_eps 1e-5), RoRoPE-converted, exported twice: with the steady channel
    (what `export --format gguf --calibration` writes) and in the exact F32 linear form (--exact-f32)."""
    root = tmp_path_factory.mktemp("quant")
    folder = root / "llama"
    original, tok = make_checkpoint("llama", folder, rope_scaling=None, rope_theta=10000.0, rms_norm_eps=1e-5)
    ids = tok(TEXT, return_tensors="pt").input_ids
    paths = {}
    for name in ("steady", "linear"):
        model, tok = load_checkpoint(folder)
        hf.to_attnlab(model)
        hf.convert_model(model, "mla", latent_dim=12, rope_dim=8, calibration_ids=ids, pair_selection="rorope")
        if name == "steady":
            add_steady_channels(model, ids)
        paths[name] = export_gguf(model, root / f"{name}.gguf", tokenizer=tok, exact_f32=name == "linear")
    hf.to_attnlab(original)
    inputs = hf.attention_inputs(original, ids[:, :10])  # what each layer reads, (10, dim)
    return original, inputs, paths


@pytest.mark.parametrize("kind", [Q.Q8_0, Q.Q4_0], ids=["Q8_0", "Q4_0"])
def test_quantised_export_stays_within_what_quantisation_costs_the_original(exports, kind):
    original, inputs, paths = exports
    meta, exact = _tensors(paths["steady"])
    _, quant = _tensors(paths["steady"], kind)
    lmeta, lexact = _tensors(paths["linear"])
    _, lquant = _tensors(paths["linear"], kind)
    for i, m in enumerate(hf.attnlab_modules(original)):
        x = inputs[i].double()[None]  # (1, 10, dim)
        xq = _act_q8(x)
        ws = [getattr(m, n).weight.detach().double() for n in ("W_Q", "W_K", "W_V", "W_O")]
        wq = [torch.from_numpy(_quantised(w.float().numpy(), kind)).double() for w in ws]
        kw = dict(grouping=m.grouping, causal=True, rope=(m.rope.base, m.rope.interleaved))
        ref = gqa_reference(x, x, *ws, m.num_heads, m.num_kv_heads, **kw)
        bound = rel_err(gqa_reference(xq, xq, *wq, m.num_heads, m.num_kv_heads, **kw), ref)
        assert bound > 0  # the quantisation did something
        mine = rel_err(_mla_out(meta, quant, i, xq), _mla_out(meta, exact, i, x))
        print(f"{kind.name} layer {i}: original {bound:.3e}, steady export {mine:.3e}")
        assert mine <= FACTOR * bound, (i, mine, bound)
        broken = rel_err(_mla_out(lmeta, lquant, i, xq), _mla_out(lmeta, lexact, i, x))
        assert broken > FACTOR * bound, (i, broken, bound)  # the linear form's latent is flushed to zero


def _q8_rows(a: torch.Tensor) -> torch.Tensor:
    """Rows (N, W) as llama.cpp's q8_0 KV cache holds them: blocks of 32 along the row (zero-padded to a whole
    block: a zero never raises a block's scale), quantised and de-quantised by gguf's quants."""
    pad = -a.shape[-1] % 32
    padded = torch.nn.functional.pad(a, (0, pad)).float().numpy()
    return torch.from_numpy(_quantised(padded, Q.Q8_0)[:, :a.shape[-1]]).to(torch.float64)


def test_the_steady_channel_stays_out_of_a_q8_0_cache(exports):
    """llama.cpp caches the normed latent; in a q8_0 KV cache every 32 values share one scale. The steady
    channel (K times the latent before the norm) once reached the cache and set its block's scale, flushing
    the rest of the block (1.106x perplexity on SmolLM2). Now the cached rows lose to q8_0 about what the
    original's cached keys and values do (the same oracle on both), and the extra channel caches 0."""
    original, inputs, paths = exports
    meta, t = _tensors(paths["steady"])
    r = meta["deepseek2.attention.kv_lora_rank"]
    for i, m in enumerate(hf.attnlab_modules(original)):
        x = inputs[i].double()  # (10, dim)
        b = f"blk.{i}."
        latent = x @ t[b + "attn_kv_a_mqa.weight"][:r].T  # (10, r): before the norm
        eps = meta["deepseek2.attention.layer_norm_rms_epsilon"]
        cached = latent * torch.rsqrt(latent.pow(2).mean(-1, keepdim=True) + eps) * t[b + "attn_kv_a_norm.weight"]
        kv = torch.cat([x @ m.W_K.weight.detach().double().T, x @ m.W_V.weight.detach().double().T], -1)
        bound = rel_err(_q8_rows(kv), kv)  # what a q8_0 cache does to the original's rows
        assert bound > 0
        read = slice(0, r - 1)  # the channels the up-projections read (the extra one's columns are zero)
        assert rel_err(_q8_rows(cached)[:, read], cached[:, read]) <= FACTOR * bound, i
        assert torch.equal(cached[:, -1], torch.zeros_like(cached[:, -1]))  # the extra channel caches 0


# -- llama.cpp's own quantiser ------------------------------------------------------------------------------
def _llama_gguf(model, folder, tok, path):
    """The original tiny Llama as a llama.cpp `llama` GGUF (F32), written as convert_hf_to_gguf.py lays it out:
    q/k rows permuted from rotate-half to llama.cpp's adjacent pairs."""
    from attnlab.models.export.deepseek_gguf import _folder_tokenizer

    cfg = model.config
    H, G = cfg.num_attention_heads, cfg.num_key_value_heads
    d = cfg.hidden_size // H

    def permute(w, heads):
        return w.reshape(heads, 2, w.shape[0] // heads // 2, -1).transpose(1, 2).reshape(w.shape)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_rope_dimension_count(d)
    writer.add_head_count(H)
    writer.add_head_count_kv(G)
    writer.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]) if getattr(cfg, "rope_parameters", None)
                              else float(cfg.rope_theta))
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    _folder_tokenizer(writer, folder, tok, None)
    add = lambda name, t: writer.add_tensor(name, t.detach().float().contiguous().numpy())  # noqa: E731
    add("token_embd.weight", model.model.embed_tokens.weight)
    for i, layer in enumerate(model.model.layers):
        a = layer.self_attn
        add(f"blk.{i}.attn_norm.weight", layer.input_layernorm.weight)
        add(f"blk.{i}.attn_q.weight", permute(a.q_proj.weight.detach(), H))
        add(f"blk.{i}.attn_k.weight", permute(a.k_proj.weight.detach(), G))
        add(f"blk.{i}.attn_v.weight", a.v_proj.weight)
        add(f"blk.{i}.attn_output.weight", a.o_proj.weight)
        add(f"blk.{i}.ffn_norm.weight", layer.post_attention_layernorm.weight)
        add(f"blk.{i}.ffn_gate.weight", layer.mlp.gate_proj.weight)
        add(f"blk.{i}.ffn_up.weight", layer.mlp.up_proj.weight)
        add(f"blk.{i}.ffn_down.weight", layer.mlp.down_proj.weight)
    add("output_norm.weight", model.model.norm.weight)
    add("output.weight", model.lm_head.weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _logits(llama_cpp, path, ids):
    llm = llama_cpp.Llama(str(path), n_ctx=128, logits_all=True, verbose=False, n_threads=1, type_k=0, type_v=0,
                          flash_attn=False)  # float32 caches: only the weights are quantised
    llm.eval(ids)
    out = np.array(llm.scores[:len(ids)], dtype=np.float64)
    del llm
    return torch.from_numpy(out)


def _quantise(llama_cpp, src, dst, ftype):
    import ctypes

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = ftype, 1
    assert llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) == 0
    return dst


@pytest.mark.parametrize("ftype", ["LLAMA_FTYPE_MOSTLY_Q8_0", "LLAMA_FTYPE_MOSTLY_Q4_K_M"])
def test_llama_cpp_quantiser_keeps_the_export_as_close_as_the_original(tmp_path, ftype):
    """llama.cpp quantises the original tiny Llama (as a `llama` GGUF) and attnlab's export (`deepseek2`); in
    llama.cpp the export's logits move from its F32 logits by at most FACTOR times what the original's move
    (hidden 256, so Q4_K_M's 256-blocks apply), while the --exact-f32 linear form is destroyed."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is an optional extra built from source")
    folder = tmp_path / "llama"
    original, tok = make_checkpoint("llama", folder, rope_scaling=None, rope_theta=10000.0, rms_norm_eps=1e-5,
                                    hidden_size=256, intermediate_size=512)
    ids = tok(TEXT, return_tensors="pt").input_ids
    files = {"original": _llama_gguf(original, folder, tok, tmp_path / "original.gguf")}
    for name in ("steady", "linear"):
        model, tok = load_checkpoint(folder)
        hf.to_attnlab(model)
        hf.convert_model(model, "mla", latent_dim=64, rope_dim=32, calibration_ids=ids, pair_selection="rorope")
        if name == "steady":
            add_steady_channels(model, ids)
        files[name] = export_gguf(model, tmp_path / f"{name}.gguf", tokenizer=tok, exact_f32=name == "linear")
    with torch.no_grad():  # llama.cpp runs the original as transformers does (the writer above is right)
        ours = original(ids[:, :48]).logits[0].double()
    flat = ids[0, :48].tolist()
    moved = {}
    for name, path in files.items():
        f32 = _logits(llama_cpp, path, flat)
        if name == "original":
            assert rel_err(f32, ours) <= 1e-4  # float32 in both, other operation order
        quant = _logits(llama_cpp, _quantise(llama_cpp, path, tmp_path / f"{name}-q.gguf", getattr(llama_cpp, ftype)),
                        flat)
        moved[name] = rel_err(quant, f32)
    print(ftype, {k: f"{v:.3e}" for k, v in moved.items()})
    assert 0 < moved["steady"] <= FACTOR * moved["original"], moved
    assert moved["linear"] > FACTOR * moved["original"], moved
