"""How fast the command line answers: wall time of fresh processes, medians over --reps runs.

    python benchmarks/speed/cli_startup.py              # 5 runs of each command
    python benchmarks/speed/cli_startup.py --reps 11

Each command runs as a user types it, through the `attnlab` entry point on PATH (a pyenv shim here,
which adds its own start-up), beside two references run with this Python: `import torch` alone and
`import torch, attnlab` (their difference is what importing attnlab costs once torch is loaded).
Targets (issue families, part 6): every `--help` under 0.5 s; `import attnlab` within 0.3 s of
`import torch`. Records the load average before and after: run it alone. Writes
benchmarks/results/cli_startup.json.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "results"  # benchmarks/results

SUBCOMMANDS = ("shrink", "tour", "kv", "bench", "convert", "heal", "export", "generate", "eval")


def commands() -> dict[str, list[str]]:
    exe = shutil.which("attnlab")
    if exe is None:
        raise SystemExit("cli_startup: no `attnlab` on PATH; run scripts/setup.sh first")
    out = {"python -c 'import torch'": [sys.executable, "-c", "import torch"],
           "python -c 'import torch, attnlab'": [sys.executable, "-c", "import torch, attnlab"],
           "python -c 'import attnlab'": [sys.executable, "-c", "import attnlab"],
           "attnlab --help": [exe, "--help"]}
    out.update({f"attnlab {c} --help": [exe, c, "--help"] for c in SUBCOMMANDS})
    out["attnlab kv llama-3-8b"] = [exe, "kv", "llama-3-8b"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", type=Path, default=RESULTS / "cli_startup.json")
    args = ap.parse_args()
    cmds = commands()
    row = {"load_before": os.getloadavg()[0], "reps": args.reps, "rows": []}
    times = {name: [] for name in cmds}
    for _ in range(args.reps):  # rounds, so a slow spell of the machine hits every command alike
        for name, argv in cmds.items():
            t0 = time.perf_counter()
            proc = subprocess.run(argv, capture_output=True, text=True)
            times[name].append(time.perf_counter() - t0)
            if proc.returncode:
                raise SystemExit(f"cli_startup: {name} failed: {proc.stderr.strip().splitlines()[-1:]}")
    row["load_after"] = os.getloadavg()[0]
    print(f"fresh processes, {args.reps} runs each, load {row['load_before']:.2f} -> {row['load_after']:.2f}")
    print("| command | median s | min | max |\n|---|---|---|---|")
    for name, ts in times.items():
        r = {"command": name, "median_s": statistics.median(ts), "min_s": min(ts), "max_s": max(ts), "all_s": ts}
        row["rows"].append(r)
        print(f"| `{name}` | {r['median_s']:.2f} | {r['min_s']:.2f} | {r['max_s']:.2f} |")
    med = {r["command"]: r["median_s"] for r in row["rows"]}
    row["attnlab_import_over_torch_s"] = med["python -c 'import torch, attnlab'"] - med["python -c 'import torch'"]
    helps = [r["median_s"] for r in row["rows"] if r["command"].endswith("--help")]
    row["slowest_help_s"] = max(helps)
    print(f"import attnlab over import torch: {row['attnlab_import_over_torch_s']:+.2f} s (target <= 0.3); "
          f"slowest --help: {row['slowest_help_s']:.2f} s (target < 0.5)")
    if row["load_before"] > 1:
        print("warning: load average above 1 before the run: something else runs; the times are not alone")
    args.json.write_text(json.dumps(row, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
