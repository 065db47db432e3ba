"""The first rows kept plain ("+s<N>" storages, modules/sink.py: an attention sink).

Oracle: attention written out per query in float64 (tests/test_recent_window.py's), over rows chosen by hand: query
i reads rows j < N and i - W < j <= i as the module compressed them, the others as the storage without "+s<N>"
returns them (storage.round_trip of a per-token storage: each row alone, checked in test_kv_lowbit.py). Every path
must equal it (<= 1e-10). Invariants: the sink rows stay out of the codes (a rope key's group range included), the
cache reads what the forward without a cache reads, the plain rows are fixed bytes, and the spellings it refuses.
"""
import pytest
import torch

from attnlab import GroupedQueryAttention
from attnlab.modules.cache import LatentCache
from attnlab.modules.storage import check_kv_dtype, round_trip
from reference import rel_err
from test_recent_window import _mla, _x, attend_rows

TOL = 1e-10


def _oracle(m, x, sink, recent, base):
    """Each query's attention from its definition: rows j < sink and the newest `recent` plain, the rest in `base`."""
    def rows(i, kv, stored):
        return torch.stack([kv[:, j] if j < sink or j > i - recent else stored[:, j] for j in range(i + 1)], 1)

    return attend_rows(m, x, base, rows)


@pytest.mark.parametrize("kv_dtype, base", [("int4/g32+r8+s2", "int4/g32+r8"), ("int3/g32+r8+s1+w4", "int3/g32+r8"),
                                            ("int8+s3", "int8")])
def test_every_path_reads_the_first_rows_plain(kv_dtype, base):
    from transformers import DynamicCache

    from attnlab.models.adapters import TransformersCache

    m = _mla(kv_dtype)
    fmt = check_kv_dtype(kv_dtype)
    x = _x()
    with torch.no_grad():
        want = _oracle(m, x, fmt.sink, fmt.recent or 0, base)
        for absorbed in (False, True):
            assert rel_err(m(x, is_causal=True, absorbed=absorbed), want) <= TOL
        cache = m.init_cache(2, 32)
        assert rel_err(torch.cat([m(x[:, i:i + 1], cache=cache) for i in range(19)], 1), want) <= TOL
        cache = m.init_cache(2, 32)
        chunks = torch.cat([m(x[:, a:a + 5], cache=cache, is_causal=True) for a in range(0, 19, 5)], 1)
        assert rel_err(chunks, want) <= TOL
        theirs = TransformersCache(DynamicCache(), 0)
        chunks = torch.cat([m(x[:, a:a + 5], cache=theirs, is_causal=True) for a in range(0, 19, 5)], 1)
        assert rel_err(chunks, want) <= TOL
        without = _oracle(m, x, 0, fmt.recent or 0, base)
        assert rel_err(without, want) > 1e-6  # the plain first rows are read


def test_the_first_rows_stay_out_of_the_codes_and_of_the_rope_keys_group_range():
    """int3/g16+c4+s2 on rows [c | k_R]: rows 0-1 come back as they were; rows 2.. do not change when rows 0-1 grow a
    thousandfold, where the storage without +s2 codes the first group of 64 rope keys over a range they stretch."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 70, 48, dtype=torch.float64, generator=g)
    loud = x.clone()
    loud[:, :2] *= 1000
    parts = (32, 16)
    got, got_loud = (round_trip(t, "int3/g16+c4+s2", parts) for t in (x, loud))
    assert torch.equal(got[:, :2], x[:, :2]) and torch.equal(got_loud[:, :2], loud[:, :2])
    assert torch.equal(got[:, 2:], got_loud[:, 2:])
    plain, plain_loud = (round_trip(t, "int3/g16+c4", parts) for t in (x, loud))
    assert rel_err(plain_loud[:, 2:64, 32:], plain[:, 2:64, 32:]) > 1e-2  # the range the sink rows stretch


def test_a_latent_cache_reads_what_the_forward_without_a_cache_reads():
    """128 rows (two whole groups of rope keys) written in chunks of 9: read back as round_trip returns them."""
    x = torch.randn(2, 128, 48, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    owner = torch.nn.Linear(1, 1)
    cache = LatentCache(owner, 2, 128, 32, 16, dtype=torch.float64, kv_dtype="int3/g16+c4+s2")
    for a in range(0, 128, 9):
        cache.extend(kv=x[:, a:a + 9])
    assert rel_err(cache.view()[0], round_trip(x, "int3/g16+c4+s2", (32, 16))) <= TOL


def test_the_first_rows_are_fixed_bytes_a_sequence():
    owner = torch.nn.Linear(1, 1)
    caches = [LatentCache(owner, 3, 40, 32, 16, dtype=torch.float32, kv_dtype=k) for k in ("int4/g32+r8",
                                                                                          "int4/g32+r8+s4")]
    assert caches[1].bytes_per_token == caches[0].bytes_per_token
    assert caches[1].fixed_bytes - caches[0].fixed_bytes == 4 * (32 + 16) * 4  # 4 rows of 48 float32 a sequence


@pytest.mark.parametrize("spelling", ["int3/g64+c4+w8+s1", "int3/g64+s0", "int3/g64+s64", "bf16+s1", "kivi4+s1",
                                      "int3/g64+s1+s2"])
def test_spellings_it_refuses(spelling):
    with pytest.raises(ValueError, match=r"\+s"):
        check_kv_dtype(spelling)


def test_a_gqa_cache_refuses_the_first_rows_plain():
    gqa = GroupedQueryAttention(32, 4, 2, kv_dtype="int4/g16")
    with pytest.raises(ValueError, match="first rows kept plain"):
        gqa.init_cache(1, 8, kv_dtype="int4/g16+s1")


def test_the_planner_keeps_the_sink_in_its_windowed_latents_only():
    """with_sink adds "+s<N>" to the few-bit latents that keep a window (an MLA's only), before the window, and
    leaves every other storage, a GQA's included, as it is."""
    from attnlab.shrink import sizes
    from attnlab.shrink.request import AUTO_STORAGES

    for fmt, storages in AUTO_STORAGES.items():
        kept = sizes.with_sink(storages, 2)
        for old, new in zip(storages, kept):
            windowed = sizes.few_bit(old) and "+w" in old
            assert (new != old) == windowed, (fmt, old, new)
            parsed, before = check_kv_dtype(new), check_kv_dtype(old)
            if windowed:
                assert (parsed.sink, parsed.recent) == (2, before.recent) and new.replace("+s2", "") == old
    assert sizes.with_sink(sizes.STORAGES, 0) == sizes.STORAGES


@pytest.mark.parametrize("env, rows", [(None, "SINK"), ("3", 3), ("0", 0)])
def test_the_planned_sink_is_sink_unless_the_variable_says(monkeypatch, env, rows):
    from attnlab.shrink import sizes

    if env is None:
        monkeypatch.delenv(sizes.SINK_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(sizes.SINK_VARIABLE, env)
    assert sizes.planned_sink() == (sizes.SINK if rows == "SINK" else rows)


@pytest.mark.parametrize("value", ["-1", "64", "one"])
def test_a_planned_sink_out_of_range_is_refused_naming_it(monkeypatch, value):
    from attnlab.shrink import sizes

    monkeypatch.setenv(sizes.SINK_VARIABLE, value)
    with pytest.raises(ValueError, match=f"ATTNLAB_SINK must be .* got '{value}'"):
        sizes.planned_sink()


def test_a_budget_at_a_context_with_sliding_layers_plans_no_sink(monkeypatch):
    """A sink keeps every token in a sliding layer (cache.window_for); where the budget counts windows, none is
    planned, and elsewhere every windowed few-bit latent keeps sizes.SINK rows."""
    from attnlab.shrink import sizes
    from attnlab.shrink.request import storage_choices

    monkeypatch.delenv(sizes.SINK_VARIABLE, raising=False)
    plain, sunk = storage_choices("auto", "attnlab", windows=True), storage_choices("auto", "attnlab")
    assert plain == sizes.STORAGES
    assert sunk == sizes.with_sink(sizes.STORAGES, sizes.SINK) != plain
