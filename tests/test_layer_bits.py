"""Bits by layer (the planner's round 5, shrink/layer_bits.py) and storages per layer wherever a storage goes.

Oracles: the storage spellings of modules/storage.py (every option must parse and hold the winner's window and
sink), the caches' own byte counts (a plan's bytes are the sum of its layers'), and the plan without the round (the
round only adds a candidate). Uniform codes' squared error falls 4x a bit, the cost model's premise, checked on
Gaussian rows through the storage's own round trip.
"""
import math

import pytest
import torch

from attnlab.modules.storage import check_kv_dtype, round_trip
from attnlab.shrink import layer_bits
from attnlab.shrink.layer_bits import KEY_BITS, Ladder, ladder


@pytest.mark.parametrize("storage, latent, keys, rest", [
    ("int3/g256+c4+s1+w8", (2, 3, 4), ("c3", "c4", "r8"), "+s1+w8"),
    ("int2/g32+r8+s1+w16", (2, 3), ("c4", "r8"), "+s1+w16"),
    ("int7/g64+c2", (6, 7), ("c2", "c3"), ""),
    ("int4/g32+c3+w4", (3, 4, 5), ("c2", "c3", "c4"), "+w4"),
])
def test_a_ladder_steps_a_bit_each_way_and_keeps_the_rest(storage, latent, keys, rest):
    steps = ladder(storage)
    assert steps == Ladder(int(storage.split("/g")[1].split("+")[0]), latent, keys, rest)
    assert storage in [steps.spell(b, k) for b, k in steps.options()]
    for spelling in [steps.spell(b, k) for b, k in steps.options()] + [steps.value_probe(), steps.key_probe()]:
        fmt = check_kv_dtype(spelling)  # every option is a storage attnlab takes, with the winner's rows plain
        assert (fmt.recent, fmt.sink) == (check_kv_dtype(storage).recent, check_kv_dtype(storage).sink)


@pytest.mark.parametrize("storage", [None, "bf16", "int8", "q4_0", "int3/g64", "int8/g32", "tq3", "kivi4+w32"])
def test_storages_the_round_does_not_step(storage):
    assert ladder(storage) is None


def test_the_modelled_cost_is_each_probe_at_its_own_bits_and_falls_4x_a_bit():
    steps = ladder("int3/g256+c4+s1+w8")
    v, k = 0.3, 0.05
    assert steps.cost(v, k, 2, "c3") == v + k
    assert steps.cost(v, k, 4, "c3") == v / 16 + k
    assert steps.cost(v, k, 2, "c4") == v + k / 4
    assert steps.cost(v, k, 2, "r8") == v + k * 4.0 ** (KEY_BITS["c3"] - KEY_BITS["r8"])


def test_uniform_codes_lose_about_4x_the_squared_error_a_bit():
    """The premise of the cost model: a latent's squared error through its storage, at b and b + 1 bits."""
    x = torch.randn(1, 4096, 256, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    err = {b: float(((round_trip(x, f"int{b}/g256", (256,)) - x) ** 2).mean()) for b in range(2, 8)}
    for b in range(2, 7):
        assert 3.0 < err[b] / err[b + 1] < 5.0, (b, err)


@pytest.mark.parametrize("env, on", [(None, True), ("1", True), ("0", False)])
def test_the_round_runs_unless_the_variable_says_0(monkeypatch, env, on):
    if env is None:
        monkeypatch.delenv(layer_bits.LAYER_BITS_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(layer_bits.LAYER_BITS_VARIABLE, env)
    assert layer_bits.planned_layer_bits() is on


def test_a_bad_variable_is_refused_naming_it(monkeypatch):
    monkeypatch.setenv(layer_bits.LAYER_BITS_VARIABLE, "yes")
    with pytest.raises(ValueError, match="ATTNLAB_LAYER_BITS must be 0 or 1, got 'yes'"):
        layer_bits.planned_layer_bits()


def test_the_label_names_the_range_or_the_one_storage():
    assert layer_bits.bits_label(["int3/g8+c4", "int2/g8+r8", "int4/g8+c3"]) == "int2-int4 latent, c3-r8 key by layer"
    assert layer_bits.bits_label(["int4/g8+c4"] * 3) == "int4/g8+c4"
    assert layer_bits.bits_label(["int3/g8+c4", "int2/g8+c4"]) == "int2-int3 latent, c4 key by layer"


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    pytest.importorskip("transformers")
    from tiny_checkpoints import make_checkpoint

    from attnlab import models as hf
    from attnlab.models.load import load_checkpoint

    root = tmp_path_factory.mktemp("bits")
    make_checkpoint("llama", root / "src", dtype=torch.float32)
    model, _ = load_checkpoint(root / "src")
    return hf.to_attnlab(model)


def _plan(model, on: bool):
    from attnlab.shrink.plan import plan
    from attnlab.shrink.sizes import parse_budget

    ids = torch.randint(0, 300, (1, 512), generator=torch.Generator().manual_seed(0))
    return plan(model, ids[:, :256], parse_budget("40%"), storages=("int3/g8+c4+s1+w4",), proxy_ids=ids[:, 256:],
                window=64, proxy_windows=2, layer_bits=on)


def test_the_round_adds_one_candidate_of_ladder_storages_within_the_bytes(tiny_llama):
    """The plan with the round measures what the plan without it measures, then one candidate whose layers each
    hold an option of the winner's ladder, its bytes the sum of its layers' caches and within the budget; the
    teacher comes back with its own storages."""
    from attnlab.models.adapters import attnlab_modules
    from attnlab.models.evaluate import kv_bytes_per_token
    from attnlab.shrink.candidate import apply, rank

    before = [m.kv_dtype for m in attnlab_modules(tiny_llama)]
    off, on = _plan(tiny_llama, False), _plan(tiny_llama, True)
    assert [(c.label(), c.proxy) for c in on.measured[:-1]] == [(c.label(), c.proxy) for c in off.measured]
    added = on.measured[-1]
    winner = min(off.measured, key=rank)
    assert added.round == 5 and added.kv_dtypes != [winner.kv_dtype] * 2
    steps = ladder(winner.kv_dtype)
    assert set(added.kv_dtypes) <= {steps.spell(b, k) for b, k in steps.options()}
    assert added.bytes_per_token <= on.budget_bytes and added.proxy is not None
    assert [m.kv_dtype for m in attnlab_modules(tiny_llama)] == before
    import copy

    student = copy.deepcopy(tiny_llama)
    apply(student, added, None)
    assert [m.kv_dtype for m in attnlab_modules(student)] == added.kv_dtypes
    each = [kv_bytes_per_token(student, kv_dtype=[k if i == j else "bf16" for j in range(2)]) -
            kv_bytes_per_token(student, kv_dtype="bf16") / 2 for i, k in enumerate(added.kv_dtypes)]
    assert math.isclose(kv_bytes_per_token(student), sum(each))


def test_a_storage_list_of_another_length_is_refused_naming_both(tiny_llama):
    from attnlab.models.evaluate import set_kv_dtype

    with pytest.raises(ValueError, match="needs 2 storages, one an attention layer, got 3"):
        set_kv_dtype(tiny_llama, ["int8"] * 3)
