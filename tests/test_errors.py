"""Bad input: a ValueError or TypeError that names the offending values."""
import pytest
import torch

from attnlab import GroupedQueryAttention, MultiHeadAttention, MultiHeadLatentAttention


def test_heads_not_divisible():
    with pytest.raises(ValueError, match=r"num_heads \(12\) must be divisible by num_kv_heads \(5\)"):
        GroupedQueryAttention(24, 12, 5)


@pytest.mark.parametrize("kwargs, message", [
    (dict(dim=0, num_heads=2), r"dim must be positive, got 0"),
    (dict(dim=8, num_heads=-2), r"num_heads must be positive, got -2"),
    (dict(dim=8, num_heads=2, head_dim=0), r"head_dim must be positive, got 0"),
    (dict(dim=8, num_heads=2, context_dim=-1), r"context_dim must be positive, got -1"),
])
def test_non_positive_sizes(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MultiHeadAttention(**kwargs)


def test_non_positive_latent():
    with pytest.raises(ValueError, match=r"latent_dim must be positive, got 0"):
        MultiHeadLatentAttention(8, 2, 0)


def test_size_of_wrong_type():
    with pytest.raises(TypeError, match=r"num_heads must be an int, got float \(2.0\)"):
        MultiHeadAttention(8, 2.0)


def test_dim_not_divisible_without_head_dim():
    with pytest.raises(ValueError, match=r"dim \(10\) is not divisible by num_heads \(4\)"):
        MultiHeadAttention(10, 4)


@pytest.mark.parametrize("module", [MultiHeadAttention(8, 2), MultiHeadLatentAttention(8, 2, 4)])
def test_wrong_number_of_dimensions(module):
    with pytest.raises(ValueError, match=r"x must have shape \(batch, length, 8\), got \(3, 8\)"):
        module(torch.randn(3, 8))


@pytest.mark.parametrize("module", [MultiHeadAttention(8, 2, context_dim=6), MultiHeadLatentAttention(8, 2, 4, context_dim=6)])
def test_wrong_last_dimension(module):
    with pytest.raises(ValueError, match=r"x has last dimension 7, expected 8"):
        module(torch.randn(1, 3, 7), torch.randn(1, 3, 6))
    with pytest.raises(ValueError, match=r"context has last dimension 8, expected 6"):
        module(torch.randn(1, 3, 8), torch.randn(1, 3, 8))
    with pytest.raises(ValueError, match=r"context_dim != dim"):
        module(torch.randn(1, 3, 8))


def test_batch_sizes_differ():
    with pytest.raises(ValueError, match=r"same batch size, got 2 and 3"):
        MultiHeadAttention(8, 2)(torch.randn(2, 4, 8), torch.randn(3, 4, 8))


def test_mask_of_wrong_shape():
    m = MultiHeadAttention(8, 2)
    with pytest.raises(ValueError, match=r"mask of shape \(4, 5\) does not broadcast to \(B, H, L, S\) = \(1, 2, 4, 4\)"):
        m(torch.randn(1, 4, 8), mask=torch.ones(4, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \(B, S\) = \(1, 4\), got \(1, 3\)"):
        m(torch.randn(1, 4, 8), key_padding_mask=torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"mask must be bool .* got torch.int64"):
        m(torch.randn(1, 4, 8), mask=torch.ones(4, 4, dtype=torch.long))


@pytest.mark.parametrize("module", [MultiHeadAttention(8, 2), MultiHeadLatentAttention(8, 2, 4)])
def test_dtype_mismatch(module):
    with pytest.raises(TypeError, match=r"x has dtype torch.float64 but the module's weights are torch.float32"):
        module(torch.randn(1, 3, 8, dtype=torch.float64))


def test_device_mismatch():
    m = MultiHeadAttention(8, 2, device="meta")
    with pytest.raises(ValueError, match=r"x is on cpu but the module's weights are on meta"):
        m(torch.randn(1, 3, 8))


def test_unknown_grouping():
    with pytest.raises(ValueError, match=r"grouping must be one of \('strided', 'blocked'\), got 'rows'"):
        GroupedQueryAttention(8, 4, 2, grouping="rows")
