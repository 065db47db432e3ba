"""The study's own names and experiments (Parts 5-14), each checked against an oracle."""
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from attnlab import MultiHeadAttention, MultiHeadLatentAttention
from attnlab.study.usaaio import GQA_2_MLA, MyGQA, MyMHA, is_gqa_representable, reduced_matrices, tiled_rank
from conftest import F64, gqa_ref, randomize
from reference import gqa_reference, rel_err


def test_my_mha_shapes_and_oracle():
    """Parts 2, 4, 5: weight shapes, attributes and the output itself."""
    m = MyMHA(12, 10, 3, 5, 4).to(F64)
    assert (m.D_1, m.D_2, m.D_qk, m.D_v, m.H) == (12, 10, 3, 5, 4)
    assert m.W_Q.weight.shape == (4 * 3, 12) and m.W_K.weight.shape == (4 * 3, 10)
    assert m.W_V.weight.shape == (4 * 5, 10) and m.W_O.weight.shape == (12, 4 * 5)
    assert all(lin.bias is None for lin in (m.W_Q, m.W_K, m.W_V, m.W_O))
    x, y = torch.randn(2, 3, 12, dtype=F64), torch.randn(2, 6, 10, dtype=F64)
    assert rel_err(m(x, y), gqa_ref(m, x, y)) <= 1e-10


def test_my_gqa_uses_the_studys_rule():
    """Part 7: query head h reads KV head h mod G."""
    m = randomize(MyGQA(12, 8, 2, 3, 6, 3).to(F64))
    assert m.W_K.weight.shape == (3 * 2, 8) and m.G == 3
    x, y = torch.randn(2, 3, 12, dtype=F64), torch.randn(2, 4, 8, dtype=F64)
    expected = gqa_reference(x, y, m.W_Q.weight, m.W_K.weight, m.W_V.weight, m.W_O.weight, 6, 3,
                             grouping="strided")
    assert rel_err(m(x, y), expected) <= 1e-10


def test_part6_tiled_rank_equals_rank():
    w = torch.randn(6, 24, dtype=F64)
    assert tiled_rank(w, 4) == (6, 6)
    low = torch.randn(6, 2, dtype=F64) @ torch.randn(2, 24, dtype=F64)  # rank 2
    assert tiled_rank(low, 4) == (2, 2)


def test_part10_gqa_to_mla_by_svd(capsys):
    np.random.seed(0)
    w = np.random.randn(4, 24)
    W_DKV, W_UM = GQA_2_MLA(w)
    assert W_DKV.shape == (4, 24) and W_UM.shape == (24, 4)
    tiled = np.concatenate([w] * 6, axis=0)
    assert np.mean((tiled - W_UM @ W_DKV) ** 2) <= 1e-20
    printed = capsys.readouterr().out
    assert "(24, 4)" in printed and "(4, 24)" in printed and "Mean-squared error" in printed


def test_part11_counterexample_and_a_true_tiling():
    product = np.array([[3.0], [4.0]]) @ np.array([[1.0, 2.0]])  # W_UM (2x1) @ W_DKV (1x2)
    assert not is_gqa_representable(product, num_heads=2, num_kv_heads=1)
    tiling = np.concatenate([np.array([[1.0, 2.0]])] * 2)
    assert is_gqa_representable(tiling, num_heads=2, num_kv_heads=1)
    block = torch.randn(2 * 3, 5, dtype=F64)  # G = 2 heads of d = 3
    for grouping in ("strided", "blocked"):
        from attnlab.modules.heads import tile_heads
        tiled = tile_heads(block, 6, 2, grouping)
        assert is_gqa_representable(tiled, 6, 2, grouping=grouping)
    assert not is_gqa_representable(tile_heads(block, 6, 2, "strided"), 6, 2, grouping="blocked")


def test_part14_kv_values_per_position_from_real_caches():
    D, H, r = 64, 8, 12
    mha = MultiHeadAttention(D, H)
    mla = MultiHeadLatentAttention(D, H, r)
    assert mha.init_cache(2, 16).values_per_token == 2 * mha.dim
    assert mla.init_cache(2, 16).values_per_token == mla.latent_dim
    assert mha.init_cache(1, 4, dtype=torch.bfloat16).bytes_per_token == 2 * D * 2


def _part13(dtype, device="cpu", B=32, L_1=100, L_2=300, D=1024, H=32, r=50, seed=0):
    """The study's Part 13 experiment, with the library's MyMHA and reduced_matrices."""
    g = torch.Generator().manual_seed(seed)
    D_qkv = D // H
    W_DKV, W_UK, W_UV = torch.randn(r, D, generator=g), torch.randn(D, r, generator=g), torch.randn(D, r, generator=g)
    W_Q, W_O = torch.randn(D, D, generator=g), torch.randn(D, D, generator=g)
    x, y = torch.randn(B, L_1, D, generator=g), torch.randn(B, L_2, D, generator=g)

    def vanilla(dt):
        m = MyMHA(D, D, D_qkv, D_qkv, H).to(dt)
        m.W_K.weight = nn.Parameter(W_UK.to(dt) @ W_DKV.to(dt))
        m.W_V.weight = nn.Parameter(W_UV.to(dt) @ W_DKV.to(dt))
        m.W_Q.weight = nn.Parameter(W_Q.to(dt))
        m.W_O.weight = nn.Parameter(W_O.to(dt))
        with torch.no_grad():
            return m(x.to(dt), y.to(dt))

    reduced = MyMHA(D, D, r, r, H).to(dtype)
    hats = reduced_matrices(*(w.to(dtype) for w in (W_DKV, W_UK, W_UV, W_Q, W_O)), H)
    reduced.W_K.weight = nn.Parameter(torch.cat([hats[0]] * H, dim=0))
    reduced.W_V.weight = nn.Parameter(torch.cat([hats[1]] * H, dim=0))
    reduced.W_Q.weight = nn.Parameter(hats[2])
    reduced.W_O.weight = nn.Parameter(hats[3])
    with torch.no_grad():
        out_reduced = reduced(x.to(dtype), y.to(dtype))
    exact = vanilla(F64)
    err = lambda a: float(((a.to(F64) - exact) ** 2).mean().sqrt() / (exact ** 2).mean().sqrt())  # noqa: E731
    return err(out_reduced), err(vanilla(dtype))


@pytest.mark.slow
def test_part13_reduced_model_at_study_sizes():
    err64, _ = _part13(F64)
    print(f"Part 13 relative error, float64: {err64:.3e}")
    assert err64 <= 1e-10
    err32, err32_vanilla = _part13(torch.float32)
    print(f"Part 13 relative error, float32: reduced {err32:.3e}, vanilla {err32_vanilla:.3e}")
    assert err32 <= 2 * err32_vanilla


def _study_part13_experiment():
    """The study's own Part 13 experiment code (after its reduced_matrices definition), read from shared/."""
    root = Path(__file__).resolve().parents[1]
    for study in (root.parent / "shared" / "study", root / "shared" / "study"):
        for f in sorted(study.glob("001_*.txt")) if study.is_dir() else []:
            text = f.read_text(encoding="utf-8")
            part = text[text.index("## Part 13"):]
            code = part[part.index("# Device"):part.index('""" END OF THIS PART')]
            return code
    return None


def test_study_part13_cell_runs_unchanged_on_our_names(capsys):
    code = _study_part13_experiment()
    if code is None:
        pytest.skip("the study (shared/study/001_*.txt) is not beside this checkout")
    namespace = {}
    exec("import torch\nimport torch.nn as nn\nimport numpy as np\nfrom attnlab.study.usaaio import *", namespace)
    exec(compile(code, "study-part13", "exec"), namespace)
    assert "Relative error" in capsys.readouterr().out
    # bound: the float32 error of the vanilla model itself, measured against float64 on the same data
    ns = namespace
    exact = MyMHA(ns["D"], ns["D"], ns["D_qkv"], ns["D_qkv"], ns["H"]).to(F64)
    with torch.no_grad():
        exact.W_K.weight.copy_(ns["W_UK"].to(F64) @ ns["W_DKV"].to(F64))
        exact.W_V.weight.copy_(ns["W_UV"].to(F64) @ ns["W_DKV"].to(F64))
        exact.W_Q.weight.copy_(ns["W_Q"].to(F64))
        exact.W_O.weight.copy_(ns["W_O"].to(F64))
        exact_out = exact(ns["x"].to(F64), ns["y"].to(F64))
    vanilla_err = rel_err(ns["output_vanilla"], exact_out)
    # the two float32 models each sit within a few vanilla errors of float64, so their gap does too
    assert ns["relative_error"].item() <= 3 * vanilla_err
