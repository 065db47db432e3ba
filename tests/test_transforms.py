"""RoRoPE and BKV (attnlab.convert.transforms, used by convert.decoupled.gqa_to_mla_decoupled): exact where nothing is cut,
and at a cut they help where the mathematics says they must."""
import pytest
import torch
from conftest import assert_mla_is_the_gqa, gqa_ref, randomize

from attnlab.convert import gqa_to_mla_decoupled
from attnlab.modules.gqa import GroupedQueryAttention
from attnlab.convert.transforms import (
    captured_energy,
    frequency_mixes,
    pair_dims,
    plane_allocation,
    select_planes,
    shared_planes,
)

F64 = torch.float64
EXACT = 1e-10


def rel_err(a, b):
    return float((a - b).detach().norm() / b.detach().norm())


def _gqa(H=6, G=3, d=8, dim=48, interleaved=False, grouping="blocked"):
    return randomize(GroupedQueryAttention(dim, H, G, head_dim=d, rope_base=50.0, rope_interleaved=interleaved,
                                           grouping=grouping, bias=False, dtype=F64))


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("grouping", ["strided", "blocked"])
@pytest.mark.parametrize("balance", [False, True])
def test_rorope_and_bkv_with_nothing_cut_are_exact(interleaved, grouping, balance):
    """Every mixed plane keeps its rotation and the latent holds all values: the model is unchanged."""
    H, G, d = 6, 3, 8
    g = _gqa(H, G, d, interleaved=interleaved, grouping=grouping)
    calib = torch.randn(3, 16, 48, dtype=F64)
    for order in ("frequency", "score"):
        mla, report = gqa_to_mla_decoupled(g, G * d, d // 2, calibration=calib, rorope=True, plane_order=order,
                                           balance=balance)
        assert mla.rope_dim == G * d and report.kv_values_after == 2 * G * d
        assert_mla_is_the_gqa(mla, g, tol=EXACT)


def test_bkv_at_full_rank_is_exact_with_per_head_pairs():
    """BKV alone (no RoRoPE): queries blind to the dropped pairs and a full latent: exact."""
    H, G, d, n = 6, 2, 8, 2
    g = _gqa(H, G, d)
    slow = torch.argsort(g.rope.inv_freq)[: d // 2 - n]
    with torch.no_grad():
        g.W_Q.weight.view(H, d, -1)[:, torch.cat([slow, slow + d // 2])] = 0
    mla, _ = gqa_to_mla_decoupled(g, G * (d - 2 * n + d), n, calibration=torch.randn(2, 16, 48, dtype=F64),
                                  balance=True)
    assert_mla_is_the_gqa(mla, g, tol=EXACT)


def test_rorope_concentrates_shared_keys_into_one_rotary_head():
    """KV heads with equal keys: one mixed plane per frequency holds all key energy, so keeping those
    (rope_dim d) is exact, while per-head selection with the same rope_dim drops real rotations."""
    H, G, d = 4, 2, 8
    g = _gqa(H, G, d, dim=32)
    with torch.no_grad():
        g.W_K.weight.view(G, d, -1)[1] = g.W_K.weight.view(G, d, -1)[0]
    r = G * d  # the values; the no-rotation keys are zero after the mix
    mixed, report = gqa_to_mla_decoupled(g, r, d // (2 * G), rorope=True)
    assert mixed.rope_dim == d
    assert_mla_is_the_gqa(mixed, g, tol=EXACT)
    per_head, _ = gqa_to_mla_decoupled(g, r + G * d // 2, d // (2 * G))  # a latent big enough for every key
    x = torch.randn(2, 7, 32, dtype=F64)
    assert rel_err(per_head(x, is_causal=True), gqa_ref(g, x, causal=True)) > 1e-3


def test_rorope_keeps_at_least_the_key_energy_of_any_per_head_choice():
    """Ky Fan: per frequency, the top-m principal planes hold at least the energy of any m heads' planes."""
    torch.manual_seed(1)
    G, d, D = 3, 16, 40
    shared = torch.randn(d, D, dtype=F64)
    wk = shared + 0.3 * torch.randn(G, d, D, dtype=F64)  # correlated heads, as in trained models
    cov = (lambda y: y.T @ y / len(y))(torch.randn(200, D, dtype=F64))
    a, b = pair_dims(d, interleaved=False)
    mixes, energy = frequency_mixes(wk, a, b, cov)
    planes = wk.reshape(G, d, D)
    head_energy = torch.stack([torch.einsum("gx,xy,gy->g", planes[:, i], cov, planes[:, i])
                               + torch.einsum("gx,xy,gy->g", planes[:, i + d // 2], cov, planes[:, i + d // 2])
                               for i in range(d // 2)])  # (half, G): energy of each head's plane
    assert torch.allclose(energy.sum(1), head_energy.sum(1), rtol=1e-12)  # the mix is orthogonal
    for m in range(1, G):
        top = energy[:, :m].sum(1)
        best_heads = head_energy.sort(1, descending=True).values[:, :m].sum(1)
        assert bool((top >= best_heads * (1 - 1e-12)).all())
    inv_freq = 50.0 ** (-torch.arange(0, d, 2, dtype=F64) / d)
    chosen = select_planes(d // 2, inv_freq, energy, order="frequency")
    assert chosen[:, 1].eq(0).all()  # component 0 of every frequency first
    best_single_head = float(head_energy.max(1).values.sum() / head_energy.sum())
    assert captured_energy(energy, chosen) >= best_single_head


def test_bkv_makes_the_cut_independent_of_how_scores_split_between_queries_and_keys():
    """W_K * c with W_Q / c is the same model. With BKV the cut is the same too; without it, a large c
    hands the latent to the keys and the cut gets worse."""
    H, G, d, n, r = 6, 3, 8, 2, 20
    g = _gqa(H, G, d)
    scaled = GroupedQueryAttention(48, H, G, head_dim=d, rope_base=50.0, grouping="blocked", dtype=F64)
    scaled.load_state_dict(g.state_dict())
    with torch.no_grad():
        scaled.W_K.weight.mul_(100.0)
        scaled.W_Q.weight.div_(100.0)
    calib = torch.randn(3, 16, 48, dtype=F64)
    x = torch.randn(2, 7, 48, dtype=F64)
    assert rel_err(gqa_ref(scaled, x, causal=True), gqa_ref(g, x, causal=True)) <= EXACT
    for rorope in (False, True):
        kw = dict(calibration=calib, rorope=rorope)
        a, _ = gqa_to_mla_decoupled(g, r, n, balance=True, **kw)
        b, _ = gqa_to_mla_decoupled(scaled, r, n, balance=True, **kw)
        assert rel_err(b(x, is_causal=True), a(x, is_causal=True)) <= 1e-9
        unbalanced, _ = gqa_to_mla_decoupled(scaled, r, n, balance=False, **kw)
        expected = gqa_ref(g, x, causal=True)
        assert rel_err(b(x, is_causal=True), expected) < rel_err(unbalanced(x, is_causal=True), expected)


def test_transform_options_refuse_bad_values():
    g = _gqa()
    with pytest.raises(ValueError, match=r"plane order must be one of"):
        gqa_to_mla_decoupled(g, 8, 1, rorope=True, plane_order="random")
    with pytest.raises(ValueError, match=r"rorope chooses mixed planes by plane_order"):
        gqa_to_mla_decoupled(g, 8, 1, rorope=True, pair_selection="norm", calibration=torch.randn(8, 48, dtype=F64))
    with pytest.raises(ValueError, match=r"rope_pairs \(5\) must be below head_dim / 2 \(4\)"):
        gqa_to_mla_decoupled(g, 8, 5, rorope=True)
    with pytest.raises(ValueError, match=r"planes to keep \(13\) must be between 0 and 12"):
        select_planes(13, torch.ones(4, dtype=F64), torch.ones(4, 3, dtype=F64))


def test_whole_llama_through_convert_model_with_rorope_and_bkv_and_nothing_cut_is_exact(tmp_path):
    """The model-level path (models.convert_model, --rope-select/--balance): a float64 Llama, every mixed
    plane rotating and a latent that holds all keys and values, gives the original logits."""
    from tiny_checkpoints import make_checkpoint

    from attnlab import models as hf
    from attnlab.convert import selection_options

    model, _ = make_checkpoint("llama", tmp_path / "llama", dtype=F64)
    model = model.to(F64).eval()
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    hf.to_attnlab(model)  # the reference: attnlab's GQA (float64 RoPE angles; transformers' are float32)
    with torch.no_grad():
        expected = model(ids).logits
    first = hf.attnlab_modules(model)[0]
    G, d = first.num_kv_heads, first.head_dim
    for select in ("rorope", "rorope-score"):
        m = __import__("copy").deepcopy(model)
        hf.convert_model(m, "mla", latent_dim=2 * G * d, rope_dim=G * d, calibration_ids=ids[:1],
                         pair_selection=select, balance=True)
        assert hf.attnlab_modules(m)[0].rope_dim == G * d
        with torch.no_grad():
            assert rel_err(m(ids).logits, expected) <= EXACT, select
    with pytest.raises(ValueError, match=r"rope selection must be one of frequency, norm, rorope, rorope-score, "
                                         r"got 'fastest'"):
        selection_options("fastest")


# -- one allocation of the kept planes for a whole model ------------------------------------------------
def _allocations(half, G, count):
    """Every way to keep `count` planes: per pair i a number c_i in 0..G (brute force)."""
    import itertools
    return [c for c in itertools.product(range(G + 1), repeat=half) if sum(c) == count]


@pytest.mark.parametrize("seed", range(4))
def test_plane_allocation_is_the_best_allocation_by_brute_force(seed):
    """Greedy on the summed c-th best scores reaches the best total of any allocation (exhaustive search), and
    shared_planes keeps, in every layer, that layer's best components of each allocated pair."""
    g = torch.Generator().manual_seed(seed)
    layers, half, G = 3, 4, 3
    scores = torch.rand(layers, half, G, generator=g, dtype=F64) ** 3  # uneven, as real scores are
    ranked = scores.sort(-1, descending=True).values  # (layers, half, G)
    for count in range(half * G + 1):
        total = lambda c: sum(float(ranked[:, i, :k].sum()) for i, k in enumerate(c))  # noqa: E731
        best = max(total(c) for c in _allocations(half, G, count))
        alloc = plane_allocation(scores, count)
        assert int(alloc.sum()) == count and total(alloc.tolist()) >= best * (1 - 1e-12)
        planes = shared_planes(scores, count)  # (layers, count, 2)
        for layer in range(layers):
            i, j = planes[layer, :, 0], planes[layer, :, 1]
            assert torch.equal(i, planes[0, :, 0])  # the same pair in every slot of every layer
            assert torch.equal(torch.bincount(i, minlength=half), alloc)
            assert bool((i[1:] >= i[:-1]).all())  # slots sorted by pair
            kept = float(scores[layer, i, j].sum())
            assert kept == pytest.approx(sum(float(ranked[layer, p, :k].sum()) for p, k in enumerate(alloc.tolist())),
                                         rel=1e-12)


def test_shared_planes_refuse_bad_counts():
    with pytest.raises(ValueError, match=r"planes to keep \(7\) must be between 0 and 6"):
        shared_planes(torch.ones(2, 3, 2, dtype=F64), 7)


def test_rorope_keeps_any_number_of_planes_exactly_where_only_they_matter():
    """G = 2: pair 0's planes differ between the KV heads (two mixed planes), pair 1's are equal (one) and the
    slower pairs carry no key: keeping those three planes (rope_dim 6, not a multiple of 2 G = 4) is exact,
    both by score and with the planes given."""
    H, G, d = 4, 2, 8
    g = _gqa(H, G, d, dim=32)
    with torch.no_grad():
        wk = g.W_K.weight.view(G, d, -1)
        a, b = pair_dims(d, interleaved=False)
        wk[1, a[1]], wk[1, b[1]] = wk[0, a[1]], wk[0, b[1]]
        wk[:, torch.cat([a[2:], b[2:]])] = 0
    r = G * d  # the values; the keys' remainder is zero
    mla, report = gqa_to_mla_decoupled(g, r, None, rorope=True, plane_order="score", rope_planes=3)
    assert mla.rope_dim == 6 and report.kv_values_after == r + 6
    assert_mla_is_the_gqa(mla, g, tol=EXACT)
    given, _ = gqa_to_mla_decoupled(g, r, None, rorope=True, planes=torch.tensor([[0, 0], [0, 1], [1, 0]]))
    assert_mla_is_the_gqa(given, g, tol=EXACT)
    with pytest.raises(ValueError, match=r"give rope_pairs or rope_planes/planes, not both"):
        gqa_to_mla_decoupled(g, r, 1, rorope=True, rope_planes=3)
    with pytest.raises(ValueError, match=r"rope_planes and planes choose RoRoPE's mixed planes: they need rorope"):
        gqa_to_mla_decoupled(g, r, None, rope_planes=3)
    with pytest.raises(ValueError, match=r"planes must be distinct rows \[pair < 4, component < 2\]"):
        gqa_to_mla_decoupled(g, r, None, rorope=True, planes=torch.tensor([[0, 0], [0, 0]]))


def test_whole_model_rorope_score_keeps_the_same_frequencies_in_every_layer(tmp_path):
    """convert_model's rorope-score allocates once for all layers: every layer turns at the same frequencies
    (what a DeepSeek config holds), the allocation is the one shared_planes makes of the layers' own
    scores, and rope_dim need only be even (6 with G = 2); per-head selections still want a multiple of 2 G."""
    from tiny_checkpoints import TEXT, make_checkpoint

    from attnlab import models as hf
    from attnlab.convert.decoupled import rorope_plane_scores

    model, tok = make_checkpoint("llama", tmp_path / "llama", num_hidden_layers=3)
    hf.to_attnlab(model)
    ids = tok(TEXT, return_tensors="pt").input_ids
    inputs = hf.attention_inputs(model, ids)
    scores = torch.stack([rorope_plane_scores(m, x) for m, x in zip(hf.attnlab_modules(model), inputs)])
    expected = shared_planes(scores, 3)
    sources = [m.rope.inv_freq for m in hf.attnlab_modules(model)]
    m = __import__("copy").deepcopy(model)
    hf.convert_model(m, "mla", latent_dim=12, rope_dim=6, calibration_ids=ids, pair_selection="rorope-score",
                     balance=True)
    for layer, (mla, src) in enumerate(zip(hf.attnlab_modules(m), sources)):
        assert torch.equal(mla.rope.inv_freq, src[expected[layer, :, 0]])
    with pytest.raises(ValueError, match=r"rope_dim \(6\) must be a non-negative multiple of 2 \* num_kv_heads "
                                         r"\(4\) for --rope-select frequency"):
        hf.convert_model(__import__("copy").deepcopy(model), "mla", latent_dim=12, rope_dim=6)
    with pytest.raises(ValueError, match=r"rope_dim \(7\) must be even"):
        hf.convert_model(__import__("copy").deepcopy(model), "mla", latent_dim=12, rope_dim=7,
                         pair_selection="rorope")
