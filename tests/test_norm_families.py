"""Keys whole: the compressed MLA of attention with per-head q/k norms (Qwen3, Gemma 3), float64 against the GQA.

Layers come from transformers' own config classes (a tiny random Qwen3 / Gemma 3 built in memory and swapped
to attnlab's modules): the rope key is each KV head's whole key, normalised per head before RoPE and cached
after it, and the latent holds the values. At latent G x dv the conversion is exact; below, the values are
the SVD's best rank (an oracle computed here); with cache codes, the error is the codes' own.
"""
import copy

import pytest
import torch

from attnlab import models as hf
from attnlab.convert import gqa_to_mla_decoupled
from attnlab.modules.storage import round_trip
from attnlab.modules.heads import kv_head_of
from attnlab.modules.mla import MultiHeadLatentAttention
from conftest import F64, gqa_ref, randomize
from reference import rel_err

H, G, D, HEAD = 4, 2, 64, 24  # query heads, KV heads, hidden size, head size: the rope key is G x d = 48
WINDOW = 4  # Gemma's sliding layer, shorter than the tests' sequences


def tiny_model(kind: str, *, layers: int = 2, dtype=F64, seed: int = 0, attention_std: float = 0.0):
    """A random Qwen3 / Gemma 3 causal LM from transformers' config classes, swapped to attnlab's modules.
    attention_std > 0 redraws the attention projections at that scale (so that attention matters to the logits)."""
    import transformers as T

    kw = dict(vocab_size=97, hidden_size=D, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=H,
              num_key_value_heads=G, head_dim=HEAD, max_position_embeddings=128, tie_word_embeddings=False)
    if kind == "gemma3":  # a sliding layer, then a global one; Gemma's own query scale, a RoPE base per layer type
        kw.update(query_pre_attn_scalar=20, sliding_window=WINDOW,
                  layer_types=["sliding_attention", "full_attention"] * (layers // 2) + ["sliding_attention"] * (
                      layers % 2))
        config, cls = T.Gemma3TextConfig(**kw), T.Gemma3ForCausalLM
    else:
        config, cls = T.Qwen3Config(**kw), T.Qwen3ForCausalLM
    torch.manual_seed(seed)
    model = cls(config).to(dtype).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            a = layer.self_attn
            a.q_norm.weight.uniform_(0.5, 1.5)  # gains away from their initial ones (Gemma's: 1 + weight)
            a.k_norm.weight.uniform_(0.5, 1.5)
            if attention_std:
                for lin in (a.q_proj, a.k_proj, a.v_proj, a.o_proj):
                    lin.weight.normal_(0, attention_std)
    return hf.to_attnlab(model)


def layers_of(kind: str):
    """The swapped float64 GQA of every layer (Gemma: a sliding one, then a global one), weights randomised."""
    mods = hf.attnlab_modules(tiny_model(kind))
    for m in mods:
        randomize(m, std=0.3)
    return mods


def _steps(m, x, prefill: int, **kw):
    """Prefill then one token at a time through the module's own cache; (B, L, dim)."""
    cache = m.init_cache(x.shape[0], x.shape[1])
    out = [m(x[:, :prefill], cache=cache, is_causal=True, **kw)]
    out += [m(x[:, t:t + 1], cache=cache, **kw) for t in range(prefill, x.shape[1])]
    return torch.cat(out, dim=1)


def convert_whole(g, latent_dim=None, **kw):
    return gqa_to_mla_decoupled(g, latent_dim or g.num_kv_heads * g.v_head_dim, g.head_dim // 2, **kw)


# -- exact at full rank ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["qwen3", "gemma3"])
def test_full_rank_values_make_the_keys_whole_mla_the_gqa(kind):
    """latent = G x dv: the MLA is the GQA to float64 rounding, whole, absorbed and
    step by step through its cache, past Gemma's sliding window; norms, scale and window carried."""
    x = torch.randn(2, 11, D, dtype=F64)
    mods = layers_of(kind)
    assert [g.sliding_window for g in mods] == ([WINDOW, None] if kind == "gemma3" else [None, None])
    for g in mods:
        mla, report = convert_whole(g, calibration=x)
        assert report.exact and report.output_error <= 1e-10
        assert mla.keys_whole and mla.head_dim == 0 and mla.rope_dim == G * HEAD and mla.latent_dim == G * HEAD
        assert mla.sliding_window == g.sliding_window and mla.scale == g.scale
        with torch.no_grad():  # (the GQA's RoPE is transformers' own, frequencies in float32: the oracle is the GQA)
            want = g(x, is_causal=True)
            for absorbed in (False, True):
                assert rel_err(mla(x, is_causal=True, absorbed=absorbed), want) <= 1e-10
                assert rel_err(_steps(mla, x, 3, absorbed=absorbed), want) <= 1e-10


def test_interleaved_rope_source_and_module_layouts_are_exact():
    """A normed GQA with interleaved RoPE (pairs 2i, 2i+1) converts exactly (its norm gains follow its dims into the
    rope key's rotate-half layout), and a keys-whole MLA with interleaved RoPE of its own, built by hand (each KV
    head's key as it is, query head h's key in its KV head's slots), is the GQA too."""
    from attnlab import GroupedQueryAttention
    from attnlab.modules.heads import tile_heads
    from attnlab.modules.rope import RotaryEmbedding

    g = randomize(GroupedQueryAttention(32, 4, 2, head_dim=8, grouping="strided", rope_base=100.0,
                                        rope_interleaved=True, qk_norm_eps=1e-5, dtype=F64), std=0.4)
    x = torch.randn(2, 7, 32, dtype=F64)
    want = gqa_ref(g, x, causal=True)
    mla, report = convert_whole(g)
    assert report.exact and rel_err(mla(x, is_causal=True), want) <= 1e-10

    byhand = MultiHeadLatentAttention(32, 4, 16, v_head_dim=8, rope_dim=16, rope_kv_heads=2, rope_grouping="strided",
                                      rope_interleaved=True, rope_base=100.0, qk_norm_eps=1e-5, softmax_scale=g.scale,
                                      dtype=F64)
    owner = kv_head_of(4, 2, "strided")
    with torch.no_grad():
        byhand.rope = RotaryEmbedding(16, 100.0, interleaved=True, inv_freq=g.rope.inv_freq.repeat(2))
        q = torch.zeros(4, 16, 32, dtype=F64)
        for h in range(4):
            q[h, 8 * owner[h]: 8 * owner[h] + 8] = g.W_Q.weight[8 * h: 8 * h + 8]
        byhand.W_Q.weight.copy_(q.reshape(64, 32))
        byhand.W_KR.weight.copy_(g.W_K.weight)
        byhand.W_DKV.weight.copy_(g.W_V.weight)
        byhand.W_UV.weight.copy_(tile_heads(torch.eye(16, dtype=F64), 4, 2, "strided"))
        byhand.W_O.weight.copy_(g.W_O.weight)
        byhand.q_head_norm.weight.copy_(g.q_head_norm.weight)
        byhand.k_head_norm.weight.copy_(g.k_head_norm.weight)
    for absorbed in (False, True):
        assert rel_err(byhand(x, is_causal=True, absorbed=absorbed), want) <= 1e-10
        assert rel_err(_steps(byhand, x, 2, absorbed=absorbed), want) <= 1e-10


def test_the_query_reads_only_its_own_kv_head_and_training_cannot_change_that():
    """Rows of W_Q outside a query head's own KV head slots get no gradient and, set to anything, change nothing."""
    g = layers_of("qwen3")[1]
    mla, _ = convert_whole(g)
    x = torch.randn(1, 5, D, dtype=F64)
    mla(x, is_causal=True).pow(2).sum().backward()
    owner = kv_head_of(H, G, g.grouping)
    grad = mla.W_Q.weight.grad.view(H, 2, G, HEAD // 2, D)  # (head, half, KV head, pair, input): rotate-half
    for h in range(H):
        others = [k for k in range(G) if k != owner[h]]
        assert grad[h, :, others].abs().max() == 0 and grad[h, :, owner[h]].abs().max() > 0
    before = mla(x, is_causal=True).detach()
    with torch.no_grad():
        w = mla.W_Q.weight.view(H, 2, G, HEAD // 2, D)
        for h in range(H):
            w[h, :, [k for k in range(G) if k != owner[h]]] = 1.0
    assert torch.equal(mla(x, is_causal=True).detach(), before)


# -- below full rank: the SVD's own error ------------------------------------------------------------------------
def _value_oracle(g, W_V):
    """g with its value projection replaced (a GQA whose output the MLA must give)."""
    o = copy.deepcopy(g)
    with torch.no_grad():
        o.W_V.weight.copy_(W_V)
    return o


def _truncated(w, rank, sqrt_cov=None):
    """The best rank-`rank` approximation of w in the metric of the inputs' covariance C = S S^T (S symmetric):
    Eckart-Young on w S, mapped back by S^-1 (the identity without calibration)."""
    a = w if sqrt_cov is None else w @ sqrt_cov
    u, s, vh = torch.linalg.svd(a, full_matrices=False)
    best = (u[:, :rank] * s[:rank]) @ vh[:rank]
    return best if sqrt_cov is None else best @ torch.linalg.inv(sqrt_cov)


@pytest.mark.parametrize("kind", ["qwen3", "gemma3"])
def test_values_of_exact_rank_r_are_exact_at_latent_r_and_below_it_the_svd_decides(kind):
    """W_V of rank 20 (< G x dv = 48): latent 20 is exact again; latent 12 gives exactly the GQA whose W_V is the
    best rank-12 approximation (the plain SVD without calibration, the covariance-weighted one with it)."""
    x = torch.randn(2, 9, D, dtype=F64)
    g = layers_of(kind)[0]
    with torch.no_grad():
        g.W_V.weight.copy_(torch.randn(G * HEAD, 20, dtype=F64) @ torch.randn(20, D, dtype=F64) / 8)
    want = g(x, is_causal=True)
    mla, report = convert_whole(g, 20)
    assert report.exact and rel_err(mla(x, is_causal=True), want) <= 1e-10
    assert rel_err(_steps(mla, x, 4), want) <= 1e-10

    lossy, report = convert_whole(g, 12)
    assert not report.exact
    oracle = _value_oracle(g, _truncated(g.W_V.weight.detach(), 12))(x, is_causal=True)
    got = lossy(x, is_causal=True)
    assert rel_err(got, oracle) <= 1e-10 and rel_err(got, want) > 1e-3  # the cut is real, and exactly the SVD's

    calib = torch.randn(4, 40, D, dtype=F64) * torch.linspace(0.2, 3.0, D, dtype=F64)  # anisotropic inputs
    y = calib.reshape(-1, D)
    cov = y.T @ y / y.shape[0]
    cov = cov + 1e-6 * torch.diagonal(cov).mean() * torch.eye(D, dtype=F64)  # linalg.whitening's documented ridge
    evals, evecs = torch.linalg.eigh(cov)
    sqrt_cov = (evecs * evals.sqrt()) @ evecs.T
    whitened, _ = convert_whole(g, 12, calibration=calib)
    oracle = _value_oracle(g, _truncated(g.W_V.weight.detach(), 12, sqrt_cov))(x, is_causal=True)
    assert rel_err(whitened(x, is_causal=True), oracle) <= 1e-10


# -- cache codes ------------------------------------------------------------------------------------------------
def _attention_on_stored_rows(mla, g, x, kv_dtype):
    """The oracle of a quantised keys-whole cache: the GQA's own queries against keys and values decoded from the
    rows the cache stores ([latent, rope key] quantised and read back), in float64, written out here."""
    rows = round_trip(mla.compress(x), kv_dtype, mla._kv_parts())  # (B, S, r + p)
    r, B, S = mla.latent_dim, x.shape[0], x.shape[1]
    half = HEAD // 2
    k_rope = rows[..., r:].unflatten(-1, (2, G, half))  # rotate-half over p: [first halves | second halves]
    k = torch.cat([k_rope[..., 0, :, :], k_rope[..., 1, :, :]], dim=-1).transpose(1, 2)  # (B, G, S, d)
    v = (rows[..., :r] @ mla.W_UV.weight.T).view(B, S, H, HEAD).transpose(1, 2)  # (B, H, S, dv)
    q = g.q_head_norm(g.W_Q(x).view(B, S, H, HEAD)).transpose(1, 2)
    q = g.rope(q, torch.arange(S))  # (B, H, S, d)
    k = k[:, kv_head_of(H, G, g.grouping)]  # (B, H, S, d)
    scores = (q @ k.transpose(-1, -2)) * g.scale
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    allowed = (j <= i) & ((j > i - g.sliding_window) if g.sliding_window else True)
    weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return g.W_O((weights @ v).transpose(1, 2).reshape(B, S, H * HEAD))


@pytest.mark.parametrize("kv_dtype", ["int8", "int4/g32+c4", "int3/g64+c4", "int4/g32+r8"])
@pytest.mark.parametrize("kind", ["qwen3", "gemma3"])
def test_cache_codes_cost_exactly_what_the_codes_lose(kind, kv_dtype):
    """With a quantised cache the MLA equals the float64 attention on the decoded rows (whole, absorbed, and step by
    step), so its error against the float64 GQA is the codes' own round trip and nothing else."""
    x = torch.randn(2, 10, D, dtype=F64)
    g = layers_of(kind)[0]
    mla, _ = convert_whole(g)
    want = g(x, is_causal=True).detach()
    mla.kv_dtype = kv_dtype
    with torch.no_grad():
        oracle = _attention_on_stored_rows(mla, g, x, kv_dtype)
        assert 1e-6 < rel_err(oracle, want) < 0.5  # the codes do cost something, and not everything
        for absorbed in (False, True):
            assert rel_err(mla(x, is_causal=True, absorbed=absorbed), oracle) <= 1e-10
            assert rel_err(_steps(mla, x, 3, absorbed=absorbed), oracle) <= 1e-10


# -- module options: save, reload, refusals ---------------------------------------------------------------------
def test_a_keys_whole_mla_survives_save_and_load(tmp_path):
    from attnlab.io import load_module, save_module

    g = layers_of("gemma3")[0]
    mla, _ = convert_whole(g, 30)
    save_module(mla, tmp_path / "ck")
    back = load_module(tmp_path / "ck")
    cfg = back.config()
    assert (cfg["rope_kv_heads"], cfg["rope_grouping"], cfg["head_dim"], cfg["sliding_window"]) == (
        G, g.grouping, 0, WINDOW)
    assert cfg["qk_norm_eps"] == g.k_head_norm.eps and cfg["softmax_scale"] == g.scale
    x = torch.randn(1, 6, D, dtype=F64)
    assert torch.equal(back(x, is_causal=True), mla(x, is_causal=True))


@pytest.mark.parametrize("kw, fragment", [
    (dict(rope_dim=16, qk_norm_eps=1e-6), r"qk_norm_eps with a decoupled rope_dim \(16\) needs the keys-whole layout: "
                                          r"rope_kv_heads=G with rope_dim = G x d .*got rope_kv_heads=None and "
                                          r"head_dim=8"),
    (dict(rope_dim=16, rope_kv_heads=2, head_dim=4, qk_norm_eps=1e-6), r"qk_norm_eps with rope_kv_heads \(2\) needs "
                                                                         r"head_dim 0 .*got head_dim 4"),
    (dict(rope_dim=12, rope_kv_heads=4, qk_norm_eps=1e-6), r"rope_kv_heads \(4\) needs rope_dim = G x w with w even"
                                                            r".*got rope_dim 12"),
    (dict(rope_dim=0, rope_kv_heads=2), r"rope_kv_heads \(2\) needs rope_dim = G x w.*got rope_dim 0"),
    (dict(rope_dim=16, rope_kv_heads=3), r"rope_kv_heads \(3\) needs rope_dim = G x w"),
    (dict(rope_dim=24, rope_kv_heads=3), r"num_heads \(4\) must be divisible by rope_kv_heads \(3\)"),
])
def test_the_module_refuses_a_norm_on_a_split_key(kw, fragment):
    with pytest.raises(ValueError, match=fragment):
        MultiHeadLatentAttention(32, 4, 16, **kw)


def test_conversions_of_a_normed_layer_refuse_every_other_layout():
    g = layers_of("qwen3")[0]
    with pytest.raises(ValueError, match=r"per-head q/k norms \(qk_norm_eps=1e-06\) converts only with its keys whole:"
                                         r" rope_dim = G x d = 2 x 24 = 48 \(rope_pairs 12 per KV head\), got rope_dim "
                                         r"16 \(rope_pairs 4\)"):
        gqa_to_mla_decoupled(g, 24, 4)
    with pytest.raises(ValueError, match="RoRoPE mixes key planes across KV heads"):
        gqa_to_mla_decoupled(g, 24, None, rorope=True, rope_planes=24)
    with pytest.raises(ValueError, match="nothing for BKV to balance"):
        gqa_to_mla_decoupled(g, 24, 12, balance=True)


def test_check_convertible_takes_only_the_keys_whole_of_a_normed_model():
    model = tiny_model("qwen3", dtype=torch.float32)
    for ok in (dict(rope_dim=48), dict(), dict(exact=True, rope_dim=8)):
        hf.check_convertible(model, **ok)
    with pytest.raises(ValueError, match=r"^cannot convert qwen3 yet \(2 layers with per-head q/k norms, qk_norm_eps\): "
                                         r"only its keys-whole MLA carries the norm, rope_dim = G x d = 2 x 24 = 48 "
                                         r"with --rope-select frequency and --no-balance, got rope_dim 16"):
        hf.check_convertible(model, rope_dim=16)
    with pytest.raises(ValueError, match=r"got --rope-select rorope-score \(RoRoPE mixes"):
        hf.check_convertible(model, rope_dim=48, pair_selection="rorope-score")
    with pytest.raises(ValueError, match=r"got BKV"):
        hf.convert_model(model, "mla", latent_dim=24, balance=True)
    assert {type(m).__name__ for m in hf.attnlab_modules(model)} == {"GroupedQueryAttention"}


def test_exports_refuse_a_per_head_key_norm_in_one_line():
    from attnlab.models.export.deepseek import check_deepseek_request, check_exportable
    from attnlab.shrink.feasible import check_format

    model = tiny_model("gemma3", dtype=torch.float32)
    for fmt, who in (("gguf", "llama.cpp deepseek2"), ("deepseek", "DeepSeek-V3")):
        with pytest.raises(ValueError, match=rf"^--format {fmt} cannot hold gemma3_text: .*per-head key norm.*{who}"):
            check_format(model, fmt)
    check_format(model, "attnlab")
    with pytest.raises(ValueError, match=r"layer 0 normalises every query and key head .*no per-head key norm"):
        check_deepseek_request(model, "mla", 24)
    hf.convert_model(model, "mla", latent_dim=24)
    with pytest.raises(ValueError, match=r"layer 0 normalises every query and key head .*no per-head key norm"):
        check_exportable(hf.attnlab_modules(model))


# -- whole models ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype, tol", [(F64, 1e-10), (torch.float32, 2e-5)])
def test_a_whole_gemma3_converts_with_its_keys_whole_to_its_own_logits(dtype, tol):
    """A tiny Gemma3ForCausalLM (sliding and global layers), convert_model(latent G x dv, rope_dim G x d): logits
    within rounding of the original's (float64: 1e-10; float32: its rounding), greedy tokens identical through
    attnlab's own loop past the window; a smaller latent is measurably different (the test can see a cut)."""
    from attnlab.generation import generate

    model = tiny_model("gemma3", layers=3, dtype=dtype, attention_std=0.15)
    ids = torch.randint(0, 97, (1, 14), generator=torch.Generator().manual_seed(1))
    lossy = copy.deepcopy(model)
    with torch.no_grad():
        want = model(ids).logits
        greedy = generate(model, ids[:, :5], max_new_tokens=8)
    reports = hf.convert_model(model, "mla", latent_dim=G * HEAD, rope_dim=G * HEAD)
    assert all(type(m).__name__ == "MultiHeadLatentAttention" and m.keys_whole for m in hf.attnlab_modules(model))
    assert hf.kv_bytes_per_token(model) == hf.kv_bytes_per_token(lossy)  # every value kept: the same bytes
    with torch.no_grad():
        assert rel_err(model(ids).logits, want) <= tol
        assert torch.equal(generate(model, ids[:, :5], max_new_tokens=8), greedy)
    assert dtype != F64 or all(r.exact for r in reports)
    hf.convert_model(lossy, "mla", latent_dim=16)  # weights only (calibrated on ids, 16 values would hold them)
    with torch.no_grad():
        assert rel_err(lossy(ids).logits, want) > 100 * tol


def test_the_plan_of_a_normed_model_keeps_its_keys_whole():
    """plan() on a tiny Qwen3 at 50% with bf16, int8 and int4/g32+c4: only keys-whole candidates (rope key G d, by
    frequency, no BKV), each with the largest latent its storage's bytes allow (bf16 cannot hold the keys and a
    latent in half the bytes), within the budget; the winner converts and runs."""
    from attnlab.shrink import parse_budget, plan
    from attnlab.shrink.candidate import apply
    from attnlab.shrink.sizes import bytes_per_token, layer_bytes

    model = tiny_model("qwen3", dtype=torch.float32, attention_std=0.1)
    ids = torch.randint(0, 97, (1, 64), generator=torch.Generator().manual_seed(2))
    result = plan(model, ids[:, :32], parse_budget("50%"), storages=("bf16", "int8", "int4/g32+c4"),
                  proxy_ids=ids[:, 32:], window=16, proxy_windows=2)
    budget = 0.5 * bytes_per_token(2 * G * HEAD, "bf16", 2)
    assert {c.kv_dtype for c in result.measured} == {"int8", "int4/g32+c4"}
    for c in result.measured:
        assert (c.rope_dim, c.rope_select, c.balance, c.latent_norm) == (G * HEAD, "frequency", False, False)
        assert c.bytes_per_token <= budget and c.latent_dim <= G * HEAD
        assert c.latent_dim == G * HEAD or \
            2 * layer_bytes(c.latent_dim + 1, c.rope_dim, c.kv_dtype, result.spread) > budget  # fixed rows spread
    assert result.best.proxy == min(c.proxy for c in result.measured)
    assert {type(m).__name__ for m in hf.attnlab_modules(model)} == {"GroupedQueryAttention"}
    apply(model, result.best, ids[:, :32])
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()
    assert hf.kv_bytes_per_token(model) == result.best.bytes_per_token
    with pytest.raises(ValueError, match=r"per-head q/k norms keep its keys whole \(48 values per token in each of the "
                                         r"2 layers\).*the smallest these storages \(bf16, int8\) can meet is \d+ "
                                         r"bytes/token"):
        plan(tiny_model("qwen3", dtype=torch.float32), ids, parse_budget("25%"), storages=("bf16", "int8"))
