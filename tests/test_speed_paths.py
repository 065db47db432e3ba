"""Fast serving paths (issue 11): exact MLA on GQA-tiled latent slices, fused SDPA for unequal
head sizes, bfloat16 absorbed decode. Oracles: the naive float64 reference, the original GQA,
the general (expanded) MLA path and torch's math SDPA."""
import pytest
import torch
import torch.nn.functional as F
from conftest import gqa_ref, mla_ref, randomize
from reference import rel_err

from attnlab import GroupedQueryAttention, MultiHeadLatentAttention
from attnlab.modules.attention import attend, fused_sdpa
from attnlab.convert import gqa_to_mla, mla_to_mha
from attnlab.io import load_module, save_module

F64 = torch.float64
EXACT = 1e-10


def _tiled(grouping="blocked", bias=False, rope=True, H=6, G=2, d=4, dim=24):
    g = randomize(GroupedQueryAttention(dim, H, G, head_dim=d, grouping=grouping, bias=bias,
                                        rope_base=1000.0 if rope else None, dtype=F64))
    mla, report = gqa_to_mla(g)
    return g, mla, report


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("grouping", ["strided", "blocked"])
@pytest.mark.parametrize("rope", [True, False])
def test_tiled_mla_equals_gqa_and_general_path(grouping, bias, rope):
    g, mla, report = _tiled(grouping, bias, rope)
    assert mla.kv_tiling == grouping and mla.kv_tiling_holds() and report.exact
    assert any("GQA tiling" in n for n in report.notes)
    x = torch.randn(2, 7, 24, dtype=F64)
    expected = gqa_ref(g, x, causal=True)
    with torch.no_grad():
        fast = mla(x, is_causal=True)
        general = mla(x, is_causal=True, absorbed=False)
    assert rel_err(fast, expected) <= EXACT and rel_err(fast, general) <= EXACT
    if not rope:  # the naive oracle knows decoupled RoPE only, not rope_after_up
        assert rel_err(fast, mla_ref(mla, x, causal=True)) <= EXACT


@pytest.mark.parametrize("grouping", ["strided", "blocked"])
def test_tiled_prefill_then_cached_decode_equals_full_forward(grouping):
    g, mla, _ = _tiled(grouping, bias=True)
    x = torch.randn(3, 9, 24, dtype=F64)
    with torch.no_grad():
        expected = mla(x, is_causal=True)
        cache = mla.init_cache(3, 9)
        steps = [mla(x[:, :4], cache=cache, is_causal=True)]
        steps += [mla(x[:, t:t + 1], cache=cache, is_causal=True) for t in range(4, 9)]
    assert rel_err(torch.cat(steps, 1), expected) <= EXACT
    assert rel_err(expected, gqa_ref(g, x, causal=True)) <= EXACT
    # the cache is a GQA's: it holds exactly the GQA's rotated keys and its values, each head's contiguous
    gcache = g.init_cache(3, 9)
    with torch.no_grad():
        g(x, cache=gcache, is_causal=True)
    assert type(cache) is type(gcache)
    for ours, theirs in zip(cache.view(), gcache.view()):  # (B, G, S, d), (B, G, S, dv)
        assert ours.is_contiguous() and rel_err(ours, theirs) <= EXACT


def test_tiled_left_padded_rows_match_gqa():
    """Per-row positions and a key-padding mask, prefill + decode: as the GQA computes them."""
    g, mla, _ = _tiled("blocked")
    B, L, T = 2, 5, 3
    x = torch.randn(B, L + T, 24, dtype=F64)
    pad = torch.tensor([[False, False, True, True, True], [True] * 5])  # row 0 left-padded by 2
    pos = (pad.long().cumsum(1) - 1).clamp_min(0)  # (B, L)
    outs = []
    for m in (g, mla):
        cache = m.init_cache(B, L + T)
        keep = pad.clone()
        with torch.no_grad():
            o = [m(x[:, :L], cache=cache, positions=pos, key_padding_mask=keep, is_causal=True)]
            p = pos[:, -1:]
            for t in range(T):
                keep = torch.cat([keep, torch.ones(B, 1, dtype=torch.bool)], 1)
                p = p + 1
                o.append(m(x[:, L + t:L + t + 1], cache=cache, positions=p, key_padding_mask=keep, is_causal=True))
        outs.append(torch.cat(o, 1))
    real = torch.cat([pad, torch.ones(B, T, dtype=torch.bool)], 1)  # padded query rows are free to differ
    assert rel_err(outs[1][real], outs[0][real]) <= EXACT


def test_tiled_save_and_reload_keeps_the_tiling(tmp_path):
    _, mla, _ = _tiled("strided", bias=True)
    save_module(mla, tmp_path / "m")
    back = load_module(tmp_path / "m")
    assert back.kv_tiling == "strided" and back.kv_tiling_holds()
    x = torch.randn(2, 6, 24, dtype=F64)
    with torch.no_grad():
        assert rel_err(back(x, is_causal=True), mla(x, is_causal=True)) <= EXACT


def test_constructor_tiling_is_checked_and_built():
    m = MultiHeadLatentAttention(24, 6, 16, head_dim=4, kv_tiling="blocked", dtype=F64)
    assert m.kv_tiling_holds()
    with pytest.raises(ValueError, match=r"kv_tiling needs rope_dim 0 \(got 0\) and latent_dim \(15\)"):
        MultiHeadLatentAttention(24, 6, 15, head_dim=4, kv_tiling="blocked")
    with pytest.raises(ValueError, match=r"grouping must be one of"):
        MultiHeadLatentAttention(24, 6, 16, head_dim=4, kv_tiling="rows")


def test_changed_weights_fall_back_or_refuse_a_tiled_cache():
    g, mla, _ = _tiled("blocked")
    x = torch.randn(2, 6, 24, dtype=F64)
    cache = mla.init_cache(2, 6)
    with torch.no_grad():
        mla(x[:, :4], cache=cache, is_causal=True)
        mla.W_UK.weight.add_(0.01 * torch.randn_like(mla.W_UK.weight))  # "training" broke the tiling
    assert not mla.kv_tiling_holds()
    with torch.no_grad():
        out = mla(x, is_causal=True)  # no cache: the general path, which reads the new weights
        with pytest.raises(ValueError, match=r"GQA-tiled keys and values but W_UK/W_UV are no longer the GQA tiling"):
            mla(x[:, 4:5], cache=cache, is_causal=True)
    mha, _ = mla_to_mha(mla)
    assert rel_err(out, gqa_ref(mha, x, causal=True)) <= EXACT


def test_autograd_takes_the_general_path_so_up_projections_get_gradients():
    g, mla, _ = _tiled("blocked")
    x = torch.randn(2, 5, 24, dtype=F64)
    out = mla(x, is_causal=True)
    out.square().sum().backward()
    assert mla.W_UK.weight.grad is not None and mla.W_UK.weight.grad.abs().sum() > 0
    assert rel_err(out.detach(), gqa_ref(g, x, causal=True)) <= EXACT
    cache = mla.init_cache(2, 5)
    with torch.no_grad():
        mla(x[:, :3], cache=cache, is_causal=True)
    with pytest.raises(ValueError, match=r"absorbed= asks for a general path"):
        mla(x[:, 3:4], cache=cache, is_causal=True, absorbed=False)


# -- fused SDPA for unequal head sizes ------------------------------------------------------------
@pytest.mark.parametrize("dv", [5, 16])
@pytest.mark.parametrize("case", ["causal", "mask", "gqa"])
def test_fused_sdpa_unequal_head_sizes_is_exact_and_fused(dv, case):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    H, G = 6, (2 if case == "gqa" else 6)
    q = torch.randn(2, H, 9, 12, dtype=F64)
    k, v = torch.randn(2, G, 9, 12, dtype=F64), torch.randn(2, G, 9, dv, dtype=F64)
    kw = dict(is_causal=True) if case != "mask" else dict(attn_mask=torch.rand(2, 1, 9, 9) > 0.3)
    expected = F.scaled_dot_product_attention(q, k.repeat_interleave(H // G, 1), v.repeat_interleave(H // G, 1),
                                              scale=0.3, **kw)
    # flash only (no math fallback): unequal sizes must still reach the fused kernel; CPU's fused
    # kernel takes no boolean mask, so the masked case checks exactness only
    backends = [SDPBackend.FLASH_ATTENTION] if case != "mask" else [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
    with sdpa_kernel(backends):
        got = fused_sdpa(q, k, v, scale=0.3, enable_gqa=G != H, **kw)
    assert rel_err(got, expected) <= EXACT


def test_decoupled_mla_prefill_through_attend_is_exact():
    m = randomize(MultiHeadLatentAttention(48, 6, 12, head_dim=4, v_head_dim=8, rope_dim=8, dtype=F64))
    x = torch.randn(2, 70, 48, dtype=F64)  # more rows than the written-out route takes
    with torch.no_grad():
        for absorbed in (False, True):  # q-k head 4 + 8 (expanded) or 12 + 8 (absorbed) vs value head 8 or 12
            assert rel_err(m(x, is_causal=True, absorbed=absorbed), mla_ref(m, x, causal=True)) <= EXACT
    q, k, v = torch.randn(1, 6, 70, 12, dtype=F64), torch.randn(1, 2, 70, 12, dtype=F64), torch.randn(1, 2, 70, 8,
                                                                                                      dtype=F64)
    math = F.scaled_dot_product_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), is_causal=True)
    assert rel_err(attend(q, k, v, is_causal=True), math) <= EXACT


# -- bfloat16 --------------------------------------------------------------------------------------
def _tiny_llama(tmp_seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(tmp_seed)
    return LlamaForCausalLM(LlamaConfig(hidden_size=96, intermediate_size=192, num_hidden_layers=2,
                                        num_attention_heads=6, num_key_value_heads=2, head_dim=16, vocab_size=128,
                                        tie_word_embeddings=True)).eval()


def test_bf16_absorbed_decode_is_as_accurate_as_bf16_allows():
    """Tolerance: the bf16 expanded path's own error against float64 (same bf16-rounded weights), x2."""
    m = randomize(MultiHeadLatentAttention(96, 6, 24, head_dim=16, rope_dim=8, dtype=F64), std=0.2)
    m16 = MultiHeadLatentAttention(96, 6, 24, head_dim=16, rope_dim=8, dtype=torch.bfloat16)
    m16.load_state_dict(m.state_dict())
    with torch.no_grad():
        m.load_state_dict(m16.state_dict())  # float64 copy of the rounded weights: the truth
    x = torch.randn(2, 40, 96, dtype=F64).to(torch.bfloat16).to(F64)
    with torch.no_grad():
        truth = m(x, is_causal=True)[:, -8:]
        outs = {}
        for absorbed in (True, False):
            cache = m16.init_cache(2, 40)
            m16(x[:, :32].bfloat16(), cache=cache, is_causal=True, absorbed=absorbed)
            outs[absorbed] = torch.cat([m16(x[:, t:t + 1].bfloat16(), cache=cache, is_causal=True,
                                            absorbed=absorbed) for t in range(32, 40)], 1)
    assert outs[True].dtype == torch.bfloat16
    err_abs, err_exp = rel_err(outs[True].double(), truth), rel_err(outs[False].double(), truth)
    assert err_abs <= 2 * err_exp, (err_abs, err_exp)


def test_generator_runs_bf16_models_within_bf16_of_float32():
    """Whole model through the static-cache loop: bf16 logits of each attnlab variant vs its own float32
    logits, within 2x the deviation that the bf16 GQA swap itself has from the float32 GQA swap."""
    from attnlab.bench.model import _GeneratorLoop
    from attnlab.models import convert_model, to_attnlab

    base = _tiny_llama()
    ids = torch.randint(0, 128, (2, 12))

    def logits(model):
        loop = _GeneratorLoop(model, 2, 16, "cpu")
        out = [loop.prefill(ids)]
        for _ in range(3):
            out.append(loop.step(out[-1].argmax(-1)))
        return torch.stack(out).double()

    import copy
    dev = {}
    for name in ("gqa", "mla-exact", "mla-compressed"):
        model = to_attnlab(copy.deepcopy(base))
        if name == "mla-exact":
            convert_model(model, "mla")
        elif name == "mla-compressed":
            convert_model(model, "mla", latent_dim=24, rope_dim=12)
        f32 = logits(model)
        b16 = logits(model.to(torch.bfloat16))
        dev[name] = rel_err(b16, f32)
    assert dev["mla-exact"] <= 2 * dev["gqa"] and dev["mla-compressed"] <= 2 * dev["gqa"], dev


# -- the whole-model benchmark (invariants only, no timings) --------------------------------------
def test_model_benchmark_quick_writes_consistent_json(tmp_path):
    import json

    from attnlab.cli import main

    out = tmp_path / "model.json"
    assert main(["bench", "--suite", "model", "--quick", "--json", str(out)]) in (0, None)
    rows = json.loads(out.read_text())["model"]
    variants = {r["variant"] for r in rows}
    assert {"hf-eager", "hf-sdpa", "gqa", "mla-exact", "gqa-bf16"} <= variants
    for r in rows:
        ref = next(g for g in rows if g["variant"] == ("gqa-bf16" if r["dtype"] == "bfloat16" else "gqa"))
        assert r["prefill_vs_gqa"] == pytest.approx(r["prefill_ms"] / ref["prefill_ms"], rel=1e-12)
        assert r["decode_time_vs_gqa"] == pytest.approx(r["decode_ms"] / ref["decode_ms"], rel=1e-12)
        assert r["decode_tok_s"] == pytest.approx(r["batch"] * 1e3 / r["decode_ms"], rel=1e-12)
        assert 0 < r["decode_roofline"] and 0 < r["prefill_roofline"]
    by = {r["variant"]: r for r in rows}
    # KV bytes per token from the allocated caches: exact MLA keeps the GQA's, bf16 halves it
    assert by["mla-exact"]["kv_bytes_per_token"] == by["gqa"]["kv_bytes_per_token"] == 2 * by["gqa-bf16"][
        "kv_bytes_per_token"]
    assert by["hf-sdpa"]["kv_bytes_per_token"] == by["gqa"]["kv_bytes_per_token"]
