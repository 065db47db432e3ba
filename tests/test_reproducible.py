"""shrink is reproducible: the same request and seed make the same plan on a fast machine and a slow one (a fake
clock that runs at two speeds), a loaded run heals less but plans alike and says how much it did, and a request
that pins the work (--tokens and --layer-steps) gives the same weights whatever the clock. Tiny random Llama
checkpoints."""
import pytest
import torch
from tiny_checkpoints import make_checkpoint

from attnlab import models as hf
from attnlab.runtime import Budget
from attnlab.shrink import ShrinkRequest, shrink
from attnlab.shrink.request import pinned, plan_count

T = 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("repro") / "llama"
    make_checkpoint("llama", folder, initializer_range=0.3, max_position_embeddings=512)
    return folder


def _slowed(monkeypatch, clock, seconds_per_pass):
    """hf.load_model whose models advance the fake clock by `seconds_per_pass` at every forward pass."""
    import attnlab.models.store as store
    real_load = store.load_model

    def load(source):
        model, tok, meta = real_load(source)
        model.model.embed_tokens.register_forward_pre_hook(
            lambda *_: clock.__setitem__(0, clock[0] + seconds_per_pass))
        return model, tok, meta

    monkeypatch.setattr(hf, "load_model", load)


def _run(tiny, out, monkeypatch, seconds_per_pass, **kw):
    clock = [0.0]
    _slowed(monkeypatch, clock, seconds_per_pass)
    req = ShrinkRequest(**{**dict(source=str(tiny), kv_budget="50%", out=str(out), minutes=10, seq_len=T,
                                  windows=48, seed=3), **kw})
    return shrink(req, budget=Budget(req.minutes, clock=lambda: clock[0]))


def _weights(folder):
    model, _, _ = hf.load_model(str(folder))
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_a_loaded_machine_makes_the_same_plan_and_heals_less(tiny, tmp_path, monkeypatch):
    """Every model pass costs 0.1 fake seconds on the fast machine and 1 on the slow one (a 5-minute budget, windows
    of 64 tokens): the data the plan reads, the candidates and the choice are the same; the slow run wrote fewer
    training windows and its report says so."""
    kw = dict(minutes=5, windows=120, seq_len=64, tokens=4 * 64 * 4)
    fast = _run(tiny, tmp_path / "fast", monkeypatch, 0.1, **kw)
    slow = _run(tiny, tmp_path / "slow", monkeypatch, 1.0, **kw)
    assert fast["plan"]["chosen"] == slow["plan"]["chosen"]
    assert [(c["label"], c["proxy"]) for c in fast["plan"]["candidates"]] == \
        [(c["label"], c["proxy"]) for c in slow["plan"]["candidates"]]
    later = sum(c["round"] >= 4 for c in fast["plan"]["candidates"])  # rounds 4 and 5: one more, whatever the count
    measured = fast["work"]["candidates_measured"]
    assert measured == slow["work"]["candidates_measured"]
    assert plan_count(5) <= measured - later <= plan_count(5) + 1  # + round 3's rival across the 2-bit margin
    assert not fast["work"]["pinned"] and not slow["work"]["pinned"]
    assert slow["work"]["training_windows"] < fast["work"]["training_windows"]  # the clock set how much
    assert slow["work"]["training_windows"] >= 2048 // 64 + 1024 // 64  # ... never the windows the plan read
    assert fast["held_out"]["teacher"]["perplexity"] == slow["held_out"]["teacher"]["perplexity"]  # same held-out


def test_pinned_work_gives_the_same_weights_whatever_the_clock(tiny, tmp_path, monkeypatch):
    """--tokens and --layer-steps pin the work: on a clock 20 times slower, where the 1-minute budget would end the
    run long before its steps, every window and step still runs and the weights are the same."""
    kw = dict(tokens=4 * T * 4, layer_steps=2, minutes=1, windows=24)
    assert pinned(ShrinkRequest(source="x", kv_budget="50%", out="o", **kw))
    fast = _run(tiny, tmp_path / "fast", monkeypatch, 0.01, **kw)
    slow = _run(tiny, tmp_path / "slow", monkeypatch, 0.2, **kw)
    assert fast["work"]["pinned"] and fast["plan"]["chosen"] == slow["plan"]["chosen"]
    assert fast["work"]["training_windows"] == slow["work"]["training_windows"] == 24
    assert fast["work"]["heal_steps"] == slow["work"]["heal_steps"] > 0
    a, b = _weights(tmp_path / "fast"), _weights(tmp_path / "slow")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_planner_stops_at_its_count_not_at_the_clock(tiny):
    """plan(max_candidates=N) measures the first N candidates of the unlimited search, in its order."""
    from attnlab.shrink import parse_budget, plan

    model, tok, _ = hf.load_model(str(tiny))
    ids = torch.randint(0, model.config.vocab_size, (1, 4 * 64), generator=torch.Generator().manual_seed(0))
    whole = plan(model, ids, parse_budget("50%"), window=64, proxy_windows=2)
    cut = plan(model, ids, parse_budget("50%"), window=64, proxy_windows=2, max_candidates=3)
    counted = [c for c in cut.measured if c.round < 4]  # round 4 comes after the count (plan's docstring)
    assert len(whole.measured) > 3 and len(counted) == 3
    assert [c.label() for c in counted] == [c.label() for c in whole.measured[:3]]
    with pytest.raises(ValueError, match="max_candidates must be a positive integer, got 0"):
        plan(model, ids, parse_budget("50%"), window=64, max_candidates=0)


def test_the_winner_is_measured_again_with_bkv_the_other_way_inside_the_count(tiny):
    """Round 1 picks BKV at a small 16-bit row; after round 3 the winner so far is measured with BKV flipped (the same
    sizes, selection and storage) and the better of the two wins. A count that cuts round 3 keeps a place for it:
    the cut search is the unlimited one's first N - 1 candidates and then that check, N in all."""
    from attnlab.shrink import parse_budget, plan

    model, tok, _ = hf.load_model(str(tiny))
    ids = torch.randint(0, model.config.vocab_size, (1, 4 * 64), generator=torch.Generator().manual_seed(0))
    budget = parse_budget("25%")
    for count in (None, 8):
        result = plan(model, ids, budget, window=64, proxy_windows=2, storages=("bf16", "int8", "int4/g32+r8"),
                      max_candidates=count)
        *before, check = [c for c in result.measured if c.round < 4]
        best = min((c for c in before if not c.native), key=lambda c: c.proxy)
        assert (check.round, check.latent_dim, check.rope_dim, check.rope_select, check.kv_dtype) == \
            (3, best.latent_dim, best.rope_dim, best.rope_select, best.kv_dtype)
        assert check.balance is not best.balance
        assert result.best is min(result.measured, key=lambda c: c.proxy)
        if count is None:
            whole = [c.label() for c in before]
        else:
            assert len(before) + 1 == count and [c.label() for c in before] == whole[:count - 1]


@pytest.mark.parametrize("seed", [-1, 2 ** 31, True])
def test_a_seed_that_cannot_be_honoured_is_refused_before_any_work(seed):
    from attnlab.shrink.request import check_request

    with pytest.raises(ValueError, match=f"--seed must be an integer from 0 to {2 ** 31 - 1}, got {seed!r}"):
        check_request(ShrinkRequest(source="smollm2", kv_budget="25%", out="o", seed=seed))
