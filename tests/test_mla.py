"""MLA: expanded and absorbed paths against the naive oracle; absorbed-weight caching."""
import pytest
import torch

from attnlab import MultiHeadLatentAttention
from conftest import F64, mla_ref, randomize
from reference import rel_err

# (B, L1, L2, D1, D2, H, r, d, dv)
SHAPES = [
    (2, 3, 3, 8, 8, 2, 4, 4, 4),
    (2, 3, 5, 12, 10, 3, 5, 2, 4),
    (1, 1, 6, 16, 8, 4, 6, 3, 2),
]


@pytest.mark.parametrize("absorbed", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_cross_attention_matches_oracle(shape, bias, absorbed):
    B, L1, L2, D1, D2, H, r, d, dv = shape
    m = randomize(MultiHeadLatentAttention(D1, H, r, head_dim=d, v_head_dim=dv, context_dim=D2, bias=bias,
                                           dtype=F64))
    x, y = torch.randn(B, L1, D1, dtype=F64), torch.randn(B, L2, D2, dtype=F64)
    assert rel_err(m(x, y, absorbed=absorbed), mla_ref(m, x, y)) <= 1e-10


DEEPSEEK_LIKE = dict(head_dim=4, v_head_dim=3, rope_dim=4, q_latent_dim=5, latent_norm=True)


@pytest.mark.parametrize("absorbed", [False, True])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("options", [dict(rope_dim=2), DEEPSEEK_LIKE, dict(DEEPSEEK_LIKE, bias=True,
                                                                           latent_bias=True)])
def test_deepseek_options_match_oracle(options, interleaved, absorbed):
    m = randomize(MultiHeadLatentAttention(12, 3, 6, rope_interleaved=interleaved, rope_base=100.0,
                                           dtype=F64, **options))
    with torch.no_grad():  # norm weights near 1, as trained models have them
        for norm in (m.q_norm, m.kv_norm):
            if norm is not None:
                norm.weight.add_(1.0)
    x = torch.randn(2, 5, 12, dtype=F64)
    assert rel_err(m(x, is_causal=True, absorbed=absorbed), mla_ref(m, x, causal=True)) <= 1e-10


def test_absorbed_equals_expanded_with_masks():
    m = randomize(MultiHeadLatentAttention(12, 4, 6, rope_dim=2, bias=True, dtype=F64))
    x = torch.randn(2, 4, 12, dtype=F64)
    mask = torch.rand(2, 4, 4, 4) > 0.4
    mask[0, 1, 2] = False  # a fully masked row: zeros on both paths, bias included
    a = m(x, mask=mask, absorbed=True)
    b = m(x, mask=mask, absorbed=False)
    assert rel_err(a, b) <= 1e-10
    assert rel_err(a, mla_ref(m, x, mask=mask)) <= 1e-10


def test_absorbed_weights_follow_parameter_changes():
    """No stale copy of the absorbed weights after load_state_dict or an optimizer step."""
    m = randomize(MultiHeadLatentAttention(12, 3, 6, dtype=F64))
    x = torch.randn(1, 2, 12, dtype=F64)
    with torch.no_grad():
        m(x, absorbed=True)  # fills the cache of absorbed weights
        other = randomize(MultiHeadLatentAttention(12, 3, 6, dtype=F64))
        m.load_state_dict(other.state_dict())
        assert rel_err(m(x, absorbed=True), mla_ref(m, x)) <= 1e-10
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m(x, absorbed=True).square().sum().backward()
    opt.step()
    with torch.no_grad():
        assert rel_err(m(x, absorbed=True), mla_ref(m, x)) <= 1e-10


def test_absorbed_path_is_chosen_for_decode():
    m = MultiHeadLatentAttention(64, 4, 16)
    assert m.prefers_absorbed(1, 1024) and not m.prefers_absorbed(1024, 1024)


def test_large_latent_warns():
    with pytest.warns(UserWarning, match=r"latent_dim \(40\) exceeds"):
        MultiHeadLatentAttention(16, 2, 40)
