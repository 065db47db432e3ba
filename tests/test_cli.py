"""The attnlab command, in-process (typer's runner) and as a subprocess for exit codes."""
import json
import struct
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from attnlab.cli import app, main
from attnlab.bench.presets import PRESETS, get_preset, kv_footprint

runner = CliRunner()


def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_kv_table_lists_every_preset(tmp_path):
    out = tmp_path / "kv.json"
    result = runner.invoke(app, ["kv", "--json", str(out)])
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())
    assert [r["name"] for r in rows] == list(PRESETS)
    for r in rows:  # the footprint comes from a cache, and scales with context (below the held bytes where layers slide)
        slides = PRESETS[r["name"]].sliding_layers
        assert r["bytes_total"] == r["bytes_per_token"] * 4096
        assert (r["bytes_per_token"] < r["bytes_per_token_held"]) if slides else \
            (r["bytes_per_token"] == r["bytes_per_token_held"])


def test_kv_presets_follow_part14_formulas():
    """bytes/token measured from meta-device caches equal 2*G*d*layers*2 (GQA) and (r + p)*layers*2 (MLA)."""
    llama = get_preset("llama-3-8b")
    assert kv_footprint(llama).bytes_per_token == 2 * llama.num_kv_heads * llama.head_dim * llama.num_layers * 2
    v3 = get_preset("deepseek-v3")
    assert kv_footprint(v3).bytes_per_token == (v3.latent_dim + v3.rope_dim) * v3.num_layers * 2


@pytest.mark.parametrize("context", [100, 4096, 131072])
def test_kv_of_sliding_layers_stops_at_their_window(context):
    """Gemma 3 (5 of 6 layers sliding): a global layer caches every token, a sliding one window + min(window, 64)
    rows at most (written out here), so bytes per token at a long context approach the global layers' alone."""
    for name in ("gemma-3-270m", "gemma-3-27b"):
        c = get_preset(name)
        row = 2 * c.num_kv_heads * c.head_dim * 2  # K and V of one token and layer, bf16
        rows = min(context, c.window + min(c.window, 64))
        want = (c.num_layers - c.sliding_layers) * row * context + c.sliding_layers * row * rows
        got = kv_footprint(c, context=context, batch=2)
        assert got.bytes_total == 2 * want and got.bytes_per_token_held == c.num_layers * row


def test_kv_plot_is_a_real_png(tmp_path):
    plot = tmp_path / "kv.png"
    result = runner.invoke(app, ["kv", "--plot", str(plot)])
    assert result.exit_code == 0, result.output
    w, h = _png_size(plot)
    assert w > 300 and h > 200


def test_unknown_preset_is_one_line_with_status_2(capsys):
    assert main(["kv", "no-such-model"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown preset 'no-such-model'" in err[0]


@pytest.mark.parametrize("args, fragment", [
    (["kv", "--context", "0"], "must be positive"),
    (["kv", "--dtype", "int3"], "unknown dtype 'int3'"),
    (["kv", "--kind", "gqa", "--heads", "12", "--kv-heads", "5"], "num_heads (12) must be divisible"),
])
def test_bad_sizes_are_one_line_errors(args, fragment):
    proc = subprocess.run([sys.executable, "-m", "attnlab", *args], capture_output=True, text=True)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], proc.stderr


def test_every_subcommand_has_help_with_an_example():
    for sub in ("tour", "kv", "bench", "convert", "eval", "generate"):
        result = runner.invoke(app, [sub, "--help"])
        assert result.exit_code == 0 and "Example: attnlab " + sub in result.output


@pytest.mark.slow
def test_tour_passes_every_check(tmp_path):
    md, figs = tmp_path / "tour.md", tmp_path / "figs"
    proc = subprocess.run([sys.executable, "-m", "attnlab", "tour", "--markdown", str(md), "--plots", str(figs)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = md.read_text()
    for part in range(1, 15):
        assert f"## Part {part}:" in text
    assert "- [ ]" not in text and "checks passed" in text
    for png in figs.glob("*.png"):
        w, h = _png_size(png)
        assert w > 300 and h > 200
    assert len(list(figs.glob("*.png"))) == 2


# -- convert and checkpoints ------------------------------------------------------------------------
import torch  # noqa: E402

from attnlab import GroupedQueryAttention, MultiHeadLatentAttention  # noqa: E402
from attnlab.io import load_module, save_module  # noqa: E402


@pytest.mark.parametrize("module", [GroupedQueryAttention(32, 8, 2, bias=True, grouping="blocked", rope_base=1e4),
                                    MultiHeadLatentAttention(32, 4, 12, rope_dim=4, latent_norm=True, q_latent_dim=8)])
def test_checkpoint_round_trip(tmp_path, module):
    save_module(module, tmp_path / "ck")
    back = load_module(tmp_path / "ck")
    assert type(back) is type(module) and back.config() == module.config()
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        assert torch.equal(back(x, is_causal=True), module(x, is_causal=True))


def test_convert_command_writes_an_exact_mla(tmp_path):
    torch.manual_seed(0)
    gqa = GroupedQueryAttention(32, 8, 2, bias=True).to(torch.float64)
    save_module(gqa, tmp_path / "gqa")
    result = runner.invoke(app, ["convert", str(tmp_path / "gqa"), "--to", "mla", "--out", str(tmp_path / "mla"),
                                 "--report", str(tmp_path / "report.json")])
    assert result.exit_code == 0, result.output
    mla = load_module(tmp_path / "mla")
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    with torch.no_grad():
        assert float((mla(x) - gqa(x)).norm() / gqa(x).norm()) <= 1e-10
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["exact"] and report["kv_values_after"] == mla.latent_dim


def test_convert_lossy_reports_its_error(tmp_path):
    save_module(GroupedQueryAttention(32, 8, 8), tmp_path / "mha")
    result = runner.invoke(app, ["convert", str(tmp_path / "mha"), "--to", "gqa", "--kv-heads", "2",
                                 "--method", "fit", "--out", str(tmp_path / "gqa")])
    assert result.exit_code == 0, result.output
    assert "lossy" in result.output and load_module(tmp_path / "gqa").num_kv_heads == 2


@pytest.mark.parametrize("setup, fragment", [
    ("missing", "is not an attnlab checkpoint"),
    ("truncated", "cannot read"),
    ("bad-json", "is not valid JSON"),
])
def test_convert_bad_checkpoints_write_nothing(tmp_path, setup, fragment):
    ck = tmp_path / "ck"
    if setup != "missing":
        save_module(GroupedQueryAttention(32, 8, 2), ck)
        if setup == "truncated":
            data = (ck / "model.safetensors").read_bytes()
            (ck / "model.safetensors").write_bytes(data[: len(data) // 2])
        else:
            (ck / "config.json").write_text("{not json")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "attnlab", "convert", str(ck), "--to", "mha", "--out", str(out)],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], proc.stderr
    assert not out.exists() and not any(p.name.startswith(".out") for p in tmp_path.iterdir())


def test_convert_unknown_target(capsys, tmp_path):
    save_module(GroupedQueryAttention(32, 8, 2), tmp_path / "ck")
    assert main(["convert", str(tmp_path / "ck"), "--to", "rnn", "--out", str(tmp_path / "o")]) == 2
    assert "unknown target 'rnn'" in capsys.readouterr().err


def test_bench_quick_writes_json_and_plot(tmp_path):
    """The bench command end to end at tiny sizes: ratios are consistent with the times they divide."""
    out, png = tmp_path / "b.json", tmp_path / "b.png"
    result = runner.invoke(app, ["bench", "--quick", "--suite", "decode", "--suite", "prefill", "--suite", "convert",
                                 "--suite", "deepseek", "--json", str(out), "--plot", str(png)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    decode = {r["variant"]: r for r in data["decode"]}
    for r in decode.values():
        assert r["speedup_of_absorbed"] == pytest.approx(r["ms"] / decode["mla-absorbed"]["ms"])
        assert r["roofline_fraction"] == pytest.approx(r["roofline_ms"] / r["ms"])
    for r in data["prefill"]:
        assert r["ratio"] == pytest.approx(r["attnlab_ms"] / r["peer_ms"])
    assert {r["method"] for r in data["convert"]} == {"select", "block-svd", "tiled-svd"}
    assert data["deepseek"][0]["relative_difference"] <= 1e-4  # the timed peers compute the same thing
    assert all(r["relative_error"] <= 1e-5 for r in data["convert"])
    w, h = _png_size(png)
    assert w > 300 and h > 200


def test_bench_unknown_suite(capsys):
    assert main(["bench", "--suite", "warp"]) == 2
    assert "unknown suite(s) ['warp']" in capsys.readouterr().err


def test_eval_help_names_the_evaluation_protocol():
    """`attnlab eval` takes several texts, a reference, the cache path and the passkey (tests/test_eval_protocol.py
    runs them)."""
    result = runner.invoke(app, ["eval", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    for option in ("--text", "--reference", "--through-cache", "--one-forward", "--chunk", "--json", "--passkey",
                   "--passkey-lengths", "--passkey-depths", "--passkey-trials", "--seed", "--kv-dtype", "--window"):
        assert option in result.output, option
