"""benchmarks/quality/protocol.py records exactly the argv it ran (no flag added behind the user's back), and its table
takes the median and the worst over seeds and texts, beside each text's best baseline at equal or more bytes."""
import importlib.util
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def protocol():
    spec = importlib.util.spec_from_file_location("protocol_bench", ROOT / "benchmarks" / "quality" / "protocol.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("seed", [0, 2])
def test_the_recorded_argv_is_the_one_that_ran_and_adds_nothing(protocol, tmp_path, monkeypatch, seed):
    ran = []

    def fake_run(command, **kw):
        ran.append(list(command))
        return subprocess.CompletedProcess(command, 0, stdout="ok", stderr="")

    monkeypatch.setattr(protocol.subprocess, "run", fake_run)
    row = protocol.run_one("smollm2-25", seed, tmp_path)
    assert ran == [row["argv"]] and row["command"] == " ".join(ran[0])
    out = str(tmp_path / f"smollm2-25-seed{seed}")
    plain = ["attnlab", "shrink", "smollm2", "--kv-budget", "25%"]
    assert ran[0] == plain + (["--seed", str(seed)] if seed else []) + ["--out", out]
    assert not {"--eval-text", "--text", "--minutes", "--tokens", "--kv-dtype"} & set(ran[0])


@pytest.mark.parametrize("at, key", [(None, "run/smollm2-25/seed1"), ("becdf2e", "at/smollm2-25@becdf2e/seed1")])
def test_a_run_at_a_worktrees_commit_is_saved_under_at(protocol, tmp_path, monkeypatch, at, key):
    """--at REV: the same plain command (the argv unchanged), its row kept as another commit's, not the case's."""
    saved = {}
    monkeypatch.setattr(protocol, "rows", lambda *a: {})
    monkeypatch.setattr(protocol, "save", lambda k, row, *a: saved.update({k: row}))
    monkeypatch.setattr(protocol.subprocess, "run", lambda command, **kw: subprocess.CompletedProcess(
        command, 1, stdout="", stderr="stopped"))
    monkeypatch.setattr(protocol.tempfile, "mkdtemp", lambda **kw: str(tmp_path))
    with pytest.raises(SystemExit, match="shrink failed"):
        protocol.part_run("smollm2-25", 1, False, False, at=at)
    assert list(saved) == [key] and "--at" not in saved[key]["argv"]


def test_a_variant_sets_its_variables_for_the_child_alone_and_names_its_row(protocol, tmp_path, monkeypatch):
    """--env ATTNLAB_X=V: the child's environment has it, the argv is the plain command's, the row's key and its
    env_set name it; any other variable is refused."""
    saved, envs = {}, []
    monkeypatch.setattr(protocol, "rows", lambda *a: {})
    monkeypatch.setattr(protocol, "save", lambda k, row, *a: saved.update({k: row}))

    def fake_run(command, **kw):  # subprocess.run itself: provenance's git calls come here too
        if command[0] == "attnlab":
            envs.append(kw["env"])
        return subprocess.CompletedProcess(command, 1, stdout="", stderr="stopped")

    monkeypatch.setattr(protocol.subprocess, "run", fake_run)
    monkeypatch.setattr(protocol.tempfile, "mkdtemp", lambda **kw: str(tmp_path))
    env = protocol.child_env(["ATTNLAB_CPU_BF16=0"])
    with pytest.raises(SystemExit, match="shrink failed"):
        protocol.part_run("smollm2-12", 2, False, False, env=env)
    key = "run/smollm2-12+ATTNLAB_CPU_BF16=0/seed2"
    assert list(saved) == [key] and saved[key]["env_set"] == {"ATTNLAB_CPU_BF16": "0"}
    assert envs[0]["ATTNLAB_CPU_BF16"] == "0" and saved[key]["argv"] == protocol.argv("smollm2-12", 2, saved[key]["out"])
    with pytest.raises(SystemExit, match="--env takes ATTNLAB_NAME=VALUE, got 'OMP_NUM_THREADS=1'"):
        protocol.child_env(["OMP_NUM_THREADS=1"])


def test_development_rows_are_reported_apart_against_the_originals_development_scores(protocol):
    """dev/ rows: median and worst over seeds and development texts of perplexity / the original's there; the report
    table ignores them."""
    texts = list(protocol.DEV_TEXTS)
    assert not set(texts) & set(protocol.REPORT_TEXTS)
    data = {"dev/baselines/smollm2": {"original": {n: {"perplexity": 10.0} for n in texts}}}
    for seed, scale in ((0, 1.0), (1, 1.1)):
        data[f"dev/run/smollm2-12/seed{seed}"] = {"case": "smollm2-12", "seed": seed, "texts": {
            n: {"perplexity": 10.0 * scale * (1 + i / 10)} for i, n in enumerate(texts)}}
    row, = protocol.dev_report(data)
    ratios = sorted([s * (1 + i / 10) for s in (1.0, 1.1) for i in range(len(texts))])
    assert row["name"] == "smollm2-12" and row["worst"] == pytest.approx(ratios[-1])
    assert row["median"] == pytest.approx((ratios[3] + ratios[4]) / 2) and row["worst_text"] == texts[-1]
    assert row["spread"] == pytest.approx(0.1 * (1 + (len(texts) - 1) / 10))
    assert all(r["case"] != "smollm2-12" for r in protocol.table(data))


def test_a_run_at_anything_but_a_commit_is_refused(protocol):
    with pytest.raises(SystemExit, match="--at takes the commit that ran .*'main'"):
        protocol.part_run("smollm2-25", 0, False, False, at="main")


def test_the_table_takes_the_median_and_the_worst_over_seeds_and_texts(protocol):
    texts = list(protocol.REPORT_TEXTS)

    def ppl(values):
        return {n: {"perplexity": v} for n, v in zip(texts, values)}

    original = {"kv_bytes_per_token": 1000, **ppl([10.0, 20.0, 5.0, 8.0])}
    data = {"baselines/smollm2": {
        "original": original,
        "baselines": {"q4_0": {"kv_bytes_per_token": 300, **ppl([10.5, 21.0, 5.1, 8.8])},
                      "q5_0": {"kv_bytes_per_token": 340, **ppl([10.2, 20.6, 5.2, 8.1])},
                      "kivi2": {"kv_bytes_per_token": 190, **ppl([1.0, 1.0, 1.0, 1.0])}}}}  # below the bytes
    runs = {0: [10.1, 20.2, 5.05, 8.4], 1: [10.3, 20.4, 5.0, 8.2], 2: [10.2, 20.8, 5.1, 8.0]}
    for seed, values in runs.items():
        data[f"run/smollm2-25/seed{seed}"] = {"seed": seed, "command": "attnlab shrink smollm2 --kv-budget 25% --out X",
                                              "kv_bytes_per_token": 250, "texts": ppl(values)}
    row = next(r for r in protocol.table(data) if r["case"] == "smollm2-25")
    # the twelve ratios sorted: 1.0, 1.0, 1.01, 1.01, 1.01, 1.02, 1.02, 1.02, 1.025, 1.03, 1.04, 1.05
    assert row["median"] == pytest.approx(1.02) and row["worst"] == pytest.approx(1.05)
    assert row["baseline"] == {"python-docs": "q5_0", "tech-docs": "q5_0", "study": "q4_0", "licence": "q5_0"}
    assert row["baseline_ratio"]["licence"] == pytest.approx(8.1 / 8.0)
    assert row["worst_text"] == "licence"  # 8.4/8.0, seed 0's, the highest ratio
    assert row["worst_median_text"] == "licence"  # median over seeds 8.2/8.0, the highest
    assert row["beats_baseline_on_every_text"] is False  # licence: 1.025x against q5_0's 1.0125x
    assert row["seed_spread"] == pytest.approx(0.05)  # licence: 1.05x (seed 0) to 1.0x (seed 2)
    # nearest in bytes: q4_0 (300) is the only one with the fewest bytes >= 250
    assert row["nearest"] == {n: "q4_0" for n in texts} and row["nearest_ratio"]["licence"] == pytest.approx(1.1)
    # q4_0 (1.05, 1.05, 1.02, 1.1) is beaten on every text by the medians (1.02, 1.02, 1.01, 1.025); q5_0 is not
    assert row["beats_on_every_text"] == ["q4_0"] and row["fair_baselines"] == ["q4_0", "q5_0"]


def test_the_worst_is_labelled_with_the_text_it_was_scored_on_not_the_worst_median(protocol):
    """One seed's bad text (tech docs 1.06x) is the worst figure while another text has the highest median
    (licence, 1.03x in every seed): the worst figure names tech docs, the worst median licence."""
    texts = list(protocol.REPORT_TEXTS)

    def ppl(values):
        return {n: {"perplexity": v} for n, v in zip(texts, values)}

    data = {"baselines/smollm2": {"original": {"kv_bytes_per_token": 1000, **ppl([10.0] * 4)},
                                  "baselines": {"q4_0": {"kv_bytes_per_token": 300, **ppl([10.5] * 4)}}}}
    tech = {0: 10.1, 1: 10.0, 2: 10.6}
    for seed in range(3):
        values = [10.1, tech[seed], 10.1, 10.3]
        data[f"run/smollm2-25/seed{seed}"] = {"seed": seed, "command": "attnlab shrink smollm2 --kv-budget 25% --out X",
                                              "kv_bytes_per_token": 250, "texts": ppl(values)}
    row = next(r for r in protocol.table(data) if r["case"] == "smollm2-25")
    assert row["worst"] == pytest.approx(1.06) and row["worst_text"] == texts[1]
    assert row["worst_median_text"] == "licence" and row["per_text_median"]["licence"] == pytest.approx(1.03)


def test_a_baseline_is_fair_only_at_the_runs_bytes_with_its_fixed_bytes_spread_over_2048_tokens(protocol):
    """A run holding 250 bytes/token and 61,440 bytes a sequence whatever its length (a recent window, a "+c4" rope
    key's newest group) holds 280 at 2,048 tokens: a baseline of 270 is not at equal or more bytes, one of 300 is."""
    texts = list(protocol.REPORT_TEXTS)

    def ppl(values):
        return {n: {"perplexity": v} for n, v in zip(texts, values)}

    data = {"baselines/smollm2": {"original": {"kv_bytes_per_token": 1000, **ppl([10.0] * 4)},
                                  "baselines": {"a": {"kv_bytes_per_token": 270, **ppl([10.1] * 4)},
                                                "b": {"kv_bytes_per_token": 300, **ppl([10.3] * 4)}}}}
    for seed in range(3):
        data[f"run/smollm2-25/seed{seed}"] = {"seed": seed, "command": "attnlab shrink smollm2 --kv-budget 25% --out X",
                                              "kv_bytes_per_token": 250, "fixed_bytes": 61_440,
                                              "texts": ppl([10.2] * 4)}
    row = next(r for r in protocol.table(data) if r["case"] == "smollm2-25")
    assert row["bytes_at_2048"] == 280 and row["fair_baselines"] == ["b"]
    assert row["beats_on_every_text"] == ["b"]
    del data["run/smollm2-25/seed0"]["fixed_bytes"], data["run/smollm2-25/seed1"]["fixed_bytes"]
    del data["run/smollm2-25/seed2"]["fixed_bytes"]  # rows without a plan or recorded fixed bytes: none counted
    row = next(r for r in protocol.table(data) if r["case"] == "smollm2-25")
    assert row["bytes_at_2048"] == 250 and row["fair_baselines"] == ["a", "b"]


def test_a_case_counted_at_a_context_meets_the_baselines_by_its_share_of_the_bytes_there(protocol):
    """Gemma 3 at 32,768 tokens: a run holding 4,392 bytes a token per token held, whose report counts 410 bytes a
    token at 32,768 tokens against the original's 3,342 there (its sliding layers hold only their window), meets
    the baselines (one storage in every layer: the same share at any context) as 410/3,342 of the original's 18,432
    bytes a token, 2,261: a baseline of 2,300 is at equal or more bytes, one of 2,200 is not. A report that counts
    no bytes at that context is refused with the numbers."""
    texts = list(protocol.REPORT_TEXTS)

    def ppl(values):
        return {n: {"perplexity": v} for n, v in zip(texts, values)}

    case = "gemma3-270m-12-32k"
    assert protocol.counted_at(case) == 32768 and protocol.counted_at("gemma3-270m-25") == 2048
    data = {"baselines/gemma3-270m": {"original": {"kv_bytes_per_token": 18432, **ppl([10.0] * 4)},
                                      "baselines": {"a": {"kv_bytes_per_token": 2200, **ppl([10.1] * 4)},
                                                    "b": {"kv_bytes_per_token": 2300, **ppl([10.3] * 4)}}}}
    at = {"context": 32768, "original_16bit": 3342.0, "shrunk": 410.0}
    for seed in range(3):
        data[f"run/{case}/seed{seed}"] = {"seed": seed, "command": "attnlab shrink gemma3-270m --out X",
                                          "kv_bytes_per_token": 4392, "fixed_bytes": 0, "texts": ppl([10.2] * 4),
                                          "report": {"kv_bytes_per_token": {"at_context": dict(at)}}}
    row = next(r for r in protocol.table(data) if r["case"] == case)
    assert row["bytes_at_2048"] == pytest.approx(18432 * 410 / 3342) and row["counted_at"] == 32768
    assert row["fair_baselines"] == ["b"] and row["beats_on_every_text"] == ["b"]
    data[f"run/{case}/seed1"]["report"]["kv_bytes_per_token"]["at_context"]["context"] = 4096
    with pytest.raises(ValueError, match="seed 1: its report counts no bytes at 32,768 tokens"):
        protocol.table(data)


def test_a_repeat_compares_the_plan_and_each_texts_perplexity_with_the_first_run(protocol):
    texts = list(protocol.REPORT_TEXTS)
    plan = {"rank": 272, "rope_dims": 112}
    first = {"plan": plan, "texts": {n: {"perplexity": 10.0} for n in texts}}
    again = {"plan": dict(plan), "texts": {n: {"perplexity": 10.0} for n in texts}}
    again["texts"][texts[2]]["perplexity"] = 10.04  # one text 0.4% worse
    c = protocol.compare_repeat(first, again)
    assert c["same_plan"] is True
    assert c["perplexity_ratio"][texts[2]] == pytest.approx(1.004)
    assert c["largest_change"] == pytest.approx(0.004)
    again["plan"] = {"rank": 256, "rope_dims": 112}
    assert protocol.compare_repeat(first, again)["same_plan"] is False


def test_a_long_part_is_read_against_the_original_of_its_baselines_row_or_its_own(protocol):
    texts = list(protocol.REPORT_TEXTS)
    scored = lambda a, b: {"texts": {n: {"perplexity": a, "perplexity_4096": b} for n in texts},  # noqa: E731
                           "passkey": {"accuracy": 0.5}}
    data = {"long/baselines/m": {"original": scored(10.0, 8.0), "q4_0": scored(11.0, 9.0), "done": True},
            "long/c/seed0": {"baselines": "long/baselines/m", "result": scored(10.5, 8.4)},
            "long/old/seed0": {"original": scored(20.0, 16.0), "result": scored(21.0, 16.0)}}
    found = {(r["key"], r["model"]): r for r in protocol.long_rows(data)}
    assert set(found) == {("long/c/seed0", "result"), ("long/baselines/m", "q4_0"), ("long/old/seed0", "result")}
    assert found["long/c/seed0", "result"]["at_4096"][texts[0]] == pytest.approx(8.4 / 8.0)
    assert found["long/baselines/m", "q4_0"]["at_512"][texts[-1]] == pytest.approx(11.0 / 10.0)
    assert found["long/old/seed0", "result"]["at_512"][texts[1]] == pytest.approx(21.0 / 20.0)


def test_a_text_that_is_not_the_one_measured_is_refused_naming_it(protocol, tmp_path, monkeypatch):
    """benchmarks/texts.py's SHA-256 is checked when a report text is read: a copy that differs stops the run."""
    for name, text in protocol.REPORT_TEXTS.items():
        monkeypatch.setitem(protocol.REPORT_TEXTS, name, text)  # texts_from replaces them; restored after the test
    for name in protocol.REPORT_TEXTS:
        (tmp_path / f"{name}.txt").write_text("not the text")
    protocol.texts_from(str(tmp_path))
    expected = protocol.REPORT_TEXTS["python-docs"].sha256
    with pytest.raises(ValueError, match=rf"python-docs\.txt: sha256 [0-9a-f]{{64}}, expected {expected}"):
        protocol.text_hashes()


def test_a_text_that_is_missing_is_refused_naming_it(protocol, tmp_path):
    """A fresh clone away from the shared/ folder has no study text: the check names the file, not a traceback of
    open()."""
    from texts import Text, checked

    gone = Text(str(tmp_path / "001.txt"), "0" * 64, "a maths/ML study text")
    with pytest.raises(ValueError, match=rf"{re.escape(gone.path)}: no such file \(a maths/ML study text"):
        checked(gone)


@pytest.fixture(scope="module")
def engines():
    spec = importlib.util.spec_from_file_location("engines_bench", ROOT / "benchmarks" / "engines" / "engines.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("seed", [0, 1])
def test_the_engine_commands_are_the_plain_gguf_command_and_the_engines_flag(engines, seed):
    """The argv of benchmarks/engines/engines.py: the plain command, the output format and the cache type the user
    serves with (the one flag the engine needs), and nothing else."""
    argv = engines.argv("smollm2-q4_0", seed, "OUT.gguf")
    assert argv == ["attnlab", "shrink", "smollm2", "--kv-budget", "30%", "--kv-dtype", "q4_0", "--format", "gguf",
                    *(["--seed", "1"] if seed else []), "--out", "OUT.gguf"]


def test_the_engine_table_is_the_median_and_the_worst_of_each_ratio(engines):
    """Two seeds, each text: ratios over the reference computed by hand (1.1, 1.2 / 1.0, 1.3 ...)."""
    texts = list(engines.REPORT_TEXTS)

    def run(seed, shrunk):
        return {"seed": seed, "command": "attnlab shrink smollm2 --out X", "argv": ["X"], "texts": {
            t: {"reference": 10.0, "untouched": 11.0, "shrunk": shrunk[i], "shrunk_q8_0": shrunk[i] * 1.01,
                "untouched_q8_0": 11.0} for i, t in enumerate(texts)},
            "report": {"kv_bytes_per_token": {}, "heal": {"kept": None if seed else "the converted weights"},
                       "written": {"rewritten": ["a"] if seed else []}}}
    data = {"run/smollm2-q4_0/seed0": run(0, [11.0, 11.0, 11.0, 11.0]),
            "run/smollm2-q4_0/seed1": run(1, [10.5, 12.0, 10.0, 11.0])}
    [row] = engines.table(data)
    assert row["untouched"] == {"median": pytest.approx(1.1), "worst": pytest.approx(1.1)}
    # the eight shrunk ratios: 1.1 x 5, 1.05, 1.2, 1.0 -> median 1.1, worst 1.2
    assert row["shrunk"] == {"median": pytest.approx(1.1), "worst": pytest.approx(1.2)}
    assert row["shrunk_q8_0_over_shrunk"]["worst"] == pytest.approx(1.01)
    assert row["heal_stood"] == [False, True] and row["rewritten"] == [0, 1] and row["seeds"] == [0, 1]


def test_the_guard_levels_read_the_verdicts_guard_worse_reaches_at_each_level(monkeypatch):
    """benchmarks/quality/guard_levels.py: a verdict is worse at a level exactly where guard.worse says so with
    ATTNLAB_TOP1_ALPHA at that level, and every level inside the printed range gives the default's verdicts."""
    import torch

    from attnlab.heal.evaluate import positions_code
    from attnlab.heal.guard import worse

    spec = importlib.util.spec_from_file_location("guard_levels", ROOT / "benchmarks" / "quality" / "guard_levels.py")
    levels = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(levels)

    def read(lost, kl=1.0):  # 24 positions: the first `lost` disagree with the teacher
        return {"kl": kl, "perplexity": 2.0, "top1_agreement": 1 - lost / 24, "tokens": 24,
                "top1_positions": positions_code(torch.arange(24) >= lost)}

    pairs = [(read(0), read(k)) for k in (3, 5, 6, 8)] + [(read(0), read(2, kl=1.5))]
    judged = [levels.judge(b, a) for b, a in pairs]
    assert [j["least_chance"] for j in judged[:4]] == [2.0 ** -k for k in (3, 5, 6, 8)]
    assert judged[4]["kl_rose_on"] == [0]
    low, high = levels.same_range([j["least_chance"] for j in judged[:4]])
    assert (low, high) == (2.0 ** -8, 2.0 ** -6)
    for level in (2.0 ** -7, high, 0.5, 0.0):
        monkeypatch.setenv("ATTNLAB_TOP1_ALPHA", str(level))
        said = [bool(j["kl_rose_on"]) or j["least_chance"] < level for j in judged]
        assert said == [worse(b, a) for b, a in pairs]
        assert (said == [False, False, False, True, True]) == (low < level <= high)
