"""The evaluation protocol behind the README's table: each plain `attnlab shrink` command, run as a user runs it,
scored on four held-out texts of different kinds, over three seeds, beside the original's cache quantized as
llama.cpp and KIVI do it, at equal or more bytes (a run's bytes at 2,048 tokens: per token held and its fixed bytes,
a "+c4" rope key's newest group and a "+w16" recent window, spread over them).

    python benchmarks/quality/protocol.py baselines --model smollm2      # the original and its quantized caches
    python benchmarks/quality/protocol.py run --case smollm2-25 --seed 0  # one plain command, then every evaluation
    python benchmarks/quality/protocol.py run --case smollm2-25 --seed 0 --at 1a2b3c4   # a worktree's commit: at/ rows
    python benchmarks/quality/protocol.py repeat --case smollm2-25 --seed 0  # the same command and seed again
    python benchmarks/quality/protocol.py long --case smollm2-25 --seed 0    # 4,096-token windows and the passkey
                                                 # (a --format transformers case in transformers), beside
                                                 # long/baselines/<model>, measured once
    python benchmarks/quality/protocol.py report     # the table: median and worst over seeds and texts
    python benchmarks/quality/protocol.py plot       # benchmarks/figures/protocol.png
    python benchmarks/quality/protocol.py bytes      # each run's bytes at 512 and 2,048 tokens
    python benchmarks/quality/protocol.py baselines --dev --model smollm2     # development texts: the original only
    python benchmarks/quality/protocol.py run --dev --case smollm2-12 --env ATTNLAB_CPU_BF16=0   # a variant, on them
    python benchmarks/quality/protocol.py report --dev   # the dev/ rows: what a default is fitted on
    bash scripts/device_protocol.sh run    # on a lent GPU machine: case smollm2-12-cuda, texts from --texts-from

Run it alone on the machine: it records the load average before and after each shrink and warns above 1.
Rows go to benchmarks/results/protocol.json, merged by key. A row kept under at/<case>@<commit>/seed<S> is the same
plain command run by another commit (a worktree of it, its own src on PYTHONPATH), a design measured and not kept:
the report shows it as its own row beside the case's.

What each command is: exactly the argv recorded in its row ("argv"), which is the list handed to the child process
(`attnlab shrink MODEL --kv-budget B --out OUT`, and `--seed S` for seeds other than the default 0). Nothing else is
added: no --eval-text, and --minutes and --text only in the cases that name them (CASES; the text is
texts.TRAINING_TEXTS). The report's `command` is that argv joined.

The report texts (texts.REPORT_TEXTS, each checked against its SHA-256 when read), chosen once for this protocol
and never used to train, calibrate, plan, probe or pick a default: Python's reference prose (pydoc_data.topics),
Debian's technical documentation (dpkg's triggers spec), the attention study's problem text (a maths/ML text,
shared/study), and the GNU Free Documentation Licence 1.3.
Without --text, shrink calibrates and trains on text the model writes itself and judges its heal on that text, on
sentences shipped with attnlab and on attnlab's own source (heal.data.judge_texts), none of them these texts.
Each is scored on its first 2,048 tokens in windows of 512, and with --long at long context on its first 4,096
tokens in one window read through the cache in chunks of 512 (as decoding reads it), with a passkey check (a key
hidden at depths 0.1, 0.5, 0.9 of 2,048 and 4,096 tokens of filler, greedy, exact match).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import replace
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCHMARKS))  # texts.py, beside the benchmark folders
from provenance import provenance  # noqa: E402
from texts import DEV_TEXTS, REPORT_TEXTS, TRAINING_TEXTS, checked, sha256  # noqa: E402

JSON = BENCHMARKS / "results" / "protocol.json"
TRAINING_ARGS = [a for t in TRAINING_TEXTS for a in ("--text", t.path)]  # the user's own text, as the cases pass it
TOKENS, WINDOW = 2048, 512
LONG_TOKENS, LONG_CHUNK = 4096, 512
SEEDS = (0, 1, 2)
CASES = {  # name: (model, shrink arguments after the model, what it checks)
    "smollm2-25": ("smollm2", ["--kv-budget", "25%"], "SmolLM2-135M at 25% of the bytes, the plain command"),
    "smollm2-50": ("smollm2", ["--kv-budget", "50%"], "SmolLM2-135M at 50% of the bytes, the plain command"),
    "smollm2-12": ("smollm2", ["--kv-budget", "12.5%"], "SmolLM2-135M at 12.5% of the bytes, the plain command"),
    "gemma3-270m-25": ("gemma3-270m", ["--kv-budget", "25%"], "Gemma 3 270M at 25% of the bytes, the plain command"),
    # the same budget written for transformers and scored there, through attnlab.hf.KVCache (score_in_transformers)
    "smollm2-25-transformers": ("smollm2", ["--kv-budget", "25%", "--format", "transformers"],
                                "SmolLM2-135M at 25% of the bytes for transformers, scored in transformers"),
    "smollm2-12-transformers": ("smollm2", ["--kv-budget", "12.5%", "--format", "transformers"],
                                "SmolLM2-135M at 12.5% of the bytes for transformers, scored in transformers"),
    "gemma3-270m-25-transformers": ("gemma3-270m", ["--kv-budget", "25%", "--format", "transformers"],
                                    "Gemma 3 270M at 25% of the bytes for transformers, scored in transformers"),
    # the codec alone (issue 78's training-free path): planned and written with no heal, scored in transformers
    **{f"{m}-{b.rstrip('%').split('.')[0]}-no-heal": (m, ["--kv-budget", b, "--no-heal", "--format", "transformers"],
                                                      f"{name} at {b} of the bytes with no heal, scored in transformers")
       for m, name, b in (("smollm2", "SmolLM2-135M", "25%"), ("smollm2", "SmolLM2-135M", "18.75%"),
                          ("smollm2", "SmolLM2-135M", "12.5%"), ("gemma3-270m", "Gemma 3 270M", "25%"))},
    # the budget counted at a long context, where Gemma's sliding layers hold 576 rows of 32,768 and its 3 global
    # layers most of the bytes (issue eighth's last target, <= 1.10x); compared with the baselines by its share of
    # the original's bytes there (fair_bytes)
    "gemma3-270m-12-32k": ("gemma3-270m", ["--kv-budget", "12.5%", "--context", "32768"],
                           "Gemma 3 270M at 12.5% of the bytes at 32,768 tokens, the plain command"),
    # what a user gets after that command's refusal, which names 17.7% as the smallest budget the storages meet
    "gemma3-270m-18-32k": ("gemma3-270m", ["--kv-budget", "18%", "--context", "32768"],
                           "Gemma 3 270M at 18% of the bytes at 32,768 tokens (the smallest the planner meets)"),
    # the user's own text and half an hour (issue eighth's first target, <= 1.10x on every text)
    "smollm2-12-text": ("smollm2", ["--kv-budget", "12.5%", *TRAINING_ARGS, "--minutes", "30"],
                        "SmolLM2-135M at 12.5% of the bytes with a text of three kinds in 30 minutes"),
    # the same with round 4 of the plan asked for (a latent size per layer): measured to decide whether the command
    # with a text should plan per layer by default (the plain 10-minute command does not: docs/decisions.md)
    "smollm2-12-text-per-layer": ("smollm2", ["--kv-budget", "12.5%", *TRAINING_ARGS, "--minutes", "30",
                                              "--per-layer"],
                                  "SmolLM2-135M at 12.5% with a text of three kinds in 30 minutes, a latent size "
                                  "per layer"),
    # the same with the 3-bit latent named: measured to decide which storage the command with a text should plan (the
    # planner chose the 2-bit latent there by its proxy, and it lost to the 3-bit plan of 6e5b220: docs/decisions.md)
    "smollm2-12-text-int3": ("smollm2", ["--kv-budget", "12.5%", *TRAINING_ARGS, "--minutes", "30", "--kv-dtype",
                                         "int3/g256+c4+w16"],
                             "SmolLM2-135M at 12.5% with a text of three kinds in 30 minutes, the 3-bit latent named"),
    # a sixteenth of the bytes with the user's text and half an hour (issue eighth's third target, <= 1.30x)
    "smollm2-6-text": ("smollm2", ["--kv-budget", "6.25%", *TRAINING_ARGS, "--minutes", "30"],
                       "SmolLM2-135M at 6.25% of the bytes with a text of three kinds in 30 minutes"),
    # the plain command of a user with one GPU: the heal's steps many times the CPU's in its minutes (a lent device
    # machine runs it: scripts/device_protocol.sh); not in the picture, which shows the CPU's commands
    "smollm2-12-cuda": ("smollm2", ["--kv-budget", "12.5%", "--device", "cuda", "--minutes", "4"],
                        "SmolLM2-135M at 12.5% of the bytes on one GPU in 4 minutes"),
}
GPU_CASES = {c for c, (_, args, _) in CASES.items() if "cuda" in args}
# llama.cpp's types, KIVI-style codes without and with KIVI's 16-bit residual of 32 or 128 tokens ("+w": each query
# reads its newest rows plain, as many as KIVI's residual holds at most), and TurboQuant's (modules/turbo.py: tq4,
# tq3, tq2 are 4.25, 3.25 and 2.25 bits a value of a 64-value head; tqp4, tqp3, tqp2 with the residual's 1-bit
# sketch, 4.5, 3.5, 2.5); `baselines --add` scores those a model's row lacks into it
BASELINES = ("q8_0", "q5_0", "q4_1", "iq4_nl", "q4_0", "kivi4", "kivi2", "tq4", "tq3", "tq2",
             "kivi4+w32", "kivi4+w128", "kivi2+w32", "kivi2+w128", "tqp4", "tqp3", "tqp2")


def load() -> float:
    return os.getloadavg()[0]


def note_load(row: dict, key: str) -> None:
    row[key] = load()
    if row[key] > 1:
        warnings.warn(f"load average {row[key]:.2f} > 1: something else runs; the figures are not alone")


def this_run() -> dict:
    """This command's provenance: its argv, the commit (a clean tree but the results), the machine."""
    return provenance(["python", "benchmarks/quality/protocol.py", *sys.argv[1:]],
                      results=(str(JSON.relative_to(BENCHMARKS.parent)),))


def rows(path: Path = JSON) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def write_json(path: Path, data) -> None:
    """Write data to a JSON file whole under another name, then rename it: never half-written."""
    from attnlab.io.folders import replace_file

    replace_file(path, json.dumps(data, indent=2).encode())


def save(key: str, row: dict, path: Path = JSON) -> None:
    """Merge one row into the JSON file by key (write_json)."""
    data = rows(path)
    data[key] = row
    write_json(path, data)


def argv(case: str, seed: int, out: str) -> list[str]:
    """The plain command of a case, as a user types it: the seed only where it is not the default."""
    model, args, _ = CASES[case]
    return ["attnlab", "shrink", model, *args, *(["--seed", str(seed)] if seed else []), "--out", out]


def texts_from(folder: str) -> None:
    """The report texts read from copies in `folder` (<name>.txt each) on a machine that lacks the originals (a lent
    GPU machine: another Python's pydoc_data, no Debian documentation); a copy is checked against the same SHA-256."""
    for name, text in list(REPORT_TEXTS.items()):
        path = Path(folder) / f"{name}.txt"
        if not path.is_file():
            raise SystemExit(f"--texts-from {folder}: no {path.name} there (one file per text: "
                             f"{', '.join(REPORT_TEXTS)})")
        REPORT_TEXTS[name] = replace(text, path=str(path))


PREFIX = ""  # "dev/" once use_dev_texts() swapped the texts: every row of the run is kept apart from the report's


def use_dev_texts() -> None:
    """Score on the development texts (texts.DEV_TEXTS) instead of the report texts, the rows under dev/: what a
    default is fitted on (docs/evaluation.md)."""
    global PREFIX
    REPORT_TEXTS.clear()
    REPORT_TEXTS.update(DEV_TEXTS)
    PREFIX = "dev/"


def child_env(pairs: list[str]) -> dict:
    """NAME=VALUE settings of attnlab's own variables (ATTNLAB_*) for the child shrink: a variant of the plain
    command, recorded in the row and its key. SystemExit naming anything else."""
    out = {}
    for pair in pairs:
        name, eq, value = pair.partition("=")
        if not eq or not re.fullmatch(r"ATTNLAB_[A-Z0-9_]+", name):
            raise SystemExit(f"--env takes ATTNLAB_NAME=VALUE, got {pair!r}")
        out[name] = value
    return out


def text_hashes() -> dict:
    """Each report text's SHA-256, its file checked against the one texts.py names."""
    return {name: sha256(checked(text)) for name, text in REPORT_TEXTS.items()}


def text_ids(tok, name: str, tokens: int):
    from attnlab import models as hf

    return hf.read_text_ids(tok, checked(REPORT_TEXTS[name]), tokens)


def score(model, tok, long: bool = False) -> dict:
    """Perplexity on every text: the first TOKENS in windows of WINDOW; with `long` also LONG_TOKENS in one window
    read through the cache in chunks of LONG_CHUNK (KIVI, which has no cache, in one forward)."""
    from attnlab import models as hf
    from attnlab.models.evaluate import score_windows

    out = {}
    for name in REPORT_TEXTS:
        row = {"perplexity": hf.perplexity(model, text_ids(tok, name, TOKENS), window=WINDOW)}
        if long:
            kivi = any(str(m.kv_dtype or "").startswith("kivi") for m in hf.attnlab_modules(model))
            row["perplexity_4096"] = score_windows(model, text_ids(tok, name, LONG_TOKENS), window=LONG_TOKENS,
                                                   chunk=None if kivi else LONG_CHUNK).perplexity
        out[name] = row
    return out


def transformers_case(case: str) -> bool:
    """Whether the case writes a --format transformers folder: its report beside it, scored in transformers."""
    return "transformers" in CASES[case][1]


def shrink_output(case: str, out: str):
    """(the shrink's report, model, tokenizer) of a run's output; for a transformers folder the report beside it and
    no model (score_in_transformers loads it)."""
    from attnlab import models as hf

    if transformers_case(case):
        return json.loads(Path(out + ".shrink.json").read_text()), None, None
    model, tok, meta = hf.load_model(out)
    return meta.get("shrink") or {}, model, tok


def in_transformers(out: str):
    """(model, tokenizer) of a --format transformers folder, in float32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(out)


def score_in_transformers(out: str, long: bool = False) -> dict:
    """score() for a --format transformers folder, in transformers' own forward over KVCache.from_pretrained(out):
    each window fed in chunks of WINDOW // 4, as decoding reads the cache (a plain cache gives one forward's figures
    to float64's rounding: tests/test_hf_cache.py), and with `long` LONG_TOKENS in chunks of LONG_CHUNK."""
    from attnlab.hf import KVCache, TransformersRunner
    from attnlab.hf.folder import value_bases
    from attnlab.models.evaluate import score_windows

    model, tok = in_transformers(out)
    planned = KVCache.from_pretrained(out, model)  # its storage, and a keys-whole plan's bases and kept layers' storage
    runner = TransformersRunner(model, planned.kv_dtype, value_bases(out, model.config.num_hidden_layers),
                                planned.kept_dtype)
    result = {}
    for name in REPORT_TEXTS:
        ids = text_ids(tok, name, TOKENS)
        result[name] = {"perplexity": score_windows(model, ids, WINDOW, chunk=WINDOW // 4, runner=runner).perplexity}
        if long:
            ids = text_ids(tok, name, LONG_TOKENS)
            result[name]["perplexity_4096"] = score_windows(model, ids, LONG_TOKENS, chunk=LONG_CHUNK,
                                                            runner=runner).perplexity
    return result


def passkey_in_transformers(out: str) -> dict:
    """passkey() for a --format transformers folder: transformers' greedy generate over a fresh
    KVCache.from_pretrained(out) a prompt (what `attnlab eval OUT --engine transformers --passkey` runs)."""
    from attnlab.hf import KVCache
    from attnlab.models.passkey import run_passkey

    model, tok = in_transformers(out)
    eos = getattr(model.generation_config, "eos_token_id", None) or tok.eos_token_id

    def decode(ids, n):
        cache = KVCache.from_pretrained(out, model)
        found = model.generate(ids, cache=cache, max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=eos)
        return found[0, ids.shape[1]:]

    return run_passkey(model, tok, lengths=PASSKEY_LENGTHS, depths=PASSKEY_DEPTHS, decode=decode).to_dict()


PASSKEY_LENGTHS, PASSKEY_DEPTHS = (2048, 4096), (0.1, 0.5, 0.9)


def passkey(model, tok) -> dict:
    """Exact-match passkey accuracy at PASSKEY_LENGTHS x PASSKEY_DEPTHS, greedy through the model's cache with
    attnlab's generation loop (what `attnlab eval --passkey` runs)."""
    from attnlab.generation.loop import generate
    from attnlab.models.passkey import run_passkey

    def decode(ids, n):
        return generate(model, ids, max_new_tokens=n)[0, ids.shape[1]:]

    return run_passkey(model, tok, lengths=PASSKEY_LENGTHS, depths=PASSKEY_DEPTHS, decode=decode).to_dict()


def part_baselines(model_name: str, redo: bool, long: bool, add: bool = False) -> None:
    """The original (its 16-bit cache) and each baseline cache of it, on every text; bytes per token of each; with
    `long`, 4,096-token windows and the passkey check for the original and the 4- and 5-bit llama.cpp caches; with
    `add`, only the BASELINES an existing row lacks, scored into it (its "added" says when and where)."""
    from attnlab import models as hf
    from attnlab.shrink import baselines

    key = f"{PREFIX}baselines/{model_name}"
    if key in rows() and not redo and not add:
        print(f"{key} is in {JSON}; --redo to measure it again, --add to score the baselines it lacks")
        return
    model, tok, _ = hf.load_model(model_name)
    known = [b for b in BASELINES if _known(b)]
    if key in rows() and not redo:  # --add: the row as it is, and each baseline it lacks scored into it
        row = rows()[key]
        if row.get("texts_sha256") not in (None, text_hashes()):
            raise SystemExit(f"{key} was scored on other texts than these: --redo it whole")
        known = [b for b in known if b not in row["baselines"]]
        row.setdefault("added", []).append({"baselines": known, "provenance": this_run(),
                                             "load_before": load()})
    else:
        row = {"model": model_name, "texts": {n: {"path": t.path, "kind": t.kind} for n, t in REPORT_TEXTS.items()},
               "texts_sha256": text_hashes()}
        note_load(row, "load_before")
        row["original"] = {"kv_bytes_per_token": hf.kv_bytes_per_token(model, torch_bf16()), **score(model, tok, long)}
        row["passkey"] = {"original": passkey(model, tok)} if long else {}
        row["baselines"] = {}
    sizes = {} if PREFIX else baselines.baseline_bytes(model, known)  # dev: the original alone
    for name, size in sizes.items():
        hf.set_kv_dtype(model, name)
        fixed = hf.kv_fixed_bytes(model, torch_bf16())  # a residual's plain rows ("+w"), a sequence's whatever its length
        row["baselines"][name] = {"kv_bytes_per_token": size, **({"fixed_bytes": fixed} if fixed else {}),
                                  **score(model, tok, long)}
        if long and name in ("q4_0", "iq4_nl"):
            row["passkey"][name] = passkey(model, tok)
        hf.set_kv_dtype(model, None)
        print(name, json.dumps(row["baselines"][name]))
    note_load(row["added"][-1] if "added" in row and not redo else row, "load_after")
    save(key, row)


def torch_bf16():
    import torch

    return torch.bfloat16


def _known(kv_dtype: str) -> bool:
    from attnlab.modules.storage import check_kv_dtype

    try:
        check_kv_dtype(kv_dtype)
        return True
    except ValueError:
        return False


def run_one(case: str, seed: int, work: Path, env: dict | None = None) -> dict:
    """The plain command in a child process; the row records exactly the argv it ran, the variables `env` set for it
    (a variant, never the plain command), and the SHA-256 of each training text a `--text` case hands it."""
    out = str(work / f"{case}-seed{seed}")
    command = argv(case, seed, out)
    row = {"case": case, "seed": seed, "what": CASES[case][2], "argv": command, "command": " ".join(command),
           **({"env_set": env} if env else {})}
    if "--text" in CASES[case][1]:
        row["training_texts_sha256"] = {t.path: sha256(checked(t)) for t in TRAINING_TEXTS}
    note_load(row, "load_before")
    t0 = time.monotonic()
    proc = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **(env or {})})
    row["wall_minutes"] = (time.monotonic() - t0) / 60
    note_load(row, "load_after")
    row["returncode"] = proc.returncode
    row["stdout_tail"] = proc.stdout[-3000:]
    if proc.returncode:
        row["stderr"] = proc.stderr[-2000:]
    row["out"] = out
    return row


def part_run(case: str, seed: int, redo: bool, long: bool, at: str | None = None, env: dict | None = None) -> None:
    """One case's plain command and its scores, saved as run/<case>/seed<S>, or at/<case>@<at>/seed<S> when `at`
    names the commit whose worktree ran it (a design measured beside the command, not the command main gives); with
    `env` the case's name carries the variables (run/<case>+NAME=VALUE/...); --dev puts the row under dev/."""
    from attnlab import models as hf

    if at is not None and not re.fullmatch(r"[0-9a-f]{7,40}", at):
        raise SystemExit(f"--at takes the commit that ran (7-40 hex digits), not {at!r}")
    name = case + "".join(f"+{k}={v}" for k, v in sorted((env or {}).items()))
    key = PREFIX + (f"at/{name}@{at}/seed{seed}" if at else f"run/{name}/seed{seed}")
    if key in rows() and not redo:
        print(f"{key} is in {JSON}; --redo to run it again")
        return
    work = Path(tempfile.mkdtemp(prefix="attnlab-protocol-"))
    prov = this_run()
    row = {**run_one(case, seed, work, env), "provenance": prov}
    if row["returncode"]:
        save(key, row)
        raise SystemExit(f"shrink failed: {row.get('stderr', '')[-500:]}")
    report, model, tok = shrink_output(case, row["out"])
    row["report"] = {k: report.get(k) for k in ("kv_bytes_per_token", "held_out", "minutes", "work", "heal_plan",
                                                   "environment")}
    row["report"]["heal"] = {k: (report.get("heal") or {}).get(k) for k in
                             ("probe", "kept", "rollbacks", "hard_batches", "layers_restored", "distill_steps",
                              "steps_done", "layer_cut", "layer_steps_fitted", "layer_wise", "end_to_end")}
    row["plan"] = (report.get("plan") or {}).get("chosen")
    if model is None:
        row["kv_bytes_per_token"] = report["kv_bytes_per_token"]["shrunk"]
        row["fixed_bytes"] = fixed_bytes(row)
        row["texts"] = score_in_transformers(row["out"], long)
        row["texts_sha256"] = text_hashes()
        save(key, row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("report", "stdout_tail")}, indent=2))
        return
    row["kv_bytes_per_token"] = hf.kv_bytes_per_token(model)
    row["fixed_bytes"] = fixed_bytes(row)
    row["texts"] = score(model, tok, long)
    row["texts_sha256"] = text_hashes()
    if case in GPU_CASES:  # run on another machine than the baselines: the original scored there too, to compare
        original, tok, _ = hf.load_model(CASES[case][0])
        row["original_here"] = score(original, tok)
    if long:
        row["passkey"] = passkey(model, tok)
    save(key, row)
    print(json.dumps({k: v for k, v in row.items() if k not in ("report", "stdout_tail")}, indent=2))


def table(data: dict | None = None) -> list[dict]:
    """One row per case: the median and the worst over seeds and texts of perplexity / the original's, beside each
    text's best baseline at equal or more bytes (its median and worst over the texts), and the seeds' spread."""
    data = rows() if data is None else data
    out = []
    groups = {case: [k for k in sorted(data) if k.startswith(f"run/{case}/")] for case in CASES}
    for k in sorted(data):  # the same plain command run by another commit (at/<case>@<rev>/seed<S>)
        if k.startswith("at/"):
            groups.setdefault(k.split("/")[1], []).append(k)
    for case, keys in groups.items():
        name, _, rev = case.partition("@")
        model, _, what = CASES[name]
        what = f"{what}, as commit {rev} ran it" if rev else what
        runs = [data[k] for k in keys if not data[k].get("returncode")]
        base = data.get(f"baselines/{model}")
        if not runs or base is None:
            continue
        original = base["original"]
        per_text = {n: [r["texts"][n]["perplexity"] / original[n]["perplexity"] for r in runs] for n in REPORT_TEXTS}
        by_seed = [[r["texts"][n]["perplexity"] / original[n]["perplexity"] for n in REPORT_TEXTS] for r in runs]
        reached = max(r["kv_bytes_per_token"] for r in runs)
        # fair: a baseline's bytes at least the run's at FAIR_CONTEXT tokens (or the case's --context), its fixed
        # bytes counted there (llama.cpp's types hold none; KIVI's and quanto's newest 16-bit tokens are not counted)
        reached_at = max(fair_bytes(r, name, original["kv_bytes_per_token"]) for r in runs)
        fair = {b: v for b, v in base["baselines"].items() if v["kv_bytes_per_token"] >= reached_at}
        best = {n: min(fair, key=lambda b: fair[b][n]["perplexity"]) for n in REPORT_TEXTS} if fair else {}
        base_ratio = {n: fair[best[n]][n]["perplexity"] / original[n]["perplexity"] for n in best}
        medians = {n: statistics.median(v) for n, v in per_text.items()}
        # the nearest in bytes: the best, on each text, of the fair baselines with the fewest bytes
        least = min((v["kv_bytes_per_token"] for v in fair.values()), default=None)
        near = {b: v for b, v in fair.items() if v["kv_bytes_per_token"] == least}
        nearest = {n: min(near, key=lambda b: near[b][n]["perplexity"]) for n in REPORT_TEXTS} if near else {}
        near_ratio = {n: near[nearest[n]][n]["perplexity"] / original[n]["perplexity"] for n in nearest}
        beaten = sorted(b for b, v in fair.items()
                        if all(medians[n] < v[n]["perplexity"] / original[n]["perplexity"] for n in REPORT_TEXTS))
        worst = max(x for v in per_text.values() for x in v)
        # the worst figure's own text (the one a seed scored it on), and apart from it the text of the worst median
        worst_text = next(n for n in REPORT_TEXTS if worst in per_text[n])
        out.append({
            "case": case, "what": what, "seeds": [r["seed"] for r in runs], "command": runs[0]["command"],
            "kv_bytes_per_token": reached, "original_bytes": original["kv_bytes_per_token"],
            f"bytes_at_{FAIR_CONTEXT}": reached_at, "counted_at": counted_at(name),
            "median": statistics.median(x for v in per_text.values() for x in v),
            "worst": worst, "per_text_median": medians, "worst_text": worst_text,
            "worst_median_text": max(medians, key=medians.get),
            "seed_spread": max(max(s) - min(s) for s in zip(*by_seed)) if len(by_seed) > 1 else None,
            "baseline": best, "baseline_ratio": base_ratio,
            "baseline_median": statistics.median(base_ratio.values()) if base_ratio else None,
            "baseline_worst": max(base_ratio.values()) if base_ratio else None,
            "beats_baseline_on_every_text": all(medians[n] < base_ratio[n] for n in base_ratio) if base_ratio
            else None,
            "nearest": nearest, "nearest_ratio": near_ratio,
            "nearest_median": statistics.median(near_ratio.values()) if near_ratio else None,
            "nearest_worst": max(near_ratio.values()) if near_ratio else None,
            "beats_on_every_text": beaten, "fair_baselines": sorted(fair),
        })
    return out


def spread(row: dict) -> str:
    """The seeds' spread as the table prints it: none for one seed (not 0: nothing was repeated)."""
    return "-" if row["seed_spread"] is None else f"{row['seed_spread']:.3f}"


def dev_report(data: dict | None = None) -> list[dict]:
    """The dev/ rows (protocol.py run --dev): per case and variant, the median and the worst over seeds and development
    texts of perplexity / the original's (dev/baselines/<model>), and the seeds' spread; printed and returned."""
    data = rows() if data is None else data
    groups: dict[str, list[dict]] = {}
    for key, row in data.items():
        m = re.fullmatch(r"dev/(?:run|at)/(.+)/seed\d+", key)
        if m and "texts" in row:
            groups.setdefault(m.group(1), []).append(row)
    out = []
    print("| development texts: case (variant) | seeds | median | worst (text) | seeds' spread |\n|---|---|---|---|---|")
    for name, runs in sorted(groups.items()):
        original = (data.get(f"dev/baselines/{CASES[runs[0]['case']][0]}") or {}).get("original")
        if original is None:
            print(f"| {name} | no dev/baselines/{CASES[runs[0]['case']][0]}: run baselines --dev first | | | |")
            continue
        ratio = {n: [r["texts"][n]["perplexity"] / original[n]["perplexity"] for r in runs] for n in DEV_TEXTS}
        every = [v for vs in ratio.values() for v in vs]
        worst = max(every)
        row = {"name": name, "seeds": sorted(r["seed"] for r in runs), "median": statistics.median(every),
               "worst": worst, "worst_text": next(n for n, vs in ratio.items() if worst in vs),
               "spread": max(max(vs) - min(vs) for vs in ratio.values())}
        out.append(row)
        print(f"| {name} | {', '.join(map(str, row['seeds']))} | {row['median']:.3f}x | {worst:.3f}x "
              f"({row['worst_text']}) | {row['spread']:.3f} |")
    return out


def part_report() -> None:
    if PREFIX:
        save("dev/table", {"rows": dev_report()})
        return
    t = table()
    print(f"| command | KV bytes/token held | at {FAIR_CONTEXT:,} tokens | median | worst (text) | seeds' spread | "
          f"best baseline at >= bytes at {FAIR_CONTEXT:,} tokens: median, worst | nearest in bytes: median, worst | "
          "beats on every text |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in t:
        share = r["kv_bytes_per_token"] / r["original_bytes"]
        names = sorted(set(r["baseline"].values()))
        rev = f" on {r['case'].partition('@')[2]}" if "@" in r["case"] else ""
        at = r.get("counted_at", FAIR_CONTEXT)
        where = "" if at == FAIR_CONTEXT else f" at {at:,} tokens"  # the share of the original's bytes there
        print(f"| `{r['command'].split(' --out')[0]} --out OUT` (seeds {', '.join(map(str, r['seeds']))}{rev}) | "
              f"{r['kv_bytes_per_token']:,.0f} ({share:.0%}) | {r[f'bytes_at_{FAIR_CONTEXT}']:,.0f} "
              f"({r[f'bytes_at_{FAIR_CONTEXT}'] / r['original_bytes']:.1%}{where}) | {r['median']:.3f}x | "
              f"{r['worst']:.3f}x "
              f"({r['worst_text']}) | {spread(r)} | {'/'.join(names)}: "
              f"{r['baseline_median'] or float('nan'):.3f}x, {r['baseline_worst'] or float('nan'):.3f}x | "
              f"{'/'.join(sorted(set(r['nearest'].values())))}: {r['nearest_median'] or float('nan'):.3f}x, "
              f"{r['nearest_worst'] or float('nan'):.3f}x | {', '.join(r['beats_on_every_text']) or 'none'} "
              f"(of {len(r['fair_baselines'])}) |")
    save("table", {"rows": t})
    long_report()
    for key, row in sorted(rows().items()):
        if key.startswith("repeat/") and "compared" in row:
            c = row["compared"]
            print(f"{key}: same plan {c['same_plan']}, largest perplexity change {c['largest_change']:.2%}")


def long_rows(data: dict | None = None) -> list[dict]:
    """Each finished long part: for the result and each baseline, perplexity over the original's at 4,096 tokens and
    at 512 on every text, and passkey accuracy (None for KIVI, which has no cache to decode through). A part whose
    original and baselines sit in a long/baselines/<model> row ("baselines") gives its result, read against that
    row's original; the row gives its baselines once."""
    data = rows() if data is None else data
    out = []
    done = [k for k in data if k.startswith("long/") and not k.endswith("/partial")
            and (not k.startswith("long/baselines/") or data[k].get("done"))]
    cut = [k for k in data if k.endswith("/partial") and k[:-len("/partial")] not in done]  # a part cut short
    for key in sorted(done + cut):
        row = {**data.get(data[key].get("baselines"), {}), **data[key]}
        orig = row["original"]
        names = ("result",) if "baselines" in data[key] else ("result", *LONG_BASELINES)
        for name in names:
            if name not in row:
                continue
            texts = row[name]["texts"]
            out.append({"key": key, "model": name, "passkey": (row[name].get("passkey") or {}).get("accuracy"),
                        "original_passkey": (orig.get("passkey") or {}).get("accuracy"),
                        "at_4096": {n: texts[n]["perplexity_4096"] / orig["texts"][n]["perplexity_4096"] for n in texts},
                        "at_512": {n: texts[n]["perplexity"] / orig["texts"][n]["perplexity"] for n in texts}})
    return out


def long_lines(data: dict | None = None) -> list[str]:
    """long_rows as a Markdown table: 4,096 (512) on each text, and passkey accuracy beside the original's."""
    found = long_rows(data)
    if not found:
        return []
    out = [f"| long part (at 4,096; at 512 in brackets) | cache | {' | '.join(REPORT_TEXTS)} | passkey (original's) |",
           f"|---|---|{'---|' * len(REPORT_TEXTS)}---|"]
    for r in found:
        cells = " | ".join(f"{r['at_4096'][n]:.3f} ({r['at_512'][n]:.3f})" for n in REPORT_TEXTS)
        key = "-" if r["passkey"] is None else f"{r['passkey']:.0%} ({r['original_passkey']:.0%})"
        out.append(f"| {r['key']} | {r['model']} | {cells} | {key} |")
    return out


def long_report() -> None:
    """Print long_lines."""
    lines = long_lines()
    if lines:
        print("\n" + "\n".join(lines))


# the original's caches beside a result at long context: llama.cpp's 4-bit types, KIVI-4 without and with its
# 128-token residual, TurboQuant's 4 bits (the 25% plans' neighbours at equal or more bytes)
LONG_BASELINES = ("q4_0", "iq4_nl", "kivi4", "tq4", "kivi4+w128")


def long_baselines(model_name: str, redo: bool) -> str:
    """The key of long/baselines/<model>: the original and each LONG_BASELINES cache of it at long context, every
    text and the passkey check, measured here unless a finished row is there (or `redo`); saved after each cache."""
    from attnlab import models as hf

    key = f"long/baselines/{model_name}"
    row = rows().get(key, {})
    if row.get("done") and not redo:
        return key
    row = {"model": model_name, "texts": list(REPORT_TEXTS), "passkey_lengths": PASSKEY_LENGTHS,
           "passkey_depths": PASSKEY_DEPTHS, "provenance": this_run()}
    note_load(row, "load_before")
    model, tok, _ = hf.load_model(model_name)
    for name in (None, *LONG_BASELINES):
        hf.set_kv_dtype(model, name)
        # KIVI is an evaluation baseline without a cache to decode through: its passkey check cannot run
        row[name or "original"] = {"texts": score(model, tok, long=True),
                                   "passkey": None if str(name).startswith("kivi") else passkey(model, tok)}
        print(name or "original", json.dumps(row[name or "original"]["texts"]))
        save(key, row)  # what is done survives a failure later in the part
    note_load(row, "load_after")
    save(key, {**row, "done": True})
    return key


def part_long(case: str, seed: int, redo: bool) -> None:
    """Long context for one case: perplexity in one 4,096-token window read through the cache (every text), and the
    passkey check, for the case's result of `seed` (its folder must still exist: the run's "out"; a --format
    transformers folder in transformers over its KVCache), beside long/baselines/<model> (measured first if
    missing)."""
    from attnlab import models as hf

    key = f"long/{case}/seed{seed}"
    if key in rows() and not redo:
        print(f"{key} is in {JSON}; --redo to measure it again")
        return
    run = rows().get(f"run/{case}/seed{seed}")
    if run is None or run.get("returncode") or not Path(run["out"]).exists():
        raise SystemExit(f"no output of run/{case}/seed{seed} on disk: run it first")
    row = {"case": case, "seed": seed, "texts": list(REPORT_TEXTS), "passkey_lengths": PASSKEY_LENGTHS,
           "passkey_depths": PASSKEY_DEPTHS, "baselines": long_baselines(CASES[case][0], False),
           "provenance": this_run()}
    note_load(row, "load_before")
    if transformers_case(case):
        row["result"] = {"texts": score_in_transformers(run["out"], long=True),
                         "passkey": passkey_in_transformers(run["out"])}
    else:
        shrunk, tok, _ = hf.load_model(run["out"])
        row["result"] = {"texts": score(shrunk, tok, long=True), "passkey": passkey(shrunk, tok)}
    print("result", json.dumps(row["result"]))
    note_load(row, "load_after")
    save(key, row)


def compare_repeat(first: dict, again: dict) -> dict:
    """The same command and seed run twice: whether the plan is the same, and each text's perplexity of the second
    run over the first's (the target: within 0.5%)."""
    ratio = {n: again["texts"][n]["perplexity"] / first["texts"][n]["perplexity"] for n in first["texts"]}
    return {"same_plan": first.get("plan") == again.get("plan"), "perplexity_ratio": ratio,
            "largest_change": max(abs(r - 1) for r in ratio.values())}


def part_repeat(case: str, seed: int, redo: bool) -> None:
    """The run of (case, seed) made again by the same argv, into another folder (from a fresh clone: what a stranger
    re-measures); saved as repeat/CASE/seedS with its comparison to the first run (compare_repeat)."""
    key = f"repeat/{case}/seed{seed}"
    first = rows().get(f"run/{case}/seed{seed}")
    if first is None or first.get("returncode"):
        raise SystemExit(f"no run/{case}/seed{seed} to repeat: run it first")
    if key in rows() and not redo:
        print(f"{key} is in {JSON}; --redo to run it again")
        return
    prov = this_run()
    row = {**run_one(case, seed, Path(tempfile.mkdtemp(prefix="attnlab-protocol-"))), "provenance": prov}
    if row["returncode"]:
        save(key, row)
        raise SystemExit(f"shrink failed: {row.get('stderr', '')[-500:]}")
    report, model, tok = shrink_output(case, row["out"])
    row["texts"] = score_in_transformers(row["out"]) if model is None else score(model, tok)
    row["plan"], row["work"] = (report.get("plan") or {}).get("chosen"), report.get("work")
    row["compared"] = compare_repeat(first, row)
    save(key, row)
    print(json.dumps(row["compared"], indent=2))


def part_plot(path: Path = BENCHMARKS / "figures" / "protocol.png") -> None:
    """One picture: per case and text, the shrunk model's perplexity over the original's (median of the seeds, the
    bar; the worst seed, the tick) beside the nearest baseline in bytes among those at equal or more bytes, and the
    best of those, on that text."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = rows()
    # the plain commands on the CPU as they stand, not designs left behind
    t = [r for r in table(data) if "@" not in r["case"] and r["case"] not in GPU_CASES]
    if not t:
        raise SystemExit("no complete case in benchmarks/results/protocol.json to draw")
    # four panels a row, each on its own scale (a 2x case beside a 1.02x one would flatten the second)
    cols = min(4, len(t))
    rows_ = -(-len(t) // cols)
    fig, axes = plt.subplots(rows_, cols, figsize=(4.2 * cols, 3.6 * rows_), squeeze=False)
    flat = [ax for row_axes in axes for ax in row_axes]
    for ax in flat[len(t):]:
        ax.set_axis_off()
    for ax, r in zip(flat, t):
        model = CASES[r["case"]][0]
        original = data[f"baselines/{model}"]["original"]
        runs = [data[k] for k in sorted(data) if k.startswith(f"run/{r['case']}/") and not data[k].get("returncode")]
        names = list(REPORT_TEXTS)
        xs = range(len(names))
        ours = [[run["texts"][n]["perplexity"] / original[n]["perplexity"] for run in runs] for n in names]
        w = 0.27
        ax.bar([x - w for x in xs], [statistics.median(v) - 1 for v in ours], w, bottom=1, label="attnlab shrink")
        ax.scatter([x - w for x in xs], [max(v) for v in ours], marker="_", color="k", s=120, label="worst seed")
        for dx, which, label in ((0, "nearest", "nearest baseline at >= bytes"),
                                 (w, "baseline", "best baseline at >= bytes")):
            ratio = r[f"{which}_ratio"]
            ax.bar([x + dx for x in xs], [ratio.get(n, 1) - 1 for n in names], w, bottom=1, label=label)
            for x, n in zip(xs, names):
                ax.text(x + dx, max(ratio.get(n, 1), 1), r[which].get(n, ""), ha="center", va="bottom", fontsize=6,
                        rotation=90)
        ax.axhline(1, color="grey", lw=0.8)
        ax.set_xticks(list(xs), names, rotation=20, fontsize=8)
        title = re.sub(r"( --text \S+)+", " --text T", r["command"].split(" --out")[0].replace("attnlab shrink ", ""))
        share = r[f"bytes_at_{FAIR_CONTEXT}"] / r["original_bytes"]
        ax.set_title(f"{title}\n{share:.1%} of the bytes at {r['counted_at']:,} tokens", fontsize=9)
    for row_axes in axes:
        row_axes[0].set_ylabel("perplexity / the original's")
    axes[0][0].legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


FAIR_CONTEXT = 2048  # the sequence length at which a run's bytes meet the baselines' ("equal or more bytes")
_LAYERS: dict[str, int] = {}


def fixed_bytes(row: dict) -> int:
    """The bytes a run's cache holds a sequence whatever its length, in bfloat16 as a served model holds them: a "+c4"
    rope key's newest 64 tokens and a "+w<N>" recent window's N rows, every layer (sizes.layer_cache, one layer's
    cache at the plan's sizes; a plan with a latent size per layer, each layer's); what part_run recorded, where it
    did."""
    import torch

    from attnlab import models as hf
    from attnlab.shrink.sizes import layer_cache

    if "fixed_bytes" in row or not row.get("plan"):  # recorded by part_run; a row without a plan: none known
        return row.get("fixed_bytes", 0)
    plan, model_name = row["plan"], CASES[row["case"].partition("@")[0]][0]
    if model_name not in _LAYERS:
        _LAYERS[model_name] = len(hf.attnlab_modules(hf.load_model(model_name)[0]))
    latents = plan.get("latent_dims") or [plan["latent_dim"]] * _LAYERS[model_name]
    return sum(layer_cache(r, plan["rope_dim"], plan["kv_dtype"], dtype=torch.bfloat16).fixed_bytes for r in latents)


def bytes_at(row: dict, context: int) -> float:
    """A run's bytes per token at a sequence of `context` tokens: per token held plus its fixed bytes spread."""
    return row["kv_bytes_per_token"] + fixed_bytes(row) / context


def counted_at(case: str) -> int:
    """The context at which a case's bytes meet the baselines': its --context where it names one, else
    FAIR_CONTEXT."""
    args = CASES[case.partition("@")[0]][1]
    return int(args[args.index("--context") + 1]) if "--context" in args else FAIR_CONTEXT


def fair_bytes(row: dict, case: str, original: int) -> float:
    """A run's bytes as the baselines' are compared with them, in bytes per token of a cache of every token: at
    FAIR_CONTEXT tokens (bytes_at); for a case whose budget counts a context T (--context), its share of the
    original's bytes at T (the shrink report's at_context: sliding layers hold only their window) times the
    original's bytes per token, since a baseline, one storage in every layer, holds the same share at any
    context."""
    context = counted_at(case)
    if context == FAIR_CONTEXT:
        return bytes_at(row, context)
    at = ((row.get("report") or {}).get("kv_bytes_per_token") or {}).get("at_context") or {}
    if at.get("context") != context:
        raise ValueError(f"{case} seed {row.get('seed')}: its report counts no bytes at {context:,} tokens "
                         f"(at_context: {at or None})")
    return original * at["shrunk"] / at["original_16bit"]


def part_bytes(contexts=(512, 2048, 4096)) -> None:
    """The bytes each run's cache holds at a context: per token held plus what a sequence holds whatever its length
    (fixed_bytes), spread over the context (at 4,096 tokens the figure the budget counts without --context, since
    9d89e99); as a share of the original's 16-bit cache."""
    data = rows()
    out = {}
    print("| run | storage | bytes/token held | fixed bytes a sequence (bf16) | "
          + " | ".join(f"at {c:,} tokens" for c in contexts) + " |")
    print("|---|---|---|---|" + "---|" * len(contexts))
    for key, row in sorted(data.items()):
        if not key.startswith(("run/", "at/")) or not row.get("plan"):
            continue
        plan, fixed = row["plan"], fixed_bytes(row)
        held = row["kv_bytes_per_token"]
        original = data[f"baselines/{CASES[row['case'].partition('@')[0]][0]}"]["original"]["kv_bytes_per_token"]
        at = {c: held + fixed / c for c in contexts}
        out[key] = {"storage": plan["kv_dtype"], "held": held, "fixed": fixed, "original": original,
                    "at": {str(c): v for c, v in at.items()}}
        print(f"| {key} | {plan['kv_dtype']} | {held:,} ({held / original:.1%}) | {fixed:,} | "
              + " | ".join(f"{v:,.0f} ({v / original:.1%})" for v in at.values()) + " |")
    save("bytes", out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", choices=("baselines", "run", "repeat", "long", "report", "plot", "bytes"))
    ap.add_argument("--case", choices=sorted(CASES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--redo", action="store_true")
    ap.add_argument("--add", action="store_true", help="baselines: score only those the model's row lacks, into it")
    ap.add_argument("--long", action="store_true", help="also 4,096-token windows through the cache and the passkey "
                    "check (minutes per model)")
    ap.add_argument("--at", help="run: the commit of the worktree on PYTHONPATH; the row goes to at/<case>@<at>/")
    ap.add_argument("--texts-from", help="read the texts from copies in this folder (<name>.txt each)")
    ap.add_argument("--dev", action="store_true", help="baselines, run, report: the development texts instead of "
                    "the report texts (texts.DEV_TEXTS), rows under dev/; baselines then scores the original only")
    ap.add_argument("--env", action="append", default=[], help="run: ATTNLAB_NAME=VALUE for the child (a variant, "
                    "recorded in the row's key); repeatable")
    a = ap.parse_args()
    if a.texts_from:
        texts_from(a.texts_from)
    if a.dev:
        use_dev_texts()
    if a.part == "baselines":
        part_baselines(a.model, a.redo, a.long, a.add)
    elif a.part == "run":
        if a.case is None:
            ap.error("run needs --case")
        part_run(a.case, a.seed, a.redo, a.long, a.at, child_env(a.env))
    elif a.part == "repeat":
        if a.case is None:
            ap.error("repeat needs --case")
        part_repeat(a.case, a.seed, a.redo)
    elif a.part == "long":
        if a.case is None:
            ap.error("long needs --case")
        part_long(a.case, a.seed, a.redo)
    elif a.part == "plot":
        part_plot()
    elif a.part == "bytes":
        part_bytes()
    else:
        part_report()


if __name__ == "__main__":
    sys.exit(main())
