"""Conversions: exact round trips, lossy ones exact at full rank and improving with rank, bad input."""
import copy
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnlab import GroupedQueryAttention, MultiHeadAttention, MultiHeadLatentAttention
from attnlab.convert import (absorb, gqa_to_mha, gqa_to_mla, mha_to_gqa, mha_to_mla, mla_to_mha)
from attnlab.convert.linalg import factor_tiled
from attnlab.modules.heads import tile_heads
from attnlab.study.usaaio import reduced_matrices
from conftest import F64, assert_mla_is_the_gqa, gqa_ref, mla_ref, randomize
from reference import rel_err

EXACT = 1e-10


def _gqa(H=6, G=2, bias=True, grouping="strided", dim=12, context_dim=None, d=None, dv=None):
    return randomize(GroupedQueryAttention(dim, H, G, head_dim=d, v_head_dim=dv, context_dim=context_dim,
                                           bias=bias, grouping=grouping, dtype=F64))


def _inputs(m, B=2, L=5, S=7):
    x = torch.randn(B, L, m.dim, dtype=F64)
    y = torch.randn(B, S, m.context_dim, dtype=F64)
    return x, y


def _same_output(a, b, tol=EXACT):
    x, y = _inputs(a)
    with torch.no_grad():
        assert rel_err(b(x, y), a(x, y)) <= tol
        if a.dim == a.context_dim:
            assert rel_err(b(x, is_causal=True), a(x, is_causal=True)) <= tol


def _unchanged(fn, m, *args, **kw):
    before = copy.deepcopy(m.state_dict())
    new, report = fn(m, *args, **kw)
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())  # input never mutated
    return new, report


SHAPES = [dict(), dict(H=6, G=3, d=3, dv=5), dict(H=4, G=1, dim=8, context_dim=10), dict(H=6, G=6)]


@pytest.mark.parametrize("grouping", ["strided", "blocked"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_gqa_to_mha_exact(shape, bias, grouping):
    g = _gqa(bias=bias, grouping=grouping, **shape)
    mha, report = _unchanged(gqa_to_mha, g)
    assert isinstance(mha, MultiHeadAttention) and report.exact
    _same_output(g, mha)
    assert report.output_error <= EXACT and max(report.matrix_errors.values()) <= EXACT
    assert report.kv_values_after == g.num_heads // g.num_kv_heads * report.kv_values_before


@pytest.mark.parametrize("method", ["select", "block-svd", None])
@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("grouping", ["strided", "blocked"])
@pytest.mark.parametrize("shape", SHAPES)
def test_gqa_to_mla_exact_and_back(shape, grouping, shared, method):
    if not shared and method == "select":
        method = "tiled-svd"  # Part 10's route, per matrix
    g = _gqa(grouping=grouping, **shape)
    mla, report = _unchanged(gqa_to_mla, g, shared=shared, method=method)
    assert report.exact and report.output_error <= EXACT
    _same_output(g, mla)
    for absorbed in (True, False):
        x, y = _inputs(g)
        assert rel_err(mla(x, y, absorbed=absorbed), g(x, y)) <= EXACT
    back, _ = mla_to_mha(mla)
    _same_output(g, back)


def test_gqa_to_mla_latent_size():
    """Shared: one latent of r = G*(d + dv) (= 2*G*d) unless the input is narrower; split: rank <= G*d each."""
    g = _gqa(H=8, G=2, dim=64, bias=False)
    mla, _ = gqa_to_mla(g)
    assert mla.latent_dim == 2 * 2 * g.head_dim
    mla, _ = gqa_to_mla(_gqa(H=6, G=6, dim=12, bias=False))  # 2*G*d = 24 > D_2 = 12
    assert mla.latent_dim == 12
    up, down = factor_tiled(g.W_K.weight.detach(), 8, 2, "strided", "block-svd")
    assert down.shape[0] == 2 * g.head_dim
    assert rel_err(up @ down, tile_heads(g.W_K.weight.detach(), 8, 2)) <= EXACT


@pytest.mark.parametrize("bias", [False, True])
def test_mla_to_mha_and_absorb_exact(bias):
    m = randomize(MultiHeadLatentAttention(12, 3, 5, head_dim=4, v_head_dim=2, context_dim=10, bias=bias,
                                           latent_bias=bias, softmax_scale=0.3, dtype=F64))
    x, y = _inputs(m)
    mha, report = _unchanged(mla_to_mha, m)
    assert report.exact and rel_err(mha(x, y), mla_ref(m, x, y)) <= EXACT
    mqa, report = _unchanged(absorb, m)
    assert report.exact and mqa.num_kv_heads == 1 and mqa.head_dim == m.latent_dim
    assert rel_err(mqa(x, y), mla_ref(m, x, y)) <= EXACT


def test_absorb_shares_the_math_of_reduced_matrices():
    m = randomize(MultiHeadLatentAttention(16, 4, 6, dtype=F64))
    mqa, _ = absorb(m)
    W_K, W_V, W_Q, W_O = reduced_matrices(m.W_DKV.weight, m.W_UK.weight, m.W_UV.weight, m.W_Q.weight,
                                          m.W_O.weight, 4)
    assert torch.equal(mqa.W_K.weight, W_K) and torch.equal(mqa.W_O.weight, W_O)
    assert rel_err(mqa.W_Q.weight, W_Q) <= 1e-14  # the same fold, scaled for the MLA's own softmax scale


@pytest.mark.parametrize("method", ["mean", "fit"])
@pytest.mark.parametrize("grouping", ["strided", "blocked"])
def test_mha_to_gqa_is_exact_when_heads_already_share(method, grouping):
    """A GQA expanded to MHA and pooled back gives the GQA's outputs (lossy methods at their exact point)."""
    g = _gqa(H=6, G=2, grouping=grouping)
    mha, _ = gqa_to_mha(g)
    back, report = _unchanged(mha_to_gqa, mha, 2, method=method, grouping=grouping)
    _same_output(g, back)
    assert report.output_error <= EXACT
    same, _ = mha_to_gqa(mha, 6, method=method)  # G = H: nothing to pool
    _same_output(mha, same)


def test_fit_beats_mean_on_output_error():
    torch.manual_seed(1)
    m = _gqa(H=8, G=8, dim=32, bias=True)
    calib = torch.randn(4, 32, 32, dtype=F64) @ torch.diag(torch.logspace(0, -2, 32, dtype=F64))
    for G in (4, 2, 1):
        _, mean = mha_to_gqa(m, G, method="mean", calibration=calib)
        _, fit = mha_to_gqa(m, G, method="fit", calibration=calib)
        assert fit.output_error < mean.output_error
        assert fit.matrix_errors["QK"] < mean.matrix_errors["QK"] and fit.matrix_errors["OV"] < mean.matrix_errors["OV"]


@pytest.mark.parametrize("joint", [True, False])
def test_mha_to_mla_full_rank_exact_and_monotone(joint):
    """The weight error of the stacked [W_K; W_V] never grows with rank (Eckart-Young), and full rank is exact.

    The attention output's error is not monotone in general (softmax is not linear: measured on this very
    module, joint rank 3 -> 4 raises it), so the monotone claim is made for the weights.
    """
    m = _gqa(H=4, G=4, dim=16, bias=True)
    x, y = _inputs(m)
    full, report = mha_to_mla(m, joint=joint)
    assert report.exact and rel_err(full(x, y), m(x, y)) <= EXACT
    stacked = torch.cat([m.W_K.weight, m.W_V.weight]).detach()

    def weight_error(mla):
        approx = torch.cat([mla.W_UK.weight @ mla.W_DKV.weight, mla.W_UV.weight @ mla.W_DKV.weight]).detach()
        return rel_err(approx, stacked)

    top = 16 if joint else 32  # rank of [W_K; W_V] is at most D_2 = 16; split, 16 for each
    errors = [weight_error(mha_to_mla(m, latent_dim=r, joint=joint)[0]) for r in range(2, top + 1, 2)]
    assert all(b <= a + 1e-12 for a, b in zip(errors, errors[1:]))
    assert errors[-1] <= EXACT


def test_mha_to_mla_energy_picks_the_smallest_rank():
    m = _gqa(H=4, G=4, dim=16, bias=False)
    mla, report = mha_to_mla(m, energy=0.9)
    assert report.energy_kept >= 0.9
    _, smaller = mha_to_mla(m, latent_dim=mla.latent_dim - 1)
    assert smaller.energy_kept < 0.9


def test_activation_aware_beats_weight_svd_at_equal_rank():
    torch.manual_seed(2)
    m = _gqa(H=4, G=4, dim=32, bias=False)
    mix = torch.diag(torch.logspace(0, -3, 32, dtype=F64))
    calib = torch.randn(8, 32, 32, dtype=F64) @ mix
    probe = torch.randn(8, 32, 32, dtype=F64) @ mix  # held out, same distribution
    for r in (8, 16, 24):
        plain, _ = mha_to_mla(m, latent_dim=r)
        aware, _ = mha_to_mla(m, latent_dim=r, calibration=calib)
        with torch.no_grad():
            assert rel_err(aware(probe), m(probe)) < rel_err(plain(probe), m(probe))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(G=st.sampled_from([1, 2, 3, 6]), d=st.integers(1, 4), dv=st.integers(1, 4), dim=st.integers(2, 20),
       context_dim=st.integers(2, 20), grouping=st.sampled_from(["strided", "blocked"]), bias=st.booleans(),
       seed=st.integers(0, 2 ** 16))
def test_exact_conversions_property(G, d, dv, dim, context_dim, grouping, bias, seed):
    torch.manual_seed(seed)
    g = randomize(GroupedQueryAttention(dim, 6, G, head_dim=d, v_head_dim=dv, context_dim=context_dim, bias=bias,
                                        grouping=grouping, dtype=F64))
    x, y = torch.randn(2, 3, dim, dtype=F64), torch.randn(2, 4, context_dim, dtype=F64)
    expected = gqa_ref(g, x, y)
    for new in (gqa_to_mha(g)[0], gqa_to_mla(g)[0], gqa_to_mla(g, shared=False)[0], mha_to_mla(g)[0]):
        assert rel_err(new(x, y), expected) <= EXACT


# -- bad input -------------------------------------------------------------------------------------
def test_bad_rank_and_energy():
    m = _gqa(H=4, G=4, dim=16, bias=False)
    with pytest.raises(ValueError, match=r"latent_dim must be positive, got 0"):
        mha_to_mla(m, latent_dim=0)
    with pytest.raises(ValueError, match=r"latent_dim for \[W_K; W_V\] \(40\) must be between 1 and 16"):
        mha_to_mla(m, latent_dim=40)
    for energy in (0.0, 1.5):
        with pytest.raises(ValueError, match=rf"energy must be in \(0, 1\], got {energy}"):
            mha_to_mla(m, energy=energy)


def test_bad_kv_heads():
    m = _gqa(H=6, G=6)
    with pytest.raises(ValueError, match=r"num_heads \(6\) must be divisible by num_kv_heads \(4\)"):
        mha_to_gqa(m, 4)
    with pytest.raises(ValueError, match=r"num_kv_heads must be positive, got 0"):
        mha_to_gqa(m, 0)
    with pytest.raises(ValueError, match=r"method must be one of \('mean', 'fit'\), got 'median'"):
        mha_to_gqa(m, 2, method="median")


def test_wrong_module_type():
    mla = MultiHeadLatentAttention(8, 2, 4)
    with pytest.raises(TypeError, match=r"gqa_to_mla takes a GroupedQueryAttention, got MultiHeadLatentAttention"):
        gqa_to_mla(mla)
    with pytest.raises(TypeError, match=r"absorb takes a MultiHeadLatentAttention, got MultiHeadAttention"):
        absorb(MultiHeadAttention(8, 2))


def test_nonlinear_mla_cannot_expand():
    with pytest.raises(ValueError, match=r"this one has latent_norm, rope_dim > 0"):
        mla_to_mha(MultiHeadLatentAttention(8, 2, 4, latent_norm=True, rope_dim=2))


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_gqa_to_mla_rotates_after_the_up_projection(interleaved):
    g = randomize(GroupedQueryAttention(24, 6, 2, grouping="blocked", rope_base=1000.0, rope_interleaved=interleaved,
                                        dtype=F64))
    mla, report = gqa_to_mla(g)
    assert mla.rope_after_up and report.exact and mla.latent_dim == 2 * 2 * 4
    x = torch.randn(2, 7, 24, dtype=F64)
    expected = gqa_ref(g, x, causal=True)
    assert rel_err(mla(x, is_causal=True), expected) <= EXACT
    cache = mla.init_cache(2, 7)
    steps = [mla(x[:, :3], cache=cache, is_causal=True)] + [mla(x[:, t:t + 1], cache=cache, is_causal=True)
                                                           for t in range(3, 7)]
    assert rel_err(torch.cat(steps, 1), expected) <= EXACT
    back, _ = mla_to_mha(mla)
    assert rel_err(back(x, is_causal=True), expected) <= EXACT
    with pytest.raises(ValueError, match=r"rope_after_up has no absorbed path"):
        mla(x, absorbed=True)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("grouping", ["strided", "blocked"])
def test_decoupled_rope_is_exact_where_dropped_rotations_do_not_matter(interleaved, grouping):
    """Queries with no component on the dropped (slow) pairs: dropping their rotation changes nothing."""
    from attnlab.convert import gqa_to_mla_decoupled

    H, G, d, n = 6, 2, 8, 2  # keep 2 of 4 pairs per KV head
    g = randomize(GroupedQueryAttention(48, H, G, head_dim=d, rope_base=50.0, rope_interleaved=interleaved,
                                        grouping=grouping, bias=False, dtype=F64))
    slow = torch.argsort(g.rope.inv_freq)[: d // 2 - n]  # the pairs that lose their rotation
    dims = torch.cat([2 * slow, 2 * slow + 1]) if interleaved else torch.cat([slow, slow + d // 2])
    with torch.no_grad():
        g.W_Q.weight.view(H, d, -1)[:, dims] = 0
    r = G * (d - 2 * n + d)  # the whole no-RoPE key block and the values
    mla, report = gqa_to_mla_decoupled(g, r, n)
    assert mla.rope_dim == 2 * G * n and report.kv_values_after == r + 2 * G * n
    assert_mla_is_the_gqa(mla, g, length=6, prefill=2, tol=EXACT)
    with torch.no_grad():  # and where they do matter, the same conversion is lossy
        g.W_Q.weight.view(H, d, -1)[:, dims] = torch.randn(H, len(dims), 48, dtype=F64)
    assert gqa_to_mla_decoupled(g, r, n)[1].output_error > 1e-3


def test_norm_pair_selection_finds_the_pairs_queries_use():
    """Queries live only on the slowest pairs: the 2-norm criterion keeps those (exact), frequency does not."""
    from attnlab.convert import gqa_to_mla_decoupled

    H, G, d, n = 4, 2, 8, 2
    g = randomize(GroupedQueryAttention(32, H, G, head_dim=d, rope_base=50.0, grouping="blocked", dtype=F64))
    fast = torch.argsort(g.rope.inv_freq, descending=True)[: d // 2 - n]  # zero the queries on these
    with torch.no_grad():
        g.W_Q.weight.view(H, d, -1)[:, torch.cat([fast, fast + d // 2])] = 0
    calib = torch.randn(4, 16, 32, dtype=F64)
    r = G * (d - 2 * n + d)
    by_norm, report = gqa_to_mla_decoupled(g, r, n, calibration=calib, pair_selection="norm")
    by_freq, _ = gqa_to_mla_decoupled(g, r, n, calibration=calib, pair_selection="frequency")
    x = torch.randn(2, 6, 32, dtype=F64)
    expected = gqa_ref(g, x, causal=True)
    assert rel_err(by_norm(x, is_causal=True), expected) <= EXACT
    assert rel_err(by_freq(x, is_causal=True), expected) > 1e-3
    with pytest.raises(ValueError, match=r"pair_selection='norm' needs calibration inputs"):
        gqa_to_mla_decoupled(g, r, n, pair_selection="norm")


@pytest.mark.parametrize("grouping", ["strided", "blocked"])
@pytest.mark.parametrize("selection", ["frequency", "norm"])
def test_a_rope_key_per_kv_head_is_dotted_one_part_per_query_head(grouping, selection):
    """A decoupled conversion that keeps each KV head's own pairs (by frequency or norm) gets a rope key per KV head
    (rope_kv_heads = G): its expanded path (prefill) dots each query head's no-RoPE dims and its own KV head's 2n
    rope dims, not all p = 2 G n, and gives the output of the full-width path (the same weights without
    rope_kv_heads, where the other heads' parts meet zero query rows) to float64 rounding, as does its absorbed path;
    the rows of W_Q on the other KV heads' parts get no gradient, so training cannot make them matter; a checkpoint
    keeps the layout."""
    import attnlab.modules.mla as mla_module
    from attnlab.convert import gqa_to_mla_decoupled
    from attnlab.io import load_module, save_module
    from attnlab.modules.heads import kv_head_of

    H, G, d, n = 6, 3, 8, 2
    g = randomize(GroupedQueryAttention(48, H, G, head_dim=d, rope_base=50.0, grouping=grouping, bias=False,
                                        dtype=F64))
    calib = torch.randn(2, 16, 48, dtype=F64)
    mla, _ = gqa_to_mla_decoupled(g, 20, n, calibration=calib, pair_selection=selection)
    p, w = 2 * G * n, 2 * n
    assert (mla.rope_kv_heads, mla.rope_grouping, mla.rope_dim, mla.head_dim) == (G, grouping, p, d - w)
    full = MultiHeadLatentAttention(**{k: v for k, v in mla.config().items()
                                       if k not in ("rope_kv_heads", "rope_grouping")}, dtype=F64)
    full.load_state_dict(mla.state_dict())  # the oracle: every query head dots the whole rope key
    widths, attend = [], mla_module.attend

    def watched(q, k, v, **kw):
        widths.append(q.shape[-1])
        return attend(q, k, v, **kw)

    x = torch.randn(2, 9, 48, dtype=F64)
    with torch.no_grad():
        expected = full(x, is_causal=True, absorbed=False)
        mla_module.attend = watched
        try:
            got = mla(x, is_causal=True, absorbed=False)
            wide = full(x, is_causal=True, absorbed=False)
        finally:
            mla_module.attend = attend
        assert widths == [d - w + w, d - w + p]  # the per-KV-head path, then the oracle's full width
        assert rel_err(got, expected) <= 1e-12 and torch.equal(wide, expected)
        assert rel_err(mla(x, is_causal=True, absorbed=True), expected) <= 1e-12
    mla(x, is_causal=True, absorbed=False).square().sum().backward()
    grad = mla.W_Q.weight.grad.view(H, d - w + p, -1)[:, d - w:]  # (H, p, dim): each head's rope rows
    parts = mla._by_head(grad.transpose(1, 2))  # (H, dim, G, w)
    own = kv_head_of(H, G, grouping)
    for h in range(H):
        others = [j for j in range(G) if j != int(own[h])]
        assert parts[h][:, others].abs().max() == 0 and parts[h][:, int(own[h])].abs().max() > 0
    with tempfile.TemporaryDirectory() as tmp:
        save_module(mla, Path(tmp) / "m")
        back = load_module(Path(tmp) / "m")
    assert (back.rope_kv_heads, back.rope_grouping) == (G, grouping)
    with torch.no_grad():
        assert torch.equal(back(x, is_causal=True, absorbed=False), got)


def test_the_input_covariance_is_computed_once_per_calibration_tensor_and_again_after_an_in_place_change():
    """convert.linalg.input_covariance's memo (a planner converts every layer once per candidate from the same inputs):
    the memoised product is the float64 Y^T Y / N computed here directly; a tensor changed in place is computed again;
    and a conversion from the memo is bit for bit the one from a fresh calibration tensor of the same values."""
    from attnlab.convert.decoupled import gqa_to_mla_decoupled
    from attnlab.convert.linalg import input_covariance, whitening

    torch.manual_seed(0)
    calib = torch.randn(3, 40, 32)
    y = calib.reshape(-1, 32).to(F64)
    first = input_covariance(calib)
    assert torch.equal(first, y.T @ y / y.shape[0])
    assert input_covariance(calib) is first  # from the memo
    calib[0, 0, 0] += 1.0  # in place: its version counter moves
    y = calib.reshape(-1, 32).to(F64)
    again = input_covariance(calib)
    assert again is not first and torch.equal(again, y.T @ y / y.shape[0])
    assert torch.equal(whitening(calib), whitening(calib.clone()))
    g = randomize(GroupedQueryAttention(32, 4, 2, head_dim=8, rope_base=50.0, dtype=F64))
    twice = [gqa_to_mla_decoupled(g, 10, None, rope_planes=2, calibration=calib, rorope=True, balance=True)[0]
             for _ in range(2)]
    fresh = gqa_to_mla_decoupled(g, 10, None, rope_planes=2, calibration=calib.clone(), rorope=True,
                                 balance=True)[0]
    for a, b in ((twice[0], fresh), (twice[1], fresh)):
        assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())


def test_attention_inputs_stop_at_the_last_attention_and_read_what_a_whole_forward_reads(tmp_path):
    """models.evaluate.attention_inputs(stop=True) ends the forward where the last attention module is called: each
    layer's input is the one the whole forward reads (stop=False), and the output head is never called."""
    from tiny_checkpoints import TEXT, make_checkpoint

    from attnlab import models as hf

    model, tok = make_checkpoint("llama", tmp_path / "llama", num_hidden_layers=3)
    hf.to_attnlab(model)
    ids = tok(TEXT, return_tensors="pt").input_ids
    heads = []
    hook = model.lm_head.register_forward_hook(lambda *a: heads.append(1))
    try:
        whole = hf.attention_inputs(model, ids, stop=False)
        assert len(heads) == 1
        short = hf.attention_inputs(model, ids)
        assert len(heads) == 1  # not called again
    finally:
        hook.remove()
    assert len(short) == len(whole) == 3 and all(torch.equal(a, b) for a, b in zip(short, whole))
