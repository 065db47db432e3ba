"""KIVI's 16-bit residual as an evaluation baseline ("kivi4+w128"): a GQA's forward without a cache lets each query
read its newest N keys and values plain and the older ones as KIVI stores them; its bytes count the N plain rows."""
import pytest
import torch

from attnlab import GroupedQueryAttention
from attnlab.modules.heads import kv_head_of
from attnlab.modules.storage import check_kv_dtype, round_trip
from conftest import F64, randomize
from reference import rel_err


def _gqa(kv_dtype, sliding_window=None):
    torch.manual_seed(0)
    m = GroupedQueryAttention(64, 4, 2, head_dim=32, rope_base=10000.0, kv_dtype=kv_dtype,
                              sliding_window=sliding_window)
    return randomize(m, std=0.3).double()


def _oracle(m, x, size, window=None):
    """Each query's attention written out over the keys and values it reads: plain within its newest `size`
    positions, as the storage returns them (the whole sequence coded at once) before; in float64."""
    B, S, _ = x.shape
    k, v = m.project_kv(x, torch.arange(S))  # (B, G, S, d)
    fmt = check_kv_dtype(m.kv_dtype)
    ks, vs = round_trip(k, fmt, (m.head_dim,), "key"), round_trip(v, fmt, (m.v_head_dim,), "value")
    q = m.rope(m.W_Q(x).view(B, S, m.num_heads, m.head_dim).transpose(1, 2), torch.arange(S))  # (B, H, S, d)
    heads = kv_head_of(m.num_heads, m.num_kv_heads, m.grouping)  # the KV head each query head reads
    out = []
    for i in range(S):
        seen = range(0 if window is None else max(0, i - window + 1), i + 1)
        kk = torch.stack([k[:, :, j] if j > i - size else ks[:, :, j] for j in seen], 2)  # (B, G, n, d)
        vv = torch.stack([v[:, :, j] if j > i - size else vs[:, :, j] for j in seen], 2)
        kk, vv = kk[:, heads], vv[:, heads]  # (B, H, n, d)
        w = torch.softmax((kk @ q[:, :, i, :, None])[..., 0] * m.scale, dim=-1)  # (B, H, n)
        out.append((w[..., None] * vv).sum(-2).reshape(B, -1))
    return m.W_O(torch.stack(out, 1))


@pytest.mark.parametrize("kv_dtype, window", [("kivi4+w8", None), ("kivi2+w32", None), ("kivi2+w5", 24),
                                              ("quanto2+w3", None)])
def test_each_query_reads_its_newest_rows_plain_and_the_rest_as_stored(kv_dtype, window):
    m = _gqa(kv_dtype, window)
    x = torch.randn(2, 70, 64, dtype=F64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = m(x, is_causal=True)
        want = _oracle(m, x, check_kv_dtype(kv_dtype).recent, window)
        m.kv_dtype = kv_dtype.split("+")[0]
        without = m(x, is_causal=True)
    assert rel_err(got, want) <= 1e-10
    assert rel_err(without, want) > 1e-4  # the residual changed what was read


def test_its_plain_rows_are_counted_a_sequence_and_spread_over_a_context():
    transformers = pytest.importorskip("transformers")
    from attnlab.models import kv_bytes_per_token, kv_fixed_bytes, set_kv_dtype, to_attnlab

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                   max_position_embeddings=64)
    model = to_attnlab(transformers.LlamaForCausalLM(cfg).eval())
    values = 2 * 2 * 32 * 2  # K and V, 2 KV heads of 32, 2 layers
    plain = 128 * values * 2  # 128 rows of them in bfloat16
    assert kv_bytes_per_token(model, torch.bfloat16, "kivi4+w128") == values * 5 // 8  # per token held
    assert kv_bytes_per_token(model, torch.bfloat16, "kivi4+w128", context=512) == values * 5 / 8 + plain / 512
    set_kv_dtype(model, "kivi4+w128")
    assert kv_fixed_bytes(model, torch.bfloat16) == plain


def test_a_cache_refuses_it_and_an_mla_refuses_kivi_whatever_its_window():
    from attnlab import MultiHeadLatentAttention

    m = _gqa("kivi4+w16")
    with pytest.raises(ValueError, match="'kivi4\\+w16'.* stores 'kivi4' without it"):
        m.init_cache(1, 8)
    m.kv_dtype = "kivi4"
    with pytest.raises(ValueError, match="'kivi4' is KIVI, an evaluation baseline"):
        m.init_cache(1, 8)
    with pytest.raises(ValueError, match="KIVI"):
        MultiHeadLatentAttention(64, 4, 32, head_dim=16, rope_dim=8, kv_dtype="kivi4+w16")
