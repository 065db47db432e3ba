"""models/divergence.py's kl_sum against torch's own kl_div in float64, in blocks of any size, in float32 within what
float32 itself achieves, and its refusal of logits of two shapes."""
import pytest
import torch
import torch.nn.functional as F

from attnlab.models.divergence import kl_sum


def _pair(V: int, seed: int, spread: float = 0.3):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(2, 7, V, generator=g, dtype=torch.float64) * 4
    return t, t + torch.randn(2, 7, V, generator=g, dtype=torch.float64) * spread


def _oracle(t: torch.Tensor, s: torch.Tensor) -> float:
    return float(F.kl_div(s.log_softmax(-1), t.log_softmax(-1), log_target=True, reduction="sum"))


@pytest.mark.parametrize("rows", [1, 3, 4, 14, 100])
def test_the_sum_is_torch_kl_div_in_float64_whatever_the_blocks(rows):
    t, s = _pair(301, rows)
    assert kl_sum(t, s, torch.float64, rows=rows) == pytest.approx(_oracle(t, s), rel=1e-12)


def test_float32_is_within_what_float32_achieves():
    """Each log-probability in float32 is off by a few units of its last place (|logit| eps), so each position's KL
    by at most a few times max |logit| eps: the bound asserted is 8 times that, summed over positions."""
    t, s = _pair(5000, 0)
    exact = _oracle(t, s)
    bound = 8 * float(torch.maximum(t.abs().max(), s.abs().max())) * torch.finfo(torch.float32).eps * 14
    assert abs(kl_sum(t.float(), s.float()) - exact) <= bound
    assert abs(kl_sum(t.float(), s.float()) - exact) > 0  # float32 really was used


def test_a_token_the_teacher_rules_out_adds_nothing():
    t = torch.tensor([[0.0, 1.0, float("-inf")]], dtype=torch.float64)
    s = torch.tensor([[0.5, 0.0, 2.0]], dtype=torch.float64)
    p = t.softmax(-1)[0, :2]
    expected = float((p * (p.log() - s.log_softmax(-1)[0, :2])).sum())
    assert kl_sum(t, s, torch.float64) == pytest.approx(expected, rel=1e-12)


def test_logits_of_two_shapes_are_refused():
    with pytest.raises(ValueError, match=r"\(2, 5\) and \(2, 6\)"):
        kl_sum(torch.zeros(2, 5), torch.zeros(2, 6))
