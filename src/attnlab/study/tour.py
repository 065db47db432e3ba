"""The tour: each of the study's 14 parts answered by running attnlab, every answer checked.

`run_tour()` returns the sections; the CLI renders them. Sizes are the study's:
the Part 7 example (H = 12, G = 3), Part 10's 4 x 24 matrix, and Part 13's
D = 1024, H = 32, d = 32, r = 50, B = 32, L_1 = 100, L_2 = 300.
"""
from __future__ import annotations

import io
from contextlib import redirect_stdout
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from ..convert.linalg import low_rank_factors, matrix_rank
from ..modules.gqa import GroupedQueryAttention, MultiHeadAttention
from ..modules.heads import tile_heads
from ..modules.mla import MultiHeadLatentAttention
from .usaaio import (
    GQA_2_MLA,
    MyGQA,
    MyMHA,
    is_gqa_representable,
    reduced_matrices,
    tiled_rank,
)

F64 = torch.float64
EXACT = 1e-10


@dataclass
class Check:
    name: str
    passed: bool
    detail: str = ""


@dataclass
class Section:
    part: int
    title: str
    lines: list[str] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)

    def say(self, line: str) -> None:
        self.lines.append(line)

    def check(self, name: str, passed: bool, detail: str = "") -> None:
        self.checks.append(Check(name, bool(passed), detail))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().to(F64), b.detach().to(F64)
    return float(torch.linalg.norm(a - b) / torch.linalg.norm(b))


def _shape_check(s: Section, what: str, got, expected) -> None:
    s.say(f"{what}: {tuple(got)}")
    s.check(f"{what} == {tuple(expected)}", tuple(got) == tuple(expected))


def _formula_output(m: MyMHA, x, y):
    """Parts 3-4 written out: alpha = softmax(q K^T / sqrt(D_qk)), o_h = sum alpha v, out = W_O o."""
    H, dq, dv = m.H, m.D_qk, m.D_v
    q = torch.einsum("hkd,bld->bhlk", m.W_Q.weight.view(H, dq, -1), x)
    k = torch.einsum("hkd,bld->bhlk", m.W_K.weight.view(H, dq, -1), y)
    v = torch.einsum("hkd,bld->bhlk", m.W_V.weight.view(H, dv, -1), y)
    alpha = torch.softmax(q @ k.transpose(-1, -2) / dq ** 0.5, dim=-1)
    o = alpha @ v  # (B, H, L_1, D_v)
    return o.transpose(1, 2).flatten(2) @ m.W_O.weight.T, alpha, o


def part1_to_5(D_1=1024, D_2=768, D_qk=32, D_v=48, H=32) -> list[Section]:
    torch.manual_seed(0)
    m = MyMHA(D_1, D_2, D_qk, D_v, H).to(F64)
    x, y = torch.randn(2, 5, D_1, dtype=F64), torch.randn(2, 7, D_2, dtype=F64)
    out = []
    s = Section(1, "Per-head projection shapes")
    s.say(f"MyMHA(D_1={D_1}, D_2={D_2}, D_qk={D_qk}, D_v={D_v}, H={H}); head 0's blocks read off the module")
    _shape_check(s, "W^Q_h", m.W_Q.weight.view(H, D_qk, D_1)[0].shape, (D_qk, D_1))
    _shape_check(s, "W^K_h", m.W_K.weight.view(H, D_qk, D_2)[0].shape, (D_qk, D_2))
    _shape_check(s, "W^V_h", m.W_V.weight.view(H, D_v, D_2)[0].shape, (D_v, D_2))
    out.append(s)

    s = Section(2, "Stacked projections and stacked queries, keys, values")
    _shape_check(s, "W^Q", m.W_Q.weight.shape, (H * D_qk, D_1))
    _shape_check(s, "W^K", m.W_K.weight.shape, (H * D_qk, D_2))
    _shape_check(s, "W^V", m.W_V.weight.shape, (H * D_v, D_2))
    q = m.W_Q(x)[0, 0]
    _shape_check(s, "q_l1", q.shape, (H * D_qk,))
    _shape_check(s, "k_l2", m.W_K(y)[0, 0].shape, (H * D_qk,))
    _shape_check(s, "v_l2", m.W_V(y)[0, 0].shape, (H * D_v,))
    err = _rel(q, m.W_Q.weight @ x[0, 0])
    s.check("q_l1 = W^Q x_l1", err <= EXACT, f"relative error {err:.1e}")
    err = _rel(m.W_K(y)[0, 0], m.W_K.weight @ y[0, 0])
    s.check("k_l2 = W^K y_l2", err <= EXACT, f"relative error {err:.1e}")
    out.append(s)

    formula, alpha, o = _formula_output(m, x, y)
    s = Section(3, "Attention scores")
    s.say("alpha_{h,l1}^{l2} = Softmax_{l2}( q_{l1,h}^T K_h^T / sqrt(D_qk) ), K_h stacking k_{l2,h}^T over l2")
    s.check("each row of alpha sums to 1", torch.allclose(alpha.sum(-1), torch.ones((), dtype=F64)))
    err = _rel(m(x, y), formula)
    s.check("the module's output uses exactly these scores", err <= EXACT, f"relative error {err:.1e}")
    out.append(s)

    s = Section(4, "Per-head outputs and the out-projection")
    _shape_check(s, "o_{h,l1}", o[0, 0, 0].shape, (D_v,))
    _shape_check(s, "o_l1", o.transpose(1, 2).flatten(2)[0, 0].shape, (H * D_v,))
    _shape_check(s, "W^O_h", m.W_O.weight.view(D_1, H, D_v)[:, 0].shape, (D_1, D_v))
    _shape_check(s, "W^O", m.W_O.weight.shape, (D_1, H * D_v))
    out.append(s)

    s = Section(5, "MyMHA, loop-free")
    y_out = m(x, y)
    _shape_check(s, "MyMHA(x, y)", y_out.shape, (2, 5, D_1))
    err = _rel(y_out, formula)
    s.check("matches the per-head formulas of Parts 3-4 (float64)", err <= EXACT, f"relative error {err:.1e}")
    out.append(s)
    return out


def part6_to_8(D=768, H=12, G=3) -> list[Section]:
    torch.manual_seed(1)
    d = D // H
    out = []
    s = Section(6, "Rank of the tiled KV projection")
    w = torch.randn(G * d, D, dtype=F64)
    r, r_tiled = tiled_rank(w, H // G)
    s.say(f"W^{{K,GQA}} ({G * d} x {D}) stacked {H // G} times: rank {r_tiled}; the block alone: rank {r}")
    s.check("rank(tilde W) == rank(W)", r == r_tiled, f"{r_tiled} == {r}")
    low = torch.randn(G * d, 10, dtype=F64) @ torch.randn(10, D, dtype=F64)
    r, r_tiled = tiled_rank(low, H // G)
    s.check("also for a rank-deficient W", r == r_tiled == 10, f"{r_tiled} == {r} == 10")
    out.append(s)

    s = Section(7, "MyGQA with the study's head rule h = g (mod G)")
    m = MyGQA(D, D, d, d, H, G).to(F64)
    for g in range(G):
        s.say(f"KV head {g} serves query heads {[h for h in range(H) if h % G == g]}")
    x = torch.randn(2, 5, D, dtype=F64)
    mha = MyMHA(D, D, d, d, H).to(F64)
    with torch.no_grad():
        mha.W_Q.weight.copy_(m.W_Q.weight)
        mha.W_O.weight.copy_(m.W_O.weight)
        mha.W_K.weight.copy_(tile_heads(m.W_K.weight, H, G, "strided"))
        mha.W_V.weight.copy_(tile_heads(m.W_V.weight, H, G, "strided"))
    s.check("K/V projections hold G heads only", m.W_K.weight.shape == (G * d, D), f"{tuple(m.W_K.weight.shape)}")
    err = _rel(m(x, x), mha(x, x))
    s.check("equals MHA with the tiled K/V weights", err <= EXACT, f"relative error {err:.1e}")
    out.append(s)

    s = Section(8, "MHA is GQA with G = H")
    mha = MultiHeadAttention(64, 8, dtype=F64)
    gqa = GroupedQueryAttention(64, 8, 8, dtype=F64)
    gqa.load_state_dict(mha.state_dict())
    x = torch.randn(2, 5, 64, dtype=F64)
    s.say("MultiHeadAttention is a GroupedQueryAttention subclass with num_kv_heads = num_heads")
    s.check("isinstance(MultiHeadAttention, GroupedQueryAttention)", isinstance(mha, GroupedQueryAttention))
    s.check("same weights, identical outputs", torch.equal(mha(x), gqa(x)))
    out.append(s)
    return out


def part9_to_11() -> list[Section]:
    torch.manual_seed(2)
    out = []
    s = Section(9, "GQA is MLA: factor the tiled projection through r = G*d")
    D, H, G = 1024, 32, 8
    d = D // H
    w = torch.randn(G * d, D, dtype=F64)
    tiled = tile_heads(w, H, G, "strided")
    up, down, sv = low_rank_factors(tiled, G * d)
    s.say(f"tilde W ({D} x {D}) has {int((sv > sv[0] * 1e-12).sum())} non-zero singular values; r = G*d = {G * d}")
    s.check("rank(tilde W) <= G*d", matrix_rank(tiled) <= G * d)
    err = _rel(up @ down, tiled)
    s.check("W^UM W^DKV reproduces tilde W (float64)", err <= EXACT, f"relative error {err:.1e}")
    out.append(s)

    s = Section(10, "GQA_2_MLA on np.random.randn(4, 24)")
    np.random.seed(0)
    w = np.random.randn(4, 24)
    buf = io.StringIO()
    with redirect_stdout(buf):
        W_DKV, W_UM = GQA_2_MLA(w)
    for line in buf.getvalue().splitlines():
        s.say(line)
    mse = float(np.mean((np.concatenate([w] * 6) - W_UM @ W_DKV) ** 2))
    s.check("shapes (24, 4) and (4, 24)", W_UM.shape == (24, 4) and W_DKV.shape == (4, 24))
    s.check("MSE <= 1e-20", mse <= 1e-20, f"MSE {mse:.1e}")
    out.append(s)

    s = Section(11, "MLA is not always GQA")
    product = np.array([[3.0], [4.0]]) @ np.array([[1.0, 2.0]])
    s.say(f"W^UM = [3; 4], W^DKV = [1 2]: product {product.tolist()}")
    s.check("the product is not two copies of one 1x2 row", not is_gqa_representable(product, 2, 1))
    s.check("a true tiling is recognised", is_gqa_representable(np.array([[1.0, 2.0], [1.0, 2.0]]), 2, 1))
    out.append(s)
    return out


def part12() -> Section:
    torch.manual_seed(3)
    s = Section(12, "Absorbed MLA: attend inside the latent")
    D, H, r = 256, 8, 40
    m = MultiHeadLatentAttention(D, H, r, dtype=F64)
    x, y = torch.randn(2, 4, D, dtype=F64), torch.randn(2, 9, D, dtype=F64)
    with torch.no_grad():
        W_K, W_V, W_Q, W_O = reduced_matrices(m.W_DKV.weight, m.W_UK.weight, m.W_UV.weight, m.W_Q.weight,
                                              m.W_O.weight, H)
    s.say(f"hat W^K = hat W^V = W^DKV {tuple(W_K.shape)}; hat W^Q {tuple(W_Q.shape)}; hat W^O {tuple(W_O.shape)}")
    s.check("shapes r x D, H*r x D, D x H*r", (tuple(W_K.shape), tuple(W_Q.shape), tuple(W_O.shape))
            == ((r, D), (H * r, D), (D, H * r)))
    with torch.no_grad():
        err = _rel(m(x, y, absorbed=True), m(x, y, absorbed=False))
    s.check("absorbed path == expanded path (float64)", err <= EXACT, f"relative error {err:.1e}")
    return s


def part13(B=32, L_1=100, L_2=300, D=1024, H=32, r=50) -> Section:
    s = Section(13, "reduced_matrices at the study's sizes")
    g = torch.Generator().manual_seed(13)
    d = D // H
    W = dict(W_DKV=torch.randn(r, D, generator=g), W_UK=torch.randn(D, r, generator=g),
             W_UV=torch.randn(D, r, generator=g), W_Q=torch.randn(D, D, generator=g),
             W_O=torch.randn(D, D, generator=g))
    x, y = torch.randn(B, L_1, D, generator=g), torch.randn(B, L_2, D, generator=g)
    outputs = {}
    for dt in (F64, torch.float32):
        w = {k: v.to(dt) for k, v in W.items()}
        vanilla = MyMHA(D, D, d, d, H).to(dt)
        vanilla.W_K.weight = nn.Parameter(w["W_UK"] @ w["W_DKV"])
        vanilla.W_V.weight = nn.Parameter(w["W_UV"] @ w["W_DKV"])
        vanilla.W_Q.weight = nn.Parameter(w["W_Q"])
        vanilla.W_O.weight = nn.Parameter(w["W_O"])
        reduced = MyMHA(D, D, r, r, H).to(dt)
        K, V, Q, O = reduced_matrices(w["W_DKV"], w["W_UK"], w["W_UV"], w["W_Q"], w["W_O"], H)
        reduced.W_K.weight = nn.Parameter(torch.cat([K] * H))
        reduced.W_V.weight = nn.Parameter(torch.cat([V] * H))
        reduced.W_Q.weight = nn.Parameter(Q)
        reduced.W_O.weight = nn.Parameter(O)
        with torch.no_grad():
            outputs[dt] = vanilla(x.to(dt), y.to(dt)), reduced(x.to(dt), y.to(dt))

    def study_err(a, b):  # the study's measure: sqrt(mean sq diff) / sqrt(mean sq)
        a, b = a.to(F64), b.to(F64)
        return float(((a - b) ** 2).mean().sqrt() / (b ** 2).mean().sqrt())

    exact = outputs[F64][0]
    e64 = study_err(outputs[F64][1], exact)
    e32 = study_err(outputs[torch.float32][1], outputs[torch.float32][0])
    e32_vanilla = study_err(outputs[torch.float32][0], exact)
    s.say(f"B={B}, L_1={L_1}, L_2={L_2}, D={D}, H={H}, r={r}")
    s.say(f"relative error reduced vs vanilla: float64 {e64:.2e}, float32 {e32:.2e}")
    s.say(f"float32 rounding of the vanilla model itself (vs float64): {e32_vanilla:.2e}")
    s.check("float64 relative error <= 1e-10", e64 <= EXACT, f"{e64:.1e}")
    s.check("float32 error within 3x float32's own rounding", e32 <= 3 * e32_vanilla,
            f"{e32:.1e} <= 3 x {e32_vanilla:.1e}")
    return s


def part14(D=1024, H=32, r=50) -> Section:
    s = Section(14, "KV cache per position")
    mha = MultiHeadAttention(D, H)
    mla = MultiHeadLatentAttention(D, H, r)
    c_mha, c_mla = mha.init_cache(1, 8), mla.init_cache(1, 8)
    s.say(f"MHA cache: {c_mha.values_per_token} values ({c_mha.bytes_per_token} bytes in float32) per position")
    s.say(f"MLA cache: {c_mla.values_per_token} values ({c_mla.bytes_per_token} bytes) per position")
    s.check("MHA stores 2D (k and v, D each)", c_mha.values_per_token == 2 * D, f"{c_mha.values_per_token}")
    s.check("MLA stores r (one latent serves k and v)", c_mla.values_per_token == r, f"{c_mla.values_per_token}")
    x = torch.randn(1, 8, D)
    with torch.no_grad():
        mla(x, cache=c_mla, is_causal=True)
    s.check("the latent cache filled by a real forward holds r per position",
            tuple(c_mla.kv.shape[1:]) == (8, r) and c_mla.length == 8)
    return s


def run_tour(progress=None) -> list[Section]:
    """All 14 parts, in order. progress(part_number) is called as each group finishes."""
    steps = [part1_to_5, part6_to_8, part9_to_11, lambda: [part12()], lambda: [part13()], lambda: [part14()]]
    sections: list[Section] = []
    for step in steps:
        new = step()
        sections.extend(new)
        if progress is not None:
            progress(new[-1].part)
    return sections


def to_markdown(sections: list[Section]) -> str:
    lines = ["# attnlab tour", ""]
    for s in sections:
        lines += [f"## Part {s.part}: {s.title}", ""]
        lines += [f"    {line}" for line in s.lines] + ([""] if s.lines else [])
        lines += [f"- [{'x' if c.passed else ' '}] {c.name}" + (f" ({c.detail})" if c.detail else "")
                  for c in s.checks]
        lines.append("")
    passed = sum(c.passed for s in sections for c in s.checks)
    total = sum(len(s.checks) for s in sections)
    lines.append(f"**{passed} of {total} checks passed.**")
    return "\n".join(lines) + "\n"
