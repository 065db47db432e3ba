"""Transform coding of an MLA's latent (convert/transform_code.py) and its storage ("tc4x40-3x24+c4", modules/lowbit.py).

Oracles: the storage's runs against attnlab's asymmetric groups of each run's bits applied to that run alone, and its
bytes counted by hand; cached decode against the full forward through the same storage (float64); the allocation
against one computed by hand in the docstring below; the coded module, before any quantisation, against the original
(float64, nothing cut, either metric), against the original with its latent projected on the top principal components
computed here by numpy (a cut in the latent metric), and, in the keys-and-values metric, a cut's error on the keys and
values equal to the sum of the eigenvalues it dropped, those of the keys' and values' own second moment computed here
(Eckart-Young: no rank-k map of the latent does better).
"""
import numpy as np
import pytest
import torch

from attnlab import MultiHeadLatentAttention
from attnlab.convert.transform_code import allocate_bits, fit_to_row, runs, spelling, transform_code
from attnlab.modules import lowbit
from attnlab.modules.storage import check_kv_dtype, round_trip
from conftest import F64, randomize
from reference import rel_err


def test_a_runs_storage_codes_each_run_as_its_own_bits_do_and_costs_what_its_pieces_cost():
    x = torch.randn(3, 5, 64 + 32, dtype=F64, generator=torch.Generator().manual_seed(0)) * torch.linspace(4, 0.1, 96)
    fmt = check_kv_dtype("tc4x40-3x24+c4").low
    assert fmt.segments == ((4, 40), (3, 24)) and fmt.rope_channel and fmt.rope_bits == 4
    got = round_trip(x, "tc4x40-3x24+r8", (64, 32))
    want = torch.cat([lowbit.round_trip(x[..., :40], (40,), lowbit.parse("int4")),
                      lowbit.round_trip(x[..., 40:64], (24,), lowbit.parse("int3")),
                      lowbit.round_trip(x[..., 64:], (32,), lowbit.parse("int7")._replace(code="int8", bits=8))], -1)
    assert torch.equal(got, want)
    codes, meta = lowbit.encode(x, (64, 32), lowbit.parse("tc4x40-3x24+r8"))
    back = lowbit.decode(codes, meta, (64, 32), lowbit.parse("tc4x40-3x24+r8"), F64)
    assert torch.equal(back, want)
    # by hand: codes 40 x 4 bits (20 B) + 24 x 3 bits (9 B); meta: groups of 32 within a run (2 + 1) and the rope key's
    # one group, each a float16 scale and minimum (4 B); the rope key 32 x 8 bits (32 B)
    assert lowbit.row_bytes((64, 32), lowbit.parse("tc4x40-3x24+r8")) == 20 + 9 + 4 * 4 + 32
    # with the rope key per channel: 32 x 4 bits (16 B) and 32 channels' scale and minimum per 64 tokens (2 B a token)
    assert lowbit.row_bytes((64, 32), fmt) == 20 + 9 + 3 * 4 + 16 + 2


def test_a_runs_storage_refuses_runs_that_do_not_make_up_the_latent_or_leave_out_the_rope_key():
    with pytest.raises(ValueError, match=r"tc4x40-3x20 codes 60 latent channels \(40 \+ 20\); this row's latent has 64"):
        lowbit.check_parts((64,), lowbit.parse("tc4x40-3x20"))
    with pytest.raises(ValueError, match=r"have a rope key too: add its storage, tc4x64\+r8 .* or tc4x64\+c4"):
        lowbit.check_parts((64, 32), lowbit.parse("tc4x64"))
    assert lowbit.parse("tc4x64-1x8") is None and lowbit.parse("tc9x8") is None  # 1 and 9 bits: no such codes


def test_an_mla_with_a_runs_storage_decodes_what_its_forward_computes():
    torch.manual_seed(0)
    m = randomize(MultiHeadLatentAttention(128, 4, 64, head_dim=32, rope_dim=16, kv_dtype="tc5x16-3x48+c4"),
                  std=0.3).double()
    x = torch.randn(2, 70, 128, dtype=F64)  # past one group of 64 tokens of the rope key
    with torch.no_grad():
        full = m(x, is_causal=True)
        cache = m.init_cache(2, 70)
        steps = [m(x[:, :65], cache=cache, is_causal=True)] + [m(x[:, t:t + 1], cache=cache) for t in range(65, 70)]
    assert rel_err(torch.cat(steps, 1), full) <= 1e-10
    assert cache.bytes_per_token == lowbit.row_bytes((64, 16), lowbit.parse("tc5x16-3x48+c4"))


def test_bits_are_allocated_as_computed_by_hand():
    """Variances 16, 4, 1, 1/4, groups of 32 (a coded component's meta share 4/32 B). Estimated error drop per byte
    (v (4^-b - 4^-b') over the step's bytes): 0 -> 2 bits costs 2/8 + 1/8 = 0.375 B and gains 15v/16, 2.5 v a byte;
    2 -> 3: 0.125 B, 0.375 v; 3 -> 4: 0.09375 v. So the steps come as: component 0 to 2 bits (40), 1 to 2 (10),
    0 to 3 (6), 2 to 2 bits (2.5), then 0 to 4 and 1 to 3 (1.5 each), 3 to 2 bits (0.625), ... Spent after each:
    0.375, 0.75, 0.875, 1.25, 1.375, 1.5, 1.875. A budget of 1.25 B stops after the fourth step; of 1.5 after the
    sixth (the seventh does not fit, nor do later ones: each costs 0.125 B more)."""
    v = [16.0, 4.0, 1.0, 0.25]
    assert allocate_bits(v, 1.25) == [3, 2, 2, 0]
    assert allocate_bits(v, 1.5) == [4, 3, 2, 0]
    assert allocate_bits(v, 0.3) == [0, 0, 0, 0]  # not even one component's first step
    assert allocate_bits([1.0, 4.0], 0.75) == [2, 2]  # any order: the bits follow the variances
    assert runs([4, 3, 3, 2, 0, 0]) == ((4, 1), (3, 2), (2, 1))
    assert spelling(((4, 1), (3, 2))) == "tc4x1-3x2+c4" and spelling(((4, 8),), group=64, rope="") == "tc4x8/g64"
    with pytest.raises(ValueError, match=r"must not increase"):
        runs([2, 3])
    with pytest.raises(ValueError, match=r"variances must be non-negative numbers, got \[1.0, -1.0\]"):
        allocate_bits([1.0, -1.0], 1.0)
    with pytest.raises(ValueError, match=r"bits must be whole numbers from 2 to 8, got \(1, 2\)"):
        allocate_bits([1.0], 1.0, bits=(1, 2))


def test_fitting_the_row_takes_back_the_cheapest_bits_until_the_real_bytes_fit():
    bits = [4] * 40 + [3] * 24
    v = list(np.linspace(10, 1, 64))
    fitted = fit_to_row(bits, v, 40.0, 16)
    row = lowbit.row_bytes((sum(n for _, n in runs(fitted)), 16), lowbit.parse(spelling(runs(fitted))))
    assert row <= 40 < lowbit.row_bytes((64, 16), lowbit.parse(spelling(runs(bits))))
    assert all(a >= b for a, b in zip(fitted, fitted[1:]))


def _mla(rope_dim=16, latent=48):
    torch.manual_seed(1)
    return randomize(MultiHeadLatentAttention(96, 4, latent, head_dim=24, rope_dim=rope_dim), std=0.3).double()


def _inputs(n=400, dim=96):
    g = torch.Generator().manual_seed(2)
    return torch.randn(n, dim, dtype=F64, generator=g) * torch.linspace(3, 0.2, dim, dtype=F64)  # a few large directions


@pytest.mark.parametrize("metric", ["kv", "latent"])
def test_the_coded_module_equals_the_original_before_quantisation_where_nothing_is_cut(metric):
    m = _mla()
    x = torch.randn(2, 9, 96, dtype=F64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = m(x, is_causal=True)
    coded, report = transform_code(m, _inputs(), budget_bytes=1e6, metric=metric)  # every component in 8 bits
    assert report["kept"] == 48 and report["storage"] == "tc8x48+c4" and coded is m
    coded.kv_dtype = None
    with torch.no_grad():
        assert rel_err(coded(x, is_causal=True), want) <= 1e-10


def test_a_cut_in_the_latent_metric_keeps_the_top_principal_components_and_reports_their_variances():
    m = _mla()
    inputs = _inputs()
    original = _mla()
    c = (inputs @ original.W_DKV.weight.detach().T).numpy()  # (N, r): the latent, computed here
    lam, vec = np.linalg.eigh(c.T @ c / c.shape[0])
    lam, vec = lam[::-1], vec[:, ::-1]
    coded, report = transform_code(m, inputs, budget_bytes=30.0, metric="latent")
    k = report["kept"]
    assert 0 < k < 48 and coded.latent_dim == k
    assert np.allclose(report["variances"], lam, rtol=1e-9, atol=1e-12)
    assert report["bytes_per_token"] <= 30.0
    assert report["bits"][:k] == sorted(report["bits"][:k], reverse=True) and not any(report["bits"][k:])
    top = torch.from_numpy(np.ascontiguousarray(vec[:, :k]))  # (r, k)
    with torch.no_grad():  # the original with its latent projected on the top k components
        original.W_DKV.weight.copy_(top @ top.T @ original.W_DKV.weight)
        x = torch.randn(2, 9, 96, dtype=F64, generator=torch.Generator().manual_seed(4))
        want = original(x, is_causal=True)
        coded.kv_dtype = None
        assert rel_err(coded(x, is_causal=True), want) <= 1e-10


def test_a_cut_in_the_kv_metric_loses_exactly_the_dropped_eigenvalues_of_the_keys_and_values():
    m = _mla()
    inputs = _inputs()
    W = torch.cat([m.W_UK.weight, m.W_UV.weight]).detach()  # (H (d + dv), r)
    kv = (inputs @ m.W_DKV.weight.detach().T @ W.T).numpy()  # the keys and values (no-RoPE part) the latent is read as
    lam = np.linalg.eigvalsh(kv.T @ kv / kv.shape[0])[::-1][:48]
    coded, report = transform_code(m, inputs, budget_bytes=30.0, metric="kv")
    k = report["kept"]
    assert 0 < k < 48 and np.allclose(report["variances"], lam, rtol=1e-8, atol=1e-10 * lam[0])
    W2 = torch.cat([coded.W_UK.weight, coded.W_UV.weight]).detach()
    kv2 = (inputs @ coded.W_DKV.weight.detach().T @ W2.T).numpy()
    assert np.isclose(((kv - kv2) ** 2).sum(1).mean(), lam[k:].sum(), rtol=1e-8)


def test_transform_coding_refuses_what_a_cut_cannot_keep_and_budgets_the_rope_key_alone_exceeds():
    normed = MultiHeadLatentAttention(96, 4, 48, head_dim=24, rope_dim=16, latent_norm=True).double()
    with pytest.raises(ValueError, match=r"a latent norm \(a GGUF's\) or a GQA tiling"):
        transform_code(normed, _inputs(), 30.0)
    # the rope key by hand: 16 values in 4 bits (8 B) and 16 channels' scale and minimum per 64 tokens (1 B a token)
    with pytest.raises(ValueError, match=r"the rope key \(16 values, \+c4\) alone takes 9 bytes"):
        transform_code(_mla(), _inputs(), 9.0)
    with pytest.raises(ValueError, match=r"metric must be one of kv, latent, got 'keys'"):
        transform_code(_mla(), _inputs(), 30.0, metric="keys")
