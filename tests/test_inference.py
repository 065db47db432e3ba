"""Masks, RoPE, caches and decode: against the oracle and against the full forward."""
import pytest
import torch

from attnlab import GroupedQueryAttention, MultiHeadAttention, MultiHeadLatentAttention
from conftest import F64, gqa_ref, mla_ref, randomize
from reference import rel_err


def _variants(dtype):
    """One of each: MHA, GQA strided with RoPE, GQA blocked interleaved RoPE, MQA, MLA (DeepSeek-like)."""
    mods = {
        "mha": MultiHeadAttention(24, 4, dtype=dtype),
        "gqa-strided-rope": GroupedQueryAttention(24, 6, 2, rope_base=10000.0, dtype=dtype),
        "gqa-blocked-interleaved": GroupedQueryAttention(24, 6, 3, grouping="blocked", rope_base=500.0,
                                                         rope_interleaved=True, bias=True, dtype=dtype),
        "mqa": GroupedQueryAttention(24, 4, 1, head_dim=8, v_head_dim=5, dtype=dtype),
        "mla": MultiHeadLatentAttention(24, 4, 10, head_dim=6, v_head_dim=5, rope_dim=4, latent_norm=True,
                                        q_latent_dim=12, dtype=dtype),
    }
    for m in mods.values():
        randomize(m, std=0.3)
        for norm in ("q_norm", "kv_norm"):
            if getattr(m, norm, None) is not None:
                with torch.no_grad():
                    getattr(m, norm).weight.add_(1.0)
    return mods


VARIANTS = ["mha", "gqa-strided-rope", "gqa-blocked-interleaved", "mqa", "mla"]


@pytest.mark.parametrize("name", ["gqa-strided-rope", "gqa-blocked-interleaved"])
def test_rope_matches_oracle(name):
    m = _variants(F64)[name]
    x = torch.randn(2, 6, 24, dtype=F64)
    assert rel_err(m(x, is_causal=True), gqa_ref(m, x, causal=True)) <= 1e-10
    pos = torch.tensor([3, 5, 8, 13, 21, 34])
    assert rel_err(m(x, positions=pos), gqa_ref(m, x, q_positions=pos.tolist(), k_positions=pos.tolist())) <= 1e-10


def _decode_steps(m, x, prefill, **kw):
    """Prefill `prefill` tokens, then one token at a time; returns the concatenated outputs."""
    cache = m.init_cache(x.shape[0], x.shape[1])
    outs = [m(x[:, :prefill], cache=cache, is_causal=True, **kw)]
    for t in range(prefill, x.shape[1]):
        outs.append(m(x[:, t:t + 1], cache=cache, is_causal=True, **kw))
    assert cache.length == x.shape[1]
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("dtype, tol", [(F64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("name", VARIANTS)
def test_cached_decode_equals_full_forward(name, dtype, tol):
    m = _variants(dtype)[name]
    x = torch.randn(2, 9, 24, dtype=dtype)
    with torch.no_grad():
        full = m(x, is_causal=True)
        paths = [dict(absorbed=True), dict(absorbed=False), {}] if name == "mla" else [{}]
        for kw in paths:
            assert rel_err(_decode_steps(m, x, 4, **kw), full) <= tol, kw
        # chunked prefill: a causal block after cached tokens (bottom-right alignment)
        cache = m.init_cache(2, 9)
        a = m(x[:, :3], cache=cache, is_causal=True)
        b = m(x[:, 3:7], cache=cache, is_causal=True)
        c = m(x[:, 7:], cache=cache, is_causal=True)
        assert rel_err(torch.cat([a, b, c], 1), full) <= tol


def test_decode_matches_oracle_float64():
    m = _variants(F64)["mla"]
    x = torch.randn(1, 7, 24, dtype=F64)
    with torch.no_grad():
        assert rel_err(_decode_steps(m, x, 3), mla_ref(m, x, causal=True)) <= 1e-10


def test_mla_decode_defaults_to_absorbed(monkeypatch):
    m = _variants(torch.float32)["mla"]
    cache = m.init_cache(1, 8)
    calls = []
    monkeypatch.setattr(m, "_absorbed", lambda *a: calls.append("absorbed") or type(m)._absorbed(m, *a))
    monkeypatch.setattr(m, "_expanded", lambda *a: calls.append("expanded") or type(m)._expanded(m, *a))
    with torch.no_grad():
        m(torch.randn(1, 6, 24), cache=cache, is_causal=True)
        m(torch.randn(1, 1, 24), cache=cache, is_causal=True)
    assert calls == ["expanded", "absorbed"]


@pytest.mark.parametrize("name", VARIANTS)
def test_bfloat16_within_bfloat16_tolerance(name):
    m64 = _variants(F64)[name]
    m16 = _variants(torch.bfloat16)[name]
    m16.load_state_dict({k: v.to(torch.bfloat16) for k, v in m64.state_dict().items()})
    m64.load_state_dict({k: v.to(torch.bfloat16).to(F64) for k, v in m64.state_dict().items()})
    x = torch.randn(2, 8, 24, dtype=F64).to(torch.bfloat16)
    with torch.no_grad():
        exact = m64(x.to(F64), is_causal=True)
        got = m16(x, is_causal=True)
        decoded = _decode_steps(m16, x, 5)
    # bfloat16 keeps 8 significant bits: relative rounding 2^-8 per operation, a few operations deep
    eps = torch.finfo(torch.bfloat16).eps
    assert rel_err(got, exact) <= 4 * eps
    assert rel_err(decoded, exact) <= 4 * eps


def test_fully_masked_row_is_zero_not_nan():
    m = randomize(GroupedQueryAttention(16, 4, 2, bias=False, dtype=F64))
    x = torch.randn(1, 3, 16, dtype=F64)
    mask = torch.ones(3, 3, dtype=torch.bool)
    mask[1] = False
    o = m(x, mask=mask)
    assert not torch.isnan(o).any()
    assert torch.equal(o[0, 1], torch.zeros(16, dtype=F64))
    assert rel_err(o, gqa_ref(m, x, mask=mask)) <= 1e-10


def test_key_padding_and_head_masks_match_oracle():
    m = randomize(GroupedQueryAttention(16, 4, 2, dtype=F64))
    x, y = torch.randn(2, 3, 16, dtype=F64), torch.randn(2, 5, 16, dtype=F64)
    kpm = torch.tensor([[True] * 5, [True, True, False, True, False]])
    head_mask = torch.rand(2, 4, 3, 5) > 0.3
    expected = gqa_ref(m, x, y, mask=head_mask & kpm[:, None, None, :])
    assert rel_err(m(x, y, mask=head_mask, key_padding_mask=kpm), expected) <= 1e-10
    additive = torch.zeros(3, 5, dtype=F64).masked_fill(torch.eye(3, 5, dtype=torch.bool), float("-inf"))
    assert rel_err(m(x, y, mask=additive), gqa_ref(m, x, y, mask=~torch.eye(3, 5, dtype=torch.bool))) <= 1e-10


@pytest.mark.parametrize("name", ["gqa-strided-rope", "mla"])
def test_cross_attention_cache_is_filled_once(name):
    mods = {"gqa-strided-rope": GroupedQueryAttention(24, 6, 2, context_dim=10, dtype=F64),
            "mla": MultiHeadLatentAttention(24, 4, 6, context_dim=10, dtype=F64)}
    m = randomize(mods[name])
    x, ctx = torch.randn(2, 4, 24, dtype=F64), torch.randn(2, 7, 10, dtype=F64)
    cache = m.init_cache(2, 7)
    full = m(x, ctx)
    steps = [m(x[:, t:t + 1], ctx, cache=cache) for t in range(4)]
    assert cache.length == 7 and cache.static
    assert rel_err(torch.cat(steps, 1), full) <= 1e-10


def test_cache_bytes_per_token_are_measured():
    d, dv, G = 8, 5, 2
    gqa = GroupedQueryAttention(32, 4, G, head_dim=d, v_head_dim=dv)
    mla = MultiHeadLatentAttention(32, 4, 12, rope_dim=4)
    assert gqa.init_cache(3, 10).bytes_per_token == G * (d + dv) * 4
    assert gqa.init_cache(3, 10, dtype=torch.bfloat16).bytes_per_token == G * (d + dv) * 2
    assert mla.init_cache(3, 10).bytes_per_token == (12 + 4) * 4
    assert MultiHeadAttention(32, 4).init_cache(1, 4).values_per_token == 2 * 32
    gqa.init_cache(1, 4)
    assert set(gqa.state_dict()) == {f"W_{n}.weight" for n in "QKVO"}  # the cache is not module state


def test_cache_reset_starts_over():
    m = randomize(GroupedQueryAttention(16, 4, 2, dtype=F64))
    x = torch.randn(1, 4, 16, dtype=F64)
    cache = m.init_cache(1, 4)
    first = m(x, cache=cache, is_causal=True)
    cache.reset()
    assert cache.length == 0
    assert torch.equal(m(x, cache=cache, is_causal=True), first)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gqa-strided-rope", "mla"])
def test_compiled_decode_does_not_recompile_per_token(name):
    from torch._dynamo.testing import CompileCounter

    m = _variants(torch.float32)[name].eval()
    x = torch.randn(1, 14, 24)
    cache = m.init_cache(1, 32)  # (a step that fills the buffer exactly may compile once more: strides change)
    torch._dynamo.reset()
    counter = CompileCounter()
    step = torch.compile(m, backend=counter)
    with torch.no_grad():
        full = m(x, is_causal=True)
        outs = [m(x[:, :4], cache=cache, is_causal=True)]
        outs += [step(x[:, t:t + 1], cache=cache, is_causal=True) for t in range(4, 14)]
    # the first step compiles with the cache length as a constant, the second makes it dynamic; then no more
    assert counter.frame_count <= 2
    assert rel_err(torch.cat(outs, 1), full) <= 1e-5


# -- bad input -------------------------------------------------------------------------------------
def test_cache_from_another_module():
    a, b = MultiHeadAttention(16, 2), MultiHeadAttention(16, 2)
    with pytest.raises(ValueError, match=r"made by another module"):
        b(torch.randn(1, 2, 16), cache=a.init_cache(1, 4))


def test_cache_with_another_batch_size_or_dtype():
    m = MultiHeadLatentAttention(16, 2, 4)
    with pytest.raises(ValueError, match=r"cache was made for batch_size 2, got a batch of 3"):
        m(torch.randn(3, 1, 16), cache=m.init_cache(2, 4))
    with pytest.raises(ValueError, match=r"cache holds torch.bfloat16 but the input is torch.float32"):
        m(torch.randn(2, 1, 16), cache=m.init_cache(2, 4, dtype=torch.bfloat16))


def test_decoding_past_max_len():
    m = GroupedQueryAttention(16, 4, 2)
    cache = m.init_cache(1, 3)
    m(torch.randn(1, 2, 16), cache=cache)
    with pytest.raises(ValueError, match=r"cannot append 2 tokens: the cache holds 2 of max_len 3"):
        m(torch.randn(1, 2, 16), cache=cache)


def test_mask_of_wrong_shape_with_cache():
    m = MultiHeadAttention(16, 2)
    cache = m.init_cache(1, 8)
    m(torch.randn(1, 3, 16), cache=cache)
    with pytest.raises(ValueError, match=r"does not broadcast to \(B, H, L, S\) = \(1, 2, 1, 4\)"):
        m(torch.randn(1, 1, 16), cache=cache, mask=torch.ones(1, 3, dtype=torch.bool))


def test_odd_rope_dim():
    with pytest.raises(ValueError, match=r"rope_dim must be even \(RoPE rotates pairs\), got 3"):
        MultiHeadLatentAttention(16, 2, 4, rope_dim=3)
    with pytest.raises(ValueError, match=r"rope dim must be even, got 5"):
        GroupedQueryAttention(15, 3, 1, rope_base=10000.0)


def test_self_attention_on_a_cross_cache():
    m = MultiHeadAttention(16, 2)
    cache = m.init_cache(1, 4)
    m(torch.randn(1, 1, 16), torch.randn(1, 4, 16), cache=cache)
    with pytest.raises(ValueError, match=r"holds a cross-attention context"):
        m(torch.randn(1, 1, 16), cache=cache)
