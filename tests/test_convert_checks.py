"""`attnlab convert` / `attnlab export` take no option silently and refuse bad input in one line (exit 2), and what
they print about the KV cache is what the written model caches (read back from the written config).
"""
import json

import pytest
import torch

pytest.importorskip("transformers")
from attnlab import models as hf  # noqa: E402
from attnlab.cli import main  # noqa: E402
from tiny_checkpoints import TEXT, make_checkpoint  # noqa: E402

LATENT, ROPE = 24, 8


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    root = tmp_path_factory.mktemp("checks")
    make_checkpoint("llama", root / "llama")
    (root / "calib.txt").write_text(TEXT)
    (root / "empty.txt").write_text("")
    return root


def _error(capsys) -> str:
    """The one error line attnlab printed (after any progress bars of transformers)."""
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines and lines[-1].startswith("attnlab: error: ")
    return lines[-1]


def _convert(source, out, *extra):
    return ["convert", str(source / "llama"), "--to", "mla", "--latent-dim", str(LATENT), "--rope-dim", str(ROPE),
            "--out", str(out), *extra]


@pytest.mark.parametrize("tokens", ["0", "-5"])
def test_calibration_tokens_must_be_positive(source, tmp_path, capsys, tokens):
    assert main(_convert(source, tmp_path / "x", "--calibration", str(source / "calib.txt"),
                         "--calibration-tokens", tokens)) == 2
    assert f"--calibration-tokens must be a positive number of tokens, got {tokens}" in _error(capsys)
    assert not (tmp_path / "x").exists()


def test_latent_norm_needs_calibration_text(source, tmp_path, capsys):
    for norm in ("fit", "steady"):
        assert main(_convert(source, tmp_path / "x", "--latent-norm", norm)) == 2
        assert f"--latent-norm {norm} fits the norm on calibration text: give --calibration FILE" in _error(capsys)
    assert main(_convert(source, tmp_path / "x", "--latent-norm", "steady", "--calibration",
                         str(source / "calib.txt"), "--format", "deepseek")) == 2
    assert "--latent-norm steady is for llama.cpp (GGUF)" in _error(capsys)


def test_empty_calibration_text_is_named(source, tmp_path, capsys):
    for fmt in ("attnlab", "deepseek"):  # deepseek: the streamed route reads it with the checkpoint's tokenizer
        assert main(_convert(source, tmp_path / "x", "--calibration", str(source / "empty.txt"), "--format", fmt)) == 2
        line = _error(capsys)
        assert str(source / "empty.txt") in line and "0 tokens" in line and "cholesky" not in line


def test_module_only_options_are_refused_for_whole_models(source, tmp_path, capsys):
    assert main(_convert(source, tmp_path / "x", "--energy", "0.9")) == 2
    assert "--energy applies to a saved attention module; a whole model takes --latent-dim" in _error(capsys)
    assert main(_convert(source, tmp_path / "x", "--split")) == 2
    assert "--split applies to a saved attention module" in _error(capsys)


def test_boolean_options_are_on_off_flags(source, tmp_path, capsys):
    from typer.testing import CliRunner

    from attnlab.cli.app import app

    text = CliRunner().invoke(app, ["convert", "--help"], terminal_width=200).output
    for flag in ("balance", "force"):
        line = next(row for row in text.splitlines() if f"--{flag}" in row)
        assert f"--no-{flag}" in line and "<bool>" not in line
    assert main(_convert(source, tmp_path / "x", "--no-balance", "--no-force")) == 0


def test_reconverting_an_mla_is_refused(source, tmp_path, capsys):
    assert main(_convert(source, tmp_path / "mla")) == 0
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "mla"), "--to", "mla", "--latent-dim", "12", "--out",
                 str(tmp_path / "again")]) == 2
    assert "the model is already an MLA (layer 0 is a MultiHeadLatentAttention, not a GQA/MHA)" in _error(capsys)
    assert not (tmp_path / "again").exists()


def test_non_finite_weights_are_named_before_converting(source, tmp_path, capsys):
    """convert_model checks the attention weights it is handed (a model damaged in memory); on disk, the loader
    (in memory route) or the streamed converter (layer by layer) names the tensor before any SVD runs."""
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    model, _ = make_checkpoint("llama", bad)
    hf.to_attnlab(model)
    with torch.no_grad():
        hf.attnlab_modules(model)[1].W_K.weight[3, 5] = float("inf")
    with pytest.raises(ValueError, match=r"layer 1's W_K.weight has 1 non-finite values \(NaN or inf\)"):
        hf.convert_model(model, "mla")  # even the exact conversion: it would give NaN logits and exit 0
    for shard in bad.glob("*.safetensors"):
        t = load_file(str(shard))
        if "model.layers.1.self_attn.k_proj.weight" in t:
            t["model.layers.1.self_attn.k_proj.weight"][3, 5] = float("nan")
            save_file(t, str(shard), metadata={"format": "pt"})
    for fmt in ("attnlab", "deepseek"):  # in memory, and streamed layer by layer
        assert main(["convert", str(bad), "--to", "mla", "--latent-dim", str(LATENT), "--rope-dim", str(ROPE),
                     "--format", fmt, "--no-calibration", "--out", str(tmp_path / fmt)]) == 2
        line = _error(capsys)
        assert "k_proj.weight" in line and "NaN" in line and ("layer 1" in line or "layers.1" in line), line
        assert not (tmp_path / fmt).exists()


def test_printed_kv_values_are_what_the_deepseek_export_caches(source, tmp_path, capsys):
    """The streamed DeepSeek export of a norm-less MLA caches latent + 1 (the constant channel) + rope per token:
    the printed count is the written config's kv_lora_rank + qk_rope_head_dim."""
    out = tmp_path / "ds"
    assert main(_convert(source, out, "--format", "deepseek", "--rope-select", "rorope-score", "--rope-dim", "6",
                         "--calibration", str(source / "calib.txt"))) == 0
    printed = capsys.readouterr().out
    cfg = json.loads((out / "config.json").read_text())
    cached = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    assert cached == LATENT + 1 + 6
    assert f"KV values per token per layer: {2 * 2 * 16} -> {cached} " in printed  # 2 G d before


def test_rope_dim_rules_name_the_selection(source, tmp_path, capsys):
    assert main(_convert(source, tmp_path / "x", "--rope-dim", "6", "--rope-select", "frequency")) == 2  # per head
    assert "must be a non-negative multiple of 2 * num_kv_heads (4) for --rope-select frequency" in _error(capsys)
    assert main(_convert(source, tmp_path / "x", "--rope-dim", "6", "--rope-select", "rorope")) == 0
