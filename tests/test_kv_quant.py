"""Quantised KV storage (modules/cache.py): int8 and fp8 caches with scales, read back by every attention path.

Oracles and invariants:
(a) a float64 quantiser written here, independent of the library (scale = amax / 127 or / 448,
    round half to even by hand, float8_e4m3fn rounding by binade): the library's scales, codes and
    read-back values must match it, and the read-back error stays within the format's own bound
    (half an int8 step; half an e4m3 ulp);
(b) every attention path (GQA, MLA expanded / absorbed / GQA-tiled, the absorbed-decode twin) on a
    quantised cache equals the same path on a plain cache that holds the dequantised values (the Triton
    kernel on quantised caches, in triton's interpreter and on a GPU, is tested in tests/test_kernels.py,
    whose interpreter child runs it with the kernel's other tests);
(c) token-by-token decode with a quantised cache equals a forward without a cache whose module has
    that kv_dtype (the same quantisation, applied before attention), float64;
(d) bytes_per_token and values_per_token equal what the cache allocated (every tensor it holds) and
    the formula of docs/generation.md.

Tolerances: float64 comparisons use 1e-10 (as the rest of the suite: same values, different order of
sums); float32 comparisons of one path on two caches holding the same values use 16 float32 epsilons
(the same arithmetic, at most a different summation order).
"""
import re

import pytest
import torch

from attnlab import GroupedQueryAttention, MultiHeadAttention, MultiHeadLatentAttention
from attnlab.kernels import absorbed_decode, absorbed_decode_reference, mla_decode
from attnlab.modules import storage as storage_mod
from attnlab.modules.storage import QuantisedKV, check_kv_dtype, quantise
from conftest import F64, randomize
from reference import rel_err

F32_TOL = 16 * torch.finfo(torch.float32).eps  # one path, the same values: float32 rounding only
F64_TOL = 1e-10
QUANTISED = ["int8", "fp8", "int8/g4", "fp8/g4"]


# -- (a) the float64 oracle ----------------------------------------------------------------------
def round_half_even(y: torch.Tensor) -> torch.Tensor:
    """Nearest integer, ties to the even one, by hand (float64)."""
    f = torch.floor(y)
    d = y - f
    return torch.where(d > 0.5, f + 1, torch.where(d < 0.5, f, f + torch.remainder(f, 2)))


def e4m3_round(y: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn rounding of float64 |y| <= 448: 3 mantissa bits, exponents from -6 (below: subnormal
    steps of 2^-9), ties to even."""
    a = y.abs()
    e = torch.floor(torch.log2(a.clamp_min(2.0 ** -40))).clamp(min=-6)  # the binade (subnormals share -6's step)
    step = 2.0 ** (e - 3)
    return torch.sign(y) * round_half_even(a / step) * step


def groups(parts, group):
    """[(first channel, end)] of each scale of a row, in the library's documented order."""
    out, start = [], 0
    for w in parts:
        g = w if group is None else group
        out += [(a, min(a + g, start + w)) for a in range(start, start + w, g)]
        start += w
    return out


def oracle_scales(x64, parts, group, qmax):
    return torch.stack([x64[..., a:b].abs().amax(-1) / qmax for a, b in groups(parts, group)], -1)  # (..., n)


def per_channel(scales, parts, group):
    """(..., n) scales -> (..., W), each channel its group's scale."""
    return torch.cat([scales[..., i:i + 1].expand(*scales.shape[:-1], b - a)
                      for i, (a, b) in enumerate(groups(parts, group))], -1)


def _rows(seed=0):
    """(B, S, r + p) rows whose latent (r = 10) and rope (p = 6) parts have different sizes, one row all zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.cat([torch.randn(2, 7, 10, generator=g, dtype=F64), 40 * torch.randn(2, 7, 6, generator=g, dtype=F64)],
                  -1)
    x[1, 3] = 0.0
    return x.float()


@pytest.mark.parametrize("group", [None, 4, 3])
def test_int8_round_trip_matches_float64_oracle(group):
    x = _rows()
    parts = (10, 6)
    codes, scales = quantise(x, parts, check_kv_dtype("int8" if group is None else f"int8/g{group}"))
    x64 = x.double()
    want = oracle_scales(x64, parts, group, 127.0)
    assert codes.dtype == torch.int8 and scales.dtype == torch.float32
    assert torch.equal(scales, want.float())  # float32 amax / 127 is the correctly rounded quotient
    s = per_channel(scales.double(), parts, group)  # the library's scales, exactly, per channel
    y = x64 / torch.where(s > 0, s, torch.ones_like(s))
    want_codes = round_half_even(y).clamp(-127, 127)
    near_tie = (torch.remainder(y, 1.0) - 0.5).abs() < 128 * 2.0 ** -24  # float32 division may tip these
    assert torch.equal(codes.double()[~near_tie], want_codes[~near_tie])
    assert (codes.double() - want_codes).abs().max() <= 1
    back = storage_mod.dequantise(codes, scales, parts, group, torch.float32).double()
    # half a step, plus a near tie tipped by float32 division (127 * 2^-24 of a step) and float32 products
    assert (back - x64).abs().le(s * (0.5 + 2.0 ** -16) + x64.abs() * 2.0 ** -23).all()
    assert torch.equal(back[1, 3], torch.zeros_like(back[1, 3]))  # a zero row: scale 0, codes 0
    per_row = storage_mod.round_trip(x, "int8", (16,))  # one scale for the whole row: the small latent suffers
    assert rel_err(per_row[..., :10], x[..., :10]) > rel_err(back[..., :10], x64[..., :10])


@pytest.mark.parametrize("group", [None, 4])
def test_fp8_round_trip_matches_float64_oracle(group):
    x = _rows(1)
    x[0, 0, 0] = 1e-5 * x[0, 0, 1:10].abs().max()  # x / s = 0.0045: among e4m3's subnormals (below 2^-6)
    parts = (10, 6)
    codes, scales = quantise(x, parts, check_kv_dtype("fp8" if group is None else f"fp8/g{group}"))
    x64 = x.double()
    assert codes.dtype == torch.float8_e4m3fn
    assert torch.equal(scales, oracle_scales(x64, parts, group, 448.0).float())
    s = per_channel(scales.double(), parts, group)
    y = (x64 / torch.where(s > 0, s, torch.ones_like(s))).clamp(-448, 448)
    want = e4m3_round(y)
    step = 2.0 ** (torch.floor(torch.log2(y.abs().clamp_min(2.0 ** -40))).clamp(min=-6) - 3)
    near_tie = (torch.remainder(y.abs() / step, 1.0) - 0.5).abs() < 1e-5  # float32 division may tip these
    got = codes.double()
    assert torch.equal(got[~near_tie], want[~near_tie])
    back = storage_mod.dequantise(codes, scales, parts, group, torch.float32).double()
    assert (back - x64).abs().le(s * step / 2 + x64.abs() * 2.0 ** -22).all()  # half an e4m3 ulp, float32 rounding
    assert got[0, 0, 0] != 0 and got[0, 0, 0].abs() < 2.0 ** -6  # kept as a subnormal, not flushed


def test_plain_storage_rounds_to_its_dtype():
    x = _rows()
    assert torch.equal(storage_mod.round_trip(x, "bf16", (16,)), x.to(torch.bfloat16).float())
    assert torch.equal(storage_mod.round_trip(x, "fp32", (16,)), x)


# -- (b) every path on a quantised cache == the same path on its dequantised values --------------
def _mla(**kw):
    torch.manual_seed(0)
    m = MultiHeadLatentAttention(32, 4, kw.pop("latent_dim", 12), head_dim=8, v_head_dim=6, **kw)
    return randomize(m, std=0.3).float()


def _tiled_mla(**kw):
    """An MLA holding the GQA tiling (G = 2 KV heads of d = 8, dv = 6): the cache is the GQA's K and V."""
    torch.manual_seed(0)
    m = MultiHeadLatentAttention(32, 4, 2 * (8 + 6), head_dim=8, v_head_dim=6, kv_tiling="blocked", **kw)
    with torch.no_grad():
        for lin in (m.W_Q, m.W_DKV, m.W_O):
            lin.weight.normal_(0, 0.3)
    return m.float()


def _gqa(**kw):
    torch.manual_seed(0)
    return randomize(GroupedQueryAttention(24, 6, 2, rope_base=10000.0, **kw), std=0.3).float()


MODULES = {"gqa": (_gqa, 24, {}), "mla-absorbed": (lambda **k: _mla(rope_dim=4, latent_norm=True, **k), 32,
                                                   {"absorbed": True}),
           "mla-expanded": (lambda **k: _mla(rope_dim=4, latent_norm=True, **k), 32, {"absorbed": False}),
           "mla-tiled": (_tiled_mla, 32, {})}


@pytest.mark.parametrize("kv_dtype", QUANTISED)
@pytest.mark.parametrize("name", list(MODULES))
def test_each_path_reads_a_quantised_cache_as_its_dequantised_values(name, kv_dtype):
    """A static (cross-attention) cache filled once: the quantised one, and a plain one whose buffers are then
    overwritten with the quantised one's read-back values. One query step through the same path on each."""
    make, dim, kw = MODULES[name]
    m = make()
    g = torch.Generator().manual_seed(2)
    x0, x1 = torch.randn(2, 1, dim, generator=g), torch.randn(2, 3, dim, generator=g)
    y = torch.randn(2, 9, dim, generator=g)
    quant, plain = m.init_cache(2, 9, kv_dtype=kv_dtype), m.init_cache(2, 9)
    with torch.no_grad():
        m(x0, y, cache=quant, **kw)
        m(x0, y, cache=plain, **kw)
        exact = [m(x, y, cache=plain, **kw) for x in (x0, x1)]  # the unquantised values
        stored = quant.view_stored()
        assert all(isinstance(t, QuantisedKV) for t in stored)
        for buf, t in zip(plain.tensors(), stored):
            buf[..., :9, :] = t.dequantise()
        got = [m(x, y, cache=quant, **kw) for x in (x0, x1)]
        want = [m(x, y, cache=plain, **kw) for x in (x0, x1)]
    for a, b, e in zip(got, want, exact):
        assert rel_err(a, b) <= F32_TOL
        assert rel_err(a, e) > 100 * F32_TOL  # the quantisation did change what is read
    if name == "mla-tiled":  # the tiled cache is a GQA's: a scale per token and KV head of K and of V
        per_head = {"k": 1, "v": 1} if "/g4" not in kv_dtype else {"k": 8 // 4, "v": -(-6 // 4)}
        assert tuple(quant.k_scales.shape[1:]) == (2, 9, per_head["k"])  # G = 2 heads of d = 8
        assert tuple(quant.v_scales.shape[1:]) == (2, 9, per_head["v"])  # ... and of dv = 6


@pytest.mark.parametrize("kv_dtype", QUANTISED)
def test_twin_reads_quantised_rows_as_their_dequantised_values(kv_dtype):
    g = torch.Generator().manual_seed(3)
    B, H, S, r, p = 2, 3, 11, 12, 4
    q = torch.randn(B, H, r + p, generator=g)
    kv = torch.randn(B, S, r + p, generator=g)
    fmt = check_kv_dtype(kv_dtype)
    codes, scales = quantise(kv, (r, p), fmt)
    deq = storage_mod.dequantise(codes, scales, (r, p), fmt.group, torch.float32)
    keep = torch.rand(B, S, generator=g) > 0.3
    keep[:, -1] = True
    got = absorbed_decode_reference(q, codes, torch.tensor([S, 7]), 0.4, r, keep, kv_scales=scales,
                                    scale_group=fmt.group)
    want = absorbed_decode_reference(q, deq, torch.tensor([S, 7]), 0.4, r, keep)
    assert rel_err(got, want) <= F32_TOL
    assert rel_err(got, absorbed_decode_reference(q, kv, torch.tensor([S, 7]), 0.4, r, keep)) > 100 * F32_TOL


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8/g4"])
def test_module_hands_the_quantised_cache_to_the_kernel(monkeypatch, kv_dtype):
    """With the kernel replaced by its twin: a decode step gives the kernel the codes and scales (no dequantised
    copy), and the result equals the PyTorch absorbed path on the same cache."""
    calls = []

    def twin(q, kv, *args, **kw):
        calls.append((kv.dtype, kw.get("kv_scales") is not None))
        return absorbed_decode_reference(q, kv, *args, **kw)

    monkeypatch.setattr(mla_decode, "absorbed_decode", twin)
    m = _mla(rope_dim=4, latent_norm=True).double()
    x = torch.randn(2, 7, 32, dtype=F64)
    outs = {}
    for mode in ("torch", "triton"):
        monkeypatch.setenv(mla_decode.ENV, mode)
        cache = m.init_cache(2, 7, kv_dtype=kv_dtype)
        with torch.no_grad():
            outs[mode] = torch.cat([m(x[:, :4], cache=cache, is_causal=True)] +
                                   [m(x[:, t:t + 1], cache=cache) for t in range(4, 7)], 1)
    assert calls == [(check_kv_dtype(kv_dtype).storage_dtype, True)] * 3
    assert rel_err(outs["triton"], outs["torch"]) <= F64_TOL


# -- (b') scales folded into the scores and weights: the same attention as on the scaled rows --------
@pytest.mark.parametrize("grouping", ["blocked", "strided"])
@pytest.mark.parametrize("H,G,L", [(6, 2, 1), (6, 2, 5), (3, 3, 1), (4, 1, 3)])
def test_attend_with_row_scales_equals_attend_on_the_scaled_rows(grouping, H, G, L):
    """attend(q, k, v, key_scale=a, value_scale=b) against attend(q, k * a, v * b) in float64: decode rows
    (the few-rows route folds the factors into scores and weights), prefill rows (causal: they go on the
    rows), C = 1 heads, a key-padding mask with a row that has nothing to attend."""
    from attnlab.modules.attention import attend

    g = torch.Generator().manual_seed(H * 10 + G + L)
    B, S, d, dv = 2, 9, 5, 4
    q, k, v = (torch.randn(B, n, m, w, generator=g, dtype=F64) for n, m, w in ((H, L, d), (G, S, d), (G, S, dv)))
    a, b = (torch.rand(B, G, S, generator=g, dtype=F64) + 0.1 for _ in range(2))
    a[0, 0, 2] = 0.0  # a zero scale (an all-zero row of a quantised cache)
    mask = torch.ones(B, 1, 1, S, dtype=torch.bool)
    mask[1] = False  # nothing to attend: zeros either way
    for kw in ({"is_causal": True}, {"mask": mask} if L == 1 else {"is_causal": True}, {}):
        got = attend(q, k, v, grouping=grouping, key_scale=a, value_scale=b, **kw)
        want = attend(q, k * a[..., None], v * b[..., None], grouping=grouping, **kw)
        assert rel_err(got, want) <= F64_TOL
        assert rel_err(got, attend(q, k, v, grouping=grouping, **kw)) > 1e3 * F64_TOL  # the factors mattered


def test_attend_names_a_row_scale_of_the_wrong_shape():
    from attnlab.modules.attention import attend

    q, k = torch.zeros(1, 4, 1, 3), torch.zeros(1, 2, 5, 3)
    with pytest.raises(ValueError, match=r"key_scale must have shape \(1, 2, 5\), got \(1, 5\)"):
        attend(q, k, k, key_scale=torch.ones(1, 5))
    with pytest.raises(ValueError, match=r"key_scale must have shape \(1, 2, 5, 2\), got \(1, 2, 5\)"):
        attend(q, k, k, key_scale=torch.ones(1, 2, 5), key_parts=(1, 2))
    with pytest.raises(ValueError, match=r"key_parts \(2, 2\) must be positive widths adding up to the key size 3"):
        attend(q, k, k, key_scale=torch.ones(1, 2, 5, 2), key_parts=(2, 2))


@pytest.mark.parametrize("L", [1, 4])
def test_attend_with_a_scale_per_key_part_equals_attend_on_the_scaled_parts(L):
    """key_parts (an MLA row: latent and rope key, each with its scale): the factors multiply each part's partial
    scores on the few-rows route and each part's columns otherwise; float64 against the scaled rows."""
    from attnlab.modules.attention import attend

    g = torch.Generator().manual_seed(L)
    B, H, S, r, p = 2, 4, 7, 6, 3
    q = torch.randn(B, H, L, r + p, generator=g, dtype=F64)
    rows = torch.randn(B, 1, S, r + p, generator=g, dtype=F64)
    s = torch.rand(B, 1, S, 2, generator=g, dtype=F64) + 0.1
    scaled = torch.cat([rows[..., :r] * s[..., :1], rows[..., r:] * s[..., 1:]], -1)
    got = attend(q, rows, rows[..., :r], is_causal=True, key_scale=s, key_parts=(r, p), value_scale=s[..., 0])
    want = attend(q, scaled, scaled[..., :r], is_causal=True)
    assert rel_err(got, want) <= F64_TOL
    swapped = attend(q, rows, rows[..., :r], is_causal=True, key_scale=s.flip(-1), key_parts=(r, p),
                     value_scale=s[..., 0])
    assert rel_err(swapped, want) > 1e3 * F64_TOL  # each part takes its own scale


@pytest.mark.parametrize("name", ["gqa", "mla-absorbed"])
def test_decode_on_per_token_int8_reads_the_codes_without_a_dequantised_copy(monkeypatch, name):
    """One int8 scale per token and part: a decode step takes the codes and folds the scales into the scores
    (QuantisedKV.dequantise is never called), and equals the same step on a twin cache read dequantised
    (foldable switched off). An all-zero token with a zero scale is among the cached ones."""
    make, dim, kw = MODULES[name]
    m = make()
    g = torch.Generator().manual_seed(5)
    x, x1 = torch.randn(2, 6, dim, generator=g), torch.randn(2, 1, dim, generator=g)
    caches = [m.init_cache(2, 8, kv_dtype="int8") for _ in range(2)]
    with torch.no_grad():
        for c in caches:
            m(x, cache=c, is_causal=True, **kw)
            for t in c.tensors():
                t[0, ..., 2, :] = 0  # token 2 of row 0: zero codes and zero scales
        with monkeypatch.context() as patch:
            patch.setattr(QuantisedKV, "dequantise", lambda self: pytest.fail("decode dequantised the cache"))
            got = m(x1, cache=caches[0], **kw)
        with monkeypatch.context() as patch:
            patch.setattr(QuantisedKV, "foldable", property(lambda self: False))
            want = m(x1, cache=caches[1], **kw)
    assert rel_err(got, want) <= F32_TOL


# -- (c) cached decode with a quantised cache == a forward without cache through the same storage --
DECODERS = {
    "gqa": lambda: randomize(GroupedQueryAttention(24, 6, 2, rope_base=10000.0, bias=True, dtype=F64), std=0.3),
    "mha": lambda: randomize(MultiHeadAttention(24, 4, rope_base=10000.0, dtype=F64), std=0.3),
    "mla": lambda: randomize(MultiHeadLatentAttention(24, 4, 10, head_dim=6, v_head_dim=5, rope_dim=4,
                                                      latent_norm=True, bias=True, dtype=F64), std=0.3),
    "mla-rope-after-up": lambda: randomize(MultiHeadLatentAttention(24, 4, 10, head_dim=6, rope_after_up=True,
                                                                    dtype=F64), std=0.3),
    "mla-tiled": lambda: _tiled_mla().double(),
}


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8/g4"])
@pytest.mark.parametrize("name", list(DECODERS))
def test_quantised_decode_equals_full_forward_through_the_same_storage(name, kv_dtype):
    torch.manual_seed(0)
    m = DECODERS[name]()
    dim = m.dim
    x = torch.randn(2, 8, dim, dtype=F64)
    with torch.no_grad():
        plain = m(x, is_causal=True)
        m.kv_dtype = kv_dtype
        full = m(x, is_causal=True)
        for absorbed in ((None, True, False) if name == "mla" else (None,)):
            cache = m.init_cache(2, 8)  # defaults to the module's kv_dtype
            assert cache.kv_dtype == kv_dtype and cache.quantised
            kw = {} if absorbed is None else {"absorbed": absorbed}
            steps = [m(x[:, :3], cache=cache, is_causal=True, **kw)]
            steps += [m(x[:, t:t + 1], cache=cache, **kw) for t in range(3, 8)]
            assert rel_err(torch.cat(steps, 1), full) <= F64_TOL
    assert rel_err(full, plain) > 1e3 * F64_TOL  # the forward did go through the storage


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("name", ["gqa", "mla"])
def test_training_through_a_quantised_storage_reaches_the_key_value_weights(name, kv_dtype):
    """A heal of a model with 8-bit storage: the forward's values are the storage's (equal to the no-grad
    forward), and the gradient reaches every weight, the key/value (latent) projections included, as
    the straight-through identity's: the gradient of the same loss with the storage's values held fixed
    (integer codes once cut the graph, and those projections never trained)."""
    torch.manual_seed(0)
    m = DECODERS[name]()
    m.kv_dtype = kv_dtype
    x = torch.randn(2, 8, m.dim, dtype=F64)
    target = torch.randn(2, 8, m.dim, dtype=F64)
    with torch.no_grad():
        stored = m(x, is_causal=True)
    out = m(x, is_causal=True)
    assert rel_err(out.detach(), stored) <= F64_TOL
    ((out - target) ** 2).sum().backward()
    grads = {k: p.grad.clone() for k, p in m.named_parameters()}
    assert all(g is not None and bool(g.abs().sum() > 0) for g in grads.values()), \
        [k for k, g in grads.items() if g is None or not bool(g.abs().sum() > 0)]
    # the oracle: the same loss where the stored values are the unquantised ones plus a fixed offset
    m.zero_grad()
    parts = {}
    original = storage_mod.round_trip

    def fixed_offset(t, fmt, p, role=None):
        parts[t.shape] = (original(t.detach(), fmt, p, role) - t.detach())
        return t + parts[t.shape]
    m.kv_dtype = kv_dtype
    import attnlab.modules.base as base_mod
    base_mod.round_trip, saved = fixed_offset, base_mod.round_trip
    try:
        ((m(x, is_causal=True) - target) ** 2).sum().backward()
    finally:
        base_mod.round_trip = saved
    for k, p in m.named_parameters():
        assert rel_err(grads[k], p.grad) <= F64_TOL, k


# -- a whole model: the Generator's quantised caches, transformers' cache, bytes -----------------
def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    from attnlab.models import to_attnlab

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   initializer_range=0.2)
    return to_attnlab(transformers.LlamaForCausalLM(cfg).double().eval())


@pytest.mark.parametrize("kv_dtype, fixed", [("int8", False), ("fp8", True)])
def test_generator_quantised_caches_equal_full_forward_with_the_models_kv_dtype(kv_dtype, fixed):
    """Prefill + steps of the Generator (its caches quantised) == one forward of the model (through transformers'
    cache, each module passing its keys through kv_dtype's storage): the logits of every fed token. The fixed-shape
    step writes its codes at a slot held in a tensor (fp8: as bytes, index_copy_ has no float8 on the CPU)."""
    from attnlab.generation.generator import Generator
    from attnlab.models import kv_bytes_per_token, set_kv_dtype

    model = _tiny_llama()
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        plain = model(ids).logits
        set_kv_dtype(model, kv_dtype)
        full = model(ids).logits  # (2, 9, V)
    gen = Generator(model, 2, 9, fixed_shape=fixed, compile=False)
    steps = [gen.prefill(ids[:, :5])] + [gen.step(ids[:, t]) for t in range(5, 9)]
    assert rel_err(torch.stack(steps, 1), full[:, 4:]) <= F64_TOL
    assert gen.kv_bytes_per_token == kv_bytes_per_token(model)
    assert rel_err(full, plain) > 1e3 * F64_TOL
    set_kv_dtype(model, None)
    gen = Generator(model, 1, 4, kv_dtype=kv_dtype)  # an explicit kv_dtype beats the modules' (None)
    assert all(c.kv_dtype == kv_dtype for c in gen.caches)


def test_fixed_slot_step_on_a_quantised_cache_traces_as_one_graph():
    """The fixed-shape decode step (CUDA graphs) writes its token's codes and scales at a slot held in a tensor:
    torch.compile traces it whole (fullgraph) and it equals the ordinary step on a second cache."""
    m = _mla(rope_dim=4, latent_norm=True)
    x, x1 = torch.randn(2, 3, 32), torch.randn(2, 1, 32)
    slot = torch.tensor([3])
    valid = torch.zeros(2, 8, dtype=torch.bool)
    valid[:, :4] = True
    torch._dynamo.reset()
    with torch.no_grad():
        fixed, plain = m.init_cache(2, 8, kv_dtype="fp8"), m.init_cache(2, 8, kv_dtype="fp8")
        m(x, cache=fixed, is_causal=True)
        m(x, cache=plain, is_causal=True)
        view = fixed.fixed_slot(slot)
        step = torch.compile(lambda t: m(t, cache=view, key_padding_mask=valid, positions=slot), fullgraph=True,
                             backend="eager")
        got = step(x1)
        want = m(x1, cache=plain)
    assert rel_err(got, want) <= F32_TOL
    assert torch.equal(fixed.kv[:, :4].view(torch.uint8), plain.kv[:, :4].view(torch.uint8))  # the same codes
    assert torch.equal(fixed.kv_scales[:, :4], plain.kv_scales[:, :4])


def _allocated(cache) -> int:
    """Bytes of every tensor the cache object holds (read from its attributes, not from tensors())."""
    return sum(v.numel() * v.element_size() for v in vars(cache).values() if isinstance(v, torch.Tensor))


@pytest.mark.parametrize("kv_dtype", [None, "fp32", "bf16", "int8", "fp8", "int8/g4", "fp8/g3"])
def test_bytes_per_token_count_what_is_allocated(kv_dtype):
    B, S = 3, 5
    mla = MultiHeadLatentAttention(32, 4, 10, head_dim=8, rope_dim=6)  # r = 10, p = 6
    gqa = GroupedQueryAttention(24, 6, 2, head_dim=4, v_head_dim=5)  # G = 2, d = 4, dv = 5
    tiled = _tiled_mla()  # G = 2, d = 8, dv = 6
    fmt = check_kv_dtype(kv_dtype)
    size = {None: 4, "fp32": 4, "bf16": 2}.get(kv_dtype, 1)
    g = None if fmt is None else fmt.group

    def n_scales(widths):
        return 0 if fmt is None or not fmt.quantised else sum(1 if g is None else -(-w // g) for w in widths)

    for module, widths in ((mla, (10, 6)), (gqa, (4,) * 2 + (5,) * 2), (tiled, (8,) * 2 + (6,) * 2)):
        cache = module.init_cache(B, S, kv_dtype=kv_dtype)
        values = sum(widths) + n_scales(widths)
        assert cache.bytes_per_token * B * S == _allocated(cache)
        assert cache.values_per_token * B * S == sum(v.numel() for v in vars(cache).values()
                                                     if isinstance(v, torch.Tensor))
        assert cache.bytes_per_token == sum(widths) * size + 4 * n_scales(widths)  # docs/generation.md
        assert cache.values_per_token == values
        assert cache.dtype == torch.float32  # the activations it returns, whatever it stores
        assert cache.batch_view(2).bytes_per_token == cache.bytes_per_token


def test_kv_bytes_per_token_of_a_model_counts_the_storage():
    from attnlab.models import kv_bytes_per_token, set_kv_dtype

    model = _tiny_llama()  # 2 layers, G = 2, head_dim 8
    per_layer = {"fp32": 2 * 2 * 8 * 4, "bf16": 2 * 2 * 8 * 2, "int8": 2 * 2 * 8 + 4 * 4, "fp8": 2 * 2 * 8 + 4 * 4}
    assert kv_bytes_per_token(model) == 2 * 2 * 2 * 8 * 8  # float64 weights, plain storage
    for kv_dtype, n in per_layer.items():
        assert kv_bytes_per_token(model, torch.float32, kv_dtype=kv_dtype) == 2 * n
    set_kv_dtype(model, "int8")
    assert kv_bytes_per_token(model) == 2 * per_layer["int8"]  # default: the modules' own kv_dtype


# -- the module attribute: config, checkpoints -----------------------------------------------------
@pytest.mark.parametrize("make", [lambda: MultiHeadLatentAttention(16, 2, 6, rope_dim=2, kv_dtype="fp8/g4"),
                                  lambda: GroupedQueryAttention(16, 4, 2, kv_dtype="int8"),
                                  lambda: MultiHeadAttention(16, 4, kv_dtype="bf16")])
def test_kv_dtype_is_saved_and_reloaded(tmp_path, make):
    pytest.importorskip("safetensors")
    from attnlab.io import load_module, save_module

    m = make()
    assert m.config()["kv_dtype"] == m.kv_dtype
    back = load_module(save_module(m, tmp_path / "m"))
    assert type(back) is type(m) and back.kv_dtype == m.kv_dtype and back.config() == m.config()


# -- bad input ------------------------------------------------------------------------------------
CHOICES = r"kv_dtype must be one of 'fp32', 'bf16', 'int8', 'fp8' .*got 'int9'"


def test_unknown_kv_dtype_names_it_and_the_choices():
    with pytest.raises(ValueError, match=CHOICES):
        GroupedQueryAttention(16, 4, 2, kv_dtype="int9")
    with pytest.raises(ValueError, match=CHOICES):
        MultiHeadLatentAttention(16, 2, 6).init_cache(1, 4, kv_dtype="int9")
    m = MultiHeadLatentAttention(16, 2, 6)
    with pytest.raises(ValueError, match=CHOICES):
        m.kv_dtype = "int9"
    with pytest.raises(ValueError, match=r"got 'int8/g0'"):
        m.kv_dtype = "int8/g0"
    with pytest.raises(TypeError, match=r"got int \(8\)"):
        m.kv_dtype = 8
    assert m.kv_dtype is None


def test_unknown_kv_dtype_on_a_model_changes_nothing():
    from attnlab.generation.generator import Generator
    from attnlab.models import attnlab_modules, kv_bytes_per_token, set_kv_dtype

    model = _tiny_llama()
    set_kv_dtype(model, "int8")
    for call in (lambda: set_kv_dtype(model, "int9"), lambda: kv_bytes_per_token(model, kv_dtype="int9"),
                 lambda: Generator(model, 1, 4, kv_dtype="int9")):
        with pytest.raises(ValueError, match=CHOICES):
            call()
    assert [m.kv_dtype for m in attnlab_modules(model)] == ["int8", "int8"]


def test_fp8_where_the_torch_build_lacks_it(monkeypatch):
    from attnlab.modules import storage

    monkeypatch.setattr(storage, "fp8_supported", lambda: False)  # where check_kv_dtype looks it up
    want = re.escape(f"kv_dtype 'fp8' needs torch.float8_e4m3fn, which torch {torch.__version__} does not support; "
                     "use 'int8'")
    with pytest.raises(ValueError, match=want):
        MultiHeadLatentAttention(16, 2, 6, kv_dtype="fp8")
    with pytest.raises(ValueError, match=want):
        GroupedQueryAttention(16, 4, 2).init_cache(1, 4, kv_dtype="fp8")
    assert GroupedQueryAttention(16, 4, 2, kv_dtype="int8").kv_dtype == "int8"  # int8 needs nothing


@pytest.mark.parametrize("fn", [absorbed_decode_reference, absorbed_decode])
def test_kernel_refuses_quantised_rows_without_their_scales(fn):
    q = torch.randn(2, 3, 6)
    codes, scales = quantise(torch.randn(2, 9, 6), (4, 2), check_kv_dtype("int8"))
    with pytest.raises(ValueError, match=r"kv holds torch.int8 codes but no kv_scales were given"):
        fn(q, codes, 9, 1.0, 4)
    with pytest.raises(ValueError, match=r"kv_scales given but kv is torch.float32"):
        fn(q, torch.randn(2, 9, 6), 9, 1.0, 4, kv_scales=scales)
    with pytest.raises(ValueError, match=r"kv_scales must have shape \(B, S, n\) = \(2, 9, 6\) \(scale_group 1\)"):
        fn(q, codes, 9, 1.0, 4, kv_scales=scales, scale_group=1)  # one scale per channel: 6 columns, not 2
    with pytest.raises(TypeError, match=r"kv_scales must be a float32 tensor \(B, S, n\), got torch.float16"):
        fn(q, codes, 9, 1.0, 4, kv_scales=scales.half())


def test_cli_unknown_kv_dtype_is_one_line_with_status_2(capsys, tmp_path):
    pytest.importorskip("typer")
    from attnlab.cli.app import main

    text = tmp_path / "t.txt"
    text.write_text("some words")
    for argv in (["eval", "smollm2", "--text", str(text), "--kv-dtype", "int9"],
                 ["generate", "smollm2", "hello", "--kv-dtype", "int9"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("attnlab: error: kv_dtype must be one of") and "'int9'" in err[0]


def test_cli_eval_scores_and_counts_the_storage(capsys, tmp_path):
    pytest.importorskip("typer")
    pytest.importorskip("tokenizers")
    from tiny_checkpoints import TEXT, make_checkpoint

    from attnlab import models as hf
    from attnlab.cli.app import main

    make_checkpoint("llama", tmp_path / "ck")  # 2 layers, G = 2, head_dim 16
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    assert main(["eval", str(tmp_path / "ck"), "--text", str(text), "--kv-dtype", "int8", "--window", "32"]) == 0
    out = dict(line.split(": ", 1) for line in capsys.readouterr().out.strip().splitlines() if ": " in line)
    model, tok, _ = hf.load_model(str(tmp_path / "ck"))
    ids = hf.read_text_ids(tok, text, 2048)
    plain = hf.perplexity(model, ids, window=32)
    hf.set_kv_dtype(model, "int8")
    assert float(out["perplexity"]) == pytest.approx(hf.perplexity(model, ids, window=32), rel=1e-4)
    assert float(out["perplexity"]) != pytest.approx(plain, rel=1e-6)
    assert int(out["kv bytes per token"].split()[0]) == 2 * (2 * 2 * 16 + 4 * 4)  # layers * (G*(d+dv) codes + 2G scales)
    assert out["kv storage"] == "int8"
