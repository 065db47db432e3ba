"""shrink: the planner (within the budget, ranking as perplexity does), the budget (a fake clock), the pipeline
end to end for each format, resume after each phase, and bad input. Tiny random Llama checkpoints."""
import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tiny_checkpoints import TEXT, make_checkpoint

from attnlab import models as hf
from attnlab.cli import main
from attnlab.runtime import Budget, Stopped
from attnlab.shrink import ShrinkRequest, parse_budget, plan, shrink
from attnlab.shrink.request import check_request
from attnlab.shrink.state import run_folder
from attnlab.shrink.feasible import feasible
from attnlab.shrink.candidate import Candidate, apply, proxy_bf16, proxy_kl, rank, teacher_logits
from attnlab.shrink.sizes import bytes_per_token
from attnlab.shrink.sizes import spread_context

T = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(folder, model, tokenizer, text file): a 2-layer Llama (H=4, G=2, d=16: 64 KV values per token and layer)."""
    root = tmp_path_factory.mktemp("shrink")
    folder = root / "llama"
    make_checkpoint("llama", folder, initializer_range=0.3, max_position_embeddings=512)
    model, tok, _ = hf.load_model(str(folder))
    text = root / "train.txt"
    text.write_text(TEXT * 40)
    held = root / "held.txt"
    held.write_text(TEXT[::-1] * 8)
    return folder, model, tok, text, held


def _cli(args, capsys):
    code = main([str(a) for a in args])
    return code, capsys.readouterr()


def _one_line_error(code, out, fragment):
    lines = out.err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and fragment in lines[0], out.err


def _ids(tok, path, n=None):
    return hf.read_text_ids(tok, path, n)


def _req(folder, out, **kw):
    """A request sized for the tiny model: windows of T tokens, a few heal steps (not the time) end it."""
    return ShrinkRequest(**{**dict(source=str(folder), kv_budget="50%", out=str(out), minutes=5, seq_len=T,
                                   tokens=4 * T * 4, layer_steps=2, windows=16), **kw})


# -- the budget ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, kind, value", [("50%", "fraction", 0.5), ("0.25", "fraction", 0.25),
                                                ("6000", "bytes", 6000.0), ("1500 bytes", "bytes", 1500.0)])
def test_budget_parses(text, kind, value):
    b = parse_budget(text)
    assert (b.kind, b.value) == (kind, value)


@pytest.mark.parametrize("text, fragment", [("0%", "strictly between 0% and 100%"), ("100%", "strictly between"),
                                             ("150%", "strictly between"), ("-5", "must be a percentage"),
                                             ("half", "must be a percentage")])
def test_bad_budgets_name_the_value(text, fragment):
    with pytest.raises(ValueError, match=fragment):
        parse_budget(text)


# -- the planner ---------------------------------------------------------------------------------------------
def test_plan_meets_the_budget_and_leaves_the_model_as_it_was(tiny):
    _, model, tok, text, _ = tiny
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cal = _ids(tok, text, 256)
    result = plan(model, cal, parse_budget("50%"), window=T)
    original = bytes_per_token(64, "bf16", 2)  # 2 layers x 64 values x 2 bytes
    assert result.original_bytes_16bit == original
    assert all(c.bytes_per_token <= 0.5 * original for c in result.measured)
    assert result.best.proxy == min(c.proxy for c in result.measured)
    measured = hf.kv_bytes_per_token  # the planner's byte count is what the caches allocate
    probe = copy.deepcopy(model)
    apply(probe, result.best, cal)
    assert measured(probe) == result.best.bytes_per_token
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert {type(m).__name__ for m in hf.attnlab_modules(model)} == {"GroupedQueryAttention"}


def test_the_plan_scores_candidates_on_the_proxy_text_it_is_given(tiny):
    """With proxy_ids, every candidate's proxy is the KL on those windows (recomputed here on a copy
    converted the same way), not on the calibration text's."""
    _, model, tok, text, held = tiny
    cal, other = _ids(tok, text, 256), _ids(tok, held, 4 * T)
    result = plan(model, cal, parse_budget("50%"), window=T, proxy_ids=other, storages=("bf16",))
    windows = other[0].reshape(4, T)
    bf16 = proxy_bf16(model)  # the planner's precision on this machine
    reference = teacher_logits(model, windows, bf16)
    for cand in result.measured[:2]:
        m = copy.deepcopy(model)
        apply(m, cand, cal)
        assert proxy_kl(m, windows, reference, bf16) == pytest.approx(cand.proxy, rel=1e-6)
    in_sample = plan(model, cal, parse_budget("50%"), window=T, storages=("bf16",))
    assert in_sample.measured[0].proxy != pytest.approx(result.measured[0].proxy, rel=1e-3)


def test_the_proxy_ranks_two_clearly_different_cuts_as_held_out_perplexity_does(tiny):
    """Held out: text the (random) teacher writes itself, on which its own perplexity is low; never calibrated on."""
    from attnlab.heal.data import teacher_windows

    _, model, tok, text, _ = tiny
    cal = _ids(tok, text, 256)
    held = teacher_windows(model, tok, 8, 32, seed=123).reshape(1, -1)
    windows = cal[0, :4 * T].reshape(4, T)
    reference = teacher_logits(model, windows)
    scores = {}
    for name, cand in {"wide": Candidate(40, 16, "rorope", True, "bf16", False),
                       "narrow": Candidate(4, 2, "rorope", True, "bf16", False)}.items():
        m = copy.deepcopy(model)
        apply(m, cand, cal)
        scores[name] = (proxy_kl(m, windows, reference), hf.perplexity(m, held, window=64))
    assert scores["wide"][0] < scores["narrow"][0] and scores["wide"][1] < scores["narrow"][1]


@pytest.mark.parametrize("values, max_rope", [(191, 64), (95, 64), (287, 64), (150, 128)])
def test_gguf_splits_fit_llama_cpps_cache_blocks_within_the_values(values, max_rope):
    """For llama.cpp's q8_0 cache (blocks of 32): the rope key and the latent with its steady channel are
    multiples of 32, never more values than given; where no aligned split exists, the plain one."""
    from attnlab.shrink.sizes import splits

    for r, p in splits(values, (0.2, 0.3, 0.5), max_rope=max_rope, block=32, extra=1):
        assert p % 32 == 0 and (r + 1) % 32 == 0 and r + p <= values and p <= max_rope and r >= 8
    assert splits(31, (0.3,), max_rope=32, block=32, extra=1) == splits(31, (0.3,), max_rope=32)


def test_no_plan_meets_a_budget_below_one_rope_pair_and_a_latent(tiny):
    _, model, tok, text, _ = tiny
    with pytest.raises(ValueError, match="no plan can meet a KV budget of 20 bytes/token"):
        plan(model, _ids(tok, text, 64), parse_budget("20"), window=T)


def test_a_refusal_names_the_tokens_fixed_rows_were_spread_over_only_where_a_storage_holds_some(tiny):
    """Without --context a budget's fixed rows are spread over spread_context's tokens; a refusal says so where one
    of the storages asked for holds fixed rows ("+w16"), and not where none does (bf16, int8)."""
    _, model, _, _, _ = tiny
    spread = spread_context(model)
    with pytest.raises(ValueError, match="no plan can meet") as plain:
        feasible(model, parse_budget("20"), "attnlab", ("bf16", "int8"))
    assert "spread over" not in str(plain.value) and "bytes/token):" in str(plain.value)
    with pytest.raises(ValueError, match=rf"20 bytes/token, a sequence's fixed rows spread over {spread} tokens\)"):
        feasible(model, parse_budget("20"), "attnlab", ("int8", "int4/g32+r8+w16"))


def test_protected_rows_that_alone_exceed_the_budget_are_refused_with_the_numbers(tiny):
    """int4/g32+r8+w16 at 16 tokens (--context 16): the smallest row (a latent of 8, one rope pair) takes 4 bytes of
    4-bit latent codes and 8 of 8-bit rope codes (a part's codes padded to 8 values), and 4 float16 numbers (a scale
    and minimum for each part): 20 bytes per token and layer; its window of 16 plain rows (10 values in 16 bits) 320
    bytes a layer, 20 per token over 16 tokens: 80 in the 2 layers (31.2% of 256), 40 of them the window's, over a
    budget of 60. The error names both, before any candidate is measured (feasible)."""
    _, model, tok, text, _ = tiny
    with pytest.raises(ValueError, match=r"KV budget of 60 bytes/token \(60 bytes/token at a context of 16 tokens\).* "
                       r"can meet is 80 bytes/token \(31\.2%\), of which 40 are the rows a sequence holds unquantised "
                       r"whatever its length \(int4/g32\+r8\+w16\), spread over 16 tokens"):
        feasible(model, parse_budget("60"), "attnlab", ("int4/g32+r8+w16",), context=16)


def test_the_plan_in_bits_fits_each_few_bit_candidate_and_rotates_its_latent(tiny):
    """A few-bit row's bytes step with its groups: every candidate takes the largest latent that fits (one value
    more would not), its latent rotated; the chosen one converts to a model whose caches allocate those bytes."""
    from attnlab.shrink.sizes import layer_bytes

    _, model, tok, text, _ = tiny
    cal = _ids(tok, text, 256)
    budget = 0.25 * bytes_per_token(64, "bf16", 2)
    result = plan(model, cal, parse_budget("25%"), window=T, storages=("bf16", "int4/g32+r8", "int2/g32+r8"))
    few = [c for c in result.measured if c.kv_dtype != "bf16"]
    assert {c.kv_dtype for c in few} >= {"int4/g32+r8", "int2/g32+r8"}
    for c in few:
        assert c.rotation == "random" and c.bytes_per_token <= budget
        # the largest that fits, or all the keys and values the latent can hold (V = 64 here)
        assert c.latent_dim + c.rope_dim == 64 or 2 * layer_bytes(c.latent_dim + 1, c.rope_dim, c.kv_dtype) > budget
        assert c.latent_dim + c.rope_dim <= 64
        assert c.values > max(b.values for b in result.measured if b.kv_dtype == "bf16")  # more values, same bytes
    # with no time limit the split round tries the two best storages (by rank: a 2-bit latent's proxy counted
    # TWO_BIT_MARGIN times), not only the winner's
    first = {c.kv_dtype: rank(c) for c in sorted(result.measured, key=lambda c: -rank(c)) if c.round < 3}
    ranked = sorted(first.items(), key=lambda kv: kv[1])
    assert {c.kv_dtype for c in result.measured if c.round == 3} == {ranked[0][0], ranked[1][0]}
    probe = copy.deepcopy(model)
    apply(probe, few[0], cal)
    assert hf.kv_bytes_per_token(probe) == few[0].bytes_per_token


@pytest.mark.parametrize("budget, fits", [("35%", True), ("30%", False)])
def test_the_plan_tries_every_value_in_few_bits_where_the_budget_holds_it(tiny, budget, fits):
    """The whole key as the rope key (G d = 32) and the values as the latent (32), in 3 bits with the key per
    channel: 16 + 34 bytes a layer here (12 of latent codes, a scale and minimum for its one short group of 64
    channels; 16 of key codes and 2 of the key's meta per token), and, with no --context, the key's newest 64 tokens
    unquantised (32 values in 16 bits) spread over 512 tokens (the model's max_position_embeddings, under the default
    4,096): 42 bytes a layer, over 30% of the tiny model's 256 bytes per token and under 35%."""
    _, model, tok, text, _ = tiny
    result = plan(model, _ids(tok, text, 256), parse_budget(budget), window=T, storages=("bf16", "int3/g64+c4"))
    whole = [c for c in result.measured if (c.latent_dim, c.rope_dim, c.kv_dtype) == (32, 32, "int3/g64+c4")
             and c.round == 2]  # round 3 may measure it again with BKV the other way, where it won
    per_layer = 32 * 3 // 8 + 2 * 2 + 32 * 4 // 8 + 32 * 2 * 2 // 64 + 64 * 32 * 2 / 512
    assert result.spread == 512 == model.config.max_position_embeddings
    assert (2 * per_layer <= parse_budget(budget).bytes_for(bytes_per_token(64, "bf16", 2))) is fits
    assert len(whole) == int(fits)
    if fits:
        assert whole[0].round == 2 and whole[0].rotation == "random" and whole[0].bytes_per_token == 2 * per_layer


def test_at_a_context_a_rope_key_per_channel_pays_for_its_newest_group(tiny):
    """--context 256: the every-value row above holds its newest 64 rope keys unquantised (32 values, counted in 16
    bits: 4,096 bytes a layer and sequence), 16 bytes per token and layer at 256 tokens: 50 bytes a layer, over 35%
    of 256 (89.6), so the plan that offered it without a context (spread over 512 tokens) does not; every candidate
    fits at 256 tokens, its bytes the caches' own (kv_bytes_per_token at that context, its fixed rows in bfloat16)."""
    _, model, tok, text, _ = tiny
    budget = parse_budget("35%").bytes_for(bytes_per_token(64, "bf16", 2))
    per_layer = 32 * 3 // 8 + 2 * 2 + 32 * 4 // 8 + 32 * 2 * 2 // 64 + 64 * 32 * 2 / 256
    assert 2 * per_layer > budget
    result = plan(model, _ids(tok, text, 256), parse_budget("35%"), window=T, storages=("bf16", "int3/g64+c4"),
                  context=256)
    assert result.spread == 256
    assert not [c for c in result.measured if (c.latent_dim, c.rope_dim, c.kv_dtype) == (32, 32, "int3/g64+c4")]
    assert result.measured and all(c.bytes_per_token <= budget for c in result.measured)
    for c in result.measured:
        probe = copy.deepcopy(model)
        apply(probe, c, _ids(tok, text, 256))
        assert c.bytes_per_token == hf.kv_bytes_per_token(probe, torch.bfloat16, context=256) == \
            (hf.kv_bytes_per_token(probe) * 256 + hf.kv_fixed_bytes(probe, torch.bfloat16)) / 256


@pytest.mark.parametrize("budget, fits", [("50%", True), ("45%", False)])
def test_a_six_bit_latent_beside_an_eight_bit_key_holds_every_value_where_the_bytes_allow(tiny, budget, fits):
    """int6/g32+r8, every value: 24 bytes of 6-bit latent codes and a scale and minimum for its group of 32, 32 bytes
    of 8-bit key codes and a scale and minimum per token: 64 a layer, 128 of the tiny model's 256 (50%)."""
    _, model, tok, text, _ = tiny
    result = plan(model, _ids(tok, text, 256), parse_budget(budget), window=T, storages=("bf16", "int6/g32+r8"))
    whole = [c for c in result.measured if (c.latent_dim, c.rope_dim, c.kv_dtype) == (32, 32, "int6/g32+r8")
             and c.round == 2]  # round 3 may measure it again with BKV the other way
    per_layer = 32 * 6 // 8 + 2 * 2 + 32 + 2 * 2
    assert (2 * per_layer <= parse_budget(budget).bytes_for(bytes_per_token(64, "bf16", 2))) is fits
    assert len(whole) == int(fits)
    if fits:
        assert whole[0].bytes_per_token == 2 * per_layer


@pytest.mark.parametrize("storage, bits", [("int2/g256+c4+w16", 2), ("int2/g32+r8", 2), ("int3/g256+c4+w8", 3),
                                           ("int6/g32+r8+w16", 6), ("bf16", None), ("int8", None), ("q4_0", None),
                                           ("q8_0,q4_0", None)])
def test_latent_bits_reads_the_storages_spelling(storage, bits):
    from attnlab.shrink.sizes import latent_bits

    assert latent_bits(storage) == bits


@pytest.mark.parametrize("three_bit, chosen", [(1.1, "int3/g256+c4"), (1.3, "int2/g256+c4")])
def test_a_two_bit_latent_wins_over_three_bits_only_by_the_margin(tiny, monkeypatch, three_bit, chosen):
    """The proxy faked by storage (the 2-bit latent's 1.0 in every candidate, the 3-bit latent's `three_bit`, 16 bits'
    10): with TWO_BIT_MARGIN 1.2 the 3-bit latent is chosen at 1.1 and the 2-bit one at 1.3, and the report lists
    the chosen candidate first."""
    import importlib

    planner = importlib.import_module("attnlab.shrink.plan")
    assert importlib.import_module("attnlab.shrink.candidate").TWO_BIT_MARGIN == 1.2
    faked = {"int2/g256+c4": 1.0, "int3/g256+c4": three_bit, "bf16": 10.0}
    monkeypatch.setattr(planner, "proxy_kl", lambda m, *_: faked[hf.attnlab_modules(m)[0].kv_dtype])
    _, model, tok, text, _ = tiny
    result = plan(model, _ids(tok, text, 256), parse_budget("40%"), window=T,
                  storages=("bf16", "int2/g256+c4", "int3/g256+c4"))
    assert {c.kv_dtype for c in result.measured} == set(faked)
    assert result.best.kv_dtype == chosen
    assert result.to_dict()["candidates"][0]["label"] == result.best.label()


@pytest.mark.parametrize("margin, chosen", [("1.05", "int2/g256+c4"), ("1.3", "int3/g256+c4")])
def test_the_margin_variable_moves_the_choice_as_the_constant_does(tiny, monkeypatch, margin, chosen):
    """ATTNLAB_TWO_BIT_MARGIN in TWO_BIT_MARGIN's place: the 2-bit latent's faked 1.0 against the 3-bit one's 1.1 is
    chosen at a margin of 1.05 and loses at 1.3."""
    import importlib

    planner = importlib.import_module("attnlab.shrink.plan")
    monkeypatch.setenv("ATTNLAB_TWO_BIT_MARGIN", margin)
    faked = {"int2/g256+c4": 1.0, "int3/g256+c4": 1.1, "bf16": 10.0}
    monkeypatch.setattr(planner, "proxy_kl", lambda m, *_: faked[hf.attnlab_modules(m)[0].kv_dtype])
    _, model, tok, text, _ = tiny
    result = plan(model, _ids(tok, text, 256), parse_budget("40%"), window=T,
                  storages=("bf16", "int2/g256+c4", "int3/g256+c4"))
    assert result.best.kv_dtype == chosen


@pytest.mark.parametrize("value", ["0.9", "many", "inf", "nan"])
def test_a_bad_margin_variable_is_refused_before_any_work(monkeypatch, value):
    monkeypatch.setenv("ATTNLAB_TWO_BIT_MARGIN", value)
    with pytest.raises(ValueError, match=f"ATTNLAB_TWO_BIT_MARGIN must be a number of at least 1, got '{value}'"):
        check_request(ShrinkRequest(source="smollm2", out="x", kv_budget="25%"))


@pytest.mark.parametrize("value", ["1.5", "-0.01", "some", "nan"])
def test_a_bad_top1_alpha_variable_is_refused_before_any_work(monkeypatch, value):
    monkeypatch.setenv("ATTNLAB_TOP1_ALPHA", value)
    with pytest.raises(ValueError, match=f"ATTNLAB_TOP1_ALPHA must be a number from 0 to 1, got '{value}'"):
        check_request(ShrinkRequest(source="smollm2", out="x", kv_budget="25%"))


@pytest.mark.parametrize("value", ["2", "yes", ""])
def test_a_bad_plan_bf16_variable_is_refused_before_any_work(monkeypatch, value):
    monkeypatch.setenv("ATTNLAB_PLAN_BF16", value)
    with pytest.raises(ValueError, match=f"ATTNLAB_PLAN_BF16 must be 0 or 1, got '{value}'"):
        check_request(ShrinkRequest(source="smollm2", out="x", kv_budget="25%"))


def test_the_proxy_runs_in_bf16_only_for_a_float32_model_on_the_cpu_as_asked(tiny, monkeypatch):
    """ATTNLAB_PLAN_BF16 decides for a float32 CPU model; a bf16 model's forwards are never autocast. Scored in
    bf16, a candidate's proxy is near its float32 one (bf16's own rounding: within 10%), not equal to it."""
    _, model, tok, text, _ = tiny
    monkeypatch.setenv("ATTNLAB_PLAN_BF16", "0")
    assert not proxy_bf16(model)
    monkeypatch.setenv("ATTNLAB_PLAN_BF16", "1")
    assert proxy_bf16(model) and not proxy_bf16(copy.deepcopy(model).to(torch.bfloat16))
    cal = _ids(tok, text, 256)
    windows = cal[0, :4 * T].reshape(4, T)
    m = copy.deepcopy(model)
    apply(m, Candidate(40, 16, "rorope", True, "bf16", False), cal)
    kl32 = proxy_kl(m, windows, teacher_logits(model, windows))
    kl16 = proxy_kl(m, windows, teacher_logits(model, windows, True), True)
    assert kl16 != kl32 and kl16 == pytest.approx(kl32, rel=0.1)


@pytest.mark.parametrize("count", [None, 12])
def test_the_best_latent_on_the_other_side_of_the_margin_is_checked_with_bkv_flipped_too(tiny, monkeypatch, count):
    """The proxy faked by storage and BKV: 16 bits 10 (11 with BKV, so that round 1 leaves BKV off), the 2-bit latent
    1.0 without BKV and 0.5 with it, the 3-bit latent 1.1 and 0.7. Ranked without BKV the 3-bit latent wins (1.1
    against 1.2) and its flip gives 0.7; the 2-bit latent's flip (0.5, ranked 0.6) is measured too, one candidate
    past the count, and wins. Before, only the ranked winner's flip was measured and the 3-bit latent was chosen."""
    import importlib

    planner = importlib.import_module("attnlab.shrink.plan")
    table = {("bf16", False): 10.0, ("bf16", True): 11.0, ("int2/g256+c4", False): 1.0, ("int2/g256+c4", True): 0.5,
             ("int3/g256+c4", False): 1.1, ("int3/g256+c4", True): 0.7}
    applied = []
    real_apply = planner.apply
    monkeypatch.setattr(planner, "apply", lambda m, cand, *a, **k: (applied.append(cand), real_apply(m, cand, *a,
                                                                                                        **k))[1])
    monkeypatch.setattr(planner, "proxy_kl", lambda m, *_: table[(applied[-1].kv_dtype, applied[-1].balance)])
    _, model, tok, text, _ = tiny
    result = plan(model, _ids(tok, text, 256), parse_budget("20%"), window=T, max_candidates=count,
                  storages=("bf16", "int2/g256+c4", "int3/g256+c4"))
    assert result.best.values < 64  # the winner cuts rank (V = 64)
    assert (result.best.kv_dtype, result.best.balance, result.best.proxy) == ("int2/g256+c4", True, 0.5)
    *before, own, rival = result.measured
    assert (own.kv_dtype, own.balance, own.proxy, rival.kv_dtype, rival.balance) == \
        ("int3/g256+c4", True, 0.7, "int2/g256+c4", True)
    assert not any(c.balance for c in before if c.kv_dtype != "bf16")
    if count is not None:
        assert len(result.measured) == count + 1


def test_a_budget_below_every_storage_names_the_smallest_that_can_be_met(tiny):
    _, model, tok, text, _ = tiny
    with pytest.raises(ValueError, match=r"the smallest these storages \(bf16, int2/g32\+r8\) can meet is \d+ "
                                         r"bytes/token"):
        plan(model, _ids(tok, text, 64), parse_budget("20"), window=T, storages=("bf16", "int2/g32+r8"))


def test_the_gguf_plan_keeps_within_what_llama_cpp_can_turn(tiny):
    from attnlab.models.export.deepseek_gguf import gguf_rope_limit

    _, model, tok, text, _ = tiny
    result = plan(model, _ids(tok, text, 256), parse_budget("50%"), fmt="gguf", window=T)
    limit = gguf_rope_limit(model)
    assert all(c.rope_select == "rorope" and c.rope_dim <= limit and c.kv_dtype == "bf16" for c in result.measured)


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """(folder, model, tokenizer): a 2-layer Llama with 1 KV head of 64 (V = 128 values per token and layer) and no
    rope scaling, so that llama.cpp can turn a rope key of a whole block of 32."""
    folder = tmp_path_factory.mktemp("wide") / "llama"
    make_checkpoint("llama", folder, rope_scaling=None, rope_theta=10000.0, hidden_size=128, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=64, max_position_embeddings=512)
    model, tok, _ = hf.load_model(str(folder))
    return folder, model, tok


@pytest.mark.parametrize("budget", ["40%", "30%"])
def test_a_gguf_plan_in_llama_cpps_cache_types_fills_whole_blocks(wide, budget):
    """For --format gguf the planner measures llama.cpp's cache types too: each such candidate's latent (with its
    steady channel) and rope key are whole blocks of 32; its bytes are llama.cpp's (34, 22 or 18 bytes a block, per
    layer) within the budget, and one block more would not fit (or would hold more than the V - 2 values a latent and a rope pair can use);
    the chosen plan converts to a model whose caches allocate those bytes."""
    from attnlab.shrink.sizes import GGUF_STORAGES, LLAMA_CPP_CACHE

    _, model, tok = wide
    cal = tok(TEXT * 10, return_tensors="pt").input_ids[:, :256]
    result = plan(model, cal, parse_budget(budget), fmt="gguf", storages=GGUF_STORAGES, window=T)
    block_bytes = {"q8_0": 34, "q5_0": 22, "q4_0": 18}
    blocks = [c for c in result.measured if c.kv_dtype in LLAMA_CPP_CACHE]
    assert {c.kv_dtype for c in blocks} == set(block_bytes)
    for c in blocks:
        n = c.values // 32
        assert (c.latent_dim + 1) % 32 == 0 and c.rope_dim % 32 == 0 and c.extra == 1 and c.latent_norm
        assert c.bytes_per_token == 2 * n * block_bytes[c.kv_dtype] <= result.budget_bytes
        per_storage = max(b.values for b in blocks if b.kv_dtype == c.kv_dtype)
        assert 2 * (per_storage // 32 + 1) * block_bytes[c.kv_dtype] > result.budget_bytes or per_storage + 32 > 126
    assert max(c.values for c in blocks) > max(c.values for c in result.measured if c.kv_dtype == "bf16")
    best = result.best
    probe = copy.deepcopy(model)
    apply(probe, best, cal)
    assert hf.kv_bytes_per_token(probe) == best.bytes_per_token


def test_a_gguf_shrink_for_a_q4_0_cache_says_how_to_run_it(wide, tiny, tmp_path):
    """shrink --format gguf --kv-dtype q4_0: planned, healed and scored through llama.cpp's q4_0 codes (its bytes
    per token), and the report (the sidecar beside the file) names the cache type and the flags that select it."""
    folder = wide[0]
    _, _, _, text, held = tiny
    out = tmp_path / "w.gguf"
    report = shrink(_req(folder, out, kv_budget="30%", fmt="gguf", storage="q4_0", text=[str(text)],
                         eval_text=[str(held)]))
    chosen = report["plan"]["chosen"]
    assert chosen["kv_dtype"] == "q4_0" and report["kv_bytes_per_token"]["shrunk"] == 2 * chosen[
        "values_per_token_per_layer"] // 32 * 18
    assert report["llama_cpp"]["cache_type_k"] == "q4_0" and report["llama_cpp"]["flash_attn"] is True
    assert "--cache-type-k q4_0 --cache-type-v q4_0 --flash-attn on" in report["llama_cpp"]["note"]
    assert json.loads((tmp_path / "w.gguf.shrink.json").read_text())["llama_cpp"] == report["llama_cpp"]


def test_a_gguf_budget_below_one_row_of_blocks_names_the_smallest(wide, tiny):
    _, model, tok = wide
    cal = tok(TEXT * 10, return_tensors="pt").input_ids[:, :256]
    with pytest.raises(ValueError, match=r"in llama.cpp's q4_0 cache, which stores rows in blocks of 32: the smallest "
                                         r"row of whole blocks \(a latent of 31 \+ the steady channel, a rope key of "
                                         r"32\) takes 72 bytes/token \(14.1%\)"):
        plan(model, cal, parse_budget("10%"), fmt="gguf", storages=("q4_0",), window=T)
    _, small, tok, text, _ = tiny  # Llama 3 rope scaling on head_dim 16: llama.cpp turns fewer than 32 rope values
    with pytest.raises(ValueError, match=r"the rope key llama.cpp can turn here is \d+ values, under one block"):
        plan(small, _ids(tok, text, 64), parse_budget("40%"), fmt="gguf", storages=("q4_0",), window=T)


def test_transformers_plans_the_original_attention_and_mlas_in_kvcache_storages(wide):
    """--format transformers: the original attention in each attnlab.hf.KVCache storage that fits (of 256 values a
    token, 512 bytes in 16 bits: q4_0 18 bytes a block of 32, 144; int3/g64 24 bytes and two float16 numbers a group
    of 64, 112; int2/g32 8 bytes and two float16 numbers a group of 32, 96), and MLAs whose latent takes attnlab's
    storages (no constant channel cached: KVCache keeps the MLA's latent); below every one, one line naming both
    smallest."""
    _, model, tok = wide
    cal = tok(TEXT * 10, return_tensors="pt").input_ids[:, :256]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    storages = ("q4_0", "int3/g64", "int2/g32")
    budget = parse_budget("30%")
    result = plan(model, cal, budget, fmt="transformers", storages=storages, window=T)
    native = {c.kv_dtype: c.bytes_per_token for c in result.measured if c.native}
    assert native == {"q4_0": 144, "int3/g64": 112, "int2/g32": 96}
    mla = [c for c in result.measured if not c.native]
    assert mla and {c.kv_dtype for c in mla} == {"int3/g64", "int2/g32"}
    assert all(c.bytes_per_token == 2 * _few_bit_row(c.latent_dim, c.rope_dim, c.kv_dtype) <= 0.3 * 512 for c in mla)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # the teacher came back as it was
    with pytest.raises(ValueError, match=r"the smallest these storages \(int3/g64, int2/g32\) can meet is .*; nor does "
                                         r"the original attention in attnlab.hf.KVCache's storages: the smallest, "
                                         r"int2/g32, takes 96 bytes/token \(18.8%\)"):
        plan(model, cal, parse_budget("3%"), fmt="transformers", storages=storages, window=T)


def _few_bit_row(latent: int, rope: int, storage: str) -> int:
    """Bytes of one [latent | rope key] row in attnlab's asymmetric groups, by hand: each part in groups of N (the
    last may be short), its codes packed 8 values in `bits` bytes (a part padded to a multiple of 8), two float16
    numbers a group."""
    bits, group = int(storage[3]), int(storage.split("/g")[1])
    return sum(-(-n // 8) * bits + 4 * -(-n // group) for n in (latent, rope))


def test_a_transformers_shrink_below_every_gqa_code_writes_a_deepseek_mla_kvcache_serves(wide, tiny, tmp_path):
    """At 15% no GQA storage fits (the smallest takes 18.8%): the plan is an MLA, written as DeepSeek-V3 whose
    config names the latent's storage; transformers alone loads it, and it generates through that KVCache."""
    from transformers import AutoModelForCausalLM

    from attnlab.hf import KVCache

    _, _, _, text, held = tiny
    out = tmp_path / "mla"
    report = shrink(_req(wide[0], out, kv_budget="15%", fmt="transformers", text=[str(text)], eval_text=[str(held)]))
    chosen = report["plan"]["chosen"]
    config = json.loads((out / "config.json").read_text())
    assert chosen["layers"] is None and config["model_type"] == "deepseek_v3"
    assert config["attnlab"]["kv_dtype"] == chosen["kv_dtype"] == report["transformers_cache"]["kv_dtype"]
    assert config["attnlab"]["latent_channels"] == chosen["latent_dim"]
    assert report["written"]["architecture"] == "deepseek_v3" and "DeepseekV3" in report["runs_in"]["how"]
    code = ("import sys; from transformers import AutoModelForCausalLM; "
            f"print(type(AutoModelForCausalLM.from_pretrained({str(out)!r})).__name__, 'attnlab' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.split() == ["DeepseekV3ForCausalLM", "False"], done.stderr[-2000:]
    model = AutoModelForCausalLM.from_pretrained(out)
    cache = KVCache.from_pretrained(out, model)
    ids = torch.arange(3, 40)[None]
    got = model.generate(ids, cache=cache, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert got.shape == (1, 45) and cache.get_seq_length() == 44
    assert sum(layer.bytes_per_token for layer in cache.layers) == report["kv_bytes_per_token"]["shrunk"]


def test_a_transformers_shrink_of_a_normed_model_writes_its_keys_whole_plan_in_its_own_class(tmp_path):
    """Gemma 3 (per-head q/k norms) at 17%, below every GQA code (the smallest takes 20.8%): the plan keeps the keys
    whole and the values in a latent; the folder is Gemma3ForCausalLM with its value bases, and the KVCache it names
    holds the report's bytes per token, the latent's width, and generates."""
    from transformers import AutoModelForCausalLM

    from attnlab.hf import KVCache

    make_checkpoint("gemma3", tmp_path / "g", initializer_range=0.3)
    (tmp_path / "t.txt").write_text(TEXT * 40)
    (tmp_path / "h.txt").write_text(TEXT[::-1] * 8)
    out = tmp_path / "o"
    report = shrink(_req(tmp_path / "g", out, kv_budget="17%", fmt="transformers", text=[str(tmp_path / "t.txt")],
                         eval_text=[str(tmp_path / "h.txt")]))
    chosen = report["plan"]["chosen"]
    assert chosen["layers"] is None and chosen["rope_dim"] == 2 * 24 and chosen["latent_dim"] < 2 * 24
    assert report["written"]["architecture"] == "gemma3_text" and "latent of rank r" in report["runs_in"]["how"]
    model = AutoModelForCausalLM.from_pretrained(out)
    cache = KVCache.from_pretrained(out, model)
    got = model.generate(torch.arange(3, 30)[None], cache=cache, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert got.shape == (1, 33) and {layer.rows.latent_dim for layer in cache.layers} == {chosen["latent_dim"]}
    assert sum(layer.bytes_per_token for layer in cache.layers) == report["kv_bytes_per_token"]["shrunk"]


@pytest.mark.parametrize("kw, message", [
    (dict(storage="quanto4"), r"--kv-dtype for --format transformers is the attnlab.hf.KVCache storage the model is "
                              r"planned and healed for: auto, q8_0, .*; got 'quanto4'$"),
    (dict(out="x.gguf"), r"--format transformers writes a folder: --out x.gguf ends in .gguf")])
def test_transformers_requests_that_cannot_be_met_are_refused_before_any_work(tiny, tmp_path, kw, message):
    req = _req(tiny[0], tmp_path / "o", fmt="transformers")
    for k, v in kw.items():
        setattr(req, k, v)
    with pytest.raises(ValueError, match=message):
        check_request(req)


def test_transformers_folder_loads_without_attnlab_and_names_its_cache(wide, tiny, tmp_path):
    """The shrink's folder is the source's class (save_pretrained): transformers alone loads it, in a process that
    never imports attnlab, and computes what attnlab computes from it; its config names the KVCache storage the plan
    chose, which KVCache.from_pretrained makes, and a model of other sizes is refused."""
    from transformers import LlamaConfig

    from attnlab.hf import KVCache

    folder = wide[0]
    _, _, _, text, held = tiny
    out = tmp_path / "tf"
    report = shrink(_req(folder, out, kv_budget="30%", fmt="transformers", storage="q4_0", text=[str(text)],
                         eval_text=[str(held)]))
    chosen = report["plan"]["chosen"]["kv_dtype"]
    assert report["runs_in"]["engine"] == "transformers" and report["transformers_cache"]["kv_dtype"] == chosen
    assert json.loads((out / "config.json").read_text())["attnlab"] == {"written_by": "attnlab", "kv_dtype": chosen}
    cache = KVCache.from_pretrained(out)
    assert cache.kv_dtype == chosen and len(cache.layers) == 2
    other = LlamaConfig(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                        num_hidden_layers=3, vocab_size=wide[2].vocab_size)
    with pytest.raises(ValueError, match=r"is for a model with num_hidden_layers 2; this model has 3"):
        KVCache.from_pretrained(out, other)
    scored = {r["kv_dtype"] for r in report["baselines"]["rows"] if r["perplexity"] is not None}
    assert scored  # the untouched model's caches at or above the bytes reached, scored beside it
    assert json.loads((tmp_path / "tf.shrink.json").read_text())["transformers_cache"] == report["transformers_cache"]
    ids = torch.arange(3, 40)[None]
    torch.save(ids, tmp_path / "ids.pt")
    code = ("import sys, torch; from transformers import AutoModelForCausalLM; "
            f"m = AutoModelForCausalLM.from_pretrained({str(out)!r}); "
            f"torch.save(m(torch.load({str(tmp_path / 'ids.pt')!r})).logits.detach(), {str(tmp_path / 'tf.pt')!r}); "
            "print(type(m).__name__, 'attnlab' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.split() == ["LlamaForCausalLM", "False"], done.stderr[-2000:]
    ours, _, _ = hf.load_model(str(out))
    with torch.no_grad():
        expected = ours(ids).logits
    got = torch.load(tmp_path / "tf.pt")
    assert (got - expected).norm() <= 1e-5 * expected.norm()  # float32, the same model by two code paths
    source, _, _ = hf.load_model(str(folder))
    moved = [n for n, p in ours.state_dict().items() if not torch.equal(p, source.state_dict()[n])]
    assert all(".attn." in n for n in moved)  # a heal moves attention weights and nothing else
    assert bool(moved) == (not report["heal"].get("kept"))  # and moves some unless the guard gave it back


# -- the pipeline ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["attnlab", "deepseek", "gguf"])
def test_shrink_end_to_end_for_each_format(tiny, tmp_path, fmt):
    folder, _, _, text, held = tiny
    out = tmp_path / ("out.gguf" if fmt == "gguf" else "out")
    report = shrink(_req(folder, out, fmt=fmt, text=[str(text)], eval_text=[str(held)]))
    assert out.exists() and not run_folder(out).exists()
    kv = report["kv_bytes_per_token"]
    assert kv["shrunk"] <= 0.5 * kv["original_16bit"] + (2 * 2 * 4 if kv["storage"] == "int8" else 0)
    assert report["held_out"]["after"]["perplexity"] > 0 and report["heal"]["steps_done"] > 0
    assert set(report["minutes"]) >= {"load", "data", "plan", "convert", "heal", "export", "total"}
    assert report["runs_in"]["engine"] == {"attnlab": "attnlab", "deepseek": "transformers", "gguf": "llama.cpp"}[fmt]
    import transformers  # what the run computed with, as the libraries themselves say
    env = report["environment"]
    assert (env["torch"], env["transformers"], env["threads"]) == (torch.__version__, transformers.__version__,
                                                                   torch.get_num_threads())
    assert (env["cores"], env["gpu"] is None) == (os.cpu_count(), not torch.cuda.is_available())
    if Path("/proc/cpuinfo").exists():  # the processor as the system names it
        assert env["cpu"] and f": {env['cpu']}\n" in Path("/proc/cpuinfo").read_text()
    against = report["baselines"]["against"]  # the tiny model's head size (16) takes the KIVI baselines only
    scored = {r["kv_dtype"]: r for r in report["baselines"]["rows"] if r["perplexity"] is not None}
    assert set(scored) <= {"kivi4", "kivi2"} and all(r["kv_bytes_per_token"] >= kv["shrunk"] for r in scored.values())
    if against is not None:
        assert against["beats"] == (report["held_out"]["after"]["perplexity"] < against["baseline_perplexity"])
    if fmt == "attnlab":
        model, _, meta = hf.load_model(str(out))
        assert meta["shrink"]["plan"]["chosen"]["label"] == report["plan"]["chosen"]["label"]
    elif fmt == "deepseek":
        assert json.loads((out / "config.json").read_text())["model_type"] == "deepseek_v3"
        assert json.loads(out.with_name("out.shrink.json").read_text())["format"] == "attnlab-shrink-report"
    else:
        from gguf import GGUFReader
        assert GGUFReader(str(out)).fields["general.architecture"].contents() == "deepseek2"


def test_no_heal_writes_the_converted_model_twice_alike_and_scores_it_against_the_baselines(tiny, tmp_path, capsys):
    """--no-heal: the teacher writes only the plan's windows, nothing is trained, the report's evaluation is the
    converted model's and the baselines are judged against it; the same command twice writes the same bytes."""
    from attnlab.shrink.pipeline import CALIBRATION_TOKENS, PROXY_TOKENS

    folder, _, _, _, _ = tiny
    outs = [tmp_path / "a", tmp_path / "b"]
    for out in outs:
        code, said = _cli(["shrink", folder, "--kv-budget", "30%", "--no-heal", "--seq-len", T, "--out", out], capsys)
        assert code == 0 and "no heal ran (--no-heal)" in said.out
    model, _, meta = hf.load_model(str(outs[0]))
    report = meta["shrink"]
    chosen = report["plan"]["chosen"]  # bits by layer measured (round 5); the model written holds what was chosen
    assert any(c["round"] == 5 and c["kv_dtypes"] for c in report["plan"]["candidates"])
    assert [m.kv_dtype for m in hf.attnlab_modules(model)] == \
        (chosen["kv_dtypes"] or [chosen["kv_dtype"]] * len(hf.attnlab_modules(model)))
    assert report["heal"]["status"] == "not run" and report["heal"]["steps_done"] == 0
    assert report["heal_plan"] is None and "heal" not in report["minutes"]
    assert report["work"]["training_windows"] == min(ShrinkRequest(source="s", kv_budget="1%", out="o").windows,
                                                     (CALIBRATION_TOKENS + PROXY_TOKENS) // T)
    before, after = report["held_out"]["before"], report["held_out"]["after"]
    assert after is None and before["perplexity"] > 0
    against = report["baselines"]["against"]  # KIVI-4 (5 bits a value) is above 30%
    assert against["perplexity"] == (before.get("texts") or [before])[0]["perplexity"]  # the run's own text
    files = [sorted((p.relative_to(o), p.read_bytes()) for p in o.rglob("*.safetensors")) for o in outs]
    assert files[0] and files[0] == files[1]


@pytest.mark.parametrize("extra", [["--tokens", "64"], ["--layer-steps", "2"], ["--keep-worse"]])
def test_no_heal_with_an_argument_of_the_heal_is_refused_in_one_line(tiny, tmp_path, capsys, extra):
    folder, _, _, text, _ = tiny
    _one_line_error(*_cli(["shrink", folder, "--out", tmp_path / "o", "--kv-budget", "50%", "--text", text,
                           "--no-heal", *extra], capsys), "--no-heal runs none")


def test_data_writing_cannot_eat_the_budget_and_a_run_that_trains_nothing_exits_2(tiny, tmp_path, monkeypatch):
    """A fake clock where each pass through the model costs 1 s: with no text, the teacher's writing stops at its
    share; with a budget too small for any training, nothing is written and the state stays for --resume."""
    folder, _, _, _, _ = tiny
    clock = [0.0]
    import attnlab.models.store as store
    real_load = store.load_model

    def load(source):
        model, tok, meta = real_load(source)
        model.model.embed_tokens.register_forward_pre_hook(lambda *_: clock.__setitem__(0, clock[0] + 1.0))
        return model, tok, meta

    monkeypatch.setattr(hf, "load_model", load)
    budget = Budget(10, clock=lambda: clock[0])  # 600 "seconds"
    out = tmp_path / "out"
    report = shrink(_req(folder, out, windows=64, tokens=None, minutes=10), budget=budget)
    batch = 8 * T  # the longest a batch of teacher text can take: T passes, plus its prefill
    assert report["minutes"]["data"] * 60 <= 0.3 * 600 + batch + 0.3 * 600 / 5 + batch
    assert report["heal"]["steps_done"] > 0
    assert clock[0] <= 600 + 2 + report["heal"]["evaluation_seconds"] + 60
    clock[0] = 0.0
    tight = Budget(0.05, clock=lambda: clock[0])  # 3 "seconds": spent before any training
    with pytest.raises((Stopped, ValueError), match="budget|nothing was trained|too few to train on"):
        shrink(_req(folder, tmp_path / "none", minutes=0.05, tokens=None), budget=tight)
    assert not (tmp_path / "none").exists()


def test_the_teacher_writes_no_more_windows_than_the_layer_wise_phase_reads():
    """Without text the teacher writes at most the windows the layer-wise phase reads (its layer_windows and the guard's
    check windows after them): a window past them only an end-to-end phase could draw, which a plain 10-minute run
    on a CPU seldom reaches, and each costs the teacher's time."""
    from attnlab.heal import guard
    from attnlab.heal.plan import HealPlan

    assert ShrinkRequest(source="s", kv_budget="25%", out="o").windows == HealPlan().layer_windows + guard.WINDOWS


def test_resume_continues_after_each_phase(tiny, tmp_path):
    folder, _, _, text, held = tiny
    out = tmp_path / "out"
    req = _req(folder, out, text=[str(text)], eval_text=[str(held)])
    phases = []

    class StopAt:
        """A display that asks the run to stop when a phase with this text begins."""

        def __init__(self, budget, word):
            self.budget, self.word = budget, word

        def phase(self, text):
            phases.append(text)
            if self.word in text:
                self.budget.request_stop()

        def count(self, *a, **k):
            pass

        def step(self, info):
            pass

    for word in ("planning", "converting", "evaluating", "writing"):
        budget = Budget(5)
        with pytest.raises(Stopped):
            shrink(req, resume=run_folder(out).exists(), budget=budget, display=StopAt(budget, word))
        state = json.loads((run_folder(out) / "state.json").read_text())
        assert not out.exists()
        done = state["done"]
        assert done == ["data", "plan", "convert", "heal"][:len(done)]
    report = shrink(req, resume=True)
    assert out.exists() and report["heal"]["steps_done"] > 0
    assert sum("reading the training text" in p for p in phases) == 1  # data was read once, then resumed


def _stopped_at_plan(folder, out, text) -> None:
    """A run of the tiny model stopped as planning begins: its run folder holds the data and state only."""
    budget = Budget(5)

    class StopAtPlan:
        def phase(self, text):
            if "planning" in text:
                budget.request_stop()

        def count(self, *a, **k):
            pass

        step = count

    with pytest.raises(Stopped):
        shrink(_req(folder, out, text=[str(text)]), budget=budget, display=StopAtPlan())


def test_resume_with_other_arguments_is_refused(tiny, tmp_path):
    folder, _, _, text, _ = tiny
    out = tmp_path / "out"
    _stopped_at_plan(folder, out, text)
    with pytest.raises(ValueError, match=r"arguments differ .*kv_budget: '50%' -> '25%'"):
        shrink(_req(folder, out, text=[str(text)], kv_budget="25%"), resume=True)


def test_force_starts_afresh_over_a_stopped_runs_state_and_nothing_else(tiny, tmp_path):
    """A stopped run's folder (state.json of a shrink run) is replaced by --force; a folder of that name holding
    anything a run does not write is refused, and kept."""
    folder, _, _, text, _ = tiny
    out = tmp_path / "out"
    _stopped_at_plan(folder, out, text)
    (run_folder(out) / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not written by attnlab"):
        shrink(_req(folder, out, text=[str(text)], kv_budget="25%"), force=True)
    assert (run_folder(out) / "notes.txt").read_text() == "mine"
    (run_folder(out) / "notes.txt").unlink()
    report = shrink(_req(folder, out, text=[str(text)], kv_budget="25%", heal=False, tokens=None,
                         layer_steps=None), force=True)
    assert report["request"]["kv_budget"] == "25%" and out.is_dir() and not run_folder(out).exists()


def test_cli_bad_input_is_one_line(tiny, tmp_path, capsys):
    folder, _, _, text, _ = tiny
    o = tmp_path / "o"
    cases = [(["--kv-budget", "0%"], "strictly between 0% and 100%"),
             (["--kv-budget", "100%"], "strictly between 0% and 100%"),
             (["--kv-budget", "20"], "no plan can meet"),
             (["--kv-budget", "50%", "--format", "gguf"], "--out must end in .gguf"),
             (["--kv-budget", "50%", "--out", "x.gguf", "--format", "gguf", "--kv-dtype", "int8"],
              "llama.cpp cache type the model is planned and healed for: auto, bf16 (llama.cpp's f16 cache), q8_0"),
             (["--kv-budget", "50%", "--kv-dtype", "q4_0"], "q4_0 is a llama.cpp cache type: with --format gguf"),
             (["--kv-budget", "50%", "--format", "deepseek", "--kv-dtype", "q8_0"], "not a DeepSeek folder's"),
             (["--kv-budget", "50%", "--latent-dim", "12"], "give --latent-dim and --rope-dim together"),
             (["--kv-budget", "50%", "--minutes", "0"], "--minutes must be a positive number"),
             (["--kv-budget", "50%", "--resume"], "no shrink run to resume")]
    for extra, fragment in cases:
        _one_line_error(*_cli(["shrink", folder, "--out", o, "--text", text, *extra], capsys), fragment)
    o.mkdir()
    _one_line_error(*_cli(["shrink", folder, "--out", o, "--kv-budget", "50%"], capsys), "exists")
    gguf_out = tmp_path / "x.gguf"
    _one_line_error(*_cli(["shrink", folder, "--out", gguf_out, "--kv-budget", "50%", "--format", "gguf",
                           "--latent-dim", "20", "--rope-dim", "44", "--text", text], capsys), "rope")


@pytest.mark.slow
def test_kill_9_mid_heal_then_resume_loses_nothing_written(tiny, tmp_path):
    """A run killed with SIGKILL while it heals leaves no output and a state that --resume completes."""
    folder, _, _, text, held = tiny
    out = tmp_path / "out"
    args = [sys.executable, "-m", "attnlab", "shrink", str(folder), "--kv-budget", "50%", "--out", str(out),
            "--text", str(text), "--eval-text", str(held), "--minutes", "3", "--seq-len", str(T), "--tokens", "64000"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    state = run_folder(out) / "state.json"
    deadline = time.time() + 240
    while time.time() < deadline:
        if state.is_file() and "convert" in json.loads(state.read_text()).get("done", []):
            time.sleep(0.3)  # the heal (1000 steps of the tiny model) has begun
            break
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not out.exists()
    done = subprocess.run(args + ["--resume"], capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr
    assert out.is_dir() and not run_folder(out).exists()


def test_convert_with_a_kv_budget_plans_within_it_and_reports_the_plan(tiny, tmp_path, capsys):
    """`attnlab convert --kv-budget`: the planner's choice is what was converted, its bytes (16-bit storage)
    are within the budget, and the report names the calibration text and the candidates."""
    folder, model, tok, text, _ = tiny
    out = tmp_path / "planned"
    code, _ = _cli(["convert", folder, "--to", "mla", "--kv-budget", "50%", "--calibration", text,
                    "--calibration-tokens", "256", "--out", out], capsys)
    assert code == 0
    conv = json.loads((out / "config.json").read_text())["conversion"]
    best = conv["plan"]["chosen"]
    assert (conv["latent_dim"], conv["rope_dim"]) == (best["latent_dim"], best["rope_dim"])
    assert best["bytes_per_token"] <= 0.5 * bytes_per_token(64, "bf16", 2) and len(conv["plan"]["candidates"]) > 1
    assert conv["calibration"] == f"256 tokens of {text}"
    loaded, _, _ = hf.load_model(str(out))
    assert hf.kv_bytes_per_token(loaded, dtype=torch.bfloat16) == best["bytes_per_token"]


def test_a_lossy_convert_without_text_calibrates_on_text_the_model_writes(tiny, tmp_path, capsys):
    """No --calibration: the cut is calibrated on the model's own seeded text (the same weights as
    convert_model given those ids), and the report says so; --no-calibration cuts on the weights alone
    (the same weights as convert_model without ids), with a warning; both flags at once are refused."""
    from attnlab.cli.convert import _self_calibration
    from safetensors.torch import load_file

    folder, model, tok, _, _ = tiny
    args = ["convert", folder, "--to", "mla", "--latent-dim", "12", "--rope-dim", "4", "--calibration-tokens", "256"]
    code, out = _cli([*args, "--seed", "3", "--out", tmp_path / "self"], capsys)
    assert code == 0
    conv = json.loads((tmp_path / "self" / "config.json").read_text())["conversion"]
    assert conv["calibration"] == "256 tokens of text the model wrote itself (seed 3)"
    ids, _ = _self_calibration(model, tok, 256, 3)
    for name, calibration in (("self", ids), ("none", None)):
        if name == "none":
            code, out = _cli([*args, "--no-calibration", "--out", tmp_path / "none"], capsys)
            assert code == 0 and "--no-calibration" in out.out
        expected = copy.deepcopy(model)
        hf.convert_model(expected, "mla", latent_dim=12, rope_dim=4, calibration_ids=calibration,
                         pair_selection="rorope-score", balance=True)
        saved = load_file(str(tmp_path / name / "attention.safetensors"))
        mine = {f"layers.{i}.{k}": v for i, m in enumerate(hf.attnlab_modules(expected))
                for k, v in m.state_dict().items()}
        assert mine.keys() == saved.keys() and all(torch.equal(saved[k], mine[k]) for k in mine)
    _one_line_error(*_cli([*args, "--no-calibration", "--calibration", folder / "config.json", "--out",
                           tmp_path / "both"], capsys), "not both")


def test_a_shrink_of_a_model_with_sliding_layers_states_its_bytes_at_a_context(tmp_path):
    """Gemma 3 (a sliding layer of window 8, a global one): the report states bytes per token at the model's
    context as well, the original's and the shrunk model's, each as kv_bytes_per_token counts them at that
    context (fixed rows in the 16 bits the budget counts), fewer than per token held (the sliding layer's cache stops
    at its window: a budget at a context plans no sink row, which would keep every token)."""
    folder = tmp_path / "gemma3"
    make_checkpoint("gemma3", folder, max_position_embeddings=256)
    text = tmp_path / "train.txt"
    text.write_text(TEXT * 40)
    out = tmp_path / "out"
    report = shrink(_req(folder, out, text=[str(text)], context=256))
    kv = report["kv_bytes_per_token"]
    storages = [kv["storage"]] if isinstance(kv["storage"], str) else kv["storage"]
    assert storages and not any("+s" in s for s in storages), storages
    at = kv["at_context"]
    model, _, _ = hf.load_model(str(out))
    teacher, _, _ = hf.load_model(str(folder))
    assert at["context"] == 256
    assert at["shrunk"] == hf.kv_bytes_per_token(model, torch.bfloat16, context=256) < kv["shrunk"]
    assert at["original_16bit"] == hf.kv_bytes_per_token(teacher, torch.bfloat16, context=256) < kv["original_16bit"]


def test_the_report_states_the_bytes_a_sequence_holds_whatever_its_length(tiny, tmp_path):
    """A rope key per channel ("+c4") keeps its newest group of 64 tokens unquantised: the report states those
    bytes beside the bytes per token, as the written model's caches allocate them (kv_fixed_bytes)."""
    folder, _, _, text, _ = tiny
    report = shrink(_req(folder, tmp_path / "out", text=[str(text)], kv_budget="40%", storage="int3/g64+c4"))
    model, _, _ = hf.load_model(str(tmp_path / "out"))
    kv = report["kv_bytes_per_token"]
    assert kv["storage"] == "int3/g64+c4" and kv["shrunk"] == hf.kv_bytes_per_token(model)
    p = report["plan"]["chosen"]["rope_dim"]
    assert kv["fixed_per_sequence"] == hf.kv_fixed_bytes(model, torch.bfloat16) == 2 * 64 * p * 2  # 2 layers, 16 bits
    planned = kv["as_planned"]  # as the budget counted them: the fixed rows over the model's 512 positions
    assert planned["context"] is None and planned["fixed_rows_over"] == 512
    assert planned["shrunk"] == kv["shrunk"] + kv["fixed_per_sequence"] / 512 <= 0.4 * kv["original_16bit"]


@pytest.mark.parametrize("keep_worse", [False, True])
def test_a_heal_judged_worse_is_given_back_unless_keep_worse(tiny, tmp_path, monkeypatch, keep_worse):
    """keep_better in a shrink: a heal judged worse (guard.worse made to say so) leaves the converted weights in the
    output and says so in the report; with keep_worse (--keep-worse) the healed ones are written."""
    from attnlab.heal import guard

    folder, _, _, text, held = tiny
    monkeypatch.setattr(guard, "worse", lambda before, after: True)
    out = tmp_path / "out"
    report = shrink(_req(folder, out, text=[str(text)], eval_text=[str(held)], keep_worse=keep_worse))
    heal = report["heal"]
    assert ("kept" in heal) == (not keep_worse) and heal["steps_done"] > 0
    held_out = report["held_out"]
    assert (held_out["after"] == held_out["before"]) == (not keep_worse)


def test_a_budget_at_a_context_is_met_there_and_the_kept_layers_are_the_teachers(tmp_path):
    """--context 256 on Gemma 3 (window 8): the budget is a share of the original's bytes at 256 tokens, the written
    model's cache holds no more there (kv_bytes_per_token at that context, from the folder), the report and the plan
    say at which context, and a layer the plan kept is the teacher's own, bit for bit; a context of 0 is refused."""
    folder = tmp_path / "gemma3"
    make_checkpoint("gemma3", folder, max_position_embeddings=256)
    text = tmp_path / "train.txt"
    text.write_text(TEXT * 40)
    out = tmp_path / "out"
    report = shrink(_req(folder, out, text=[str(text)], kv_budget="35%", context=256))
    at = report["kv_bytes_per_token"]["at_context"]
    model, _, _ = hf.load_model(str(out))
    teacher, _, _ = hf.load_model(str(folder))
    assert at["context"] == report["plan"]["context"] == 256
    assert at["shrunk"] == hf.kv_bytes_per_token(model, context=256) <= 0.35 * at["original_16bit"]
    for row in report["baselines"]["rows"]:  # the original's cache quantized, counted at the same context
        assert row["kv_bytes_per_token"] == hf.kv_bytes_per_token(teacher, kv_dtype=row["kv_dtype"], context=256)
    kept = [i for i in range(2) if i not in (report["plan"]["chosen"]["layers"] or range(2))]
    for i in kept:
        mine, theirs = hf.attnlab_modules(model)[i].state_dict(), hf.attnlab_modules(teacher)[i].state_dict()
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    with pytest.raises(ValueError, match="--context must be a positive number of tokens, got 0"):
        check_request(_req(folder, tmp_path / "o2", context=0))


def test_a_plan_that_keeps_every_value_heals_end_to_end_first_with_a_probe(tiny):
    """The heal plan of a student whose layers hold every value (the whole key as the rope key, the values as the
    latent: only codes differ) starts end to end with a probe (heal_plan.PROBE_SHARE) and sizes a layer-wise phase for
    the rest of the time, in case the probe finds the end-to-end phase harmful; one cut to low rank has no probe and
    its layer-wise phase first (heal_plan.LAYER_SHARE), each layer fitted on the student's own inputs
    (heal_plan.LOW_RANK_INPUTS), and its end-to-end phase after it at heal_plan.AFTER_LAYERS_LR; the one that keeps
    every value fits its layers on the teacher's, as measured there, and heals end to end at EVERY_VALUE_LR."""
    import copy

    from attnlab.heal.plan import EVERY_VALUE_LR, HealPlan
    from attnlab.shrink.heal_plan import AFTER_LAYERS_LR, FEW_STEPS_LR, PROBE_SHARE, heal_plan

    _, teacher, tok, text, _ = tiny
    train = _ids(tok, text, 4 * T).reshape(4, T)
    req = ShrinkRequest(source="x", kv_budget="25%", out="o", seq_len=T)
    every, cut = copy.deepcopy(teacher), copy.deepcopy(teacher)
    hf.convert_model(every, "mla", latent_dim=32, rope_dim=32, pair_selection="rorope")  # 64 = G d + G d: all
    hf.convert_model(cut, "mla", latent_dim=12, rope_dim=4)
    codes, low_rank = heal_plan(req, teacher, every, train, 600.0), heal_plan(req, teacher, cut, train, 600.0)
    assert codes.probe == PROBE_SHARE and codes.layer_steps >= 5
    assert low_rank.probe == 0 and low_rank.layer_steps >= 5
    assert (codes.layer_inputs, low_rank.layer_inputs) == ("teacher", "student")
    assert (codes.lr, low_rank.lr) == (EVERY_VALUE_LR, AFTER_LAYERS_LR) and AFTER_LAYERS_LR < HealPlan().lr
    pinned = heal_plan(ShrinkRequest(source="x", kv_budget="25%", out="o", seq_len=T, layer_steps=3), teacher, cut,
                       train, 600.0)
    assert (pinned.layer_steps, pinned.layer_inputs, pinned.lr) == (3, "student", AFTER_LAYERS_LR)
    for p in (codes, low_rank):  # fewer than 50 steps a layer: batches of 4 at the rate measured for them
        assert p.layer_batch == 8 or p.layer_lr == FEW_STEPS_LR


@pytest.mark.parametrize("native", [False, True])
def test_a_cpu_heal_plan_runs_in_bf16_where_the_time_binds_and_the_cpu_multiplies_it_natively(tiny, monkeypatch,
                                                                                             native):
    """heal_plan sets HealPlan.bf16 for a CPU heal of a plan that cuts rank where runtime.environment.cpu_bf16 says the
    CPU multiplies bf16 natively and the time binds the layer-wise phase (its few-steps schedule, batches of 4 at
    FEW_STEPS_LR), and then times its layer step under that autocast: the step's projections return bf16, seen by a
    hook on the copy it times (deep copies keep forward hooks). Where the whole schedule fits (batches of 8) the heal
    is float32; ATTNLAB_CPU_BF16=1 asks for bf16 there too, =0 never; with CPU_BF16 off (the default, fitted on the
    development texts) only where asked; a plan that keeps every value heals in float32 whatever is asked."""
    import copy
    import importlib

    from attnlab.heal.plan import HealPlan
    from attnlab.shrink import heal_plan as hp

    environment = importlib.import_module("attnlab.runtime.environment")  # the package re-exports the function

    _, teacher, tok, text, _ = tiny
    train = _ids(tok, text, 4 * T).reshape(4, T)
    cut = copy.deepcopy(teacher)
    hf.convert_model(cut, "mla", latent_dim=12, rope_dim=4)
    monkeypatch.setattr(environment, "cpu_bf16", lambda cpuinfo=None: native)
    monkeypatch.delenv(hp.BF16_VARIABLE, raising=False)
    seen = set()
    linear = next(m for m in hf.attnlab_modules(cut)[0].modules() if isinstance(m, torch.nn.Linear))
    linear.register_forward_hook(lambda m, i, out: seen.add(out.dtype))
    req = ShrinkRequest(source="x", kv_budget="25%", out="o", seq_len=T)

    def planned(seconds, model=cut):
        seen.clear()
        return hp.heal_plan(req, teacher, model, train, seconds)

    roomy, tight = planned(300.0), planned(1e-3)  # the tiny model: 100 steps of 8 fit 300 s; none fit 1 ms
    assert (roomy.layer_batch, roomy.layer_lr, tight.layer_batch, tight.layer_lr) == (8, HealPlan().layer_lr, 4,
                                                                                        hp.FEW_STEPS_LR)
    assert roomy.bf16 is False and tight.bf16 is False and seen == {torch.float32}  # CPU_BF16 off: float32
    monkeypatch.setattr(hp, "CPU_BF16", True)
    assert planned(1e-3).bf16 is native
    assert seen == ({torch.float32, torch.bfloat16} if native else {torch.float32})  # float32 timed, then bf16
    monkeypatch.setenv(hp.BF16_VARIABLE, "1")  # asked for: bf16 whatever the schedule, timed so
    plan = planned(300.0)
    assert plan.bf16 is native and seen == {torch.bfloat16 if native else torch.float32}
    every = copy.deepcopy(teacher)  # every value kept (only codes differ): float32 whatever the CPU
    hf.convert_model(every, "mla", latent_dim=32, rope_dim=32, pair_selection="rorope")
    assert planned(1e-3, every).bf16 is False
    monkeypatch.setenv(hp.BF16_VARIABLE, "0")  # ATTNLAB_CPU_BF16=0: float32 on any CPU
    assert planned(1e-3).bf16 is False and seen == {torch.float32}


def test_cpu_bf16_reads_the_flags_line_of_cpuinfo():
    """runtime.environment.cpu_bf16 on cpuinfo texts written here: AVX-512 BF16 or AMX BF16 among the flags (as a
    whole word) says yes; AVX-512 alone, a flag that only starts alike, another line naming it, or no flags line says
    no."""
    from attnlab.runtime.environment import cpu_bf16

    head = "processor\t: 0\nmodel name\t: Some CPU avx512_bf16 edition\n"
    assert cpu_bf16(head + "flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n")
    assert cpu_bf16(head + "flags\t\t: fpu avx512f amx_tile amx_bf16\n")
    assert not cpu_bf16(head + "flags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_vnni\n")
    assert not cpu_bf16(head + "flags\t\t: fpu avx512_bf16x\n")
    assert not cpu_bf16(head)


@pytest.mark.parametrize("inputs", ["teacher", "student"])
def test_the_layer_wise_phase_is_sized_to_its_time_by_hand(tiny, monkeypatch, inputs):
    """heal_plan's sizing on a clock that moves one second a reading: one window of the teacher's hidden states
    costs 1 s (so the phase's windows cost layer_windows s), a step of 4 windows 1/2 s (two steps a reading) and 1.3
    times that with the optimizer. The steps a layer are what is left of LAYER_SHARE of the time over the steps' cost,
    computed here by hand, whichever inputs the phase reads (the stream a phase on the student's own inputs carries
    is not counted: counting it cut the plain 12.5% command's steps from 60 to 36-42 a layer and made it worse,
    docs/decisions.md)."""
    import copy
    import itertools

    from attnlab.shrink import heal_plan as hp

    _, teacher, tok, text, _ = tiny
    train = _ids(tok, text, 4 * T).reshape(4, T)
    cut = copy.deepcopy(teacher)
    hf.convert_model(cut, "mla", latent_dim=12, rope_dim=4)
    monkeypatch.setattr(hp, "LOW_RANK_INPUTS", inputs)
    ticks = itertools.count()
    monkeypatch.setattr(hp.time, "perf_counter", lambda: float(next(ticks)))
    plan = hp.heal_plan(ShrinkRequest(source="x", kv_budget="25%", out="o", seq_len=T), teacher, cut, train, 300.0)
    layers, windows = len(hf.attnlab_modules(cut)), plan.layer_windows
    left = hp.LAYER_SHARE * 300.0 - windows
    assert plan.layer_inputs == inputs and windows == 4
    assert (plan.layer_batch, plan.layer_steps) == (8, int(min(100, left / (2 * 0.5 * 1.3 * layers))))


def test_the_shrink_prints_the_verdict_on_its_end_to_end_phase_with_both_kl_figures(tiny, tmp_path, capsys):
    """A plan that cuts rank heals layer-wise, then end to end, and heal_model judges the end-to-end phase against the
    layer-wise one (heal.run._switch): `attnlab shrink` prints the verdict with the KL after each phase, the figures of
    the written report (the evaluation after the heal is kept under held_out, apart from the heal's entry)."""
    folder, _, _, text, held = tiny
    out = tmp_path / "out"
    code, printed = _cli(["shrink", folder, "--out", out, "--kv-budget", "25%", "--text", text, "--eval-text", held,
                          "--tokens", 4 * T * 4, "--layer-steps", 2, "--seq-len", T], capsys)
    assert code == 0, printed.err
    report = hf.load_model(str(out))[2]["shrink"]
    entry, heal = report["heal"]["layer_wise"], report["heal"]
    assert report["plan"]["chosen"]["latent_dim"] is not None and heal["plan"]["layer_inputs"] == "student"
    end = heal.get("end_to_end") or report["held_out"]["after"]
    line = (f"the end-to-end phase ({entry['end_to_end_steps']} steps): {entry['verdict']}, KL to the teacher "
            f"{entry['evaluation']['kl']:.4g} after the layer-wise phase, {end['kl']:.4g} after the end-to-end one")
    assert entry["end_to_end_steps"] == 4 and line in " ".join(printed.out.split())
