"""A rope key per layer (convert_model(rope_dim=[...]); issue `eighth`: what a wider rope key in the first layers
does, docs/decisions.md). Oracles: the one-size conversion at each layer's rope key, and the saved model read
back."""
import copy
import re

import pytest
import torch
from tiny_checkpoints import make_checkpoint

from attnlab import models as hf
from attnlab.models.adapters import attnlab_modules
from attnlab.models.convert import convert_model, layer_ropes


@pytest.fixture(scope="module")
def six(tmp_path_factory):
    """(model, calibration ids (1, 256)) of a 6-layer tiny Llama (2 KV heads of 16: 32 key values a layer)."""
    folder = tmp_path_factory.mktemp("ropes") / "llama"
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
    hf.save_model(mixed, hf.sources_of(model)[0], tmp_path / "out")
    back, _, _ = hf.load_model(str(tmp_path / "out"))
    assert [m.rope_dim for m in attnlab_modules(back)] == ropes
    x = ids[:, :64]
    with torch.no_grad():
        assert torch.equal(back(x).logits, mixed(x).logits)


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
