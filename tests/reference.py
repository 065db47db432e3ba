"""A deliberately naive attention oracle, written from the study's formulas (Parts 1-4).

One head, one query position and one key position at a time, with an explicit
softmax, in float64. It shares no code with attnlab: only torch tensors and
Python loops. Slow on purpose; use tiny shapes.

    q_{l1,h} = W^Q_h x_{l1} (+ b)            k_{l2,g} = W^K_g y_{l2} (+ b)
    alpha_{h,l1}^{l2} = softmax_{l2}(q . k / sqrt(D_qk))   over allowed l2
    o_{h,l1} = sum_{l2} alpha v_{l2,g}        out_{l1} = W^O [o_{0,l1}; ...; o_{H-1,l1}] (+ b)
"""
from __future__ import annotations

import math

import torch

F64 = torch.float64


def rotate(vec, position, base, interleaved):
    """RoPE of one vector at one position, pair by pair."""
    n = vec.shape[0]
    out = vec.clone()
    for i in range(n // 2):
        angle = position * base ** (-2.0 * i / n)
        a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + n // 2)
        out[a] = vec[a] * math.cos(angle) - vec[b] * math.sin(angle)
        out[b] = vec[b] * math.cos(angle) + vec[a] * math.sin(angle)
    return out


def rms_norm(vec, weight, eps):
    return vec / torch.sqrt(torch.mean(vec * vec) + eps) * weight


def _rows(w, start, size):
    return w[start:start + size]


def attend_naive(q, k, v, head_to_kv, allowed, scale):
    """q[b][h][l1], k[b][g][l2], v[b][g][l2]: lists of 1-D tensors. allowed(b, h, l1, l2) -> bool.

    Returns o[b][l1] = concatenation over heads of the per-head outputs.
    """
    out = []
    for b in range(len(q)):
        rows = []
        for l1 in range(len(q[b][0])):
            heads = []
            for h in range(len(q[b])):
                g = head_to_kv[h]
                scores = []
                for l2 in range(len(k[b][g])):
                    if allowed(b, h, l1, l2):
                        scores.append((l2, float(torch.dot(q[b][h][l1], k[b][g][l2])) * scale))
                o = torch.zeros_like(v[b][g][0])
                if scores:
                    top = max(s for _, s in scores)
                    weights = [(l2, math.exp(s - top)) for l2, s in scores]
                    total = sum(w for _, w in weights)
                    for l2, w in weights:
                        o = o + (w / total) * v[b][g][l2]
                heads.append(o)
            rows.append(torch.cat(heads))
        out.append(rows)
    return out


def _allowed_fn(mask, causal, L1, L2):
    """mask: None or bool tensor broadcastable to (B, H, L1, L2), True = may attend."""
    def allowed(b, h, l1, l2):
        if causal and l2 > l1 + (L2 - L1):
            return False
        if mask is None:
            return True
        m = mask
        while m.dim() < 4:
            m = m.unsqueeze(0)
        return bool(m[b if m.shape[0] > 1 else 0, h if m.shape[1] > 1 else 0,
                      l1 if m.shape[2] > 1 else 0, l2])
    return allowed


def _lin(w, b, vec):
    y = w @ vec
    return y if b is None else y + b


def _rms_normed(vec, gain, eps):
    """gain * vec / sqrt(mean(vec^2) + eps), written out element by element in float64."""
    n = len(vec)
    rms = math.sqrt(sum(float(t) ** 2 for t in vec) / n + eps)
    return torch.tensor([float(gain[i]) * float(vec[i]) / rms for i in range(n)], dtype=F64)


def gqa_reference(x, y, W_Q, W_K, W_V, W_O, H, G, *, grouping="strided", biases=(None, None, None, None),
                  mask=None, causal=False, rope=None, q_positions=None, k_positions=None, qk_norm=None,
                  scale=None, window=None):
    """Grouped-query attention (MHA when G = H) on x (B, L1, D1), y (B, L2, D2), float64.

    rope: None or (base, interleaved); positions default to 0..L-1 (offset by L2 - L1 for queries
    when causal self-attention continues a cache). qk_norm: None or (query gain, key gain, eps): each
    query and key head vector v becomes gain * v / sqrt(mean(v^2) + eps) before RoPE (Qwen3, Gemma 3).
    scale: the scores' scale (default 1 / sqrt(d)). window: None, or a query at position i sees only keys at
    positions j with i - window < j <= i (a sliding-window layer; positions as above).
    """
    x, y = x.detach().to(F64), y.detach().to(F64)
    W_Q, W_K, W_V, W_O = (w.detach().to(F64) for w in (W_Q, W_K, W_V, W_O))
    bq, bk, bv, bo = (None if b is None else b.detach().to(F64) for b in biases)
    B, L1, _ = x.shape
    L2 = y.shape[1]
    d = W_Q.shape[0] // H
    dv = W_V.shape[0] // G
    head_to_kv = [h % G if grouping == "strided" else h // (H // G) for h in range(H)]
    q_positions = list(range(L1)) if q_positions is None else q_positions
    k_positions = list(range(L2)) if k_positions is None else k_positions
    q, k, v = [], [], []
    for b in range(B):
        qb, kb, vb = [], [], []
        for h in range(H):
            col = []
            for l1 in range(L1):
                vec = _lin(_rows(W_Q, h * d, d), None if bq is None else _rows(bq, h * d, d), x[b, l1])
                if qk_norm is not None:
                    vec = _rms_normed(vec, qk_norm[0], qk_norm[2])
                if rope is not None:
                    vec = rotate(vec, q_positions[l1], *rope)
                col.append(vec)
            qb.append(col)
        for g in range(G):
            kcol, vcol = [], []
            for l2 in range(L2):
                vec = _lin(_rows(W_K, g * d, d), None if bk is None else _rows(bk, g * d, d), y[b, l2])
                if qk_norm is not None:
                    vec = _rms_normed(vec, qk_norm[1], qk_norm[2])
                if rope is not None:
                    vec = rotate(vec, k_positions[l2], *rope)
                kcol.append(vec)
                vcol.append(_lin(_rows(W_V, g * dv, dv), None if bv is None else _rows(bv, g * dv, dv), y[b, l2]))
            kb.append(kcol)
            vb.append(vcol)
        q.append(qb)
        k.append(kb)
        v.append(vb)
    allowed = _allowed_fn(mask, causal, L1, L2)
    if window is not None:
        inner = allowed

        def allowed(b, h, l1, l2):
            i, j = q_positions[l1], k_positions[l2]
            return inner(b, h, l1, l2) and i - window < j <= i
    o = attend_naive(q, k, v, head_to_kv, allowed, 1.0 / math.sqrt(d) if scale is None else scale)
    return torch.stack([torch.stack([_lin(W_O, bo, o[b][l1]) for l1 in range(L1)]) for b in range(B)])


def mla_reference(x, y, p, H, *, mask=None, causal=False, q_positions=None, k_positions=None):
    """Multi-head latent attention from its definition, float64.

    p: dict of float64 tensors and settings with keys W_Q or (W_DQ, q_norm, W_UQ), W_DKV, W_UK, W_UV,
    W_O, optional W_KR (with rope=(base, interleaved)), kv_norm, biases b_<name>, eps, scale.
    Keys and values are built per head and position: k_h = [W_UK_h c, RoPE(W_KR y)], v_h = W_UV_h c.
    """
    g = lambda name: None if p.get(name) is None else p[name].detach().to(F64)  # noqa: E731
    x, y = x.detach().to(F64), y.detach().to(F64)
    B, L1, _ = x.shape
    L2 = y.shape[1]
    d = p["W_UK"].shape[0] // H
    dv = p["W_UV"].shape[0] // H
    pr = 0 if p.get("W_KR") is None else p["W_KR"].shape[0]
    eps = p.get("eps", 1e-6)
    scale = p.get("scale") or 1.0 / math.sqrt(d + pr)
    q_positions = list(range(L1)) if q_positions is None else q_positions
    k_positions = list(range(L2)) if k_positions is None else k_positions
    q, k, v = [], [], []
    for b in range(B):
        qb = [[] for _ in range(H)]
        for l1 in range(L1):
            if g("W_Q") is not None:
                full = _lin(g("W_Q"), g("b_W_Q"), x[b, l1])
            else:
                ql = rms_norm(_lin(g("W_DQ"), g("b_W_DQ"), x[b, l1]), g("q_norm"), eps)
                full = _lin(g("W_UQ"), g("b_W_UQ"), ql)
            for h in range(H):
                head = _rows(full, h * (d + pr), d + pr)
                if pr:
                    head = torch.cat([head[:d], rotate(head[d:], q_positions[l1], *p["rope"])])
                qb[h].append(head)
        kb = [[] for _ in range(H)]
        vb = [[] for _ in range(H)]
        for l2 in range(L2):
            c = _lin(g("W_DKV"), g("b_W_DKV"), y[b, l2])
            if g("kv_norm") is not None:
                c = rms_norm(c, g("kv_norm"), eps)
            kr = None
            if pr:
                kr = rotate(_lin(g("W_KR"), g("b_W_KR"), y[b, l2]), k_positions[l2], *p["rope"])
            for h in range(H):
                bk = None if g("b_W_UK") is None else _rows(g("b_W_UK"), h * d, d)
                bv = None if g("b_W_UV") is None else _rows(g("b_W_UV"), h * dv, dv)
                kh = _lin(_rows(g("W_UK"), h * d, d), bk, c)
                kb[h].append(kh if kr is None else torch.cat([kh, kr]))
                vb[h].append(_lin(_rows(g("W_UV"), h * dv, dv), bv, c))
        q.append(qb)
        k.append(kb)
        v.append(vb)
    o = attend_naive(q, k, v, list(range(H)), _allowed_fn(mask, causal, L1, L2), scale)
    return torch.stack([torch.stack([_lin(g("W_O"), g("b_W_O"), o[b][l1]) for l1 in range(L1)])
                        for b in range(B)])


def rel_err(a, b) -> float:
    a, b = a.detach().to(F64), b.detach().to(F64)
    return float(torch.linalg.norm(a - b) / torch.linalg.norm(b))


# -- llama.cpp's iq4_nl block, one value at a time ---------------------------------------------------------
IQ4_NL_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # ggml's kvalues_iq4nl


def iq4_nl_block(block) -> tuple[float, list[int]]:
    """One block of 32 numbers as ggml's quantize_row_iq4_nl_ref stores it, written from its C one value at a
    time in float32 (numpy scalars): (d as float16, read back as a float; the 32 codes). The value of largest
    magnitude m (the first on ties) gives d0 = m / -127; each code is the level nearest x / d0, the upper of two
    at the same distance; the stored d = sum(w q x) / sum(w q q) with w = x^2 and q the code's level, summed in
    the block's order. A block whose largest magnitude is below 1e-15 stores d = 0 (codes [] here: ggml leaves
    them unset)."""
    import numpy as np

    f = np.float32
    x = [f(v) for v in block]
    amax, m = f(0), f(0)
    for v in x:
        if abs(v) > amax:
            amax, m = abs(v), v
    if amax < f(1e-15):
        return 0.0, []
    inv = f(1) / (m / f(IQ4_NL_LEVELS[0]))
    codes, sum_qx, sum_q2 = [], f(0), f(0)
    for v in x:
        t = inv * v
        best, best_gap = 0, None
        for i, level in enumerate(IQ4_NL_LEVELS):  # ascending: "<=" hands a tie to the upper level
            gap = abs(t - f(level))
            if best_gap is None or gap <= best_gap:
                best, best_gap = i, gap
        codes.append(best)
        q = f(IQ4_NL_LEVELS[best])
        w = v * v
        sum_qx = sum_qx + w * q * v
        sum_q2 = sum_q2 + w * q * q
    d = sum_qx / sum_q2 if sum_q2 > 0 else f(0)
    return float(np.float16(d)), codes
