"""A wider rope key in the first layers (issue `eighth`: the planner's round 5): a model converted with a rope key
per layer, round 5's sizes by hand, and its candidate within the budget. Oracles: the one-size conversion at each
layer's rope key, the byte count of each layer's own cache (shrink/sizes.py), and the saved model read back."""
import copy
import re

import pytest
import torch
from tiny_checkpoints import make_checkpoint

from attnlab import models as hf
from attnlab.models.adapters import attnlab_modules
from attnlab.models.convert import convert_model, layer_ropes
from attnlab.shrink import parse_budget, plan
from attnlab.shrink.plan import Candidate, front_count, front_ropes
from attnlab.shrink.sizes import layer_bytes


@pytest.fixture(scope="module")
def six(tmp_path_factory):
    """(model, calibration ids (1, 256)) of a 6-layer tiny Llama (2 KV heads of 32: 64 key values a layer)."""
    folder = tmp_path_factory.mktemp("front") / "llama"
    make_checkpoint("llama", folder, initializer_range=0.3, max_position_embeddings=512, num_hidden_layers=6)
    model, _, _ = hf.load_model(str(folder))
    ids = torch.randint(0, model.config.vocab_size, (1, 256), generator=torch.Generator().manual_seed(0))
    return model, ids


@pytest.mark.parametrize("select", ["rorope", "frequency"])
def test_a_rope_key_per_layer_converts_each_layer_as_its_own_size_does(six, select):
    model, ids = six
    G = attnlab_modules(model)[0].num_kv_heads
    ropes = [8 * G, 8 * G, 4 * G, 4 * G, 4 * G, 4 * G]
    mixed = copy.deepcopy(model)
    convert_model(mixed, "mla", latent_dim=24, rope_dim=ropes, calibration_ids=ids, pair_selection=select)
    for layer, p in enumerate(ropes):
        one = copy.deepcopy(model)
        convert_model(one, "mla", latent_dim=24, rope_dim=p, calibration_ids=ids, pair_selection=select)
        a, b = attnlab_modules(mixed)[layer], attnlab_modules(one)[layer]
        assert a.rope_dim == p
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_a_mixed_rope_model_is_saved_and_read_back_with_its_sizes(six, tmp_path):
    model, ids = six
    mixed = copy.deepcopy(model)
    ropes = [16, 16, 8, 8, 8, 8]
    convert_model(mixed, "mla", latent_dim=20, rope_dim=ropes, calibration_ids=ids, pair_selection="rorope")
    hf.save_model(mixed, str(six_source(model)), tmp_path / "out")
    back, _, _ = hf.load_model(str(tmp_path / "out"))
    assert [m.rope_dim for m in attnlab_modules(back)] == ropes
    x = ids[:, :64]
    with torch.no_grad():
        assert torch.equal(back(x).logits, mixed(x).logits)


def six_source(model):
    return hf.sources_of(model)[0]


@pytest.mark.parametrize("bad, kind, fragment", [
    ([8, 8], ValueError, "rope_dim must be a non-negative whole number, or 6 of them (one per layer), got [8, 8]"),
    ([8, -2, 8, 8, 8, 8], ValueError, "got [8, -2, 8, 8, 8, 8]"),
    ("8", TypeError, "rope_dim must be a whole number or a list of one per layer, got '8'"),
])
def test_bad_rope_keys_per_layer_are_named(bad, kind, fragment):
    with pytest.raises(kind, match=re.escape(fragment)):
        layer_ropes(bad, 6)


def test_shared_rorope_score_planes_refuse_rope_keys_that_differ(six):
    model, ids = six
    with pytest.raises(ValueError, match=re.escape("one rope_dim for the converted layers, got [8, 16]")):
        convert_model(copy.deepcopy(model), "mla", latent_dim=20, rope_dim=[16, 8, 8, 8, 8, 8], calibration_ids=ids,
                      pair_selection="rorope-score")


@pytest.mark.parametrize("latent, rope, layers, max_rope, expected", [
    (176, 40, 30, 192, [80] * 5 + [40] * 25),   # SmolLM2's 12.5% winner: its first sixth at twice the rope key
    (100, 120, 30, 192, [192] * 5 + [120] * 25),  # capped at what a layer's keys hold
    (40, 14, 4, 64, [28] + [14] * 3),            # at least one front layer
    (40, 14, 1, 64, []),                         # one layer: no front apart from the rest
    (40, 64, 6, 64, []),                         # the whole key already rotates: nothing to widen
    (40, 0, 6, 64, []),                          # no rope key
])
def test_front_ropes_by_hand(latent, rope, layers, max_rope, expected):
    assert front_ropes(Candidate(latent, rope, "rorope", True, "bf16", False), layers, max_rope) == expected
    if expected:
        assert front_count(expected) == max(1, round(layers / 6))


def test_front_ropes_leave_per_layer_or_partial_or_native_winners_alone():
    for kw in (dict(latent_dims=[8, 16]), dict(layers=[0]), dict(layers=[])):
        assert front_ropes(Candidate(40, 14, "rorope", True, "bf16", False, **kw), 6, 64) == []


def test_round_5_is_measured_within_the_budget_with_the_front_widened(six):
    """plan() measures round 5 after the uniform rounds: its rope keys are front_ropes of the best uniform candidate,
    its latent the largest whose layers' bytes (each layer's own cache, sizes.layer_bytes) fit the budget, and the
    model comes back unchanged."""
    model, ids = six
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = plan(model, ids, parse_budget("25%"), storages=("bf16",), window=64, proxy_windows=2)
    fifth = [c for c in result.measured if c.round == 5]
    assert len(fifth) == 1
    c = fifth[0]
    uniform = min((u for u in result.measured if u.round in (1, 2, 3)), key=lambda u: u.proxy)
    assert c.rope_dims == front_ropes(uniform, 6, 64) and c.rope_dims[0] > c.rope_dims[-1]

    def total(r):
        return sum(layer_bytes(r, p, c.kv_dtype) for p in c.rope_dims)

    assert total(c.latent_dim) <= result.budget_bytes < total(c.latent_dim + 1)
    assert c.bytes_per_token == total(c.latent_dim) and c.proxy is not None
    assert c.to_dict()["values_each_layer"] == [c.latent_dim + p for p in c.rope_dims]
    assert "p=" + f"{c.rope_dims[0]} in layers 0-0, {c.rope_dims[-1]} after" in c.label()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
