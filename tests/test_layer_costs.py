"""Per-layer plans (issue `eighth`, part 2): a model converted with a latent size per layer, the cost of each layer
changed alone measured from that layer on (shrink/layer_costs.py), and the planner's round 4. Oracles: the whole
model's forward (candidate.proxy_kl), the one-size conversion, and shrink/per_layer.py's choice on costs measured that way."""
import copy
import re
import sys

import pytest
import torch
from tiny_checkpoints import make_checkpoint

from attnlab import models as hf
from attnlab.models.adapters import attnlab_modules, decoder_layers, replace_attention
from attnlab.models.convert import convert_model, layer_latents
from attnlab.shrink import parse_budget, plan
from attnlab.shrink.candidate import Candidate, apply, proxy_kl, teacher_logits
from attnlab.shrink.layer_costs import Prefix, layer_costs
from attnlab.shrink.layer_rounds import per_layer_sizes
from attnlab.shrink.per_layer import choose_per_layer
from attnlab.shrink.sizes import layer_bytes


@pytest.fixture(scope="module")
def four_folder(tmp_path_factory):
    """A 4-layer tiny Llama checkpoint (64 KV values per token and layer) with its tokenizer."""
    folder = tmp_path_factory.mktemp("per_layer") / "llama"
    make_checkpoint("llama", folder, initializer_range=0.3, max_position_embeddings=512, num_hidden_layers=4)
    return folder


@pytest.fixture(scope="module")
def four(four_folder):
    """(model, calibration ids (1, 256), windows (2, 64)) of four_folder's model."""
    model, _, _ = hf.load_model(str(four_folder))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, 256), generator=g)
    windows = torch.randint(0, model.config.vocab_size, (2, 64), generator=g)
    return model, ids, windows


def _convert_one(model, layer: int, latent: int, ids) -> None:
    convert_model(model, "mla", latent_dim=latent, rope_dim=8, calibration_ids=ids, pair_selection="rorope",
                  layers=[layer])


@pytest.mark.parametrize("layer", [0, 2, 3])
def test_the_kl_from_a_layer_on_is_the_whole_models(four, layer):
    """Prefix.kl(l) with layer l alone changed = the KL of the whole model's forward (the same float32 work after l,
    the original's outputs before it): equal to float32's rounding of a sum over positions."""
    model, ids, windows = four
    prefix = Prefix(model, windows)
    student = copy.deepcopy(model)
    _convert_one(student, layer, 12, ids)
    prefix.model = student  # the same layers before `layer`: the copies' outputs are the originals'
    prefix.layers = decoder_layers(student)
    whole = proxy_kl(student, windows, teacher_logits(model, windows))
    assert whole > 1e-4
    assert prefix.kl(layer) == pytest.approx(whole, rel=1e-5)
    assert all("forward" not in vars(m) for m in decoder_layers(student))  # the class's forward again


def test_windows_read_in_batches_score_as_one_at_a_time(four, monkeypatch):
    """The proxy and Prefix.kl read WINDOW_BATCH windows a forward: the same KL as one window a forward, to float32's
    rounding of a sum over positions (an odd count leaves a last batch of one)."""
    import attnlab.shrink.layer_costs as costs_module

    model, ids, windows = four
    student = copy.deepcopy(model)
    _convert_one(student, 1, 12, ids)
    three = ids[0, :192].reshape(3, 64)
    batched = proxy_kl(student, three, teacher_logits(model, three))
    from_two = Prefix(model, three)
    monkeypatch.setattr(costs_module, "WINDOW_BATCH", 1)
    single = proxy_kl(student, three, teacher_logits(model, three))
    assert len(costs_module.batches(three)) == 3 and len(from_two.reference) == 2
    assert batched > 1e-4 and batched == pytest.approx(single, rel=1e-5)


def test_an_unchanged_model_costs_nothing_and_a_bad_start_is_named(four):
    model, _, windows = four
    prefix = Prefix(model, windows)
    assert prefix.kl(0) == 0.0 and prefix.kl(3) == 0.0
    for bad in (4, -1, True):
        with pytest.raises(ValueError, match=f"start must be a layer index in 0..3, got {bad!r}"):
            prefix.kl(bad)


def test_layer_costs_measure_each_layer_and_option_and_always_restore(four):
    model, ids, windows = four
    prefix = Prefix(model, windows)
    originals = list(attnlab_modules(model))
    undone = []

    def restore():
        replace_attention(model, originals)
        undone.append(1)

    costs = layer_costs(prefix, 4, [8, 24], lambda layer, r: _convert_one(model, layer, r, ids), restore)
    assert len(undone) == 8 and attnlab_modules(model) == originals
    for layer in range(4):  # each cost is the whole model's KL with that layer alone converted
        student = copy.deepcopy(model)
        _convert_one(student, layer, 8, ids)
        assert costs[layer][0] == pytest.approx(proxy_kl(student, windows, prefix.reference), rel=1e-5)
        assert costs[layer][0] > costs[layer][1]  # more latent, less loss

    def broken(layer, r):
        raise RuntimeError("conversion failed")

    with pytest.raises(RuntimeError, match="conversion failed"):
        layer_costs(prefix, 4, [8], broken, restore)
    assert len(undone) == 9 and attnlab_modules(model) == originals  # restored after a failed change too


def test_a_latent_per_layer_converts_each_layer_as_its_own_size_does(four):
    """convert_model(latent_dim=[...]): layer l is exactly what the one-size conversion at that size makes of it."""
    model, ids, _ = four
    sizes = [8, 24, 16, 8]
    mixed = copy.deepcopy(model)
    convert_model(mixed, "mla", latent_dim=sizes, rope_dim=8, calibration_ids=ids, pair_selection="rorope")
    for layer, r in enumerate(sizes):
        one = copy.deepcopy(model)
        convert_model(one, "mla", latent_dim=r, rope_dim=8, calibration_ids=ids, pair_selection="rorope")
        a, b = attnlab_modules(mixed)[layer], attnlab_modules(one)[layer]
        assert a.latent_dim == r
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("bad, kind, fragment", [
    ([8, 8, 8], ValueError, "or 4 of them (one per layer), got [8, 8, 8]"),
    ([8, 0, 8, 8], ValueError, "got [8, 0, 8, 8]"),
    ("8", TypeError, "got '8'"),
    (8.0, TypeError, "got 8.0"),
])
def test_bad_per_layer_latents_are_named(bad, kind, fragment):
    with pytest.raises(kind, match=re.escape(fragment)):
        layer_latents(bad, 4)


@pytest.mark.parametrize("latent, rope, values, expected", [
    (112, 76, 384, [80, 112, 160]),   # SmolLM2's 12.5% winner: the sizes measured best before any heal
    (22, 10, 64, [16, 22, 32]),
    (50, 10, 64, [32, 50, 54]),       # the winner's own as it is; capped at the values it can hold (64 - 10)
    (54, 10, 64, []),                 # every value kept: nothing cut, no per-layer sizes
])
def test_per_layer_sizes_by_hand(latent, rope, values, expected):
    assert per_layer_sizes(Candidate(latent, rope, "rorope", True, "bf16", False), values) == expected


def test_round_4_chooses_by_the_whole_models_costs_within_the_bytes(four, monkeypatch):
    """The plan's round 4 picks what choose_per_layer picks on costs measured with whole-model forwards; its
    candidate holds those sizes, within the budget, and apply() builds them."""
    rounds = sys.modules["attnlab.shrink.layer_rounds"]
    model, ids, windows = four
    seen = {}
    real = rounds.per_layer_sizes

    def spy(best, values):
        seen["best"] = best
        return real(best, values)

    monkeypatch.setattr(rounds, "per_layer_sizes", spy)
    result = plan(model, ids, parse_budget("50%"), storages=("bf16",), window=64, proxy_windows=2, per_layer=True,
                  layer_ids=windows.reshape(1, -1))
    best = seen["best"]
    sizes = real(best, 64)
    assert len(sizes) == 3
    reference = teacher_logits(model, windows)
    costs = []
    for layer in range(4):
        row = []
        for r in sizes:
            student = copy.deepcopy(model)
            apply(student, Candidate(r, best.rope_dim, best.rope_select, best.balance, "bf16", False, layers=[layer]),
                  ids)
            row.append(proxy_kl(student, windows, reference))
        costs.append(row)
    row = [layer_bytes(r, best.rope_dim, "bf16") for r in sizes]
    dims = [sizes[o] for o in choose_per_layer(costs, [row] * 4, int(result.budget_bytes))]
    fourth = [c for c in result.measured if c.round == 4]
    if len(set(dims)) == 1:  # the uniform plan is the cheapest: nothing more to measure
        assert not fourth
        return
    (cand,) = fourth
    assert cand.latent_dims == dims and cand.bytes_per_token <= result.budget_bytes
    assert cand.bytes_per_token == sum(layer_bytes(r, best.rope_dim, "bf16") for r in dims)
    student = copy.deepcopy(model)
    apply(student, cand, ids)
    assert [m.latent_dim for m in attnlab_modules(student)] == dims
    assert "per layer" in cand.label()


def test_round_4_measures_a_mixed_plan_as_a_candidate(four, monkeypatch):
    """Costs that make one layer dear and one cheap (layer_costs replaced): round 4 measures the mixed plan the
    knapsack picks, and the model comes back unchanged."""
    import attnlab.shrink.layer_costs as lc

    model, ids, windows = four

    def costs(prefix, count, options, change, restore, progress=None):
        sizes = list(options)
        dear = [[10.0 / r for r in sizes]] + [[1.0 / r for r in sizes]] * (count - 1)
        return dear

    monkeypatch.setattr(lc, "layer_costs", costs)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = plan(model, ids, parse_budget("50%"), storages=("bf16",), window=64, proxy_windows=2, per_layer=True)
    (cand,) = [c for c in result.measured if c.round == 4]
    assert cand.latent_dims[0] == max(cand.latent_dims) > min(cand.latent_dims)  # the dear layer gets the most
    assert cand.proxy is not None and cand.bytes_per_token <= result.budget_bytes
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(type(m).__name__ == "GroupedQueryAttention" for m in attnlab_modules(model))


def test_the_per_layer_costs_read_the_judge_files_next_tokens_never_the_judges(tmp_path):
    """heal.data.planning_texts takes each judge file's tokens right after judge_texts' (together: the file's first
    tokens, none read twice); shrink's cost text is the proxy's first window, then those."""
    from tiny_checkpoints import make_tokenizer

    from attnlab.heal.data import JUDGE_TOKENS, _judge_files, judge_texts, planning_texts
    from attnlab.shrink.pipeline import LAYER_WINDOW, _layer_text

    tok = make_tokenizer(tmp_path)
    judges, plans = judge_texts(tok), planning_texts(tok, 40)
    for f, j, p in zip(_judge_files(), judges, plans):
        whole = tok(f.read_text(encoding="utf-8"), return_tensors="pt").input_ids
        assert j.shape[1] == JUDGE_TOKENS and p.shape[1] == 40
        assert torch.equal(torch.cat([j, p], dim=1), whole[:, :JUDGE_TOKENS + 40])
    proxy = torch.arange(2 * LAYER_WINDOW)[None]
    text = _layer_text({"proxy": proxy, "calibration": proxy + 1}, tok)
    half = planning_texts(tok, LAYER_WINDOW // 2)
    assert torch.equal(text, torch.cat([proxy[:, :LAYER_WINDOW], *half], dim=1))


def test_round_4_runs_only_when_asked_and_only_for_attnlabs_format(four, tmp_path, monkeypatch):
    """plan() without per_layer (what shrink does unless --per-layer) never measures round 4; --per-layer with another
    format, or with explicit sizes, is refused before any work, naming why."""
    from attnlab.shrink import ShrinkRequest
    from attnlab.shrink.request import check_request

    model, ids, _ = four
    result = plan(model, ids, parse_budget("50%"), storages=("bf16",), window=64, proxy_windows=2)
    assert all(c.round < 4 and c.latent_dims is None for c in result.measured)
    for kw, why in ((dict(fmt="gguf", out="o.gguf"), "--format gguf holds one latent size for every layer"),
                    (dict(fmt="deepseek"), "--format deepseek holds one latent size for every layer"),
                    (dict(latent_dim=32, rope_dim=16), "--latent-dim gives the sizes itself")):
        req = ShrinkRequest(**{"source": "x", "kv_budget": "25%", "out": "o", "per_layer": True, **kw})
        with pytest.raises(ValueError, match=re.escape(f"only the planner's --format attnlab plans: {why}")):
            check_request(req)


def test_a_per_layer_shrink_writes_layers_of_their_own_sizes(four_folder, tmp_path, monkeypatch):
    """shrink --per-layer end to end (costs replaced so that the plan mixes sizes): the written model holds each
    layer at the size the plan chose, within the budget, and the report names them."""
    import attnlab.shrink.layer_costs as lc
    from tiny_checkpoints import TEXT

    from attnlab.shrink import ShrinkRequest, shrink

    monkeypatch.setattr(lc, "layer_costs", lambda prefix, count, options, change, restore, progress=None:
                        [[10.0 / r for r in options]] + [[1.0 / r for r in options]] * (count - 1))
    text = tmp_path / "train.txt"
    text.write_text(TEXT * 40)
    out = tmp_path / "out"
    report = shrink(ShrinkRequest(source=str(four_folder), kv_budget="50%", out=str(out), minutes=5, seq_len=16,
                                  tokens=256, layer_steps=2, windows=16, text=[str(text)], storage="bf16",
                                  per_layer=True))
    chosen = report["plan"]["chosen"]
    assert chosen["round"] == 4 and len(set(chosen["latent_dims"])) > 1
    model, _, meta = hf.load_model(str(out))
    assert [m.latent_dim for m in attnlab_modules(model)] == chosen["latent_dims"]
    assert report["kv_bytes_per_token"]["shrunk"] == hf.kv_bytes_per_token(model) <= 0.5 * report[
        "kv_bytes_per_token"]["original_16bit"]
    assert meta["shrink"]["request"]["per_layer"] is True


def test_cli_per_layer_for_a_gguf_is_one_line_and_exit_2(tmp_path, capsys):
    from attnlab.cli import main

    code = main(["shrink", "smollm2", "--kv-budget", "12.5%", "--per-layer", "--format", "gguf",
                 "--out", str(tmp_path / "o.gguf")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "--per-layer plans a latent size per layer" in err and "--format gguf holds one latent size" in err


@pytest.mark.parametrize("select", ["rorope", "rorope-score"])
def test_an_unreported_conversion_is_the_reported_one(four, select):
    """convert.report.unreported() (what the planner's candidates convert in) leaves the reports out and nothing else:
    the converted model's weights are bitwise those of the same conversion with its reports, which are real reports
    outside the block (one per layer, each with its errors)."""
    from attnlab.convert.report import ConversionReport, unreported

    model, ids, _ = four
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    reports = convert_model(a, "mla", latent_dim=24, rope_dim=8, calibration_ids=ids, pair_selection=select,
                            balance=True)
    with unreported():
        none = convert_model(b, "mla", latent_dim=24, rope_dim=8, calibration_ids=ids, pair_selection=select,
                             balance=True)
    assert none == [None] * 4
    assert all(isinstance(r, ConversionReport) and r.matrix_errors for r in reports)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    again = convert_model(copy.deepcopy(model), "mla", latent_dim=24, rope_dim=8, calibration_ids=ids,
                          pair_selection=select)  # after the block: reported again
    assert all(isinstance(r, ConversionReport) for r in again)
