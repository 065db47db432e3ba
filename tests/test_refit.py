"""Closed-form refits of an MLA's up-projections (convert/refit.py). Oracles: numpy's least squares on the same latent
and read-back (the refit is its solution), the storage-free case (the refit returns the weights it was given, float64),
and the invariant that the refit's error on the calibration rows is no more than before."""
import numpy as np
import pytest
import torch

from attnlab import MultiHeadLatentAttention
from attnlab.convert.refit import latent_pairs, refit_up
from conftest import F64, randomize
from reference import rel_err


def _mla(kv_dtype="int3/g32+c4"):
    torch.manual_seed(0)
    return randomize(MultiHeadLatentAttention(96, 4, 40, head_dim=24, rope_dim=16, kv_dtype=kv_dtype), std=0.3).double()


def _inputs(n=300):
    return torch.randn(n, 96, dtype=F64, generator=torch.Generator().manual_seed(1)) * torch.linspace(3, 0.2, 96,
                                                                                                       dtype=F64)


def test_the_refit_is_numpys_least_squares_and_lowers_the_error():
    m = _mla()
    x = _inputs()
    C, Ch = latent_pairs(m, x)
    assert rel_err(Ch, C) > 1e-3  # the 3-bit codes moved the latent
    W = torch.cat([m.W_UK.weight, m.W_UV.weight]).detach().numpy()
    want = np.linalg.lstsq(Ch.numpy(), C.numpy() @ W.T, rcond=None)[0].T
    report = refit_up(m, x)
    got = torch.cat([m.W_UK.weight, m.W_UV.weight]).detach()
    assert report["refitted"] and report["after"] < report["before"]
    assert rel_err(got, torch.from_numpy(want)) <= 1e-6  # the ridge (1e-9 of the Gram's scale) is all that differs
    with torch.no_grad():
        y = m(x[None, :40], is_causal=True)  # still a working module through its storage
    assert torch.isfinite(y).all()


def test_a_plain_storage_is_refitted_to_itself():
    m = _mla(kv_dtype=None)
    before = torch.cat([m.W_UK.weight, m.W_UV.weight]).detach().clone()
    report = refit_up(m, _inputs())
    assert report["before"] == 0.0 and rel_err(torch.cat([m.W_UK.weight, m.W_UV.weight]).detach(), before) <= 1e-10


def test_refitting_the_values_alone_leaves_the_keys_as_they_were():
    m = _mla()
    keys = m.W_UK.weight.detach().clone()
    report = refit_up(m, _inputs(), "v")
    assert report["refitted"] and report["after"] < report["before"] and torch.equal(m.W_UK.weight, keys)


def test_a_refit_refuses_a_latent_norm_and_other_projections():
    m = MultiHeadLatentAttention(96, 4, 40, head_dim=24, rope_dim=16, latent_norm=True).double()
    with pytest.raises(ValueError, match=r"a latent norm \(a GGUF's\) or a GQA tiling is not refitted"):
        refit_up(m, _inputs())
    with pytest.raises(ValueError, match=r"which must be 'kv' \(keys and values\) or 'v' \(values alone\), got 'k'"):
        refit_up(_mla(), _inputs(), "k")
