"""attnlab.hf.KVCache for an MLA attnlab wrote as DeepSeek-V3: transformers' own DeepseekV3 forward over the cache
scores and decodes what attnlab's loop scores and decodes with the same storage (float64), the folder names its
storage, and the bytes held are the storage's.
"""
import gc

import pytest
import torch

pytest.importorskip("transformers")
from tiny_checkpoints import make_checkpoint  # noqa: E402
from transformers import AutoModelForCausalLM, DeepseekV3Config  # noqa: E402

from attnlab import models as hf  # noqa: E402
from attnlab.hf import KVCache, TransformersRunner  # noqa: E402
from attnlab.models.adapters import attnlab_modules  # noqa: E402
from attnlab.models.evaluate import score_windows  # noqa: E402
from attnlab.models.export.deepseek import export_deepseek  # noqa: E402
from attnlab.models.load import load_checkpoint  # noqa: E402
from test_hf_cache import _tensors_reachable  # noqa: E402

LATENT, ROPE = 24, 8
STORAGES = [None, "int8", "int4/g8+r8", "int3/g8+c4", "int3/g8+c4+w4", "int3/g8+c4+s1+w4"]
# the plain export agrees with attnlab's MLA to float64's rounding over the longrope factors and the folded softmax
# scale (measured up to 2.4e-10); the cache codes the MLA's own latent, so the codes add nothing to it
EXPORT_TOL = 1e-9


def _ids(n, seed=0):
    return torch.randint(0, 300, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=["fit", "constant"])
def converted(request, tmp_path_factory):
    """A tiny Llama (float64) converted to a decoupled-RoPE MLA, with a fitted latent norm or without one."""
    root = tmp_path_factory.mktemp(f"mla-{request.param}")
    make_checkpoint("llama", root / "src", dtype=torch.float64)
    model, _ = load_checkpoint(root / "src")
    model = hf.to_attnlab(model.to(torch.float64))
    calibration = _ids(64, seed=1)
    hf.convert_model(model, "mla", latent_dim=LATENT, rope_dim=ROPE, calibration_ids=calibration,
                     pair_selection="frequency")
    if request.param == "fit":
        hf.add_latent_norms(model, calibration)
    return request.param, model, root


def _export(model, root, storage):
    for m in attnlab_modules(model):
        m.kv_dtype = storage
    name = "ds-" + str(storage).replace("/", "_").replace("+", "-")
    folder = export_deepseek(model, root / name, force=True)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval(), folder


@pytest.mark.parametrize("storage", STORAGES)
def test_transformers_scores_what_attnlabs_loop_scores(converted, storage):
    """Windows of 80 fed in chunks of 7 (with a recent window each query reads its own newest rows plain, in both):
    the same perplexity through KVCache.from_pretrained's cache as through attnlab's."""
    _, model, root = converted
    ds, folder = _export(model, root, storage)
    assert KVCache.from_pretrained(folder, ds).kv_dtype == storage if storage else True
    ids, chunk = _ids(160), 7
    theirs = score_windows(ds, ids, 80, chunk=chunk, runner=TransformersRunner(ds, storage))
    loop = score_windows(model, ids, 80, chunk=chunk, kv_dtype=storage)
    assert (theirs.scored, theirs.windows) == (loop.scored, loop.windows) == (158, 2)
    assert abs(theirs.nll - loop.nll) <= EXPORT_TOL * abs(loop.nll)


@pytest.mark.parametrize("storage", ["int3/g8+c4+w4", "int4/g8+w4"])
def test_a_chunk_in_blocks_of_queries_scores_what_attnlabs_loop_scores(converted, storage, monkeypatch):
    """hf/attention.py reads a chunk a block of queries at a time, the last first, each block's plain rows written
    after the stored rows it reads: in blocks of 2 a chunk of 7 still scores what attnlab's loop scores."""
    from attnlab.hf import attention

    _, model, root = converted
    ds, _ = _export(model, root, storage)
    monkeypatch.setattr(attention, "BLOCK", 2 * ds.model.layers[0].self_attn.num_key_value_groups)
    ids, chunk = _ids(160), 7
    theirs = score_windows(ds, ids, 80, chunk=chunk, runner=TransformersRunner(ds, storage))
    loop = score_windows(model, ids, 80, chunk=chunk, kv_dtype=storage)
    assert (theirs.scored, theirs.windows) == (loop.scored, loop.windows) == (158, 2)
    assert abs(theirs.nll - loop.nll) <= EXPORT_TOL * abs(loop.nll)


def test_a_storage_per_layer_goes_through_the_folder_and_scores_as_attnlabs_loop(converted, tmp_path, capsys):
    """A plan's bits by layer (shrink/layer_bits.py): the folder names each layer's storage, from_pretrained's cache
    holds each, transformers scores what attnlab's loop scores with them (not what either storage alone scores), and
    the bytes are each layer's own, as `attnlab eval --engine transformers` says."""
    pytest.importorskip("typer")
    from tiny_checkpoints import TEXT

    from attnlab.cli.app import main

    _, model, root = converted
    storages = ["int3/g8+c4+s1+w4", "int2/g8+c3+s1+w4"]
    for m, k in zip(attnlab_modules(model), storages):
        m.kv_dtype = k
    try:
        folder = export_deepseek(model, root / "ds-each", force=True)
        _scores_as_the_loop(model, folder, storages)
    finally:
        hf.set_kv_dtype(model, None)  # the module fixture's model as the other tests take it
    (tmp_path / "a.txt").write_text(TEXT * 2)
    assert main(["eval", str(folder), "--engine", "transformers", "--text", str(tmp_path / "a.txt"), "--window",
                 "40", "--chunk", "8"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "kv storage: int2-int3 latent, c3-c4 key by layer" in out
    assert any(line.startswith("kv bytes per token: 48 ") for line in out)


def _scores_as_the_loop(model, folder, storages):
    from attnlab.hf.shapes import storage_bytes

    ds = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    assert KVCache.from_pretrained(folder, ds).kv_dtype == storages
    ids, chunk = _ids(160), 7
    theirs = score_windows(ds, ids, 80, chunk=chunk, runner=TransformersRunner(ds, storages))
    loop = score_windows(model, ids, 80, chunk=chunk)  # each module's own storage
    assert abs(theirs.nll - loop.nll) <= EXPORT_TOL * abs(loop.nll)
    for alone in storages:
        assert abs(score_windows(model, ids, 80, chunk=chunk, kv_dtype=alone).nll - loop.nll) > 1e3 * EXPORT_TOL * \
            abs(loop.nll)
    # a 24-value latent in groups of 8 (three float16 pairs: 12 bytes) at 3 bits (9 bytes) and 2 bits (6); a rope key
    # of 8 channels at 4 bits (4 bytes) and 3 bits (3), its float16 pairs a 64th of 16 numbers, rounded up (1 byte)
    assert storage_bytes(ds, storages) == (9 + 12 + 4 + 1) + (6 + 12 + 3 + 1)


def test_greedy_tokens_crop_and_beams(converted):
    """generate through KVCache gives attnlab's greedy tokens; a crop and a beam search run on the latent rows."""
    _, model, root = converted
    storage = "int3/g8+c4"
    ds, folder = _export(model, root, storage)
    prompt = _ids(70, seed=2)  # past one group of 64 rope-key tokens
    with torch.no_grad():
        want = model.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False)
        got = ds.generate(prompt, cache=KVCache.from_pretrained(folder), max_new_tokens=32, min_new_tokens=32,
                          do_sample=False)
        assert torch.equal(got, want)
        cache = KVCache.from_pretrained(folder)
        ds(prompt, cache=cache)
        cache.crop(-4)  # the rope key's tokens after its first group of 64 are plain: the rest as it was
        assert cache.get_seq_length() == 66
        after = ds(prompt[:, 66:], cache=cache).logits
        whole = ds(prompt, cache=KVCache.from_pretrained(folder)).logits[:, 66:]
        assert torch.allclose(after, whole, rtol=0, atol=1e-12)
        beams = ds.generate(prompt[:, :20], cache=KVCache.from_pretrained(folder), num_beams=3, max_new_tokens=8,
                            do_sample=False)
        assert beams.shape == (1, 28) and torch.equal(beams[:, :20], prompt[:, :20])


@pytest.mark.parametrize("storage, by_hand", [
    # latent of 64 in 4 bits (32 bytes) + two groups' float16 scale and minimum (8); rope key of 16 in 8 bits (16)
    # + its float16 scale and minimum (4)
    ("int4/g32+r8+w16", 32 + 8 + 16 + 4),
    (None, (64 + 16) * 4)])
def test_bytes_held_after_8192_tokens(storage, by_hand):
    """Two DeepSeek layers, a latent of 65 whose last channel (an export's constant) is not kept: every tensor the
    cache holds, walked, is cache.nbytes, within 2% of the bytes by hand times the tokens plus 16 plain rows."""
    config = DeepseekV3Config(hidden_size=64, num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=2,
                              kv_lora_rank=65, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
                              q_lora_rank=None, vocab_size=10, attnlab={"latent_channels": 64})
    cache = KVCache(config, storage)
    g = torch.Generator().manual_seed(0)
    for _ in range(8):
        for layer in range(2):
            latent, key = cache.update(torch.randn(1, 1, 1024, 65, generator=g), torch.randn(1, 1, 1024, 16, generator=g),
                                       layer)
            assert latent.shape[-1] == 65 and not latent[..., 64].any()
    gc.collect()
    walked = sum(t.untyped_storage().nbytes() for t in _tensors_reachable(cache).values())
    assert walked == cache.nbytes
    fixed = 16 * (64 + 16) * 4 if storage else 0
    assert 1.0 <= cache.nbytes / (2 * (by_hand * 8192 + fixed)) <= 1.02


def test_refusals_name_the_values():
    config = DeepseekV3Config(hidden_size=64, num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=2,
                              kv_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                              q_lora_rank=None, vocab_size=10, attnlab={"latent_channels": 30})
    with pytest.raises(ValueError, match="latent_channels must be an int in 1..24"):
        KVCache(config, None)
    config.attnlab = {"latent_channels": 24}
    with pytest.raises(ValueError, match="KVCache\\('q4_0'\\) for deepseek_v3 \\(a latent of 24"):
        KVCache(config, "q4_0")  # blocks of 32 values: a latent of 24 is not a whole number of them
    cache = KVCache(config, "int8")
    with pytest.raises(ValueError, match="made for a latent of 24"):
        cache.update(torch.zeros(1, 1, 3, 32), torch.zeros(1, 1, 3, 8), 0)


def test_cli_eval_engine_transformers_scores_a_deepseek_folder_in_its_planned_storage(converted, tmp_path, capsys):
    """`attnlab eval OUT --engine transformers` on an MLA folder: transformers loads it alone, its rows are
    TransformersRunner's over KVCache in the storage the folder names, and its bytes those of that storage."""
    pytest.importorskip("typer")
    import json

    from tiny_checkpoints import TEXT
    from transformers import AutoTokenizer

    from attnlab.cli.app import main
    from attnlab.hf.shapes import storage_bytes
    from attnlab.models.evaluate import read_text_ids

    _, model, root = converted
    _, folder = _export(model, root, "int3/g8+c4")
    (tmp_path / "a.txt").write_text(TEXT * 2)
    out = tmp_path / "rows.json"
    assert main(["eval", str(folder), "--engine", "transformers", "--text", str(tmp_path / "a.txt"), "--window",
                 "40", "--chunk", "8", "--json", str(out)]) == 0
    assert "kv storage: int3/g8+c4" in capsys.readouterr().out.splitlines()
    got = json.loads(out.read_text())
    ds = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = read_text_ids(AutoTokenizer.from_pretrained(folder), tmp_path / "a.txt", 2048)
    mine = score_windows(ds, ids, 40, chunk=8, runner=TransformersRunner(ds, "int3/g8+c4"))
    assert got["kv_dtype"] == "int3/g8+c4" and got["rows"][0]["perplexity"] == mine.perplexity
    # 2 layers of a 24-value latent in 3 bits (3 groups of 8: 9 bytes, 6 float16 numbers) and a rope key of 8 in 4
    # bits per channel over groups of 64 tokens (4 bytes, a 64th of 16 float16 numbers, rounded up to a byte)
    assert got["kv_bytes_per_token"] == storage_bytes(ds, "int3/g8+c4") == 2 * (9 + 12 + 4 + 1)
