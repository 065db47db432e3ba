"""GGUF export (llama.cpp's deepseek2): the file, read back with `gguf` alone and run through the naive MLA
oracle with llama.cpp's conventions (tests/reference.py), gives attnlab's attention output, for each way the
latent norm gets there (the exact F32 linear form, a fitted norm under another eps, the steady channel); where
llama-cpp-python is installed (extra [llamacpp], built from source), llama.cpp itself gives attnlab's logits
and the same greedy tokens. The rope limit (gguf_rope_limit) is what llama.cpp can turn, and refusals name it.
Bad input gets one-line errors. Quantisation: tests/test_export_quant.py.
"""
import json

import pytest
import torch

pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from attnlab import models as hf  # noqa: E402
from attnlab.cli import main  # noqa: E402
from attnlab.models.export.latent_norm import add_steady_channels  # noqa: E402
from attnlab.models.export.deepseek_gguf import export_gguf, gguf_rope_limit  # noqa: E402
from attnlab.models.load import load_checkpoint  # noqa: E402
from reference import mla_reference, rel_err  # noqa: E402
from tiny_checkpoints import TEXT, make_checkpoint  # noqa: E402

LATENT, ROPE = 12, 8  # rope_dim <= head_dim 16: RoRoPE keeps the 4 fastest distinct frequencies
# the file holds the model's float32 weights; three things each move the output by at most float32's unit
# roundoff (relative): the query rounded once more after the softmax-scale ratio, the latent norm's weight
# sqrt(eps)/s rounded to float32, and that norm's distance from a fixed scale (export.linear_latent_norm)
TOL = 3 * 2.0 ** -24


def _converted(folder, select="rorope", norm="none", rope_dim=ROPE):
    model, tok = load_checkpoint(folder)
    hf.to_attnlab(model)
    ids = tok(TEXT, return_tensors="pt").input_ids
    hf.convert_model(model, "mla", latent_dim=LATENT, rope_dim=rope_dim, calibration_ids=ids, pair_selection=select)
    if norm == "fit":
        hf.add_latent_norms(model, ids)
    elif norm == "steady":
        add_steady_channels(model, ids)
    return model, tok, ids


CASES = {  # name: (latent norm, the model's rms_norm_eps: llama.cpp's latent norm uses it)
    "exact F32 linear form (no latent norm)": ("none", 1e-6),
    "fitted latent norm, eps 1e-6 under the model's 1e-5": ("fit", 1e-5),
    "steady channel": ("steady", 1e-5),
}


@pytest.fixture(scope="module", params=list(CASES))
def exported(request, tmp_path_factory):
    """A tiny Llama (no rope scaling) converted for llama.cpp and exported: (model, tok, ids, path).

    Without a latent norm the export is the exact F32 form (linear_latent_norm, exact_f32=True); a norm of its own
    is written as it is, its W_DKV rescaled for llama.cpp's eps (export_gguf.gguf_ready)."""
    norm, eps = CASES[request.param]
    folder = tmp_path_factory.mktemp("gguf") / "llama"
    make_checkpoint("llama", folder, rope_scaling=None, rope_theta=10000.0, rms_norm_eps=eps)
    model, tok, ids = _converted(folder, norm=norm)
    path = export_gguf(model, folder.parent / "model.gguf", tokenizer=tok, exact_f32=norm == "none")
    return model, tok, ids, path


def test_linear_latent_norm_is_a_fixed_scale_up_to_the_input_bound():
    """The normed copy equals the MLA (float64) on inputs up to the bound, the worst one included: the input
    along the largest down-projection row, at the bound's norm."""
    from attnlab import MultiHeadLatentAttention
    from attnlab.models.export.latent_norm import linear_latent_norm

    g = torch.Generator().manual_seed(0)
    m = MultiHeadLatentAttention(dim=32, num_heads=4, latent_dim=8, rope_dim=4, dtype=torch.float64)
    bound, eps = 40.0, 1e-5
    normed, s = linear_latent_norm(m, bound, eps)
    w = m.W_DKV.weight.detach()
    worst = w[w.norm(dim=1).argmax()] / w.norm(dim=1).max() * bound  # (dim,)
    x = torch.randn(1, 6, 32, generator=g, dtype=torch.float64)
    x = torch.cat([x / x.norm(dim=-1, keepdim=True) * bound, worst.expand(1, 2, 32)], dim=1)  # (1, 8, dim)
    with torch.no_grad():
        assert rel_err(normed(x, is_causal=True), m(x, is_causal=True)) <= 2.0 ** -24
        c = normed.W_DKV(worst)
    assert float(c.pow(2).mean()) <= 2.0 ** -24 * eps and s == 2.0 ** round(torch.log2(torch.tensor(s)).item())


def _read(path):
    reader = gguf.GGUFReader(str(path))
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml.merges")}
    tensors = {t.name: torch.from_numpy(t.data.copy()).to(torch.float64) for t in reader.tensors}
    return meta, tensors


def test_gguf_attention_read_back_through_the_oracle_is_attnlabs(exported):
    """Each layer's tensors, read from the file and interpreted as llama.cpp's deepseek2 does (softmax over
    qk_nope + qk_rope, k_b transposed, rope pair i at rope_theta^(-2i/p) on consecutive dims, the latent always
    RMS-normalised), give the output of attnlab's MLA layer on the same input."""
    model, _, _, path = exported
    meta, t = _read(path)
    assert meta["general.architecture"] == "deepseek2"
    H, r, p = meta["deepseek2.attention.head_count"], meta["deepseek2.attention.kv_lora_rank"], meta[
        "deepseek2.rope.dimension_count"]
    m0 = hf.attnlab_modules(model)[0]  # the steady channel widens the latent by one
    assert (r, p, meta["deepseek2.attention.head_count_kv"]) == (m0.latent_dim, ROPE, 1)
    theta, eps = meta["deepseek2.rope.freq_base"], meta["deepseek2.attention.layer_norm_rms_epsilon"]
    x = torch.randn(1, 7, 64, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True))  # what an attention layer reads: RMS-normalised
    for i, m in enumerate(hf.attnlab_modules(model)):
        xi = x * model.model.layers[i].input_layernorm.weight.detach().double()  # (1, 7, dim)
        b = f"blk.{i}."
        k_b, v_b = t[b + "attn_k_b.weight"], t[b + "attn_v_b.weight"]  # (H, r, d), (H, dv, r)
        kv_a = t[b + "attn_kv_a_mqa.weight"]
        params = {"W_Q": t[b + "attn_q.weight"], "W_DKV": kv_a[:r], "W_KR": kv_a[r:],
                  "kv_norm": t[b + "attn_kv_a_norm.weight"], "W_UK": k_b.transpose(1, 2).reshape(-1, r),
                  "W_UV": v_b.reshape(-1, r), "W_O": t[b + "attn_output.weight"], "rope": (theta, True), "eps": eps}
        ref = mla_reference(xi, xi, params, H, causal=True)
        with torch.no_grad():
            ours = m.double()(xi, is_causal=True)
        m.float()
        assert rel_err(ours, ref) <= TOL, i


def test_gguf_runs_in_llama_cpp_with_attnlabs_logits_and_greedy_tokens(exported):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is an optional extra built from source")
    import numpy as np

    model, tok, ids, path = exported
    ids = ids[:, :48]
    llm = llama_cpp.Llama(str(path), n_ctx=128, logits_all=True, verbose=False, n_threads=1,
                          type_k=0, type_v=0, flash_attn=False)  # GGML_TYPE_F32 caches: no f16 rounding
    llm.eval(ids[0].tolist())
    theirs = torch.from_numpy(np.array(llm.scores[:ids.shape[1]]))
    with torch.no_grad():
        ours = model(ids).logits[0]
    assert rel_err(theirs, ours) <= 1e-4  # float32, other operation order (measured ~2e-7)
    prompt = ids[0, :8].tolist()
    llm.reset()
    greedy = []
    for token in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
        greedy.append(token)
        if len(greedy) == 32:
            break
    with torch.no_grad():
        from attnlab.generation import generate
        mine = generate(model, ids[:, :8], max_new_tokens=32)[0, 8:].tolist()
    assert greedy == mine


def test_gguf_refusals(tmp_path, exported):
    folder = tmp_path / "llama"
    make_checkpoint("llama", folder, rope_scaling=None, rope_theta=10000.0)
    model, tok, _ = _converted(folder, select="frequency")  # per-head pairs: each kept frequency twice (G = 2)
    # no rope scaling: every pair of head_dim 16 is theta^(-2i/16), so the limit is head_dim
    with pytest.raises(ValueError, match=r"not such a sequence: pair 1 .* \(a frequency kept twice\); export with "
                                         r"--format deepseek .*, or convert with --rope-select rorope --rope-dim <= 16 "):
        export_gguf(model, tmp_path / "b.gguf", tokenizer=tok, exact_f32=True)
    model, tok, _ = _converted(folder)  # exportable frequencies, but no latent norm
    with pytest.raises(ValueError, match=r"layer 0's MLA has no latent norm, which llama.cpp always applies .* give "
                                         r"calibration text .*exact_f32=True"):
        export_gguf(model, tmp_path / "b.gguf", tokenizer=tok)
    assert not (tmp_path / "b.gguf").exists()
    model, tok, _, path = exported
    with pytest.raises(ValueError, match=r"model\.gguf exists; pass (force=True|--force)"):
        export_gguf(model, path, tokenizer=tok)


def test_cli_convert_with_latent_norm_then_export_gguf(tmp_path, capsys):
    folder = tmp_path / "llama"
    make_checkpoint("llama", folder, rope_scaling=None, rope_theta=10000.0)
    text = tmp_path / "calib.txt"
    text.write_text(TEXT)
    conv, out = tmp_path / "conv", tmp_path / "m.gguf"
    assert main(["convert", str(folder), "--to", "mla", "--latent-dim", str(LATENT), "--rope-dim", str(ROPE),
                 "--rope-select", "rorope", "--latent-norm", "fit", "--calibration", str(text), "--out",
                 str(conv)]) == 0
    assert "latent norms fitted" in capsys.readouterr().out
    assert main(["export", str(conv), "--format", "gguf", "--out", str(out)]) == 0
    reloaded, _, _ = hf.load_model(str(conv))
    meta, t = _read(out)
    assert meta["deepseek2.block_count"] == 2
    assert torch.equal(t["blk.1.attn_kv_a_norm.weight"].float(), hf.attnlab_modules(reloaded)[1].kv_norm.weight)
    assert main(["export", str(conv), "--format", "deepseek", "--out", str(tmp_path / "ds")]) == 0
    config = json.loads((tmp_path / "ds" / "config.json").read_text())
    assert (config["model_type"], config["kv_lora_rank"]) == ("deepseek_v3", LATENT)  # its own norm: no extra channel
    assert (tmp_path / "ds" / "tokenizer.json").is_file()
    capsys.readouterr()
    assert main(["export", str(conv), "--format", "gguf", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()  # the output-safety rule's wording (io.folders), one line
    assert err.startswith("attnlab: error:") and f"{out} exists; pass --force" in err and "\n" not in err
    assert main(["export", str(conv), "--format", "onnx", "--out", str(tmp_path / "x")]) == 2
    assert "--format must be one of deepseek, gguf, not 'onnx'" in capsys.readouterr().err
    assert main(["convert", str(folder), "--to", "mla", "--latent-norm", "fit", "--out", str(tmp_path / "y")]) == 2
    assert "--latent-norm fit needs --to mla --latent-dim R" in capsys.readouterr().err


# -- the rope limit ------------------------------------------------------------------------------------------
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 256}


def test_rope_limit_is_what_llama_cpp_can_turn_under_llama3_scaling(tmp_path):
    """With Llama 3 rope scaling only the fast pairs keep rope_theta's own frequencies; the limit counts the fastest
    pairs that still form theta^(-2i/p) (measured here against the unscaled frequencies, computed independently).
    RoRoPE by frequency at the limit exports; 2 dims more (still <= head_dim, the old advice) is refused, and the
    refusal names the limit, so the advice leads somewhere."""
    folder = tmp_path / "llama3"
    model, _ = make_checkpoint("llama", folder, rope_theta=10000.0, rope_scaling=LLAMA3, max_position_embeddings=512)
    source = model.model.rotary_emb.inv_freq.double()  # transformers' scaled frequencies
    default = 10000.0 ** (-torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    unscaled = int(torch.isclose(source, default, rtol=1e-6, atol=0).long().cumprod(0).sum())
    assert 2 <= unscaled < 8  # the configuration leaves some pairs unscaled and scales the rest
    limit = gguf_rope_limit(model)
    assert limit == 2 * unscaled
    assert gguf_rope_limit(default) == 16 and gguf_rope_limit(default, scaling=1.5) == 0
    model, tok, _ = _converted(folder, norm="steady", rope_dim=limit)
    export_gguf(model, tmp_path / "ok.gguf", tokenizer=tok)
    _, t = _read(tmp_path / "ok.gguf")
    assert t["blk.0.attn_kv_a_mqa.weight"].shape[0] == LATENT + 1 + limit
    model, tok, _ = _converted(folder, norm="steady", rope_dim=limit + 2)
    with pytest.raises(ValueError, match=rf"not such a sequence: pair \d+ .*; export with --format deepseek .*, "
                                         rf"or convert with --rope-select rorope --rope-dim <= {limit} "):
        export_gguf(model, tmp_path / "no.gguf", tokenizer=tok)


def test_cli_export_gguf_fits_a_norm_on_calibration_text(tmp_path, capsys):
    """export --format gguf of a norm-less MLA: refused without --calibration (naming it and --exact-f32); with it,
    every layer gets the steady channel (errors printed, one more cached number); --exact-f32 writes F32."""
    folder = tmp_path / "llama"
    make_checkpoint("llama", folder, rope_scaling=None, rope_theta=10000.0)
    text = tmp_path / "calib.txt"
    text.write_text(TEXT)
    conv = tmp_path / "conv"
    assert main(["convert", str(folder), "--to", "mla", "--latent-dim", str(LATENT), "--rope-dim", str(ROPE),
                 "--rope-select", "rorope", "--calibration", str(text), "--out", str(conv)]) == 0
    capsys.readouterr()
    assert main(["export", str(conv), "--format", "gguf", "--out", str(tmp_path / "a.gguf")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # the one line after transformers' progress bars
    assert err.startswith("attnlab: error: layer 0's MLA has no latent norm")
    assert "--calibration FILE" in err and "--exact-f32" in err
    assert main(["export", str(conv), "--format", "gguf", "--calibration", str(text), "--out",
                 str(tmp_path / "a.gguf")]) == 0
    out = capsys.readouterr().out
    assert "steady channel" in out and f"caches {LATENT + 1 + ROPE} values per token per layer" in out
    meta, _ = _read(tmp_path / "a.gguf")
    assert meta["deepseek2.attention.kv_lora_rank"] == LATENT + 1
    assert main(["export", str(conv), "--format", "gguf", "--exact-f32", "--out", str(tmp_path / "b.gguf")]) == 0
    assert f"caches {LATENT + ROPE} values" in capsys.readouterr().out
    assert main(["export", str(conv), "--format", "deepseek", "--exact-f32", "--out", str(tmp_path / "c")]) == 2
    assert "--exact-f32 applies to --format gguf" in capsys.readouterr().err
    assert main(["export", str(conv), "--format", "deepseek", "--out", str(tmp_path / "c")]) == 0
    assert f"caches {LATENT + 1 + ROPE} values per token per layer (latent {LATENT} + 1 constant channel" in \
        capsys.readouterr().out


@pytest.mark.parametrize("cache, rotated", [("q4_0", False), ("q4_0", True), ("q8_0", True)])
def test_llama_cpps_quantised_cache_is_the_one_attnlab_planned_and_healed_through(tmp_path, cache, rotated):
    """A GGUF shrink is planned and healed through attnlab's copy of a llama.cpp cache type (shrink --format gguf
    --kv-dtype q4_0): the latent with its steady channel and the rope key in whole blocks of 32, the cached row
    [latent | rope key] quantised block by block as llama.cpp's K cache stores it (deepseek2 caches no V). Oracle:
    llama.cpp itself with that cache type. Its logits must sit much closer to attnlab's through the same codes than
    to attnlab's unquantised ones: the mismatch left (llama.cpp also rounds the query to q8_0 for its dot products
    with q4_0 blocks, and sums in another order) is a small part of what the codes themselves change."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is an optional extra built from source")
    import numpy as np

    from attnlab.models.evaluate import set_kv_dtype

    folder = tmp_path / "llama"  # head_dim 64: a rope key of 32 (16 pairs) that llama.cpp can turn
    make_checkpoint("llama", folder, rope_scaling=None, rope_theta=10000.0, head_dim=64)
    model, tok = load_checkpoint(folder)
    hf.to_attnlab(model)
    ids = tok(TEXT, return_tensors="pt").input_ids
    hf.convert_model(model, "mla", latent_dim=63, rope_dim=32, calibration_ids=ids, pair_selection="rorope")
    add_steady_channels(model, ids)  # the latent: 63 + 1 = 64, two blocks; the rope key one
    if rotated:  # as the planner does for these caches: every latent channel but the steady one (convert/rotate.py)
        from attnlab.convert.rotate import rotate_latent

        for m in hf.attnlab_modules(model):
            rotate_latent(m, "random")
    path = export_gguf(model, tmp_path / "model.gguf", tokenizer=tok)
    ids = ids[:, :48]
    with torch.no_grad():
        plain = model(ids).logits[0]
        set_kv_dtype(model, cache)
        ours = model(ids).logits[0]
    kind = getattr(llama_cpp, f"GGML_TYPE_{cache.upper()}")
    llm = llama_cpp.Llama(str(path), n_ctx=128, logits_all=True, verbose=False, n_threads=1, type_k=kind,
                          type_v=kind, flash_attn=True)  # a quantised cache needs flash attention
    llm.eval(ids[0].tolist())
    theirs = torch.from_numpy(np.array(llm.scores[:ids.shape[1]]))
    codes = rel_err(ours, plain)  # what the codes change
    assert codes > 1e-4
    assert rel_err(theirs, ours) <= 0.2 * codes, (rel_err(theirs, ours), codes, rel_err(theirs, plain))
