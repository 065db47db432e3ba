"""Transform coding of an MLA's latent: decorrelate it, spend the cache's bits where its variance is, cut the rest.

A latent c = W_DKV y (r numbers a token) is read only through W_UK and W_UV, so any invertible T folds into the
weights exactly: cache z = T c with W_DKV' = T W_DKV and read it through W_U' = W_U T^-1 (convert/rotate.py does
this for orthogonal T). Here T comes from the latent's statistics on calibration text and from the metric its
error is counted in. metric "kv": the error of the keys and values it is read as, |W_U e|^2 with
W_U = [W_UK; W_UV], so with G = W_U^T W_U and M = E[c c^T] (the second moment over the calibration tokens, float64),
G^1/2 M G^1/2 = Q diag(lambda) Q^T and T = Q^T G^1/2 (G's null space, read by no head, gets variance 0); metric
"latent" (the default; it measured better, benchmarks/quality/transform_code.py): the latent's own error, T = Q^T from
M = Q diag(lambda) Q^T (plain PCA, an orthogonal T; the calibrated conversion's latent is already weighted as the
keys and values are read, BKV's balance included, which the kv metric would undo). Either way the
eigenvalues are taken in decreasing order: the cached components are uncorrelated on that text, component i of mean
square lambda_i, and an error e_i on it costs e_i^2 in the metric. Transform coding then gives component i an integer number of bits b_i (0: not cached at all) that minimises
the high-rate estimate of the coding error, sum_i lambda_i 4^(-b_i) (each bit quarters a component's mean squared
error; a component cut costs its whole lambda_i), within a byte budget per token (allocate_bits). Since the lambda_i
decrease, so do the b_i: the components form runs of equal bits, and the latent becomes those runs, the cut
components dropped (W_DKV's rows and the up-projections' columns of a cut component removed: the rank cut is the
PCA truncation). Within each run the components are mixed by an orthogonal matrix (Hadamard where the run's length
is a power of two, else a seeded random one), so that each group of channels a run's codes share a scale over
holds values of similar size. The storage is the spelling modules/lowbit.py reads, "tc4x40-3x56-2x16+c4": each run
in asymmetric groups of its bits, the rope key by the suffix (default 4 bits per channel over 64 tokens).

The byte model the allocation uses: a component in b bits costs b/8 bytes and its share of its group's float16
scale and minimum (4/group bytes); the runs' real bytes (lowbit.row_bytes, a short last group and packing included)
are then checked, and the last bits the allocation added are taken back until the row fits.

Before any quantisation the coded module equals the original with its latent projected on the kept components:
exactly the original in float64 where nothing is cut (tests/test_transform_code.py). Only attnlab's format holds it
(a GGUF's latent norm would not commute with the cut). Core: torch only.
"""
from __future__ import annotations

import heapq

import torch

from ..modules import lowbit
from .rotate import fold_latent, hadamard, random_orthogonal, rotate_latent

METRICS = ("kv", "latent")

F64 = torch.float64
BITS = (2, 3, 4, 5, 6, 7, 8)  # a coded component's bits; 1 bit is not a storage attnlab has


def _step_cost(b: int, to: int, group: int) -> float:
    """Bytes a token one component's move from b bits to `to` costs: the codes, and the meta share when it starts."""
    return (to - b) / 8 + (4 / group if b == 0 else 0.0)


def allocate_bits(variances, budget_bytes: float, *, bits=BITS, group: int = lowbit.BLOCK,
                  noise_weight: float = 1.0) -> list[int]:
    """Bits per component (0: cut) minimising sum_i v_i 4^(-b_i) within budget_bytes a token (the byte model in the
    module docstring), greedily: each step moves the component whose next allowed bit count lowers the estimate most
    per byte, until no step fits. variances: the components' mean squares, any order. ValueError naming the values
    for negative variances, a negative budget, or bit counts outside 2..8."""
    v = [float(x) for x in variances]
    if any(not x >= 0 for x in v):
        raise ValueError(f"variances must be non-negative numbers, got {variances!r}")
    if not budget_bytes >= 0:
        raise ValueError(f"budget_bytes must be a non-negative number of bytes, got {budget_bytes!r}")
    levels = sorted(set(bits))
    if not levels or any(not isinstance(b, int) or not 2 <= b <= 8 for b in levels):
        raise ValueError(f"bits must be whole numbers from 2 to 8, got {bits!r}")
    nxt = {0: levels[0], **{a: b for a, b in zip(levels, levels[1:])}}
    out = [0] * len(v)

    def entry(i: int):
        b = out[i]
        if b not in nxt:
            return None
        to = nxt[b]
        gain = v[i] * ((noise_weight * 4.0 ** -b if b else 1.0) - noise_weight * 4.0 ** -to)
        return (-gain / _step_cost(b, to, group), i, to)

    heap = [e for e in (entry(i) for i in range(len(v))) if e is not None]
    heapq.heapify(heap)
    spent = 0.0
    while heap:
        ratio, i, to = heapq.heappop(heap)
        if ratio == 0:
            break
        cost = _step_cost(out[i], to, group)
        if spent + cost > budget_bytes + 1e-12:
            continue  # this step does not fit; a cheaper one may
        spent += cost
        out[i] = to
        e = entry(i)
        if e is not None:
            heapq.heappush(heap, e)
    return out


def runs(bits: list[int]) -> tuple[tuple[int, int], ...]:
    """(bits, components) of each run of equal bits, in order, the cut components (0 bits) left out. ValueError
    unless the bits never increase (what allocate_bits gives components in decreasing variance)."""
    if any(a < b for a, b in zip(bits, bits[1:])):
        raise ValueError(f"bits must not increase along the components (sorted by decreasing variance), got {bits}")
    out: list[list[int]] = []
    for b in bits:
        if b == 0:
            break
        if out and out[-1][0] == b:
            out[-1][1] += 1
        else:
            out.append([b, 1])
    return tuple((b, n) for b, n in out)


def spelling(segments, *, group: int = lowbit.BLOCK, rope: str = "+c4") -> str:
    """The storage spelling of runs of (bits, components) with the rope key's suffix ("" for a row without one)."""
    g = "" if group == lowbit.BLOCK else f"/g{group}"
    return "tc" + "-".join(f"{b}x{n}" for b, n in segments) + g + rope


def fit_to_row(bits: list[int], variances, budget_bytes: float, rope_width: int, *, group: int = lowbit.BLOCK,
               rope: str = "+c4", levels=BITS) -> list[int]:
    """bits lowered until the real row (lowbit.row_bytes: the runs' packed codes and meta, and the rope key in its
    storage) fits budget_bytes: each time the component whose lost bit raises the error estimate least."""
    bits, v = list(bits), [float(x) for x in variances]

    def row(bs: list[int]) -> int:
        segs = runs(bs)
        if not segs:
            return 0
        parts = (sum(n for _, n in segs), rope_width) if rope_width else (sum(n for _, n in segs),)
        return lowbit.row_bytes(parts, lowbit.parse(spelling(segs, group=group, rope=rope if rope_width else "")))

    while any(bits) and row(bits) > budget_bytes:
        def loss(i: int) -> float:
            lower = max([0] + [b for b in levels if b < bits[i]])
            return v[i] * (4.0 ** -lower - 4.0 ** -bits[i])
        # only the last component of a run may lose a bit, so that the bits keep decreasing
        ends = [i for i in range(len(bits)) if bits[i] and (i + 1 == len(bits) or bits[i + 1] < bits[i])]
        i = min(ends, key=loss)
        bits[i] = max([0] + [b for b in levels if b < bits[i]])
    return bits


def latent_moment(mla, inputs: torch.Tensor) -> torch.Tensor:
    """M = E[c c^T] (r, r) float64 of the latent c = W_DKV y (the cached latent, before any storage) over the
    calibration rows `inputs` (N, context_dim) the attention reads."""
    with torch.no_grad():
        c = mla.W_DKV(inputs.to(mla.W_DKV.weight.dtype)).to(F64)  # (N, r)
    return c.T @ c / max(1, c.shape[0])


def _descending_eigh(M: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(eigenvalues in decreasing order, clamped at 0; their eigenvectors as columns) of a symmetric M."""
    lam, Q = torch.linalg.eigh(M)
    order = torch.argsort(lam, descending=True)
    return lam[order].clamp_min(0), Q[:, order]


def principal_transform(mla, inputs: torch.Tensor, metric: str = "latent", key_weight: float = 1.0
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lambda (r,) decreasing, T (r, r), T^-1 (r, r)), float64: the components' mean squares and the map from the
    latent to them in that metric (module docstring). ValueError naming a metric that is not one of METRICS."""
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {', '.join(METRICS)}, got {metric!r}")
    M = latent_moment(mla, inputs)
    if metric == "latent":
        lam, Q = _descending_eigh(M)
        T = Q.T.contiguous()
        return lam, T, T.T.contiguous()
    W = torch.cat([mla.W_UK.weight.detach().to(F64) * key_weight ** 0.5,
                   mla.W_UV.weight.detach().to(F64)])  # (H (d + dv), r): the keys' error counted key_weight times
    g, P = torch.linalg.eigh(W.T @ W)
    live = g > g.max() * 1e-12  # directions some head reads
    root = (P[:, live] * g[live].sqrt()) @ P[:, live].T  # G^1/2
    inv_root = (P[:, live] / g[live].sqrt()) @ P[:, live].T  # its pseudo-inverse
    lam, Q = _descending_eigh(root @ M @ root)
    T, T_inv = Q.T @ root, inv_root @ Q
    if not bool(live.all()):  # the unread directions: kept apart so that T stays invertible (they get variance 0)
        dead = P[:, ~live]  # (r, n0)
        n0 = dead.shape[1]
        T[-n0:], T_inv[:, -n0:] = dead.T, dead
    return lam, T, T_inv


def _keep(mla, k: int):
    """A copy of `mla` with only its first k latent channels (W_DKV's first k rows, the up-projections' first k
    columns); every other weight and option as it was, no storage set."""
    cls = type(mla)
    new = cls(**{**mla.config(), "latent_dim": k, "kv_dtype": None}).to(mla.W_DKV.weight.dtype)
    state = mla.state_dict()
    cut = {"W_DKV.weight": lambda w: w[:k], "W_DKV.bias": lambda b: b[:k], "W_UK.weight": lambda w: w[:, :k],
           "W_UV.weight": lambda w: w[:, :k]}
    new.load_state_dict({name: cut[name](t) if name in cut else t for name, t in state.items()})
    return new.to(mla.W_DKV.weight.device)


def transform_code(mla, inputs: torch.Tensor, budget_bytes: float, *, group: int = lowbit.BLOCK, rope: str = "+c4",
                   metric: str = "latent", key_weight: float = 1.0, bits=BITS, noise_weight: float = 1.0,
                   seed: int = 0):
    """(the coded module, a report): `mla`'s latent mapped to its principal components on `inputs` (N, context_dim)
    in `metric` (principal_transform),
    bits allocated within budget_bytes per token for the whole row (the rope key's storage included), the components
    given none cut, each run mixed by an orthogonal matrix, and kv_dtype set to the runs' spelling. `mla` itself is
    transformed in place (the same function) and returned when nothing is cut. ValueError, one line, for a latent norm
    or a GQA tiling (neither survives a cut), or a budget the rope key alone exceeds."""
    if mla.kv_norm is not None or mla.kv_tiling is not None:
        raise ValueError("transform coding cuts latent channels, which a latent norm (a GGUF's) or a GQA tiling does "
                         "not survive: convert without them (attnlab's format)")
    p = mla.rope_dim
    if p and rope not in ("+r8", "+c2", "+c3", "+c4"):
        raise ValueError(f"rope must be '+r8', '+c4', '+c3' or '+c2' (the rope key's storage), got {rope!r}")
    rope_bytes = 0 if not p else lowbit.row_bytes((8, p), lowbit.parse(f"int4{rope}")) - \
        lowbit.row_bytes((8,), lowbit.parse("int4"))  # the row's bytes less a latent's of 8 channels
    if budget_bytes <= rope_bytes:
        raise ValueError(f"a budget of {budget_bytes:.1f} bytes/token leaves nothing for the latent: the rope key "
                         f"({p} values, {rope}) alone takes {rope_bytes} bytes")
    lam, T, T_inv = principal_transform(mla, inputs, metric, key_weight)
    fold_latent(mla, T, T_inv)
    levels = bits
    bits = allocate_bits(lam.tolist(), budget_bytes - rope_bytes, bits=levels, group=group, noise_weight=noise_weight)
    bits = fit_to_row(bits, lam.tolist(), budget_bytes, p, group=group, rope=rope, levels=levels)
    segments = runs(bits)
    if not segments:
        raise ValueError(f"a budget of {budget_bytes:.1f} bytes/token codes no latent component beside the rope key")
    kept = sum(n for _, n in segments)
    coded = mla if kept == mla.latent_dim else _keep(mla, kept)
    blocks, gen_seed = [], seed
    for _, n in segments:
        blocks.append(hadamard(n) if n & (n - 1) == 0 else random_orthogonal(n, gen_seed))
        gen_seed += 1
    rotate_latent(coded, torch.block_diag(*blocks))
    coded.kv_dtype = spelling(segments, group=group, rope=rope if p else "")
    report = {"storage": coded.kv_dtype, "metric": metric, "kept": kept, "of": mla.latent_dim, "bits": bits,
              "variances": lam.tolist(), "bytes_per_token": coded.init_cache(1, 1, device="meta").bytes_per_token,
              "budget_bytes": budget_bytes,
              "estimate": float(sum(v * 4.0 ** -b for v, b in zip(lam.tolist(), bits)) /
                                max(float(lam.sum()), 1e-300))}
    return coded, report
