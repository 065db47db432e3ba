"""Layer types: a model converted in some layers only (convert_model(layers=...)), a planner that counts bytes at a
context and may keep a sliding-window model's sliding layers (shrink/plan.py layouts), and a heal that trains only
what the conversion changed. Tiny random Gemma 3 (a sliding layer, then a global one) and Llama models."""
import copy
import re

import pytest
import torch
from test_norm_families import G, HEAD, WINDOW, tiny_model

from attnlab import models as hf
from attnlab.models.convert import check_layers
from attnlab.modules.cache import window_rows
from attnlab.modules.gqa import GroupedQueryAttention
from attnlab.modules.mla import MultiHeadLatentAttention
from attnlab.shrink import parse_budget, plan
from attnlab.shrink.feasible import MIN_WHOLE_LATENT
from attnlab.shrink.feasible import feasible
from attnlab.shrink.candidate import apply
from attnlab.shrink.sizes import Layout, layers_bytes, layouts, original_bytes
from attnlab.shrink.sizes import spread_context
from reference import rel_err

IDS = torch.randint(0, 97, (1, 64), generator=torch.Generator().manual_seed(2))
CONTEXT = 128  # the tiny models' max_position_embeddings: a sliding layer holds window_rows(4, 128) = 8 of its rows


def _gemma(layers=4):
    return tiny_model("gemma3", layers=layers, dtype=torch.float32, attention_std=0.1)


def test_converting_some_layers_leaves_the_others_as_they_were_and_stays_exact():
    """The exact MLA of the global layers only (float64): the sliding layers are the very modules they were, the
    global ones MLA, and the logits the original's within 1e-10."""
    model = tiny_model("gemma3", layers=4)
    with torch.no_grad():
        want = model(IDS).logits
    before = hf.attnlab_modules(model)
    reports = hf.convert_model(model, "mla", layers=[1, 3])
    after = hf.attnlab_modules(model)
    assert [r is None for r in reports] == [True, False, True, False]
    assert after[0] is before[0] and after[2] is before[2]
    assert [type(m) for m in after] == [GroupedQueryAttention, MultiHeadLatentAttention] * 2
    with torch.no_grad():
        assert rel_err(model(IDS).logits, want) <= 1e-10


@pytest.mark.parametrize("layers, error, match", [
    ([], ValueError, "it is empty"), ([0, 0], ValueError, "an index repeats"), ([4], ValueError, "4 is not a layer"),
    ([True], ValueError, "True is not a layer"), ("01", TypeError, "collection of layer indices")])
def test_a_bad_layer_selection_is_refused_naming_it(layers, error, match):
    with pytest.raises(error, match=match):
        check_layers(layers, 4)


def test_bytes_at_a_context_count_a_sliding_layer_by_its_window():
    """The planner's arithmetic (layers_bytes over Layout.counted) against the caches a converted model allocates
    (models.kv_bytes_per_token on the meta device, fixed rows in bfloat16 as the budget counts them), with and without
    a context: at a context a sliding layer holds its window's rows, and a sequence's fixed rows (a "+c4" rope key's
    newest group of tokens, a "+w16" window: min(16, the layer's window) rows in a sliding layer) count once per layer,
    not by its window's share; and the original's bytes at the context: 2 global layers whole, 2 sliding ones holding
    8 rows of 128."""
    model = _gemma()
    full = 2 * G * HEAD * 2  # one layer's 16-bit keys and values per token
    assert original_bytes(model) == 4 * full
    assert original_bytes(model, CONTEXT) == pytest.approx(2 * full + 2 * full * window_rows(WINDOW, CONTEXT) / CONTEXT)
    every = layouts(model, 1e9, CONTEXT)[0]
    for storage in ("bf16", "int8", "int4/g32+r8", "int4/g32+c4", "int4/g32+r8+w16", "int3/g64+c4+w16"):
        student = copy.deepcopy(model)
        hf.convert_model(student, "mla", latent_dim=24, rope_dim=G * HEAD)
        hf.set_kv_dtype(student, storage)
        for context in (None, CONTEXT):
            want = hf.kv_bytes_per_token(student, torch.bfloat16, context=context)
            assert layers_bytes(24, G * HEAD, storage, every.counted(context), context) == pytest.approx(want)
        # no --context: every layer counted global, so a sliding layer's window of plain rows as 16 where its cache
        # holds 8 (a "+c4" cache keeps every token, and 16 plain rows)
        ring = 2 * (16 - WINDOW) * (24 + G * HEAD) * 2 if storage.endswith("+w16") and "+c4" not in storage else 0
        assert layers_bytes(24, G * HEAD, storage, every.counted(None), CONTEXT) == pytest.approx(
            hf.kv_bytes_per_token(student) + (hf.kv_fixed_bytes(student, torch.bfloat16) + ring) / CONTEXT)
    # a "+c4" rope key keeps every token: the sliding layers count whole
    everywhere = (None,) * len(every.windows)
    assert layers_bytes(24, G * HEAD, "int4/g32+c4", every.counted(CONTEXT), CONTEXT) == pytest.approx(
        layers_bytes(24, G * HEAD, "int4/g32+c4", everywhere, CONTEXT))
    assert layers_bytes(24, G * HEAD, "int8", every.counted(CONTEXT), CONTEXT) < layers_bytes(
        24, G * HEAD, "int8", everywhere, CONTEXT)


def test_at_a_long_context_the_plan_keeps_the_sliding_layers_and_meets_the_budget():
    """At a context the planner offers keeping the sliding layers (their cache in bf16 or int8) and converting the
    global ones, beside converting every layer. Every candidate's measured bytes at the context (a "+c4" rope key's
    newest 64 tokens counted) are within the budget; a plan that keeps them, applied to a copy, measures so too, its
    kept layers are the teacher's own weights, and the teacher comes back with its storages."""
    model = _gemma()
    budget = parse_budget("40%")
    storages = ("bf16", "int8", "int4/g32+c4", "int4/g32+r8")
    _, budget_bytes, options = feasible(model, budget, storages=storages, context=CONTEXT)
    assert {lay.layers for lay, _ in options} == {None, (1, 3)}
    result = plan(model, IDS[:, :32], budget, storages=storages, proxy_ids=IDS[:, 32:], window=16, proxy_windows=2,
                  context=CONTEXT)
    assert result.context == CONTEXT and result.budget_bytes == pytest.approx(budget_bytes)
    keeping = [c for c in result.measured if c.layers == [1, 3]]
    assert keeping and {c.kept_dtype for c in keeping} <= {"bf16", "int8"}
    assert all(c.bytes_per_token <= budget_bytes for c in result.measured)
    assert [m.kv_dtype for m in hf.attnlab_modules(model)] == [None] * 4
    student = copy.deepcopy(model)
    apply(student, keeping[0], IDS[:, :32])
    mods, originals = hf.attnlab_modules(student), hf.attnlab_modules(model)
    assert hf.kv_bytes_per_token(student, context=CONTEXT) == keeping[0].bytes_per_token <= budget_bytes
    for i in (0, 2):
        assert isinstance(mods[i], GroupedQueryAttention) and mods[i].kv_dtype == keeping[0].kept_dtype
        assert all(torch.equal(v, originals[i].state_dict()[k]) for k, v in mods[i].state_dict().items())
    assert {mods[1].kv_dtype, mods[3].kv_dtype} == {keeping[0].kv_dtype}


def test_without_a_context_or_a_global_layer_every_layer_is_converted():
    """No context: bytes are every token held, and a kept sliding layer would save nothing; a model of sliding layers
    only has nothing to keep them for; a Qwen3 (no sliding layer) plans one layout at any context."""
    model = _gemma()
    assert [lay.layers for lay in layouts(model, 1e9, None)] == [None]
    assert [lay.layers for lay in layouts(_gemma(layers=1), 1e9, CONTEXT)] == [None]
    assert [lay.layers for lay in layouts(tiny_model("qwen3", dtype=torch.float32), 1e9, CONTEXT)] == [None]
    kept = layouts(model, 1e9, CONTEXT)[1:]
    assert [(lay.layers, lay.kept_dtype) for lay in kept] == [((1, 3), "bf16"), ((1, 3), "int8"), ((1, 3), "int4/g32")]
    assert isinstance(kept[0], Layout) and kept[0].room < 1e9
    assert all(lay.room + lay.kept_bytes == pytest.approx(1e9) and lay.kept_bytes > 0 for lay in kept)


def test_the_kept_layers_take_4_bit_groups_where_the_request_names_them():
    """The kept layers' cache may be in 4-bit groups where the request names them (`--kv-dtype int4/g32`), not in the
    plain command's storages. Their bytes are counted by hand: a sliding layer holds window_rows(4, 128) = 8 rows,
    each G heads of K and of V, a head's 24 values in 4 bits (12 bytes) beside one float16 scale and minimum (its
    group of 32 covers the head), spread over the context; the room that frees goes to the global layers (as many
    values or more in every storage than with the cache in int8, more in some). A plan keeping them so, applied,
    measures its bytes as planned and quantises the kept layers' K and V in its forward."""
    from attnlab.shrink.sizes import STORAGES, kept_storages

    assert kept_storages(STORAGES) == ["bf16", "int8"]
    assert kept_storages(("int3/g256+c4+w16",)) == []
    assert kept_storages(("int4/g32",)) == ["int4/g32"]
    model = _gemma()
    rows = window_rows(WINDOW, CONTEXT)
    by_hand = 2 * rows * G * 2 * (HEAD // 2 + 4) / CONTEXT  # two sliding layers of four
    storages = ("bf16", "int8", "int4/g32", "int3/g256+c4+w16")
    budget = parse_budget("40%")
    _, budget_bytes, options = feasible(model, budget, storages=storages, context=CONTEXT)
    kept = {lay.kept_dtype: (lay, per_storage) for lay, per_storage in options if lay.layers is not None}
    assert set(kept) == {"bf16", "int8", "int4/g32"}
    four, eight = kept["int4/g32"], kept["int8"]
    assert four[0].kept_bytes == pytest.approx(by_hand) and four[0].room == pytest.approx(budget_bytes - by_hand)
    assert all(four[1][s] >= v for s, v in eight[1].items()) and any(four[1][s] > v for s, v in eight[1].items())
    result = plan(model, IDS[:, :32], budget, storages=storages, proxy_ids=IDS[:, 32:], window=16, proxy_windows=2,
                  context=CONTEXT)
    keeping = [c for c in result.measured if c.kept_dtype == "int4/g32"]
    assert keeping and all(c.bytes_per_token <= budget_bytes for c in keeping)
    student = copy.deepcopy(model)
    apply(student, keeping[0], IDS[:, :32])
    mods = hf.attnlab_modules(student)
    assert [mods[i].kv_dtype for i in (0, 2)] == ["int4/g32"] * 2
    assert hf.kv_bytes_per_token(student, context=CONTEXT) == keeping[0].bytes_per_token
    with torch.no_grad():
        stored = student(IDS).logits
        for i in (0, 2):
            mods[i].kv_dtype = None
        assert not torch.equal(stored, student(IDS).logits)


def test_a_budget_no_layout_meets_names_the_smallest():
    with pytest.raises(ValueError, match=r"KV budget of 1% .* at a context of 128 tokens.*the smallest these storages"):
        feasible(_gemma(), parse_budget("1%"), storages=("bf16", "int8"), context=CONTEXT)
    with pytest.raises(ValueError, match="context must be positive, got 0"):
        feasible(_gemma(), parse_budget("25%"), context=0)


def test_the_smallest_budget_named_at_a_context_is_met_and_counts_the_kept_sliding_layers():
    """The smallest budget the error names is one some layout meets, and one byte less is refused again: at a context
    that is the global layers converted with the sliding ones kept (their cache in bf16, its bytes named), below
    what converting every layer can reach (a "+c4" rope key keeps every token, so converted sliding layers do not
    slide). Gemma 3 270M at 32,768 tokens: 26.1% was named, while 20% plans."""
    model = _gemma()
    storages = ("bf16", "int4/g32+c4")
    with pytest.raises(ValueError, match=r"the smallest these storages .* can meet is \d+ bytes/token .*; \d+ of them "
                                         r"are the sliding layers kept, their cache in bf16") as refused:
        feasible(model, parse_budget("1%"), storages=storages, context=CONTEXT)
    n = int(re.search(r"can meet is (\d+) bytes/token", str(refused.value)).group(1))
    every = layouts(model, 1e9, CONTEXT)[0]
    spread = spread_context(model, CONTEXT)
    assert n < min(layers_bytes(MIN_WHOLE_LATENT, G * HEAD, s, every.counted(CONTEXT), spread) for s in storages)
    _, _, options = feasible(model, parse_budget(str(n + 1)), storages=storages, context=CONTEXT)
    assert [(lay.layers, lay.kept_dtype) for lay, _ in options] == [((1, 3), "bf16")]
    with pytest.raises(ValueError, match=f"can meet is {n} bytes/token"):
        feasible(model, parse_budget(str(n - 1)), storages=storages, context=CONTEXT)


def test_the_heal_trains_only_the_converted_layers():
    """A student converted in its second layer only: the heal's both phases leave the first layer bit for bit the
    teacher's, train the second, and the layer-wise phase runs for that layer alone."""
    from test_heal import _plan

    from attnlab.heal import heal_model
    from attnlab.heal.data import converted_layers

    model = tiny_model("qwen3", dtype=torch.float32, attention_std=0.3)
    student = copy.deepcopy(model)
    hf.convert_model(student, "mla", latent_dim=16, layers=[1])
    assert converted_layers(model, student) == [1]
    assert converted_layers(model, copy.deepcopy(model)) == [0, 1]  # nothing converted: every layer trains
    start = [copy.deepcopy(m.state_dict()) for m in hf.attnlab_modules(student)]
    windows = torch.randint(0, 97, (32, 16), generator=torch.Generator().manual_seed(0))
    report = heal_model(model, student, windows, windows[:8].reshape(1, -1), _plan(), keep_better=False)
    mods = hf.attnlab_modules(student)
    assert all(torch.equal(v, start[0][k]) for k, v in mods[0].state_dict().items())
    assert any(not torch.equal(v, start[1][k]) for k, v in mods[1].state_dict().items())
    assert len(report["layer_losses"]) == 1 and report["layers_trained"] == [1]


def test_a_mixed_model_saves_and_loads_as_it_was(tmp_path):
    """save_model/load_model of a model with GQA and MLA layers (each layer's record): the same logits, bit for bit,
    and each layer's storage."""
    from tiny_checkpoints import make_checkpoint

    folder = tmp_path / "llama"
    make_checkpoint("llama", folder)
    model, _, _ = hf.load_model(str(folder))
    hf.convert_model(model, "mla", latent_dim=12, rope_dim=4, layers=[0])
    hf.attnlab_modules(model)[1].kv_dtype = "int8"
    hf.save_model(model, str(folder), tmp_path / "mixed")
    back, _, _ = hf.load_model(str(tmp_path / "mixed"))
    ids = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(0))
    assert [type(m) for m in hf.attnlab_modules(back)] == [MultiHeadLatentAttention, GroupedQueryAttention]
    assert hf.attnlab_modules(back)[1].kv_dtype == "int8"
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model(ids).logits)
