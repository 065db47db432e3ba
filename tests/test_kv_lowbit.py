"""Few-bit KV storages (modules/lowbit.py), the latent rotation (convert/rotate.py), the shrink's baselines.

Oracles and invariants:
(a) llama.cpp's block formats against gguf's own quantizers (gguf.quants, the reference Python port of
    ggml's quantize_row_*_ref): the same read-back values bit for bit, and the same bytes per row;
(b) attnlab's asymmetric groups against a quantiser written here from the documented formula (its range
    search included), on a group computed by hand; KIVI's key groups along tokens and value groups along
    channels likewise (min-max, no search); the search never does worse than min-max and clips an outlier;
(c) packing: pack/unpack is the identity on codes of every width, for every bit count;
(d) a cache in each storage allocates exactly the documented bytes, reads back what a forward
    without a cache computes (decode == full forward through the same storage, float64), and
    trains through the codes (straight-through);
(f) an MLA's rope key per channel ("+c4"): whole groups of 64 tokens per channel against the formula by
    hand, the newest partial group as it is; a cache of it decodes exactly what a forward without a
    cache computes on each prefix (float64), across group boundaries, and counts the documented bytes;
(e) the rotation of an MLA's latent leaves the module's output unchanged in float64 (<= 1e-10), with
    and without a latent norm and bias, and lowers the few-bit error of an outlier-heavy latent.
"""
import copy
import math

import pytest
import torch

from attnlab import GroupedQueryAttention, MultiHeadLatentAttention
from attnlab.convert.rotate import hadamard, random_orthogonal, rotate_latent
from attnlab.modules import lowbit
from attnlab.modules.storage import check_kv_dtype, round_trip
from conftest import F64, randomize
from reference import rel_err

F64_TOL = 1e-10


def _x(rows=6, width=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g) * torch.rand(rows, 1, generator=g).mul(3).add(0.01)
    x[0, :32] = 0.0  # an all-zero block: scale 0
    x[1, 5] = 40.0  # an outlier
    return x


# -- (a) llama.cpp's blocks against gguf --------------------------------------------------------------
@pytest.mark.parametrize("name", ["q8_0", "q5_0", "q4_0", "q4_1"])
def test_block_formats_read_back_what_gguf_quantizers_write(name):
    gguf = pytest.importorskip("gguf")
    from gguf import quants

    qtype = getattr(gguf.GGMLQuantizationType, name.upper())
    x = _x()
    blocks = quants.quantize(x.numpy(), qtype)
    want = torch.from_numpy(quants.dequantize(blocks, qtype))
    fmt = lowbit.BLOCK_FORMATS[name]
    packed, meta = lowbit.encode(x, (64, 64), fmt)
    got = lowbit.decode(packed, meta, (64, 64), fmt, torch.float32)
    assert torch.equal(got, want)
    assert lowbit.row_bytes((64, 64), fmt) == blocks.shape[-1]  # gguf's bytes per row of 128 values
    assert torch.equal(round_trip(x, name, (64, 64)), want)  # the forward's path: no packing, the same values


# -- (b) attnlab's groups and KIVI by hand -----------------------------------------------------------
def _minmax_oracle(group: torch.Tensor, bits: int, lo: float, hi: float) -> torch.Tensor:
    """One group (float64) stored over the range [lo, hi]: m = f16(lo), d = f16((hi - m) / (2^b - 1))."""
    m = float(torch.tensor(lo).half())
    d = float(torch.tensor((hi - m) / (2 ** bits - 1)).half())
    codes = torch.clamp(torch.round((group - m) / d), 0, 2 ** bits - 1) if d else torch.zeros_like(group)
    return codes * d + m


def _asym_oracle(group: torch.Tensor, bits: int, search: bool = True) -> torch.Tensor:
    """attnlab's group (search) as documented: of the ranges [min, max] shrunk about their middle by 1, 0.95, ...,
    0.6, the first whose read-back has the least squared error (float32); KIVI's (search=False): [min, max]."""
    lo, hi = float(group.min()), float(group.max())
    if not search:
        return _minmax_oracle(group, bits, lo, hi)
    mid, best, best_err = (lo + hi) / 2, None, None
    for ratio in (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6):
        got = _minmax_oracle(group, bits, mid + (lo - mid) * ratio, mid + (hi - mid) * ratio)
        err = float(((got - group).float() ** 2).sum())
        if best is None or err < best_err:
            best, best_err = got, err
    return best


@pytest.mark.parametrize("bits", [7, 6, 5, 4, 3, 2])
def test_asymmetric_group_matches_the_formula_by_hand(bits):
    group = torch.tensor([-1.5, -0.2, 0.0, 0.3, 0.9, 2.25, 2.0, -0.7], dtype=F64)
    fmt = check_kv_dtype(f"int{bits}/g8").low
    got = lowbit.decode(*lowbit.encode(group[None], (8,), fmt), (8,), fmt, F64)[0]
    assert torch.allclose(got, _asym_oracle(group, bits), rtol=0, atol=1e-12)
    minmax = _asym_oracle(group, bits, search=False)  # the search tries [min, max] first: never worse than it
    assert float(((got - group) ** 2).sum()) <= float(((minmax - group) ** 2).sum()) + 1e-6


def test_range_search_clips_an_outlier_that_min_max_spends_the_levels_on():
    """A group of 31 values spread over [-1, 1] and one at 2.4, in 2 bits: min-max puts 1 level above 1.2 and
    leaves 3 for the rest; the search gives up some of the outlier for the other 31 (less squared error)."""
    group = torch.cat([torch.linspace(-1, 1, 31, dtype=F64), torch.tensor([2.4], dtype=F64)])
    fmt = check_kv_dtype("int2/g32").low
    got = lowbit.decode(*lowbit.encode(group[None], (32,), fmt), (32,), fmt, F64)[0]
    minmax = _asym_oracle(group, 2, search=False)
    assert torch.allclose(got, _asym_oracle(group, 2), rtol=0, atol=1e-12)
    assert float(got.max()) < 2.4 - 0.1  # the range was clipped
    assert float(((got - group) ** 2).sum()) < 0.9 * float(((minmax - group) ** 2).sum())


@pytest.mark.parametrize("spelling", ["int4/g8", "int2/g5", "int4/g32+r8", "int2+r8"])
def test_groups_cover_each_part_with_a_short_last_group(spelling):
    fmt = check_kv_dtype(spelling).low
    x = _x(5, 46, seed=1).double()
    parts = (30, 16)
    got = lowbit.decode(*lowbit.encode(x, parts, fmt), parts, fmt, F64)
    want = torch.empty_like(x)
    start = 0
    for w, f in zip(parts, lowbit.part_formats(parts, fmt)):
        for a in range(start, start + w, f.group):
            b = min(a + f.group, start + w)
            for i in range(x.shape[0]):
                want[i, a:b] = _asym_oracle(x[i, a:b], f.bits)
        start += w
    assert torch.allclose(got, want, rtol=0, atol=1e-12)
    assert torch.equal(round_trip(x, spelling, parts), got)


def test_kivi_keys_per_channel_over_tokens_values_per_token():
    g = torch.Generator().manual_seed(3)
    k = torch.randn(1, 2, 70, 32, generator=g, dtype=F64)  # two whole groups of 32 tokens and 6 left over
    v = torch.randn(1, 2, 70, 32, generator=g, dtype=F64)
    kq = round_trip(k, "kivi4", (32,), "key")
    vq = round_trip(v, "kivi4", (32,), "value")
    for c in (0, 17):  # a channel's first group of 32 tokens, by hand
        assert torch.allclose(kq[0, 1, :32, c], _asym_oracle(k[0, 1, :32, c], 4, search=False), rtol=0, atol=1e-12)
    assert torch.equal(kq[..., 64:, :], k[..., 64:, :])  # the partial group stays as it is (KIVI's residual)
    assert torch.allclose(vq[0, 0, 5], _asym_oracle(v[0, 0, 5], 4, search=False), rtol=0, atol=1e-12)


# -- (c) packing ------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("width", [1, 7, 8, 30, 64])
def test_pack_unpack_is_the_identity(bits, width):
    codes = torch.randint(0, 2 ** bits, (3, 4, width), generator=torch.Generator().manual_seed(bits), dtype=torch.uint8)
    packed = lowbit.pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape[-1] == lowbit.packed_width(width, bits)
    assert torch.equal(lowbit.unpack(packed, bits, width), codes)


@pytest.mark.parametrize("bits", [3, 5, 6, 7])
def test_packing_of_other_bits_is_its_binary_digits_low_first(bits):
    """The documented layout by hand: a b-bit code cut into the chunks of b's binary digits (4, 2, 1), low bits
    first, each chunk 8 / w codes to a byte with the first code in the low bits."""
    width = 16
    codes = torch.randint(0, 2 ** bits, (width,), generator=torch.Generator().manual_seed(bits), dtype=torch.uint8)
    want, shift = [], 0
    for w in [c for c in (4, 2, 1) if bits & c]:
        part = [(int(c) >> shift) & ((1 << w) - 1) for c in codes]
        per = 8 // w
        want += [sum(v << (w * j) for j, v in enumerate(part[i:i + per])) for i in range(0, width, per)]
        shift += w
    assert lowbit.pack(codes, bits).tolist() == want
    with pytest.raises(ValueError, match="9 bits"):
        lowbit.pack(codes, 9)


# -- (d) caches ---------------------------------------------------------------------------------------
def _mla(**kw):
    torch.manual_seed(0)
    m = MultiHeadLatentAttention(64, 4, 64, head_dim=16, rope_dim=32, latent_norm=True, **kw)
    return randomize(m, std=0.3).double()


def _gqa(**kw):
    torch.manual_seed(0)
    return randomize(GroupedQueryAttention(64, 4, 2, head_dim=32, rope_base=10000.0, **kw), std=0.3).double()


@pytest.mark.parametrize("make, parts", [(_mla, {"kv": (64, 32)}), (_gqa, {"k": (32,) * 2, "v": (32,) * 2})])
@pytest.mark.parametrize("kv_dtype", ["q8_0", "q5_0", "q4_0", "q4_1", "int4", "int2/g16", "int4/g32+r8", "int6/g32+r8",
                                      "int7/g16", "int5"])
def test_cache_allocates_the_documented_bytes(make, parts, kv_dtype):
    m = make()
    fmt = check_kv_dtype(kv_dtype).low
    if fmt.rope_bits and make is _gqa:
        with pytest.raises(ValueError, match=r"\+r8.*rope key.*\(32,\)"):
            m.init_cache(2, 5, kv_dtype=kv_dtype)
        return
    cache = m.init_cache(2, 5, kv_dtype=kv_dtype)
    # per head (GQA) a row of 32 values is stored per KV head, so parts per head
    per_row = {"kv": lowbit.row_bytes((64, 32), fmt)} if make is _mla else {"k": 2 * lowbit.row_bytes((32,), fmt),
                                                                         "v": 2 * lowbit.row_bytes((32,), fmt)}
    assert cache.bytes_per_token == sum(per_row.values())
    allocated = sum(t.numel() * t.element_size() for t in cache.tensors())
    assert allocated == cache.bytes_per_token * 2 * 5


DECODERS = {"gqa": _gqa, "mla": _mla}


@pytest.mark.parametrize("name, kv_dtype", [(n, k) for n in DECODERS for k in ("q4_0", "q8_0", "int4", "int2/g16")]
                         + [("mla", "int4/g32+r8"), ("mla", "int6/g32+r8"), ("gqa", "int5/g16")])
def test_few_bit_decode_equals_full_forward_through_the_same_storage(name, kv_dtype):
    m = DECODERS[name]()
    x = torch.randn(2, 8, m.dim, dtype=F64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = m(x, is_causal=True)
        m.kv_dtype = kv_dtype
        full = m(x, is_causal=True)
        for absorbed in ((None, True, False) if name == "mla" else (None,)):
            cache = m.init_cache(2, 8)
            kw = {} if absorbed is None else {"absorbed": absorbed}
            steps = [m(x[:, :3], cache=cache, is_causal=True, **kw)]
            steps += [m(x[:, t:t + 1], cache=cache, **kw) for t in range(3, 8)]
            assert rel_err(torch.cat(steps, 1), full) <= F64_TOL
            step = m.init_cache(2, 8)  # the fixed-shape step writes the packed codes at a slot
            m(x[:, :7], cache=step, is_causal=True, **kw)
            view = step.fixed_slot(torch.tensor([7]))
            pad = torch.ones(2, 8, dtype=torch.bool)
            last = m(x[:, 7:], cache=view, key_padding_mask=pad, positions=torch.tensor([7]), **kw)
            assert rel_err(last, full[:, 7:]) <= F64_TOL
    assert rel_err(full, plain) > 1e-4  # the forward did go through the storage


@pytest.mark.parametrize("kv_dtype", ["int4", "int2+r8", "int3/g16+c4"])
def test_training_through_few_bit_codes_reaches_the_latent_projection(kv_dtype):
    m = _mla()
    m.kv_dtype = kv_dtype
    x = torch.randn(2, 8, m.dim, dtype=F64, generator=torch.Generator().manual_seed(2))
    out = m(x, is_causal=True)
    with torch.no_grad():
        assert rel_err(out.detach(), m(x, is_causal=True)) <= F64_TOL  # forward values are the storage's
    out.square().sum().backward()
    for name in ("W_DKV", "W_KR"):
        assert float(getattr(m, name).weight.grad.abs().sum()) > 0, name


def test_kivi_is_an_evaluation_baseline_and_a_gqa_one():
    gqa, mla = _gqa(), _mla()
    gqa.kv_dtype = "kivi2"  # a forward without a cache takes it
    with pytest.raises(ValueError, match=r"'kivi2' is KIVI, an evaluation baseline"):
        gqa.init_cache(1, 4)
    with pytest.raises(ValueError, match=r"'kivi4' \(KIVI\).*MultiHeadLatentAttention.*int4/g<N>"):
        mla.kv_dtype = "kivi4"


def test_block_format_refuses_rows_that_are_not_whole_blocks():
    m = MultiHeadLatentAttention(64, 4, 40, head_dim=16, rope_dim=8)
    with pytest.raises(ValueError, match=r"q4_0 stores rows in blocks of 32 values; parts of widths \(40, 8\)"):
        m.init_cache(1, 4, kv_dtype="q4_0")


def test_model_bytes_count_kivi_in_its_steady_state():
    transformers = pytest.importorskip("transformers")
    from attnlab.models import kv_bytes_per_token, to_attnlab

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = to_attnlab(transformers.LlamaForCausalLM(cfg).eval())
    values = 2 * 2 * 16 * 2  # K and V, 2 KV heads of 16, 2 layers
    assert kv_bytes_per_token(model, kv_dtype="kivi4") == values * 5 // 8
    assert kv_bytes_per_token(model, kv_dtype="kivi2") == values * 3 // 8


# -- (e) the rotation ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kw", [{}, {"latent_norm": True}, {"latent_norm": True, "latent_bias": True, "bias": True}])
@pytest.mark.parametrize("rotation", ["random", "hadamard"])
def test_rotating_the_latent_is_exact_in_float64(kw, rotation):
    torch.manual_seed(0)
    m = randomize(MultiHeadLatentAttention(48, 4, 32, head_dim=12, rope_dim=8, **kw), std=0.3).double()
    if m.kv_norm is not None:
        with torch.no_grad():
            m.kv_norm.weight.uniform_(0.5, 2.0)
    x = torch.randn(2, 9, 48, dtype=F64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        before = [m(x, is_causal=True, absorbed=a) for a in (True, False)]
        c_before = m.compress(x)[..., :32]
        R = rotate_latent(m, rotation)
        after = [m(x, is_causal=True, absorbed=a) for a in (True, False)]
        c_after = m.compress(x)[..., :32]
    for b, a in zip(before, after):
        assert rel_err(a, b) <= F64_TOL
    assert torch.allclose(R @ R.T, torch.eye(32, dtype=F64), atol=1e-12)
    assert rel_err(c_after, c_before) > 0.1  # the cached latent did change


@pytest.mark.parametrize("rotation", ["random", "hadamard"])
def test_a_steady_channel_stays_out_of_the_rotation_and_the_model_is_unchanged(rotation):
    """A GGUF's latent norm with its steady channel (norm weight 0, no up-projection column, a pre-norm value far
    above the others): the other channels rotate, the steady one keeps its weight 0 and its row of W_DKV, its
    cached value stays 0, and every output is the same in float64."""
    torch.manual_seed(0)
    m = randomize(MultiHeadLatentAttention(48, 4, 33, head_dim=12, rope_dim=8, latent_norm=True), std=0.3).double()
    with torch.no_grad():
        m.kv_norm.weight.uniform_(0.5, 2.0)
        m.kv_norm.weight[-1] = 0.0
        m.W_UK.weight[:, -1] = 0.0
        m.W_UV.weight[:, -1] = 0.0
        m.W_DKV.weight[-1] *= 30  # steadies the norm's scale
    steady_row = m.W_DKV.weight[-1].clone()
    x = torch.randn(2, 9, 48, dtype=F64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        before = [m(x, is_causal=True, absorbed=a) for a in (True, False)]
        c_before = m.compress(x)[..., :33]
        R = rotate_latent(m, rotation if rotation == "random" else torch.as_tensor(hadamard(32)))
        after = [m(x, is_causal=True, absorbed=a) for a in (True, False)]
        c_after = m.compress(x)[..., :33]
    for b, a in zip(before, after):
        assert rel_err(a, b) <= F64_TOL
    assert R.shape == (33, 33) and R[-1, -1] == 1 and torch.count_nonzero(R[-1, :-1]) == 0
    assert torch.equal(m.kv_norm.weight[-1], torch.zeros((), dtype=F64))
    assert torch.equal(m.kv_norm.weight[:-1], torch.ones(32, dtype=F64))
    assert torch.equal(m.W_DKV.weight[-1], steady_row)
    assert torch.count_nonzero(c_after[..., -1]) == 0 and rel_err(c_after[..., :-1], c_before[..., :-1]) > 0.1


def test_rotation_spreads_an_outlier_channel_and_lowers_the_four_bit_error():
    torch.manual_seed(0)
    m = randomize(MultiHeadLatentAttention(64, 4, 64, head_dim=16, rope_dim=0), std=0.3).double()
    with torch.no_grad():
        m.W_DKV.weight[3] *= 30  # one latent channel 30 times the others
    x = torch.randn(4, 32, 64, dtype=F64, generator=torch.Generator().manual_seed(6))
    fmt = "int4/g32"

    def read_error(module):
        with torch.no_grad():
            c = module.compress(x)
            k = module.W_UK(c)
            return rel_err(module.W_UK(round_trip(c, fmt, (64,))), k)

    plain = read_error(m)
    rotate_latent(m, "hadamard")
    assert read_error(m) < plain / 2


def test_rotation_sizes_and_refusals():
    assert torch.allclose(hadamard(8) @ hadamard(8).T, torch.eye(8, dtype=F64), atol=1e-14)
    q = random_orthogonal(10, seed=3)
    assert torch.allclose(q @ q.T, torch.eye(10, dtype=F64), atol=1e-12)
    assert torch.equal(q, random_orthogonal(10, seed=3))
    with pytest.raises(ValueError, match=r"power-of-two size, got 12"):
        hadamard(12)
    m = MultiHeadLatentAttention(16, 2, 6)
    with pytest.raises(ValueError, match=r"must be 6 x 6 \(the latent's channels with a nonzero norm weight\), got "
                                         r"\(5, 5\)"):
        rotate_latent(m, torch.eye(5))
    with pytest.raises(ValueError, match="not orthogonal"):
        rotate_latent(m, 2 * torch.eye(6))


# -- the shrink's baselines --------------------------------------------------------------------------
def test_baseline_verdict_takes_the_best_at_or_above_the_bytes_reached():
    from attnlab.shrink.baselines import at_or_above, compare

    sizes = {"q8_0": 100, "q5_0": 66, "q4_0": 56, "kivi2": 38}
    assert at_or_above(sizes, 50) == ["q4_0", "q5_0"]
    out = compare(50, 10.5, 10.0, sizes, {"q4_0": 11.0, "q5_0": 10.2})
    assert out["against"]["baseline"] == "q5_0" and out["against"]["beats"] is False
    assert math.isclose(out["against"]["perplexity_ratio_to_baseline"], 10.5 / 10.2)
    assert [r["kv_dtype"] for r in out["rows"]] == ["kivi2", "q4_0", "q5_0", "q8_0"]
    assert compare(120, 10.5, 10.0, sizes, {})["against"] is None
    # baselines of one size are all scored: on SmolLM2 q4_1 and KIVI 4-bit both take 7,200 bytes, KIVI far better
    tied = {"q8_0": 12240, "q5_0": 7920, "q4_1": 7200, "q4_0": 6480, "kivi4": 7200, "kivi2": 4320}
    assert at_or_above(tied, 5760) == ["q4_0", "q4_1", "kivi4"]
    assert at_or_above(tied, 6481) == ["q4_1", "kivi4", "q5_0"]


# -- (f) the rope key per channel ("+c4") -----------------------------------------------------------------
@pytest.mark.parametrize("key_bits", [4, 3, 2])
def test_rope_key_per_channel_matches_the_formula_by_hand(key_bits):
    """int3/g8+c<b> on rows (1, 150, 30 + 16): the latent per token in groups of 8 channels (3 bits), the rope key
    per channel over groups of 64 tokens (b bits); tokens 128-149, an incomplete group, as they are."""
    x = torch.randn(1, 150, 46, generator=torch.Generator().manual_seed(4), dtype=F64)
    x[0, :, 33] *= 30.0  # an outlier channel of the key
    got = round_trip(x, f"int3/g8+c{key_bits}", (30, 16))
    for t in (0, 77, 149):
        for a in range(0, 30, 8):
            b = min(a + 8, 30)
            assert torch.allclose(got[0, t, a:b], _asym_oracle(x[0, t, a:b], 3), rtol=0, atol=1e-12)
    for c in (30, 33, 45):
        for start in (0, 64):
            group = x[0, start:start + 64, c]
            assert torch.allclose(got[0, start:start + 64, c], _asym_oracle(group, key_bits), rtol=0, atol=1e-12)
    assert torch.equal(got[0, 128:, 30:], x[0, 128:, 30:])


@pytest.mark.parametrize("absorbed", [None, True, False])
def test_rope_key_per_channel_cache_decodes_what_a_forward_of_each_prefix_computes(absorbed):
    m = _mla()
    m.kv_dtype = "int3/g16+c4"
    x = torch.randn(2, 150, m.dim, dtype=F64, generator=torch.Generator().manual_seed(5))
    kw = {} if absorbed is None else {"absorbed": absorbed}
    with torch.no_grad():
        cache = m.init_cache(2, 160)
        out = [m(x[:, :70], cache=cache, is_causal=True, **kw)]  # one whole group of 64 in the prefill
        out += [m(x[:, t:t + 1], cache=cache, **kw) for t in range(70, 150)]
        steps = torch.cat(out, 1)
        for t in (69, 70, 127, 128, 129, 149):  # a group completes at 127
            assert rel_err(steps[:, t], m(x[:, :t + 1], is_causal=True)[:, -1]) <= F64_TOL
        plain = copy.deepcopy(m)
        plain.kv_dtype = None
        assert rel_err(steps[:, 149], plain(x, is_causal=True)[:, -1]) > 1e-4  # it did go through the codes


@pytest.mark.parametrize("kv_dtype, fixed", [("int3/g16+c4", 64 * 32 * 8), ("int3/g16+r8", 0), ("int8", 0)])
def test_bytes_at_a_context_are_what_a_cache_made_for_it_allocates(kv_dtype, fixed):
    """A "+c4" cache holds its newest group of 64 rope keys (32 values each) unquantised in the activation dtype
    (float64 here) whatever the sequence's length: fixed bytes, not per token. bytes_at(T) spreads them over T, so
    T bytes_at(T) is every byte a cache made for T tokens allocates (its tensors, per sequence)."""
    m = _mla()  # latent 64, rope key 32, float64
    for T in (64, 256, 4096):
        cache = m.init_cache(2, T, kv_dtype=kv_dtype)
        allocated = sum(t.numel() * t.element_size() for t in cache.tensors()) / 2
        assert cache.fixed_bytes == fixed
        assert cache.bytes_at(T) * T == allocated == cache.bytes_per_token * T + fixed


def test_rope_key_per_channel_cache_bytes_and_refusals():
    m = _mla()  # latent 64, rope key 32
    cache = m.init_cache(2, 200, kv_dtype="int3/g16+c4")
    # per token: 64 latent codes of 3 bits, a float16 scale and minimum per 16 of them, 32 key codes of 4 bits,
    # and 1/64 of the key's scale and minimum per channel (32 * 2 * 2 bytes a group of 64 tokens)
    by_hand = 64 * 3 // 8 + (64 // 16) * 2 * 2 + 32 * 4 // 8 + 32 * 2 * 2 // 64
    assert cache.bytes_per_token == by_hand == lowbit.row_bytes((64, 32), check_kv_dtype("int3/g16+c4").low)
    with pytest.raises(ValueError, match="fixed-shape step"):
        cache.fixed_slot(torch.tensor([3]))
    with pytest.raises(ValueError, match=r"\+c4.*rope key.*\(32,\)"):
        _gqa().init_cache(2, 5, kv_dtype="int4/g32+c4")
    with pytest.raises(ValueError, match="stored by a LatentCache"):
        lowbit.encode(torch.zeros(1, 96), (64, 32), check_kv_dtype("int4+c4").low)


def test_rope_key_per_channel_truncate_keeps_the_stored_tokens_and_goes_on():
    m = _mla()
    m.kv_dtype = "int4/g32+c4"
    x = torch.randn(1, 160, m.dim, dtype=F64, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        cache = m.init_cache(1, 200)
        m(x[:, :150], cache=cache, is_causal=True)
        (before,) = cache.view()
        cache.truncate(100)  # into the group 64-127, quantised: its first 36 tokens go back to the newest group
        (after,) = cache.view()
        assert after.shape[1] == 100 and torch.equal(after, before[:, :100])
        m(x[:, 100:160], cache=cache)  # the group completes again at 127 and is quantised anew
        (grown,) = cache.view()
    assert torch.equal(grown[:, :64], before[:, :64]) and grown.shape[1] == 160
    assert torch.equal(grown[:, 128:, 64:], m.compress(x[:, :160])[:, 128:, 64:])  # the newest group as it is


# -- runs of their own bits ("tc4x40-3x24+c4": a latent whose channels are coded in runs) -------------------------
def test_a_runs_storage_codes_each_run_as_its_own_bits_do_and_costs_what_its_pieces_cost():
    x = torch.randn(3, 5, 64 + 32, dtype=F64, generator=torch.Generator().manual_seed(0)) * torch.linspace(4, 0.1, 96)
    fmt = check_kv_dtype("tc4x40-3x24+c4").low
    assert fmt.segments == ((4, 40), (3, 24)) and fmt.rope_channel and fmt.rope_bits == 4
    got = round_trip(x, "tc4x40-3x24+r8", (64, 32))
    want = torch.cat([lowbit.round_trip(x[..., :40], (40,), lowbit.parse("int4")),
                      lowbit.round_trip(x[..., 40:64], (24,), lowbit.parse("int3")),
                      lowbit.round_trip(x[..., 64:], (32,), lowbit.parse("int7")._replace(code="int8", bits=8))], -1)
    assert torch.equal(got, want)
    codes, meta = lowbit.encode(x, (64, 32), lowbit.parse("tc4x40-3x24+r8"))
    back = lowbit.decode(codes, meta, (64, 32), lowbit.parse("tc4x40-3x24+r8"), F64)
    assert torch.equal(back, want)
    # by hand: codes 40 x 4 bits (20 B) + 24 x 3 bits (9 B); meta: groups of 32 within a run (2 + 1) and the rope key's
    # one group, each a float16 scale and minimum (4 B); the rope key 32 x 8 bits (32 B)
    assert lowbit.row_bytes((64, 32), lowbit.parse("tc4x40-3x24+r8")) == 20 + 9 + 4 * 4 + 32
    # with the rope key per channel: 32 x 4 bits (16 B) and 32 channels' scale and minimum per 64 tokens (2 B a token)
    assert lowbit.row_bytes((64, 32), fmt) == 20 + 9 + 3 * 4 + 16 + 2


def test_a_runs_storage_refuses_runs_that_do_not_make_up_the_latent_or_leave_out_the_rope_key():
    with pytest.raises(ValueError, match=r"tc4x40-3x20 codes 60 latent channels \(40 \+ 20\); this row's latent has 64"):
        lowbit.check_parts((64,), lowbit.parse("tc4x40-3x20"))
    with pytest.raises(ValueError, match=r"have a rope key too: add its storage, tc4x64\+r8 .* or tc4x64\+c4"):
        lowbit.check_parts((64, 32), lowbit.parse("tc4x64"))
    assert lowbit.parse("tc4x64-1x8") is None and lowbit.parse("tc9x8") is None  # 1 and 9 bits: no such codes


def test_an_mla_with_a_runs_storage_decodes_what_its_forward_computes():
    torch.manual_seed(0)
    m = randomize(MultiHeadLatentAttention(128, 4, 64, head_dim=32, rope_dim=16, kv_dtype="tc5x16-3x48+c4"),
                  std=0.3).double()
    x = torch.randn(2, 70, 128, dtype=F64)  # past one group of 64 tokens of the rope key
    with torch.no_grad():
        full = m(x, is_causal=True)
        cache = m.init_cache(2, 70)
        steps = [m(x[:, :65], cache=cache, is_causal=True)] + [m(x[:, t:t + 1], cache=cache) for t in range(65, 70)]
    assert rel_err(torch.cat(steps, 1), full) <= 1e-10
    assert cache.bytes_per_token == lowbit.row_bytes((64, 16), lowbit.parse("tc5x16-3x48+c4"))


# -- the clip search in one pass (a decode step's few rows) -------------------------------------------------------
@pytest.mark.parametrize("code", ["int2/g32", "int3/g64", "int4/g32", "int3/g256"])
def test_the_clip_search_at_once_chooses_what_the_search_in_turn_chooses(code):
    """lowbit's two clip searches give bitwise the same range on rows with ties (constant and zero groups), outliers
    and a short padded last group; above AT_ONCE values the codes come from the loop."""
    from attnlab.modules.lowbit import _grouped, _range_meta, _search_at_once, _search_in_turn

    fmt = lowbit.parse(code)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(5, 3, 200, generator=g) * torch.rand(5, 3, 1, generator=g) * 4
    x[0, 0, :64] = 0.5  # a constant group
    x[1, 1, :64] = 0.0
    x[2, 2, 5] = 40.0  # an outlier
    xg = _grouped(x, fmt.group)
    real = torch.ones(xg.shape[-2:])
    real[-1, 200 % fmt.group or fmt.group:] = 0
    top = (1 << fmt.bits) - 1
    lo, hi = xg.amin(-1, keepdim=True), xg.amax(-1, keepdim=True)
    m, d = _range_meta(lo, hi, top)
    for r in (real, None):
        a, b = _search_in_turn(xg, lo, hi, m, d, top, r), _search_at_once(xg, lo, hi, m, d, top, r)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        assert not torch.equal(a[1], d)  # some group clipped: the search chose something
