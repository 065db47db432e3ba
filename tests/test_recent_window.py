"""A recent window kept plain ("+w<N>" storages, modules/recent.py).

Oracle: attention written out per query in float64 (no mask, no module path): query i reads the rows
j <= i - N as the storage returns them (storage.round_trip, itself checked against gguf's quantizers
and hand-computed groups in test_kv_lowbit.py) and the rows i - N < j <= i as the module compressed
them, with the module's own projections. Every path must equal it to float64 rounding (<= 1e-10): a
forward without a cache (expanded and absorbed), one token at a time through a LatentCache, a prefill in
chunks, a sliding-window cache, transformers' DynamicCache. Invariants: the window changes the
output (it is read), bytes (a cache allocates its N plain rows a sequence, fixed_bytes, and the
planner prices them at a context), truncate (positions the ring no longer held come back as stored).
"""
import pytest
import torch

from attnlab import GroupedQueryAttention, MultiHeadLatentAttention
from attnlab.modules.cache import LatentCache
from attnlab.modules.storage import check_kv_dtype, round_trip
from attnlab.shrink import sizes
from conftest import randomize
from reference import rel_err

TOL = 1e-10


def _mla(kv_dtype, **kw):
    torch.manual_seed(0)
    m = MultiHeadLatentAttention(48, 4, 24, head_dim=12, rope_dim=8, kv_dtype=kv_dtype, **kw)
    return randomize(m, std=0.3).double()


def _x(S=19, B=2, seed=1):
    return torch.randn(B, S, 48, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _oracle(m, x, size, window=None):
    """Each query's attention from its definition over rows chosen by hand (module docstring)."""
    def rows(i, kv, stored):
        first = 0 if window is None else max(0, i - window + 1)
        return torch.stack([kv[:, j] if j > i - size else stored[:, j] for j in range(first, i + 1)], 1)

    return attend_rows(m, x, m.kv_dtype, rows)


def attend_rows(m, x, storage, rows_for):
    """The module's output when query i reads rows_for(i, plain rows, rows as `storage` returns them) (B, n, r+p),
    written out per query in float64."""
    B, S, _ = x.shape
    H, r, d, dv = m.num_heads, m.latent_dim, m.head_dim, m.v_head_dim
    kv = m.compress(x)  # (B, S, r+p) plain
    stored = round_trip(kv, storage, m._kv_parts())
    q_nope, q_rope = m.project_query(x, torch.arange(S))
    out = []
    for i in range(S):
        rows = rows_for(i, kv, stored)
        n = rows.shape[1]
        k = m.W_UK(rows[..., :r]).view(B, n, H, d).transpose(1, 2)  # (B, H, n, d)
        k = torch.cat([k, rows[:, None, :, r:].expand(B, H, n, m.rope_dim)], -1)
        v = m.W_UV(rows[..., :r]).view(B, n, H, dv).transpose(1, 2)  # (B, H, n, dv)
        q = torch.cat([q_nope[:, :, i], q_rope[:, :, i]], -1)  # (B, H, d+p)
        w = torch.softmax((k @ q[..., None])[..., 0] * m.scale, dim=-1)  # (B, H, n)
        out.append((w[..., None] * v).sum(-2).reshape(B, H * dv))
    return m.W_O(torch.stack(out, 1))


@pytest.mark.parametrize("kv_dtype", ["int4/g32+r8+w4", "int8+w3", "int2/g16+r8+w1", "int3/g32+r8+w16"])
def test_every_path_reads_each_querys_newest_rows_plain_and_the_rest_as_stored(kv_dtype):
    m = _mla(kv_dtype)
    size = check_kv_dtype(kv_dtype).recent
    x = _x()
    with torch.no_grad():
        want = _oracle(m, x, size)
        for absorbed in (False, True):
            assert rel_err(m(x, is_causal=True, absorbed=absorbed), want) <= TOL
        cache = m.init_cache(2, 32)
        steps = torch.cat([m(x[:, i:i + 1], cache=cache) for i in range(19)], 1)
        assert rel_err(steps, want) <= TOL
        cache = m.init_cache(2, 32)
        chunks = torch.cat([m(x[:, a:a + 5], cache=cache, is_causal=True) for a in range(0, 19, 5)], 1)
        assert rel_err(chunks, want) <= TOL
        base = _mla(kv_dtype.rsplit("+w", 1)[0])
        assert rel_err(base(x, is_causal=True), want) > 1e-6  # the plain rows are read
        if size < 19:
            assert rel_err(_oracle(m, x, 19), want) > 1e-6  # and the stored ones too


@pytest.mark.parametrize("window", [6, 3])
def test_a_sliding_window_cache_keeps_the_recent_rows_it_can_see(window):
    """Window 6 > N = 4: the window cache drops rows and keeps the ring; window 3 < N: the ring is the window."""
    m = _mla("int4/g32+r8+w4", sliding_window=window)
    x = _x(S=23)
    with torch.no_grad():
        want = _oracle(m, x, 4, window)
        assert rel_err(m(x, is_causal=True), want) <= TOL
        cache = m.init_cache(2, 23)
        assert cache.window == window and cache._recent.size == min(4, window)
        steps = torch.cat([m(x[:, i:i + 1], cache=cache) for i in range(23)], 1)
        assert rel_err(steps, want) <= TOL


def test_transformers_cache_holds_plain_rows_and_reads_them_as_stored_but_the_newest():
    from transformers import DynamicCache

    from attnlab.models.adapters import TransformersCache

    m = _mla("int4/g32+r8+w4")
    x = _x(S=11)
    with torch.no_grad():
        cache = TransformersCache(DynamicCache(), 0)
        steps = torch.cat([m(x[:, :4], cache=cache, is_causal=True)] +
                          [m(x[:, i:i + 1], cache=cache) for i in range(4, 11)], 1)
        assert rel_err(steps, _oracle(m, x, 4)) <= TOL


def test_the_plain_rows_are_fixed_bytes_a_sequence():
    """N rows of r + p values in the activation dtype a sequence, whatever its length: a cache with the window allocates
    exactly those bytes more than one without, all of them fixed_bytes, none per token; T bytes_at(T) is every byte a
    cache made for T tokens allocates (a rope key per channel's newest group of 64 beside them, "+c4")."""
    def allocated(cache):
        return sum(t.numel() * t.element_size() for t in cache.tensors()) / 2

    for kv_dtype, size in [("int4/g32+r8+w5", 5), ("int3/g32+c4+w16", 16)]:
        m, base = _mla(kv_dtype), kv_dtype.rsplit("+w", 1)[0]
        for T in (64, 300):
            cache, without = m.init_cache(2, T), m.init_cache(2, T, kv_dtype=base)
            ring = size * (24 + 8) * 8  # float64
            assert allocated(cache) - allocated(without) == ring == cache.fixed_bytes - without.fixed_bytes
            assert cache.bytes_per_token == without.bytes_per_token
            if "+r8" in kv_dtype:
                assert cache.bytes_at(T) * T == allocated(cache) == cache.bytes_per_token * T + ring


def test_the_planner_prices_the_plain_rows_at_a_context():
    """sizes.layer_bytes at T tokens: the window's 16 x (r + p) values over T, in the 16 bits the budget counts in, on
    top of the same storage's bytes without it; per token held (no context) they are not a per-token cost."""
    r, p, T = 40, 16, 512
    assert sizes.few_bit("int3/g64+c4+w16") and sizes.storage_ok("int3/g64+c4+w16") and sizes.storage_ok("int8+w16")
    assert all(s.endswith((f"+w{sizes.RECENT}", f"+w{sizes.RECENT // 2}")) and sizes.few_bit(s) for s in sizes.FEW_BIT)
    with_window = sizes.layer_bytes(r, p, "int3/g64+c4+w16", T)
    assert with_window - sizes.layer_bytes(r, p, "int3/g64+c4", T) == pytest.approx(16 * (r + p) * 2 / T, rel=1e-12)
    assert sizes.layer_bytes(r, p, "int3/g64+c4+w16") == sizes.layer_bytes(r, p, "int3/g64+c4")


def test_the_two_bit_latent_the_planner_offers_costs_its_codes_and_scales():
    """int2/g256+c4+w16, counted by hand per token held: a latent of 256 in one group of 256 (64 bytes of 2-bit codes,
    a float16 scale and minimum: 4), a rope key of 40 in 4 bits per channel (20 bytes, and each channel's float16
    scale and minimum per 64 tokens: 160 bytes over 64 tokens, 3 a token rounded up); a latent of 257 takes codes for
    eight more (widths are packed in eights: 2 bytes) and a second group (4 bytes of meta). The 3-bit latent holds 80
    values fewer in 2 bytes more."""
    two = "int2/g256+c4+w16"
    assert two in sizes.FEW_BIT and two in sizes.STORAGES
    assert sizes.layer_bytes(256, 40, two) == 64 + 4 + 20 + 3
    assert sizes.layer_bytes(257, 40, two) == 66 + 8 + 20 + 3
    assert sizes.layer_bytes(176, 40, "int3/g256+c4+w16") == 66 + 4 + 20 + 3


def test_truncate_keeps_plain_rows_it_held_and_takes_the_others_as_stored():
    m = _mla("int4/g32+r8+w4")
    x = _x(S=10)
    with torch.no_grad():
        kv = m.compress(x)
        stored = round_trip(kv, m.kv_dtype, m._kv_parts())
        cache = m.init_cache(2, 16)
        m(x, cache=cache, is_causal=True)
        cache.truncate(7)  # the ring held positions 6..9; now 3..6: 6 plain, 3..5 as stored
        assert rel_err(cache._recent.rows[:, :3], stored[:, 3:6]) <= TOL
        assert rel_err(cache._recent.rows[:, 3], kv[:, 6]) <= TOL
        cache.truncate(2)  # positions 0, 1: both as stored
        assert rel_err(cache._recent.rows[:, :2], stored[:, :2]) <= TOL


@pytest.mark.parametrize("spelling, named", [("bf16+w16", "'bf16' is not one"), ("fp32+w8", "'fp32' is not one"),
                                             ("int4+w0", "N >= 1"), ("int4+w4+w4", "one '\\+w<N>'")])
def test_a_window_on_what_cannot_hold_one_is_refused(spelling, named):
    with pytest.raises(ValueError, match=named):
        check_kv_dtype(spelling)


def test_modules_and_caches_that_cannot_read_a_window_refuse_it():
    with pytest.raises(ValueError, match=r"int4/g32\+r8\+w4.*GroupedQueryAttention.*'int4/g32\+r8'"):
        GroupedQueryAttention(48, 4, 2, kv_dtype="int4/g32+r8+w4")
    m = _mla("int4/g32+r8+w4")
    with pytest.raises(ValueError, match="fixed-shape step"):
        m.init_cache(1, 8).fixed_slot(torch.zeros(1, dtype=torch.int64))
    tiled = MultiHeadLatentAttention(48, 4, 24, head_dim=12, kv_tiling="strided", kv_dtype="int4/g32+w4").double()
    with pytest.raises(ValueError, match="GQA-tiled"):
        tiled(_x(S=3), is_causal=True)
    with pytest.raises(ValueError, match="keeps no recent window"):
        LatentCache(m, 1, 8, 24, 8, dtype=torch.float64, kv_dtype="int8").extend_recent(torch.zeros(1, 1, 32))
