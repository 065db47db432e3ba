import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from reference import gqa_reference, mla_reference  # noqa: E402

F64 = torch.float64


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def randomize(module, std=0.5):
    """Give every parameter (biases and norm weights included) random values."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * std + (1.0 if p.dim() == 1 and p.shape == () else 0.0))
    return module


def assert_mla_is_the_gqa(mla, gqa, length: int = 7, prefill: int = 3, tol: float = 1e-10):
    """A converted MLA gives the GQA's causal self-attention (the oracle's) on both paths and in cached decode."""
    from reference import rel_err

    x = torch.randn(2, length, gqa.dim, dtype=torch.float64)
    expected = gqa_ref(gqa, x, causal=True)
    assert rel_err(mla(x, is_causal=True), expected) <= tol
    assert rel_err(mla(x, is_causal=True, absorbed=True), expected) <= tol
    cache = mla.init_cache(2, length)
    steps = [mla(x[:, :prefill], cache=cache, is_causal=True)] + [
        mla(x[:, t:t + 1], cache=cache, is_causal=True) for t in range(prefill, length)]
    assert rel_err(torch.cat(steps, 1), expected) <= tol


def gqa_ref(m, x, y=None, **kw):
    """The oracle for a GroupedQueryAttention module, weights read off the module."""
    y = x if y is None else y
    biases = tuple(None if lin.bias is None else lin.bias.detach() for lin in (m.W_Q, m.W_K, m.W_V, m.W_O))
    rope = None if m.rope is None else (m.rope.base, m.rope.interleaved)
    qk_norm = None if getattr(m, "k_head_norm", None) is None else (
        m.q_head_norm.weight.detach(), m.k_head_norm.weight.detach(), m.k_head_norm.eps)
    return gqa_reference(x, y, m.W_Q.weight.detach(), m.W_K.weight.detach(), m.W_V.weight.detach(),
                         m.W_O.weight.detach(), m.num_heads, m.num_kv_heads, grouping=m.grouping,
                         biases=biases, rope=rope, qk_norm=qk_norm, scale=getattr(m, "softmax_scale", None),
                         window=getattr(m, "sliding_window", None), **kw)


def mla_params(m):
    p = {}
    for name in ("W_Q", "W_DQ", "W_UQ", "W_DKV", "W_KR", "W_UK", "W_UV", "W_O"):
        lin = getattr(m, name)
        if lin is None:
            continue
        p[name] = lin.weight.detach()
        if lin.bias is not None:
            p["b_" + name] = lin.bias.detach()
    if m.q_norm is not None:
        p["q_norm"] = m.q_norm.weight.detach()
        p["eps"] = m.q_norm.eps
    if m.kv_norm is not None:
        p["kv_norm"] = m.kv_norm.weight.detach()
        p["eps"] = m.kv_norm.eps
    if m.rope is not None:
        p["rope"] = (m.rope.base, m.rope.interleaved)
    p["scale"] = m.scale
    return p


def mla_ref(m, x, y=None, **kw):
    return mla_reference(x, x if y is None else y, mla_params(m), m.num_heads, **kw)
