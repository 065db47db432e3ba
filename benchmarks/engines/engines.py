"""Each GGUF shrink output measured in llama.cpp: a GGUF in the source's own architecture, healed for one of
llama.cpp's cache types, scored by llama.cpp itself (llama-cpp-python) beside the untouched model with the same
flags. (A transformers folder runs in transformers over attnlab.hf.KVCache: benchmarks/quality/hf_kvcache.py.)

    python benchmarks/engines/engines.py run --case smollm2-q4_0 --seed 0  # the plain command, scored by llama.cpp
    python benchmarks/engines/engines.py report                            # median and worst over seeds and texts

Run it alone on the machine (the shrink is a 10-minute budget; the load average before and after is recorded).
Rows go to benchmarks/results/engines.json, merged by key.

The command is exactly the argv in the row: `attnlab shrink MODEL --kv-budget B --kv-dtype T --format gguf --out
OUT.gguf` (`--seed S` where S is not 0); --kv-dtype is the llama.cpp cache type the user serves with, the one flag
the engine needs (K,V for --cache-type-k K --cache-type-v V: smollm2-q8_0-q4_0). Texts and windows are
benchmarks/quality/protocol.py's (the first 2,048 tokens of the four report texts, windows of 512, the same token ids
handed to llama.cpp), none of which the shrink reads.

What llama.cpp runs, each with a fresh context per window and flash attention (what a quantized V cache needs):
- the reference: the untouched model with llama.cpp's default f16 cache;
- `untouched`: the untouched model with the cache type (what the flag gives today, no training);
- `shrunk`: the shrink's output with the cache type;
- `shrunk_q8_0`: the output after llama.cpp's own weight quantizer (llama_model_quantize, Q8_0), the cache type
  again, beside `untouched_q8_0` (the untouched model's Q8_0 copy, the same cache).
Every GGUF is first de-quantized to F32 by llama.cpp itself (ALL_F32), so that the untouched and the shrunk models
differ only in what the heal changed (the shrink rewrites the attention tensors it moved in F32 and keeps the rest
as the source had it: SmolLM2's bundled file is Q4_1, and llama.cpp rounds a Q4_1 projection's input to 8 bits).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
JSON = HERE.parent / "results" / "engines.json"
sys.path[:0] = [str(HERE), str(HERE.parent / "quality")]  # llama_cpp_cache.py beside it; protocol.py

from llama_cpp_cache import f32_copy, llama_cpp_windows, perplexity_of  # noqa: E402
import protocol  # noqa: E402
from protocol import REPORT_TEXTS, TOKENS, WINDOW, note_load, text_ids  # noqa: E402

CASES = {  # name: (model, shrink arguments after the model, the engine's cache type, what it checks)
    "smollm2-q4_0": ("smollm2", ["--kv-budget", "30%", "--kv-dtype", "q4_0", "--format", "gguf"], "q4_0",
                     "SmolLM2-135M for llama.cpp's q4_0 K and V cache"),
    "smollm2-q8_0-q4_0": ("smollm2", ["--kv-budget", "41%", "--kv-dtype", "q8_0,q4_0", "--format", "gguf"],
                          "q8_0,q4_0", "SmolLM2-135M for llama.cpp's q8_0 K and q4_0 V cache"),
    "gemma3-270m-q4_0": ("gemma3-270m", ["--kv-budget", "30%", "--kv-dtype", "q4_0", "--format", "gguf"], "q4_0",
                         "Gemma 3 270M for llama.cpp's q4_0 K and V cache"),
    # the plain 12.5% GGUF (MLA, deepseek2 in llama.cpp), scored with the cache type it was planned for (None: the
    # one its report names; issue eighth's fourth target, <= 1.25x)
    "smollm2-12-gguf": ("smollm2", ["--kv-budget", "12.5%", "--format", "gguf"], None,
                        "SmolLM2-135M at 12.5% of the bytes as an MLA GGUF, llama.cpp's cache type of its plan"),
}


def rows() -> dict:
    return protocol.rows(JSON)


def save(key: str, row: dict) -> None:
    protocol.save(key, row, JSON)


def argv(case: str, seed: int, out: str) -> list[str]:
    model, args, _, _ = CASES[case]
    return ["attnlab", "shrink", model, *args, *(["--seed", str(seed)] if seed else []), "--out", out]


def quantized_copy(source: Path, out: Path, ftype: str, threads: int = 2) -> Path:
    """The GGUF as llama.cpp's own quantizer writes it in `ftype` (e.g. "MOSTLY_Q8_0"), requantizing allowed."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread, params.ftype = threads, getattr(llama_cpp, f"LLAMA_FTYPE_{ftype}")
    params.allow_requantize = True
    if llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params)) != 0:
        raise ValueError(f"llama.cpp could not write a {ftype} copy of {source} at {out}")
    return out


def scored(files: dict[str, tuple[Path, str]], tok) -> dict:
    """{text: {name: perplexity}} for each (file, cache type) on every protocol text, in llama.cpp."""
    out = {}
    for text in REPORT_TEXTS:
        ids = text_ids(tok, text, TOKENS)
        out[text] = {name: perplexity_of(llama_cpp_windows(path, ids, cache, WINDOW)) for name, (path, cache) in
                     files.items()}
        print(f"  {text:<12} " + "  ".join(f"{k} {v:.4f}" for k, v in out[text].items()), flush=True)
    return out


def part_run(case: str, seed: int, redo: bool) -> None:
    from attnlab import models as hf

    key = f"run/{case}/seed{seed}"
    model_name, _, cache, what = CASES[case]
    row = rows().get(key)
    if row and row.get("texts") and not redo:
        print(f"{key} is in {JSON}; --redo to run it again")
        return
    if not row or redo or not Path(row.get("out", "")).exists():  # else: shrunk before, scoring cut short
        work = Path(tempfile.mkdtemp(prefix="attnlab-engines-"))
        out = work / f"{case}-seed{seed}.gguf"
        command = argv(case, seed, str(out))
        row = {"case": case, "seed": seed, "what": what, "argv": command, "command": " ".join(command),
               "cache": cache, "out": str(out)}
        note_load(row, "load_before")
        t0 = time.monotonic()
        proc = subprocess.run(command, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        row["wall_minutes"] = (time.monotonic() - t0) / 60
        note_load(row, "load_after")
        row["returncode"], row["stdout_tail"] = proc.returncode, proc.stdout[-3000:]
        if proc.returncode:
            row["stderr"] = proc.stderr[-2000:]
            save(key, row)
            raise SystemExit(f"shrink failed: {proc.stderr[-500:]}")
        report = json.loads(out.with_name(out.name + ".shrink.json").read_text())
        row["report"] = {k: report.get(k) for k in ("kv_bytes_per_token", "llama_cpp", "written", "minutes", "work")}
        row["report"]["heal"] = {k: (report.get("heal") or {}).get(k) for k in ("probe", "kept", "distill_steps",
                                                                              "steps_done")}
        row["plan"] = (report.get("plan") or {}).get("chosen")
        if row["cache"] is None:  # the cache type the plan chose, as the report says to run it
            k, v = report["llama_cpp"]["cache_type_k"], report["llama_cpp"]["cache_type_v"]
            row["cache"] = k if k == v else f"{k},{v}"
        save(key, row)
    out = Path(row["out"])
    cache = row["cache"]
    work = out.parent
    teacher, tok, _ = hf.load_model(model_name)
    source = Path(teacher.attnlab_source)
    del teacher
    f32 = {"source": f32_copy(source, work / "source-f32.gguf"), "shrunk": f32_copy(out, work / "shrunk-f32.gguf")}
    q8 = {k: quantized_copy(v, work / f"{k}-q8_0.gguf", "MOSTLY_Q8_0") for k, v in f32.items()}
    files = {"reference": (f32["source"], "f16"), "untouched": (f32["source"], cache), "shrunk": (f32["shrunk"], cache),
             "untouched_q8_0": (q8["source"], cache),
             "shrunk_q8_0": (q8["shrunk"], cache)}
    row["texts"] = scored(files, tok)
    note_load(row, "load_after_scoring")
    save(key, row)
    print(json.dumps({k: v for k, v in row.items() if k not in ("report", "stdout_tail")}, indent=2))


def table(data: dict | None = None) -> list[dict]:
    """Per case: median and worst over seeds and texts of each model's perplexity over the reference's (the untouched
    F32 model, f16 cache), and of each Q8_0 copy's over its F32 file's (the same cache type)."""
    data = rows() if data is None else data
    out = []
    for case in CASES:
        runs = [r for k, r in data.items() if k.startswith(f"run/{case}/") and r.get("texts")]
        if not runs:
            continue
        ratios: dict[str, list[float]] = {"untouched": [], "shrunk": [], "shrunk_q8_0_over_shrunk": [],
                                          "untouched_q8_0_over_untouched": []}
        by_text: dict[str, dict[str, list[float]]] = {}
        for r in runs:
            for text, p in r["texts"].items():
                for name in ("untouched", "shrunk"):
                    ratios[name].append(p[name] / p["reference"])
                    by_text.setdefault(text, {}).setdefault(name, []).append(p[name] / p["reference"])
                if "shrunk_q8_0" in p:  # llama.cpp's rows: the Q8_0 copies too
                    ratios["shrunk_q8_0_over_shrunk"].append(p["shrunk_q8_0"] / p["shrunk"])
                    ratios["untouched_q8_0_over_untouched"].append(p["untouched_q8_0"] / p["untouched"])
        row = {"case": case, "what": CASES[case][3], "seeds": sorted(r["seed"] for r in runs),
               "command": runs[0]["command"].replace(runs[0]["argv"][-1], "OUT.gguf"),
               "bytes": runs[0]["report"]["kv_bytes_per_token"],
               "heal_stood": [not r["report"]["heal"].get("kept") for r in runs],  # kept: the unhealed weights
               "rewritten": [len((r["report"].get("written") or {}).get("rewritten", [])) for r in runs]}
        for name, values in ratios.items():
            if values:
                row[name] = {"median": statistics.median(values), "worst": max(values)}
        row["per_text"] = {t: {n: statistics.median(v) for n, v in d.items()} for t, d in by_text.items()}
        out.append(row)
    return out


def part_report() -> None:
    for row in table():
        print(f"{row['case']} ({row['what']}); seeds {row['seeds']}; heal stood {row['heal_stood']}; "
              f"tensors rewritten {row['rewritten']}\n  {row['command']}")
        print("  | text | untouched, same flag | shrunk |")
        print("  |---|---|---|")
        for t, v in row["per_text"].items():
            print(f"  | {t} | {v['untouched']:.4f} | {v['shrunk']:.4f} |")
        print(f"  median / worst: untouched {row['untouched']['median']:.4f} / {row['untouched']['worst']:.4f}, "
              f"shrunk {row['shrunk']['median']:.4f} / {row['shrunk']['worst']:.4f}")
        if "shrunk_q8_0_over_shrunk" not in row:
            continue
        print(f"  after llama-quantize Q8_0 "
              f"{row['shrunk_q8_0_over_shrunk']['median']:.4f} / {row['shrunk_q8_0_over_shrunk']['worst']:.4f} "
              f"of the F32 file's (the untouched model's: {row['untouched_q8_0_over_untouched']['median']:.4f} / "
              f"{row['untouched_q8_0_over_untouched']['worst']:.4f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=("run", "report"))
    parser.add_argument("--case", choices=tuple(CASES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--redo", action="store_true")
    args = parser.parse_args()
    if args.part == "run":
        if not args.case:
            parser.error("run needs --case")
        os.environ.setdefault("OMP_NUM_THREADS", "2")
        part_run(args.case, args.seed, args.redo)
    else:
        part_report()


if __name__ == "__main__":
    main()
