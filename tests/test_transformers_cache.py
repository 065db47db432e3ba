"""attnlab's copy of transformers' QuantizedCache codes (quanto backend: modules/lowbit.py quanto4, quanto2).

Oracles: optimum-quanto's own MaxOptimizer + quantize_weight + dequantize, called as transformers'
QuantoQuantizedLayer calls them, and transformers' QuantizedCache itself (what a decode step reads back for the
tokens it quantised). Both skip where optimum-quanto is not installed (an optional extra: pip install
optimum-quanto). Without it: invariants of min-max codes (the levels, the error bound, a constant group) and the
bytes by hand.
"""
import importlib.util

import pytest
import torch

from attnlab.modules import lowbit
from attnlab.modules.storage import check_kv_dtype, round_trip

HAS_QUANTO = importlib.util.find_spec("optimum") is not None and importlib.util.find_spec("optimum.quanto") is not None
needs_quanto = pytest.mark.skipif(not HAS_QUANTO, reason="optimum-quanto is not installed (pip install optimum-quanto)")


def _keys(shape=(2, 3, 37, 64), dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.linspace(0.1, 4.0, shape[-1])  # channels of different sizes
    x[..., 5] += 6.0  # an outlier channel, as RoPE'd keys have
    return x.to(dtype)


def _quanto(x, bits, group=64):
    from optimum.quanto import MaxOptimizer, qint2, qint4, quantize_weight

    qtype = qint4 if bits == 4 else qint2
    scale, shift = MaxOptimizer()(x, qtype, 0, group)
    return quantize_weight(x, qtype, 0, scale, shift, group).dequantize()


@needs_quanto
@pytest.mark.parametrize("code", ["quanto4", "quanto2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(2, 3, 37, 64), (1, 1, 9, 256), (1, 2, 5, 128)])
def test_round_trip_equals_optimum_quanto(code, dtype, shape):
    x = _keys(shape, dtype)
    fmt = lowbit.QUANTO_FORMATS[code]
    ours = lowbit.quanto_round_trip(x, fmt)
    assert ours.dtype == dtype
    assert torch.equal(ours, _quanto(x, fmt.bits))


@needs_quanto
@pytest.mark.parametrize("code", ["quanto4", "quanto2"])
def test_round_trip_equals_what_transformers_quantized_cache_reads_back(code):
    """transformers' QuantizedCache (quanto, its defaults but nbits): a prefill of 40 tokens is quantised whole; the
    next decode step returns those tokens dequantised, which must be attnlab's round trip of them, keys and values."""
    from transformers import LlamaConfig, QuantizedCache

    fmt = lowbit.QUANTO_FORMATS[code]
    config = LlamaConfig(hidden_size=192, num_attention_heads=3, num_key_value_heads=3, num_hidden_layers=1)
    cache = QuantizedCache("quanto", config, nbits=fmt.bits)
    k, v = _keys((1, 3, 40, 64), seed=1), _keys((1, 3, 40, 64), seed=2)
    cache.update(k, v, 0)
    k1, v1 = _keys((1, 3, 1, 64), seed=3), _keys((1, 3, 1, 64), seed=4)
    keys, values = cache.update(k1, v1, 0)
    assert torch.equal(keys[..., :40, :], lowbit.quanto_round_trip(k, fmt))
    assert torch.equal(values[..., :40, :], lowbit.quanto_round_trip(v, fmt))
    assert torch.equal(keys[..., 40:, :], k1)  # the newest token: transformers' unquantised residual


@pytest.mark.parametrize("code", ["quanto4", "quanto2"])
def test_min_max_codes_by_hand(code):
    """Each group of 64 holds at most 2^b levels, its min and max among them, every value within half a step."""
    fmt = lowbit.QUANTO_FORMATS[code]
    x = _keys((1, 2, 11, 64), torch.float64)
    y = lowbit.quanto_round_trip(x, fmt)
    g, gy = x.reshape(-1, 64), y.reshape(-1, 64)
    step = (g.amax(-1) - g.amin(-1)) / ((1 << fmt.bits) - 1)
    assert torch.allclose(gy.amin(-1), g.amin(-1), rtol=0, atol=1e-12)
    assert torch.allclose(gy.amax(-1), g.amax(-1), rtol=0, atol=1e-12)
    assert ((gy - g).abs() <= step[:, None] / 2 + 1e-12).all()
    assert max(len(torch.unique(row)) for row in gy) <= 1 << fmt.bits
    flat = torch.full((1, 1, 1, 64), 0.37, dtype=torch.float64)
    assert torch.equal(lowbit.quanto_round_trip(flat, fmt), flat)  # a constant group: no division by zero


def test_quanto_storage_is_applied_in_a_forward_and_refused_by_caches():
    from attnlab import GroupedQueryAttention

    m = GroupedQueryAttention(128, 4, 2, rope_base=10000.0).double()
    m.kv_dtype = "quanto2"
    x = torch.randn(1, 9, 128, dtype=torch.float64)
    with torch.no_grad():
        k = m.W_K(x).view(1, 9, 2, 32).transpose(1, 2)  # (B, G, S, d): heads of 32, so a group spans two of them
        assert torch.equal(round_trip(k, "quanto2", (32,), "key"),
                           lowbit.quanto_round_trip(k, lowbit.QUANTO_FORMATS["quanto2"]))
        plain = GroupedQueryAttention(128, 4, 2, rope_base=10000.0).double()
        plain.load_state_dict(m.state_dict())
        assert not torch.equal(m(x, is_causal=True), plain(x, is_causal=True))  # the forward reads the codes
    with pytest.raises(ValueError, match="'quanto2' is transformers' QuantizedCache code"):
        m.init_cache(1, 9)
    assert check_kv_dtype("quanto4").evaluation_only


def test_steady_state_bytes_by_hand():
    """b bits a value and a 16-bit scale and minimum per 64 values: SmolLM2 (3 KV heads of 64, K and V) 384 values."""
    assert lowbit.engine_bytes(384, lowbit.QUANTO_FORMATS["quanto4"]) == 384 * 4 / 8 + 384 / 64 * 4
    assert lowbit.engine_bytes(384, lowbit.QUANTO_FORMATS["quanto2"]) == 384 * 2 / 8 + 384 / 64 * 4


def test_a_tensor_off_the_group_is_refused():
    with pytest.raises(ValueError, match=r"quanto4 stores groups of 64 values: a tensor of shape \(1, 1, 3, 20\)"):
        lowbit.quanto_round_trip(torch.zeros(1, 1, 3, 20), lowbit.QUANTO_FORMATS["quanto4"])
