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


def _heads_output(module, x: torch.Tensor) -> np.ndarray:
    """What the module's W_O reads from x, computed by its own forward (N, h d_v) as numpy."""
    seen = []
    hook = module.W_O.register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach()))
    with torch.no_grad():
        module(x, is_causal=True)
    hook.remove()
    return seen[0].reshape(-1, seen[0].shape[-1]).numpy()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kind", ["mla", "gqa"])
def test_the_output_refit_is_numpys_least_squares_and_its_reported_errors_are_the_modules(kind, bias):
    """Without the ridge, refit_out's W_O (and bias) is numpy's least-squares solution from the heads' outputs to the
    targets (float64), and the errors it reports are those of the module's own output before and after."""
    from attnlab import GroupedQueryAttention
    from attnlab.convert.refit import refit_out

    torch.manual_seed(2)
    m = (MultiHeadLatentAttention(32, 4, 12, head_dim=8, rope_dim=4, bias=bias, kv_dtype="int3/g32+c4")
         if kind == "mla" else GroupedQueryAttention(32, 4, 2, bias=bias))
    m = randomize(m, std=0.3).double()
    x = torch.randn(3, 20, 32, dtype=F64, generator=torch.Generator().manual_seed(3))
    y = torch.randn(3, 20, 32, dtype=F64, generator=torch.Generator().manual_seed(4))
    O = _heads_output(m, x)
    if bias:
        O = np.concatenate([O, np.ones((O.shape[0], 1))], 1)
    want = np.linalg.lstsq(O, y.reshape(-1, 32).numpy(), rcond=None)[0].T  # (dim, h d_v [+ 1])

    def error():
        with torch.no_grad():
            return float(((m(x, is_causal=True) - y) ** 2).sum() / (y ** 2).sum())

    start = error()
    report = refit_out(m, x, y, chunk=2, ridge=0.0)  # two chunks: the sums over chunks are the whole
    got = m.W_O.weight.detach()
    if bias:
        got = torch.cat([got, m.W_O.bias.detach()[:, None]], 1)
    assert rel_err(got, torch.from_numpy(want)) <= 1e-10
    assert report["before"] == pytest.approx(start, rel=1e-10)
    assert report["after"] == pytest.approx(error(), rel=1e-10)
    assert report["after"] < report["before"]


def test_the_output_refit_keeps_the_weights_of_directions_the_inputs_never_reach():
    """The ridge pulls towards the weights the module had: W_O's columns for a head whose output is always zero (its
    value projection zeroed) keep their old values, where a pull towards zero would have erased them."""
    from attnlab import GroupedQueryAttention
    from attnlab.convert.refit import refit_out

    torch.manual_seed(5)
    m = randomize(GroupedQueryAttention(32, 4, 4), std=0.3).double()
    with torch.no_grad():
        m.W_V.weight[:8] = 0  # head 0's values: its 8 columns of W_O read nothing
    old = m.W_O.weight.detach().clone()
    x = torch.randn(2, 24, 32, dtype=F64, generator=torch.Generator().manual_seed(6))
    refit_out(m, x, torch.randn(2, 24, 32, dtype=F64, generator=torch.Generator().manual_seed(7)))
    assert torch.allclose(m.W_O.weight[:, :8], old[:, :8], rtol=0, atol=1e-12)
    assert rel_err(m.W_O.weight[:, 8:], old[:, 8:]) > 0.1  # the rest was fitted


def test_the_output_refit_refuses_mismatched_windows_and_modules_without_w_o():
    from attnlab import GroupedQueryAttention
    from attnlab.convert.refit import refit_out

    m = GroupedQueryAttention(32, 4, 2).double()
    with pytest.raises(ValueError, match=r"inputs \(2, 8, 32\) and targets \(2, 6, 32\) must be"):
        refit_out(m, torch.zeros(2, 8, 32, dtype=F64), torch.zeros(2, 6, 32, dtype=F64))
    with pytest.raises(ValueError, match="Linear has none"):
        refit_out(torch.nn.Linear(3, 3), torch.zeros(1, 2, 3), torch.zeros(1, 2, 3))
