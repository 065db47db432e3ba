"""MHA and GQA modules against the naive float64 oracle and against torch.nn.MultiheadAttention."""
import pytest
import torch

from attnlab import GroupedQueryAttention, MultiHeadAttention
from conftest import F64, gqa_ref, randomize
from reference import rel_err

# (B, L1, L2, D1, D2, H, G, d, dv)
SHAPES = [
    (2, 3, 3, 8, 8, 4, 4, 2, 2),      # MHA, self-attention sizes
    (2, 3, 5, 12, 8, 6, 2, 3, 5),     # L1 != L2, D1 != D2, d != dv, proper divisor
    (1, 4, 2, 6, 10, 4, 1, 4, 3),     # MQA, G = 1
    (3, 1, 6, 16, 16, 8, 4, 2, 2),    # one query
]


@pytest.mark.parametrize("grouping", ["strided", "blocked"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_cross_attention_matches_oracle(shape, grouping, bias):
    B, L1, L2, D1, D2, H, G, d, dv = shape
    m = randomize(GroupedQueryAttention(D1, H, G, head_dim=d, v_head_dim=dv, context_dim=D2, bias=bias,
                                        grouping=grouping, dtype=F64))
    x, y = torch.randn(B, L1, D1, dtype=F64), torch.randn(B, L2, D2, dtype=F64)
    assert rel_err(m(x, y), gqa_ref(m, x, y)) <= 1e-10


@pytest.mark.parametrize("grouping", ["strided", "blocked"])
@pytest.mark.parametrize("G", [1, 2, 6])
def test_self_attention_causal_matches_oracle(grouping, G):
    m = randomize(GroupedQueryAttention(12, 6, G, grouping=grouping, dtype=F64))
    x = torch.randn(2, 5, 12, dtype=F64)
    assert rel_err(m(x), gqa_ref(m, x)) <= 1e-10
    assert rel_err(m(x, is_causal=True), gqa_ref(m, x, causal=True)) <= 1e-10


def test_mha_is_gqa_with_g_equal_h():
    """Part 8: MHA is GQA with G = H; with the same weights the outputs are identical."""
    mha = randomize(MultiHeadAttention(12, 4, dtype=F64))
    x = torch.randn(2, 5, 12, dtype=F64)
    for grouping in ("strided", "blocked"):
        gqa = GroupedQueryAttention(12, 4, 4, grouping=grouping, dtype=F64)
        gqa.load_state_dict(mha.state_dict())
        assert torch.equal(gqa(x), mha(x))


def test_kv_heads_are_not_copied():
    """K/V projections have G heads: the parameter count is that of G heads, not H."""
    m = GroupedQueryAttention(64, 8, 2)
    assert m.W_K.weight.shape == (2 * 8, 64) and m.W_V.weight.shape == (2 * 8, 64)


def _torch_mha(m: MultiHeadAttention, bias: bool):
    ref = torch.nn.MultiheadAttention(m.dim, m.num_heads, bias=bias, batch_first=True, dtype=F64)
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([m.W_Q.weight, m.W_K.weight, m.W_V.weight]))
        ref.out_proj.weight.copy_(m.W_O.weight)
        if bias:
            ref.in_proj_bias.copy_(torch.cat([m.W_Q.bias, m.W_K.bias, m.W_V.bias]))
            ref.out_proj.bias.copy_(m.W_O.bias)
    return ref.eval()


@pytest.mark.parametrize("bias", [False, True])
def test_parity_with_torch_multihead_attention(bias):
    m = randomize(MultiHeadAttention(16, 4, bias=bias, dtype=F64))
    ref = _torch_mha(m, bias)
    x, y = torch.randn(2, 5, 16, dtype=F64), torch.randn(2, 7, 16, dtype=F64)
    expected, _ = ref(x, y, y, need_weights=False)
    assert rel_err(m(x, y), expected) <= 1e-10
    # masks: torch's bool masks are True = blocked, ours True = may attend
    causal = torch.ones(5, 5, dtype=torch.bool).triu(1)
    expected, _ = ref(x, x, x, attn_mask=causal, need_weights=False)
    assert rel_err(m(x, is_causal=True), expected) <= 1e-10
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[0, 4:] = True
    expected, _ = ref(x, y, y, key_padding_mask=pad, need_weights=False)
    assert rel_err(m(x, y, key_padding_mask=~pad), expected) <= 1e-10


# -- per-head q/k norms (Qwen3, Gemma 3) -----------------------------------------------------------
def _qk_norm_gqa(eps=1e-6):
    torch.manual_seed(3)
    m = randomize(GroupedQueryAttention(32, 4, 2, head_dim=8, grouping="blocked", rope_base=10000.0,
                                        qk_norm_eps=eps, dtype=F64))
    with torch.no_grad():  # gains away from 1, and a key head with a large scale, which the norm removes
        m.q_head_norm.weight.uniform_(0.5, 1.5)
        m.k_head_norm.weight.uniform_(0.5, 1.5)
        m.W_K.weight[:8] *= 50
    return m


def test_qk_norm_matches_the_oracle_full_and_cached():
    """Float64: the written-out oracle (each head vector RMS-normalised before RoPE), whole and step by step."""
    m = _qk_norm_gqa()
    x = torch.randn(2, 6, 32, dtype=F64)
    want = gqa_ref(m, x, causal=True)
    assert rel_err(m(x, is_causal=True), want) <= 1e-10
    cache = m.init_cache(2, 6)
    steps = [m(x[:, :3], cache=cache, is_causal=True)] + [m(x[:, i:i + 1], cache=cache) for i in range(3, 6)]
    assert rel_err(torch.cat(steps, dim=1), want) <= 1e-10


def test_qk_norm_survives_save_and_load(tmp_path):
    from attnlab.io import load_module, save_module

    m = _qk_norm_gqa(eps=1e-5)
    save_module(m, tmp_path / "ck")
    back = load_module(tmp_path / "ck")
    assert back.config()["qk_norm_eps"] == 1e-5
    x = torch.randn(1, 5, 32, dtype=F64)
    assert torch.equal(back(x, is_causal=True), m(x, is_causal=True))


@pytest.mark.parametrize("eps", [0, -1e-6, "1e-6", True])
def test_qk_norm_eps_must_be_positive(eps):
    with pytest.raises(ValueError, match=f"qk_norm_eps must be a positive number or None, got {eps!r}"):
        GroupedQueryAttention(32, 4, 2, qk_norm_eps=eps)


def test_conversions_that_would_drop_qk_norms_refuse_them():
    """Every conversion but the exact gqa_to_mla and the decoupled one with the keys whole (which carry them)
    refuses per-head q/k norms; the decoupled one names the rope_dim it takes (tests/test_norm_families.py)."""
    from attnlab.convert import gqa_to_mha, gqa_to_mla_decoupled, mha_to_mla

    m = _qk_norm_gqa()
    for convert in (gqa_to_mha, lambda g: mha_to_mla(g, latent_dim=8)):
        with pytest.raises(ValueError, match=r"per-head q/k norms yet \(qk_norm_eps=1e-06"):
            convert(m)
    with pytest.raises(ValueError, match=r"converts only with its keys whole: rope_dim = G x d = 2 x 8 = 16"):
        gqa_to_mla_decoupled(m, 8, 2)


# -- Gemma 3's layers: a sliding window and a query scale of their own ----------------------------------------
def _gemma_like(window=3):
    torch.manual_seed(4)
    return randomize(GroupedQueryAttention(32, 4, 2, head_dim=8, grouping="blocked", rope_base=10000.0,
                                           qk_norm_eps=1e-6, softmax_scale=0.21, sliding_window=window, dtype=F64))


def test_sliding_window_and_scale_match_the_oracle_full_cached_and_padded():
    """Float64 against the written-out oracle (a query at i sees keys i - 3 < j <= i, scores times 0.21): a whole
    causal forward, a prefill then steps past the window through attnlab's cache, and a padding mask merged in."""
    m = _gemma_like()
    x = torch.randn(2, 9, 32, dtype=F64)
    want = gqa_ref(m, x, causal=True)
    assert rel_err(m(x, is_causal=True), want) <= 1e-10
    assert rel_err(m(x), want) <= 1e-10  # a sliding layer is causal whether or not is_causal says so
    cache = m.init_cache(2, 9)
    steps = [m(x[:, :4], cache=cache, is_causal=True)] + [m(x[:, i:i + 1], cache=cache) for i in range(4, 9)]
    assert rel_err(torch.cat(steps, dim=1), want) <= 1e-10
    keep = torch.ones(2, 9, dtype=torch.bool)
    keep[1, 7] = False  # one key hidden from row 1
    mask = keep[:, None, None, :]
    assert rel_err(m(x, mask=mask), gqa_ref(m, x, causal=True, mask=mask)) <= 1e-10
    wide = GroupedQueryAttention(32, 4, 2, head_dim=8, grouping="blocked", rope_base=10000.0, qk_norm_eps=1e-6,
                                 softmax_scale=0.21, dtype=F64)
    wide.load_state_dict(m.state_dict())
    assert rel_err(wide(x, is_causal=True), want) > 1e-3  # the window did cut something


@pytest.mark.parametrize("kw, fragment", [({"sliding_window": 0}, "sliding_window"),
                                          ({"softmax_scale": -1.0}, "softmax_scale must be a positive number")])
def test_window_and_scale_refuse_bad_values(kw, fragment):
    with pytest.raises(ValueError, match=fragment):
        GroupedQueryAttention(32, 4, 2, **kw)


def test_conversions_refuse_a_window_or_scale_they_would_drop():
    from attnlab.convert import gqa_to_mla_decoupled

    for kw in ({"sliding_window": 4}, {"softmax_scale": 0.3}):
        m = GroupedQueryAttention(32, 4, 2, rope_base=10000.0, **kw)
        with pytest.raises(ValueError, match=f"{next(iter(kw))}=.* no conversion carries it"):
            gqa_to_mla_decoupled(m, 8, 2)


@pytest.mark.parametrize("method", ["select", "block-svd"])
def test_exact_mla_carries_norms_scale_and_window(method):
    """gqa_to_mla of a Gemma-like layer, float64: the GQA-tiled path ("select": the cache holds the GQA's K and V)
    and the general expanded one ("block-svd") both give the GQA's output, whole and step by step past the
    window through the MLA's own cache; the absorbed path, which cannot hold a key norm, is refused."""
    from attnlab.convert import gqa_to_mla

    g = _gemma_like()
    mla, report = gqa_to_mla(g, method=method)
    assert report.exact and (mla.kv_tiling is not None) == (method == "select")
    x = torch.randn(2, 9, 32, dtype=F64)
    want = g(x, is_causal=True)
    with torch.no_grad():  # (the tiled path is taken where no gradient reaches W_UK/W_UV)
        assert rel_err(mla(x, is_causal=True), want) <= 1e-10
        cache = mla.init_cache(2, 9)
        steps = [mla(x[:, :4], cache=cache, is_causal=True)] + [mla(x[:, i:i + 1], cache=cache) for i in range(4, 9)]
        assert rel_err(torch.cat(steps, dim=1), want) <= 1e-10
    assert rel_err(mla(x, is_causal=True), want) <= 1e-10  # and the expanded path, with autograd on
    with pytest.raises(ValueError, match="no absorbed path"):
        mla(x, is_causal=True, absorbed=True)
