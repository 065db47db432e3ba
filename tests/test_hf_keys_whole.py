"""A keys-whole plan (Qwen3, Gemma 3: keys whole, values through a latent of rank r) in transformers' own class.

Oracles: the keys-whole MLA itself (its GQA computes the same outputs, float64), attnlab's own loop over the MLA's
LatentCache with the same storage (transformers' forward over KVCache must score the same windows), and the folder
round trip (transformers alone loads it; KVCache.from_pretrained holds the latent, not the values).
"""
import copy

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from test_norm_families import G, HEAD, tiny_model  # noqa: E402

from attnlab import models as hf  # noqa: E402
from attnlab.convert.keys_whole import keys_whole_to_gqa, value_basis  # noqa: E402
from attnlab.convert.rotate import rotate_latent  # noqa: E402
from attnlab.hf import KVCache, TransformersRunner  # noqa: E402
from attnlab.models.evaluate import score_windows  # noqa: E402
from reference import rel_err  # noqa: E402

LATENT = 16  # of G x dv = 48 values per token: a cut


def converted(kind, dtype=torch.float64, latent=LATENT):
    """A tiny model of that kind, every layer a keys-whole MLA of `latent`, its latent rotated (as a plan's is)."""
    model = tiny_model(kind, layers=2, dtype=dtype, attention_std=0.15)
    hf.convert_model(model, "mla", latent_dim=latent, rope_dim=G * HEAD)
    for m in hf.attnlab_modules(model):
        rotate_latent(m, "random")
    return model


def _untie(m, head, seed=0, foldable=True):
    """Query head `head`'s value up-projection moved as a heal may move it: M A_g for a random M (foldable), or A_g
    plus a random matrix."""
    dv = m.v_head_dim
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        up = m.W_UV.weight.view(m.num_heads, dv, -1)
        if foldable:
            up[head] = torch.randn(dv, dv, generator=g, dtype=up.dtype) @ up[head]
        else:
            up[head] += 0.1 * torch.randn(up[head].shape, generator=g, dtype=up.dtype)


@pytest.mark.parametrize("kind", ["qwen3", "gemma3"])
def test_the_gqa_written_for_a_keys_whole_mla_computes_what_it_computes(kind):
    """keys_whole_to_gqa: the same outputs as the MLA to float64 rounding, with a query head whose values a heal moved
    folded into W_O; its values are U c for the MLA's latent c (value_basis)."""
    for m in hf.attnlab_modules(converted(kind)):
        _untie(m, 1)
        gqa = keys_whole_to_gqa(m)
        x = torch.randn(2, 9, m.dim, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
        with torch.no_grad():
            assert rel_err(gqa(x, is_causal=True), m(x, is_causal=True)) <= 1e-10
            c = m.W_DKV(x)
            assert rel_err(gqa.W_V(x), c @ value_basis(m).T) <= 1e-10


def test_values_no_kv_head_can_carry_are_refused_naming_the_head():
    """A latent wider than a head (r = 40 > dv = 24) whose query heads a heal moved apart: no GQA of the source's
    shape holds it."""
    m = hf.attnlab_modules(converted("qwen3", latent=40))[0]
    keys_whole_to_gqa(m)  # tied, as the conversion leaves them: written
    _untie(m, 1, foldable=False)
    with pytest.raises(ValueError, match=r"query head 1's values are not a function of KV head 0's .*latent 40 > "
                                         r"head size 24"):
        keys_whole_to_gqa(m)


@pytest.mark.parametrize("kind", ["qwen3", "gemma3"])
@pytest.mark.parametrize("storage, chunk", [(None, 7), ("int4/g16", 7), ("int4/g16+c4", 7), ("int3/g16+c4+w4", 7),
                                            ("int3/g16+c4+s1+w4", 7)])
def test_transformers_scores_a_keys_whole_plan_as_attnlabs_loop(kind, storage, chunk):
    """transformers' forward over KVCache(model, storage, value bases) and attnlab's loop over the MLAs' own
    LatentCache give the same perplexity, sliding layers and codes included, to float32's unit roundoff (transformers'
    RMSNorm computes in float32 in a float64 model); the codes are really read (a coded cache scores otherwise)."""
    model = converted(kind)
    ids = torch.randint(3, 97, (1, 60), generator=torch.Generator().manual_seed(1))
    bases = [value_basis(m) for m in hf.attnlab_modules(model)]
    loop = score_windows(model, ids, 30, chunk=chunk, kv_dtype=storage)
    theirs_model = hf.from_attnlab(copy.deepcopy(model))
    theirs = score_windows(theirs_model, ids, 30, chunk=chunk, runner=TransformersRunner(theirs_model, storage, bases))
    tol = torch.finfo(torch.float32).eps / 2
    assert (theirs.scored, theirs.windows) == (loop.scored, loop.windows) == (58, 2)
    assert abs(theirs.nll - loop.nll) <= tol * abs(loop.nll)
    if storage is not None:
        plain = score_windows(model, ids, 30, chunk=chunk)
        assert abs(plain.nll - loop.nll) > 100 * tol * abs(loop.nll)


def test_a_keys_whole_folder_loads_in_transformers_and_its_cache_holds_the_latent(tmp_path):
    """export_transformers writes a keys-whole Gemma 3 as Gemma3ForCausalLM with its value bases beside it:
    KVCache.from_pretrained holds [latent | keys] rows, the bytes attnlab's own cache of the plan holds (fewer than
    the values would take), and greedy decoding through it gives attnlab's own loop's tokens (int8)."""
    from transformers import AutoModelForCausalLM

    from attnlab.generation.loop import generate
    from attnlab.hf.shapes import storage_bytes
    from attnlab.models.export.native_transformers import VALUE_BASES, export_transformers

    model = converted("gemma3", dtype=torch.float32)
    out = tmp_path / "gemma-kw"
    written = export_transformers(model, out, storage="int8")
    assert written["architecture"] == "gemma3_text" and (out / VALUE_BASES).is_file()
    theirs = AutoModelForCausalLM.from_pretrained(out).eval()
    cache = KVCache.from_pretrained(out, theirs)
    prompt = torch.randint(3, 97, (1, 12), generator=torch.Generator().manual_seed(5))
    hf.set_kv_dtype(model, "int8")
    with torch.no_grad():
        want = generate(model, prompt, max_new_tokens=10)
        got = theirs.generate(prompt, cache=cache, max_new_tokens=10, min_new_tokens=10, do_sample=False)
    assert torch.equal(got, want)
    config = theirs.config
    whole = storage_bytes(config, "int8")  # the same storage holding every value
    held = storage_bytes(config, "int8", [torch.zeros(G * HEAD, LATENT)] * config.num_hidden_layers)
    assert held == sum(layer.bytes_per_token for layer in cache.layers) == hf.kv_bytes_per_token(model) < whole


def test_a_plan_that_keeps_the_sliding_layers_runs_each_layer_in_its_own_storage(tmp_path):
    """Gemma 3 with its global layer converted and its sliding one kept (a plan at a long context): the folder names
    both storages, transformers' forward over KVCache.from_pretrained scores what attnlab's loop scores with the
    converted layer's storage and the kept layer's own (float32's unit roundoff), and holds its bytes."""
    from transformers import AutoModelForCausalLM

    from attnlab.models.export.native_transformers import export_transformers

    model = tiny_model("gemma3", layers=2, dtype=torch.float64, attention_std=0.15)
    hf.convert_model(model, "mla", latent_dim=LATENT, rope_dim=G * HEAD, layers=[1])
    mods = hf.attnlab_modules(model)
    assert [type(m).__name__ for m in mods] == ["GroupedQueryAttention", "MultiHeadLatentAttention"]
    mods[0].kv_dtype, mods[1].kv_dtype = "int8", "int4/g16+c4"
    out = tmp_path / "kept"
    export_transformers(model, out, storage="int4/g16+c4", kept_dtype="int8")
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64).eval()
    cache = KVCache.from_pretrained(out, theirs)
    assert repr(cache).endswith("kv_dtype='int4/g16+c4', kept_dtype='int8', tokens=0)")
    ids = torch.randint(3, 97, (1, 60), generator=torch.Generator().manual_seed(1))
    loop = score_windows(model, ids, 30, chunk=7)
    runner = TransformersRunner(theirs, cache.kv_dtype, [None, value_basis(mods[1])], cache.kept_dtype)
    got = score_windows(theirs, ids, 30, chunk=7, runner=runner)
    assert abs(got.nll - loop.nll) <= torch.finfo(torch.float32).eps / 2 * abs(loop.nll)
    assert sum(layer.bytes_per_token for layer in runner.cache.layers) == hf.kv_bytes_per_token(model)


def test_a_keys_whole_plan_with_bits_by_layer_runs_each_layer_in_its_own_storage(tmp_path):
    """Gemma 3 keys-whole in both layers, each its own storage (shrink/layer_bits.py): the folder names both,
    transformers' forward over KVCache.from_pretrained scores what attnlab's loop scores (float32's unit roundoff,
    as above) and holds the bytes attnlab's caches hold."""
    from transformers import AutoModelForCausalLM

    from attnlab.models.export.native_transformers import export_transformers

    model = tiny_model("gemma3", layers=2, dtype=torch.float64, attention_std=0.15)
    hf.convert_model(model, "mla", latent_dim=LATENT, rope_dim=G * HEAD)
    storages = ["int4/g16+c4", "int3/g16+c3"]
    hf.set_kv_dtype(model, storages)
    out = tmp_path / "each"
    export_transformers(model, out, storage=storages)
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64).eval()
    cache = KVCache.from_pretrained(out, theirs)
    assert cache.kv_dtype == storages
    ids = torch.randint(3, 97, (1, 60), generator=torch.Generator().manual_seed(1))
    loop = score_windows(model, ids, 30, chunk=7)
    runner = TransformersRunner(theirs, storages, [value_basis(m) for m in hf.attnlab_modules(model)])
    got = score_windows(theirs, ids, 30, chunk=7, runner=runner)
    assert abs(got.nll - loop.nll) <= torch.finfo(torch.float32).eps / 2 * abs(loop.nll)
    assert sum(layer.bytes_per_token for layer in runner.cache.layers) == hf.kv_bytes_per_token(model)
