"""TurboQuant's codes (modules/turbo.py, "tq1" to "tq4"): a randomized Hadamard rotation, a float16 norm a head,
the Lloyd-Max levels of N(0, 1).

Oracles: Max's table of the Gaussian's Lloyd-Max quantisers (J. Max, IRE Trans. Inf. Theory, 1960: the levels and
the mean squared error at 1 to 4 bits), and the distortion TurboQuant's paper gives for a rotated unit vector
(arXiv 2504.19874: about 0.36, 0.117, 0.03 and 0.009 at 1 to 4 bits), which the codes must meet at a head size of
256; the bytes by hand.
"""
import pytest
import torch

from attnlab.modules import lowbit, turbo
from attnlab.modules.storage import check_kv_dtype, round_trip

MAX_1960 = {  # the positive levels and the mean squared error of N(0, 1)'s Lloyd-Max quantiser
    1: ((0.7979,), 0.3634),
    2: ((0.4528, 1.510), 0.1175),
    3: ((0.2451, 0.7560, 1.344, 2.152), 0.03454),
    4: ((0.1284, 0.3881, 0.6568, 0.9424, 1.256, 1.618, 2.069, 2.733), 0.009497),
}


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_levels_and_distortion_are_maxs(bits):
    levels = turbo.levels(bits)
    want, mse = MAX_1960[bits]
    assert all(abs(a + b) <= 1e-12 for a, b in zip(levels, reversed(levels)))  # symmetric
    assert all(abs(a - b) <= 6e-4 for a, b in zip(levels[len(levels) // 2:], want))  # the table's 4 digits
    assert abs(turbo.distortion(bits) - mse) <= 1e-4 * max(1.0, mse * 100)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_a_unit_vectors_error_is_the_papers(bits):
    """4,096 random unit vectors of 256 values: the mean squared error of the round trip is the Gaussian's
    Lloyd-Max distortion to 2% (a rotated unit vector's coordinates are only nearly normal at this size)."""
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(4096, 256, generator=g, dtype=torch.float64)
    x = x / x.norm(dim=-1, keepdim=True)
    y = round_trip(x, f"tq{bits}", (256,))
    mse = float(((x - y) ** 2).sum(-1).mean())
    assert abs(mse / turbo.distortion(bits) - 1) <= 0.02
    scaled = round_trip(4 * x, f"tq{bits}", (256,))  # the norm is stored: the codes do not depend on the scale
    assert torch.equal(scaled, 4 * y)  # (a power of two: float16's norm scales exactly)


def test_bytes_and_refusals():
    fmt = check_kv_dtype("tq3").low
    assert lowbit.row_bytes((64,), fmt) == 64 * 3 // 8 + 2  # 3 bits a value, a float16 norm a head
    assert lowbit.row_bytes((64, 64), fmt) == 2 * (64 * 3 // 8 + 2)
    with pytest.raises(ValueError, match=r"tq3 rotates each head by a Hadamard transform of its size; parts of "
                                         r"widths \(48,\) are not all powers of two"):
        lowbit.row_bytes((48,), fmt)
    zero = torch.zeros(2, 64)
    assert torch.equal(round_trip(zero, "tq2", (64,)), zero)  # a zero vector: norm 0, no division by it


def test_the_sketched_codes_inner_product_is_unbiased_within_the_papers_variance():
    """tqp3 (TurboQuant_prod): over 4,000 draws of the sketch S, the mean of <q, read-back> is <q, x> to five
    standard errors, while the 2-bit codes alone miss it by more; the draws' variance is within the paper's bound
    pi / (2g) |r|^2 |q|^2 (Theorem 2), r the 2-bit codes' residual."""
    g, draws = 64, 4000
    gen = torch.Generator().manual_seed(7)
    x, q = torch.randn(1, g, generator=gen, dtype=torch.float64), torch.randn(g, generator=gen, dtype=torch.float64)
    codes, norm = turbo.encode(x, 2)
    plain = turbo.decode(codes, norm, 2, torch.float64)
    r = x - plain
    reads = []
    for _ in range(draws):
        s = torch.randn(g, g, generator=gen, dtype=torch.float64)
        c, meta = turbo.encode_sketched(x, 3, s)
        assert torch.equal(c & 3, codes) and torch.equal(meta[..., :1], norm)  # the 2-bit codes, then the sketch
        reads.append(float(turbo.decode_sketched(c, meta, 3, torch.float64, s)[0] @ q))
    reads = torch.tensor(reads, dtype=torch.float64)
    exact, bound = float(x[0] @ q), torch.pi / (2 * g) * float(r.norm() ** 2 * q.norm() ** 2)
    error = 5 * (bound / draws) ** 0.5
    assert abs(float(reads.mean()) - exact) <= error < abs(float(plain[0] @ q) - exact)
    assert float(reads.var()) <= 1.1 * bound  # the bound with room for 4,000 draws' own spread


def test_sketched_bytes_and_round_trip():
    """tqp<b>: b bits a value and two float16 numbers a head; packed and read back as the codes say; a zero vector
    reads back as zeros."""
    fmt = check_kv_dtype("tqp3").low
    assert (fmt.bits, fmt.kind) == (3, "qjl")
    assert lowbit.row_bytes((64,), fmt) == 64 * 3 // 8 + 4
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(3))
    packed, meta = lowbit.encode(x, (64, 64), fmt)
    codes, m = turbo.encode_sketched(x.unflatten(-1, (2, 64)), 3)
    want = turbo.decode_sketched(codes, m, 3, torch.float32).flatten(-2)
    assert torch.equal(lowbit.decode(packed, meta, (64, 64), fmt, torch.float32), want)
    assert torch.equal(round_trip(x, "tqp3", (64, 64)), want)
    zero = torch.zeros(2, 64)
    assert torch.equal(round_trip(zero, "tqp2", (64,)), zero)
