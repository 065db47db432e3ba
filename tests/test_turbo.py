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
