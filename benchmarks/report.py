"""The README's results and docs/results.md, written from the results files, with benchmarks/figures/frontier.png.

    python benchmarks/report.py           # write README.md's marked blocks, docs/results.md and frontier.png
    python benchmarks/report.py --check   # exit 1, naming the file, where README.md or docs/results.md is stale

Nothing here measures. Every figure is read from benchmarks/results/protocol.json (the plain shrink commands and the
baselines: quality/protocol.py's table), benchmarks/results/engines.json (GGUF outputs in llama.cpp:
engines/engines.py's table) and benchmarks/results/hf_kvcache.json (transformers: quality/hf_kvcache.py's table).
The README holds only what lies between its `<!-- NAME: begin -->` and `<!-- NAME: end -->` markers; the rest of it
is prose, edited by hand.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(HERE / "quality"), str(HERE / "engines")]  # the scripts whose tables this reads
import engines  # noqa: E402
import hf_kvcache  # noqa: E402
import protocol  # noqa: E402
from protocol import FAIR_CONTEXT, REPORT_TEXTS, TRAINING_TEXTS  # noqa: E402

README = ROOT / "README.md"
RESULTS = ROOT / "docs" / "results.md"
PICTURE = HERE / "figures" / "frontier.png"
# the README's rows: the plain commands on a CPU, one per budget (the GPU case and designs not kept stay in docs)
README_CASES = ("smollm2-50", "smollm2-25", "smollm2-25-no-heal", "smollm2-12", "smollm2-12-text", "gemma3-270m-25",
                "gemma3-270m-18-32k")
WIDTH = 118  # the README's and docs/results.md's prose lines
MODELS = {"smollm2": ("SmolLM2-135M", "smollm2-135m"), "gemma3-270m": ("Gemma 3 270M", "gemma-3-270m")}
# the baselines drawn as lines: protocol.json's (the original model in attnlab) and hf_kvcache.json's (transformers)
PROTOCOL_FAMILIES = {"llama.cpp's types": ("q8_0", "q5_0", "q4_1", "iq4_nl", "q4_0"), "KIVI-style": ("kivi4", "kivi2")}
HF_FAMILIES = {"quanto (transformers)": ("quanto4", "quanto2"), "hqq (transformers)": ("hqq8", "hqq4", "hqq2"),
               "TurboQuant (attnlab.hf)": ("tq4", "tq3", "tq2")}


def x(ratio: float) -> str:
    return f"{ratio:.3f}x"


def md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |"
                                                                           for r in rows]


# -- reading the results ------------------------------------------------------------------------------------------
def protocol_data() -> tuple[dict, dict[str, dict]]:
    """protocol.json's plain runs and baselines (designs not kept, at/, left out), and protocol.table's row per
    case."""
    plain = {k: v for k, v in protocol.rows().items() if k.startswith(("run/", "baselines/"))}
    return plain, {r["case"]: r for r in protocol.table(plain)}


def case_row(table: dict[str, dict], case: str) -> dict:
    if case not in table:
        raise ValueError(f"benchmarks/results/protocol.json has no finished run of case {case!r}: "
                         f"python benchmarks/quality/protocol.py run --case {case} --seed S")
    return table[case]


def runs(data: dict, case: str) -> list[dict]:
    """The finished runs of a case, by seed."""
    return [data[k] for k in sorted(data) if k.startswith(f"run/{case}/") and not data[k].get("returncode")]


def over_original(entry: dict, original: dict) -> dict[str, float]:
    """Perplexity over the original's on each protocol text."""
    return {n: entry[n]["perplexity"] / original[n]["perplexity"] for n in REPORT_TEXTS}


def baselines(data: dict, model: str) -> dict[str, dict]:
    """Each baseline cache of `model` in protocol.json: bytes per token, share of the 16-bit cache, the ratio on each
    text, their median and worst."""
    key = f"baselines/{model}"
    if key not in data:
        raise ValueError(f"benchmarks/results/protocol.json has no {key!r}: "
                         f"python benchmarks/quality/protocol.py baselines --model {model}")
    original = data[key]["original"]
    out = {}
    for name, entry in data[key]["baselines"].items():
        ratios = over_original(entry, original)
        held = entry["kv_bytes_per_token"] + entry.get("fixed_bytes", 0) / FAIR_CONTEXT  # a residual's rows spread
        out[name] = {"bytes": held, "share": held / original["kv_bytes_per_token"], "ratios": ratios,
                     "median": statistics.median(ratios.values()), "worst": max(ratios.values())}
    return out


def best_baseline(row: dict, stats: dict[str, dict]) -> str:
    """The baseline a row is set beside: of llama.cpp's types and the KIVI-style codes (PROTOCOL_FAMILIES) at the two
    smallest sizes at or above the row's bytes (the shrink report's rule, shrink.baselines.at_or_above), the one of
    least median over the texts. TurboQuant's and KIVI's with a residual are set beside a row by name (losses)."""
    from attnlab.shrink.baselines import at_or_above

    compared = {n for names in PROTOCOL_FAMILIES.values() for n in names}
    names = at_or_above({n: s["bytes"] for n, s in stats.items() if n in compared}, row[f"bytes_at_{FAIR_CONTEXT}"])
    if not names:
        raise ValueError(f"case {row['case']!r} ({row[f'bytes_at_{FAIR_CONTEXT}']:,.0f} bytes/token) has no "
                         "baseline at equal or more bytes")
    return min(names, key=lambda n: (stats[n]["median"], stats[n]["worst"]))


def label(baseline: str) -> str:
    """A baseline's name in prose: "KIVI-style 4-bit", "KIVI-style 2-bit with a 128-token residual", "TurboQuant's
    tq3", "llama.cpp's iq4_nl"."""
    kivi = re.fullmatch(r"kivi(\d)(?:\+w(\d+))?", baseline)
    if kivi:
        return f"KIVI-style {kivi.group(1)}-bit" + (f" with a {kivi.group(2)}-token residual" if kivi.group(2) else "")
    return f"TurboQuant's {baseline}" if baseline.startswith("tq") else f"llama.cpp's {baseline}"


def share(row: dict) -> float:
    """A row's bytes as the baselines meet them, over the original's 16-bit cache."""
    return row[f"bytes_at_{FAIR_CONTEXT}"] / row["original_bytes"]


def command(row: dict) -> str:
    """A row's command as the README shows it: no --out, no --seed, the --text files as T."""
    return re.sub(r"( --text \S+)+", " --text T", re.sub(r" --out \S+| --seed \d+", "", row["command"]))


def budget(case: str) -> str:
    """A case's short name in the picture: its budget, '+text' with a text, '@32k' with a context."""
    args = protocol.CASES[case][1]
    label = args[args.index("--kv-budget") + 1]
    if "--text" in args:
        label += " +text"
    if "--context" in args:
        label += f" @{int(args[args.index('--context') + 1]) // 1024}k"
    if "--no-heal" in args:
        label += " no heal"
    return label


def given_back(run: dict) -> bool:
    """Whether a run's guard gave its heal back, whole or its end-to-end steps."""
    heal = (run.get("report") or {}).get("heal") or {}
    verdict = str((heal.get("probe") or {}).get("verdict", ""))
    return bool(heal.get("kept")) or verdict.startswith("the converted weights back")


def hf_data() -> dict:
    return json.loads(hf_kvcache.JSON.read_text())


def hf_rows(model: str) -> dict[str, dict]:
    """hf_kvcache.json's quality rows of `model` by cache: ratio over DynamicCache's on each text, median, worst."""
    data = hf_data()
    by: dict[str, dict[str, float]] = {}
    for r in data.get("quality", {}).get("rows", {}).values():
        if r["model"] == model and r["cache"] != "dynamic":
            by.setdefault(r["cache"], {})[r["text"]] = r["ratio"]
    return {c: {"ratios": v, "median": statistics.median(v.values()), "worst": max(v.values())} for c, v in by.items()}


def hf_share(model: str, cache: str) -> float:
    """A transformers cache's bytes over a 16-bit cache at the length its quality was scored (the window's end, its
    plain residual counted: hf_kvcache.py quality), against the float32 DynamicCache of the same run, halved."""
    rows = hf_data()["quality"]["rows"]
    mine = [r["bytes_per_token"] for r in rows.values() if r["model"] == model and r["cache"] == cache]
    plain = [r["bytes_per_token"] for r in rows.values() if r["model"] == model and r["cache"] == "dynamic"]
    if not mine or not plain:
        raise ValueError(f"benchmarks/results/hf_kvcache.json has no quality rows of {model} in {cache!r} and "
                         "DynamicCache")
    return statistics.median(mine) / (statistics.median(plain) / 2)


def speed_range() -> tuple[float, float, int, float]:
    """The slowest and fastest attnlab.hf.KVCache decode over DynamicCache's, the context they were timed at, and
    quanto 4-bit's QuantizedCache over DynamicCache's."""
    data = hf_data()
    every = data.get("speed", {}).get("rows", {})
    rows = [r for r in every.values() if r["cache"] != "dynamic" and r["cache"] not in hf_kvcache.QUANTIZED]
    quanto = every.get("smollm2/quanto4")
    if not rows or quanto is None:
        raise ValueError("benchmarks/results/hf_kvcache.json has no speed rows (or none of quanto4): "
                         "python benchmarks/quality/hf_kvcache.py speed")
    return (min(r["of_dynamic"] for r in rows), max(r["of_dynamic"] for r in rows), rows[0]["context"],
            quanto["of_dynamic"])


# -- the README's blocks ------------------------------------------------------------------------------------------
def machine(run: dict) -> str | None:
    """The machine a run names: its own field (older rows) or its provenance's cores and CPU."""
    prov = run.get("provenance") or {}
    return run.get("machine") or (f"{prov['cores']}-core {prov['cpu']}" if prov.get("cpu") else None)


def commit(run: dict) -> str | None:
    """The commit a run ran at, shortened: its own field (older rows) or its provenance's."""
    return run.get("commit") or ((run.get("provenance") or {}).get("commit") or "")[:7] or None


def machines(data: dict, cases) -> str:
    found = sorted({machine(r) or "CPU" for c in cases for r in runs(data, c)})
    return " or ".join(found)


def wrap(text: str, indent: str = "") -> list[str]:
    """A paragraph (or a bullet, its next lines indented) in lines of at most WIDTH characters."""
    return textwrap.wrap(text, WIDTH, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)


def headline(data: dict, table: dict) -> list[str]:
    """One sentence: what the plain 25% and 50% commands give SmolLM2, at what cost."""
    quarter, half = case_row(table, "smollm2-25"), case_row(table, "smollm2-50")
    minutes = math.ceil(max(r["wall_minutes"] for c in ("smollm2-25", "smollm2-50") for r in runs(data, c)))
    return wrap(f"In {minutes} minutes on a {machines(data, ('smollm2-25', 'smollm2-50'))}, `attnlab shrink` cuts "
                f"SmolLM2-135M's KV cache to {share(quarter):.1%} of its 16-bit size for {quarter['median'] - 1:.1%} "
                f"more perplexity (median) on text it never saw ({quarter['worst'] - 1:.1%} on the worst text), or to "
                f"{share(half):.1%} for {half['median'] - 1:.1%}.")


def results_block(data: dict, table: dict) -> list[str]:
    """The conditions in one sentence, then one row per README case."""
    rows = [case_row(table, c) for c in README_CASES]
    seeds = sorted({len(r["seeds"]) for r in rows})
    lines = wrap(f"Perplexity over the original's on {len(REPORT_TEXTS)} held-out texts of different kinds (first "
                 f"{protocol.TOKENS:,} tokens, windows of {protocol.WINDOW}), {'-'.join(map(str, seeds))} seeds "
                 f"each, on a {machines(data, README_CASES)}; KV bytes at {FAIR_CONTEXT:,} tokens; beside the best "
                 "cache of the untouched model at the two smallest sizes with equal or more bytes:") + [""]
    body = []
    for row in rows:
        stats = baselines(data, protocol.CASES[row["case"]][0])
        b = best_baseline(row, stats)
        at = "" if row["counted_at"] == FAIR_CONTEXT else f" at {row['counted_at'] // 1024}k tokens"
        kv = f"{share(row):.1%}{at}"
        body.append([f"`{command(row).removeprefix('attnlab shrink ')}`", kv, x(row["median"]),
                     f"{x(row['worst'])} ({row['worst_text']})",
                     f"{b} ({stats[b]['share']:.1%}): {x(stats[b]['median'])}, {x(stats[b]['worst'])}"])
    return lines + md_table(["`attnlab shrink`", "KV bytes (of 16-bit)", "median", "worst (text)",
                             "best baseline at >= bytes: median, worst"], body)


def losses(data: dict, table: dict) -> list[str]:
    """The README's 'Where it loses', five bullets, each figure read from the results."""
    quarter, eighth, text = (case_row(table, c) for c in ("smollm2-25", "smollm2-12", "smollm2-12-text"))
    codec = case_row(table, "smollm2-25-no-heal")
    small = baselines(data, "smollm2")
    qb, eb = best_baseline(quarter, small), best_baseline(eighth, small)
    codec_minutes = max(r["wall_minutes"] for r in runs(data, "smollm2-25-no-heal"))
    gguf = next((r for r in engines.table() if r["case"] == "smollm2-12-gguf"), None)
    if gguf is None:
        raise ValueError("benchmarks/results/engines.json has no smollm2-12-gguf rows: "
                         "python benchmarks/engines/engines.py run --case smollm2-12-gguf --seed S")
    lo, hi, context, quanto = speed_range()
    st, gt, gl = (case_row(table, c) for c in ("smollm2-25-transformers", "gemma3-270m-25-transformers",
                                               "gemma3-270m-25"))
    upper = [c for c in README_CASES if share(case_row(table, c)) >= 0.25 and "--no-heal" not in protocol.CASES[c][1]]
    heals = [given_back(r) for c in upper for r in runs(data, c)]
    stood = [s for r in engines.table() if r["case"] != "smollm2-12-gguf" for s in r["heal_stood"]]
    bullets = [
        f"At a quarter of the bytes SmolLM2 gives {x(quarter['median'])} median, {x(quarter['worst'])} worst "
        f"({quarter['worst_text']}); {label(qb)} at {small[qb]['share']:.1%} gives {x(small[qb]['median'])}, "
        f"{x(small[qb]['worst'])}. With no heal (`--no-heal`, at most {codec_minutes:.1f} minutes) "
        f"{x(codec['median'])}, {x(codec['worst'])} ({codec['worst_text']}): below {label('tq4')} at "
        f"{small['tq4']['share']:.1%} ({x(small['tq4']['median'])}, {x(small['tq4']['worst'])}), above "
        f"{label('kivi4+w32')} at {small['kivi4+w32']['share']:.1%} ({x(small['kivi4+w32']['median'])}, "
        f"{x(small['kivi4+w32']['worst'])}).",
        f"At 12.5% the plain command gives {x(eighth['median'])} median, {x(eighth['worst'])} worst; your text and "
        f"30 minutes bring it to {x(text['median'])}, {x(text['worst'])}. {label(eb)} at {small[eb]['share']:.1%} "
        f"gives {x(small[eb]['median'])}, {x(small[eb]['worst'])}.",
        f"In transformers' own forward over `attnlab.hf.KVCache` (`--format transformers`) the 25% plans give "
        f"SmolLM2 {x(st['median'])} median, {x(st['worst'])} worst and Gemma 3 {x(gt['median'])}, {x(gt['worst'])} "
        f"(attnlab's loop: {x(quarter['median'])}, {x(quarter['worst'])}; {x(gl['median'])}, {x(gl['worst'])}). "
        f"As a llama.cpp GGUF the 12.5% plan gives {x(gguf['shrunk']['median'])} median, "
        f"{x(gguf['shrunk']['worst'])} worst.",
        f"`attnlab.hf.KVCache` decodes at {lo:.2f}-{hi:.2f}x DynamicCache's speed at {context:,} tokens on a CPU, "
        f"quanto 4-bit's QuantizedCache at {quanto:.2f}x: each step reads every row back dequantised.",
        "On a CPU the heal does not pay at 25% and above: the guard gave back its end-to-end steps, or all of it, "
        f"in {sum(heals)} of {len(heals)} protocol runs, and the whole heal in {len(stood) - sum(stood)} of "
        f"{len(stood)} llama.cpp runs (`--format gguf`).",
    ]
    return [line for b in bullets for line in wrap("- " + b, "  ")]


def blocks(data: dict, table: dict) -> dict[str, list[str]]:
    return {"headline": headline(data, table), "results": results_block(data, table), "losses": losses(data, table)}


def fill(text: str, name: str, lines: list[str]) -> str:
    """text with the lines between its `<!-- name: begin -->` and `<!-- name: end -->` markers replaced."""
    begin, end = f"<!-- {name}: begin -->", f"<!-- {name}: end -->"
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise ValueError(f"README.md needs one {begin!r} and, after it, one {end!r}")
    head, rest = text.split(begin)
    return head + begin + "\n" + "\n".join(lines) + "\n" + end + rest.split(end, 1)[1]


def readme(text: str, data: dict, table: dict) -> str:
    for name, lines in blocks(data, table).items():
        text = fill(text, name, lines)
    return text


# -- docs/results.md ----------------------------------------------------------------------------------------------
def md_summary(data: dict, table: dict) -> list[str]:
    """Every case of protocol.json with finished runs: bytes, median and worst, the seeds' spread, the baselines."""
    body = []
    for row in table.values():
        stats = baselines(data, protocol.CASES[row["case"]][0])
        b = best_baseline(row, stats)
        near = "/".join(sorted(set(row["nearest"].values())))
        body.append([f"`{command(row)}`", ", ".join(map(str, row["seeds"])),
                     f"{row['kv_bytes_per_token']:,} ({row['kv_bytes_per_token'] / row['original_bytes']:.1%})",
                     f"{share(row):.1%}" + ("" if row["counted_at"] == FAIR_CONTEXT else f" at {row['counted_at']:,}"),
                     x(row["median"]), f"{x(row['worst'])} ({row['worst_text']})", protocol.spread(row),
                     f"{near}: {x(row['nearest_median'])}, {x(row['nearest_worst'])}",
                     f"{b}: {x(stats[b]['median'])}, {x(stats[b]['worst'])}"])
    return md_table(["command", "seeds", "bytes/token held", f"at {FAIR_CONTEXT:,} tokens", "median",
                     "worst (text)", "seeds' spread", "nearest baseline at >= bytes", "the README's baseline"], body)


def md_runs(data: dict, table: dict) -> list[str]:
    """One table per case: each seed's ratio on each text, with where and how long it ran."""
    out = []
    for row in table.values():
        model = protocol.CASES[row["case"]][0]
        original = data[f"baselines/{model}"]["original"]
        body = []
        for run in runs(data, row["case"]):
            ratios = over_original(run["texts"], original)
            body.append([str(run["seed"]), machine(run) or "-", commit(run) or "-",
                         f"{run['wall_minutes']:.1f}", *(x(ratios[n]) for n in REPORT_TEXTS)])
        body.append(["median", "", "", "", *(x(row["per_text_median"][n]) for n in REPORT_TEXTS)])
        out += [f"`{command(row)}` ({protocol.CASES[row['case']][2]}):", ""]
        out += md_table(["seed", "machine", "commit", "minutes", *REPORT_TEXTS], body) + [""]
    return out


def md_baselines(data: dict) -> list[str]:
    out = []
    for model, (name, _) in MODELS.items():
        stats = baselines(data, model)
        original = data[f"baselines/{model}"]["original"]["kv_bytes_per_token"]
        body = [[n, f"{s['bytes']:,.0f} ({s['share']:.1%})", *(x(s["ratios"][t]) for t in REPORT_TEXTS),
                 x(s["median"]), x(s["worst"])] for n, s in sorted(stats.items(), key=lambda kv: -kv[1]["bytes"])]
        out += md_table([f"{name} ({original:,} bytes/token in 16 bits)", "bytes/token", *REPORT_TEXTS, "median",
                         "worst"], body) + [""]
    return out


def md_engines() -> list[str]:
    body = []
    for r in engines.table():
        stood = sum(r["heal_stood"])
        body.append([f"`{r['command']}`", r["bytes"]["storage"], f"{r['bytes']['shrunk']:,} "
                     f"({r['bytes']['shrunk'] / r['bytes']['original_16bit']:.1%})",
                     f"{x(r['untouched']['median'])}, {x(r['untouched']['worst'])}",
                     f"{x(r['shrunk']['median'])}, {x(r['shrunk']['worst'])}", f"{stood} of {len(r['heal_stood'])}"])
    return md_table(["command (seeds 0, 1, 2)", "llama.cpp cache", "bytes/token", "the untouched model, same cache",
                     "the shrink's output", "heal stood"], body)


def hf_table() -> list[str]:
    """hf_kvcache.table()'s lines, its rows of equal bytes in name order (it sorts a set by bytes alone, so their
    order changes with the process's string hashing)."""
    out: list[str] = []
    rows: list[str] = []
    for line in [*hf_kvcache.table().rstrip().splitlines(), ""]:
        if line.startswith(("| KVCache ", "| QuantizedCache ")):
            rows.append(line)
            continue
        out += sorted(rows, key=lambda r: (-float(r.split("|")[2].split()[0].replace(",", "")), r)) + [line]
        rows = []
    return out[:-1]


def md_provenance() -> list[str]:
    """Where each part of hf_kvcache.json was measured: one line per run."""
    out = []
    for part, section in hf_data().items():
        for i, run in enumerate(section.get("runs", [])):
            v = run.get("versions") or {}
            out += wrap(f"- {part} run {i}: `{' '.join(run['argv'])}` at {run['commit'][:7]} on {run['cores']} "
                        f"cores of {run['cpu']} (torch {v.get('torch')}, transformers {v.get('transformers')}; load "
                        f"{run['load_before']:.1f} before, {run.get('load_after', float('nan')):.1f} after)", "  ")
    return out


def md_long() -> list[str]:
    """The long parts of protocol.json: each result and baseline at 4,096 tokens (and 512), with the passkey."""
    lines = protocol.long_lines()
    if not lines:
        return []
    return ["## At long context", "",
            *wrap(f"`python benchmarks/quality/protocol.py long --case C --seed S`: each text's first "
                  f"{protocol.LONG_TOKENS:,} tokens in one window read through the cache in chunks of "
                  f"{protocol.LONG_CHUNK} (a `--format transformers` result in transformers over its KVCache), "
                  "over the original's; in brackets the same at windows of 512. The passkey: a key hidden at "
                  f"depths {', '.join(map(str, protocol.PASSKEY_DEPTHS))} of "
                  f"{' and '.join(f'{n:,}' for n in protocol.PASSKEY_LENGTHS)} tokens of filler, greedy, exact "
                  "match, beside the original's. KIVI has no cache to decode through: no passkey."), "",
            *lines, ""]


def results_md(data: dict, table: dict) -> str:
    """The whole of docs/results.md."""
    texts = "; ".join(f"{n}, {t.kind}" for n, t in REPORT_TEXTS.items())
    training = ", ".join(Path(t.path).name for t in TRAINING_TEXTS)
    at = sum(1 for k in protocol.rows() if k.startswith("at/"))
    lines = [
        "# Results", "",
        *wrap("Written by `python benchmarks/report.py` from benchmarks/results/protocol.json, engines.json and "
              "hf_kvcache.json; do not edit it by hand. `python benchmarks/report.py --check` says "
              "whether it is current. docs/evaluation.md says how each figure is measured."), "",
        "## The plain shrink commands", "",
        *wrap(f"`python benchmarks/quality/protocol.py run --case C --seed S` runs each command as a user types it "
              f"and scores it on {len(REPORT_TEXTS)} held-out texts: {texts}. Each text's first "
              f"{protocol.TOKENS:,} tokens, windows of {protocol.WINDOW}. Nothing was trained, calibrated or chosen on "
              f"them. The commands with `--text T` train on other files: {training} (benchmarks/texts.py's "
              "TRAINING_TEXTS). The seeds' spread is the largest difference between two seeds on one text. "
              f"A figure is perplexity over the original model's on the same text. Bytes per token are counted at "
              f"{FAIR_CONTEXT:,} tokens (what a sequence holds whatever its length spread over them), or at the "
              "command's `--context`. The nearest baseline is the best, on each text, of those at the fewest bytes "
              "at or above the command's; the README's is the best by median of those at the two smallest sizes."),
        "", *md_summary(data, table), "",
        "### Each seed on each text", "", *md_runs(data, table),
        *wrap(f"protocol.json also keeps {at} rows of other commits (its at/ keys: designs measured and not kept, "
              "and re-timings of a plan); `python benchmarks/quality/protocol.py report` lists them."), "",
        "## The baselines: the original model's cache quantized", "",
        *wrap("`python benchmarks/quality/protocol.py baselines --model M`: llama.cpp's cache types (its Hadamard "
              "rotation included) and KIVI-style codes, on the original model in attnlab, the same texts and "
              "windows."), "",
        *md_baselines(data),
        "## In llama.cpp", "",
        *wrap("`python benchmarks/engines/engines.py run --case C --seed S`: each `--format gguf` output scored by "
              "llama.cpp itself, beside the untouched model with the same cache flags, over the untouched model "
              "with its f16 cache. 'Heal stood': the seeds whose guard kept the heal."), "",
        *md_engines(), "",
        "## In transformers", "",
        *wrap("`python benchmarks/quality/hf_kvcache.py quality|bytes|speed|memory`: the original attention in "
              "transformers, with attnlab.hf.KVCache and transformers' QuantizedCache beside DynamicCache. Quality "
              "is over DynamicCache's perplexity, fed in chunks of 128 through the cache; QuantizedCache keeps its "
              "newest 128 tokens plain, up to a quarter of a 512-token window."), "",
        *hf_table(), "",
        "Where each was measured:", "", *md_provenance(), "",
        *md_long(),
        "## The picture", "",
        *wrap("benchmarks/figures/frontier.png: KV bytes per token over a 16-bit cache against perplexity over the "
              "original's (the point: the median; the whisker: the worst text). attnlab's plain commands at their "
              f"bytes at {FAIR_CONTEXT:,} tokens; the baselines of protocol.json at theirs; quanto and hqq at the "
              "bytes transformers' caches hold at the end of the 512-token windows scored (a residual kept plain "
              "counted), TurboQuant's codes too. llama.cpp's line joins the best of its types at each size."),
    ]
    return "\n".join(lines) + "\n"


# -- the picture --------------------------------------------------------------------------------------------------
def frontier_lines(data: dict, model: str) -> dict[str, list[tuple[str, float, float, float]]]:
    """Each baseline family of `model`: (name, share of a 16-bit cache, median, worst) per bit width, by bytes; for
    llama.cpp's types the best at each size."""
    stats = baselines(data, model)
    out: dict[str, list] = {}
    for family, names in PROTOCOL_FAMILIES.items():
        points = [(n, stats[n]["share"], stats[n]["median"], stats[n]["worst"]) for n in names if n in stats]
        best = {}
        for p in sorted(points, key=lambda p: (p[1], p[2])):
            best.setdefault(p[1], p)
        out[family] = sorted(best.values(), key=lambda p: p[1])
    found = hf_rows(model)
    for family, names in HF_FAMILIES.items():
        points = [(n, hf_share(model, n), found[n]["median"], found[n]["worst"]) for n in names if n in found]
        if points:
            out[family] = sorted(points, key=lambda p: p[1])
    return out


def frontier(data: dict, table: dict, path: Path = PICTURE) -> None:
    """benchmarks/figures/frontier.png: one panel per model, attnlab's plain commands as points, each baseline as a
    line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, axes = plt.subplots(1, len(MODELS), figsize=(6.2 * len(MODELS), 4.6))
    families = sorted({f for model in MODELS for f in frontier_lines(data, model)})
    colours = {f: f"C{i}" for i, f in enumerate(families)}  # one colour a family in every panel
    for ax, (model, (name, _)) in zip(axes, MODELS.items()):
        for family, points in frontier_lines(data, model).items():
            xs, med, worst = ([100 * p[1] for p in points], [p[2] - 1 for p in points], [p[3] - 1 for p in points])
            line = ax.errorbar(xs, med, yerr=[[0] * len(med), [w - m for w, m in zip(worst, med)]], marker="o",
                               ms=4, lw=1, capsize=2, label=family, color=colours[family])
            for p, px, py in zip(points, xs, med):
                ax.annotate(p[0], (px, py), xytext=(3, -8), textcoords="offset points", fontsize=6,
                            color=line.lines[0].get_color())
        ours = [case_row(table, c) for c in README_CASES if protocol.CASES[c][0] == model]
        ax.errorbar([100 * share(r) for r in ours], [r["median"] - 1 for r in ours],
                    yerr=[[0] * len(ours), [r["worst"] - r["median"] for r in ours]], fmt="*", ms=11, color="k",
                    capsize=3, label="attnlab shrink (3 seeds)")
        for r in ours:  # a no-heal row sits beside its budget's healed one: its label goes left, below
            left = "--no-heal" in protocol.CASES[r["case"]][1]
            ax.annotate(budget(r["case"]), (100 * share(r), r["median"] - 1), xytext=(-5, -9) if left else (5, 3),
                        textcoords="offset points", fontsize=8, weight="bold", ha="right" if left else "left")
        ax.set_yscale("symlog", linthresh=1e-3)
        ax.yaxis.set_major_locator(matplotlib.ticker.FixedLocator([0, 1e-3, 1e-2, 0.1, 1, 4]))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{1 + v:g}x"))
        ax.set_ylim(-2e-4, 12)
        ax.set_xlim(0, 80)
        ax.grid(alpha=0.3)
        ax.set_title(name)
        ax.set_xlabel("KV bytes per token, % of a 16-bit cache")
    axes[0].set_ylabel("perplexity / the original's (median; whisker: worst text)")
    axes[0].legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


# -- the command --------------------------------------------------------------------------------------------------
def expected(data: dict, table: dict) -> dict[Path, str]:
    """What each generated text file should hold."""
    return {README: readme(README.read_text(), data, table), RESULTS: results_md(data, table)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 where a file is not current")
    args = ap.parse_args(argv)
    data, table = protocol_data()
    files = expected(data, table)
    stale = [p for p, text in files.items() if not p.exists() or p.read_text() != text]
    if args.check:
        for p in stale:
            print(f"{p.relative_to(ROOT)} differs from what `python benchmarks/report.py` writes")
        return 1 if stale else 0
    for p in stale:
        p.write_text(files[p])
        print(f"wrote {p.relative_to(ROOT)}")
    frontier(data, table)
    print(f"wrote {PICTURE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
