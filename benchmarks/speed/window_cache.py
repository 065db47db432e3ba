"""What Gemma 3's sliding-window caches save in attnlab's own loop: bytes allocated and decode-step time at a long
context, against caches that keep every token (the window then applied by the mask alone). Real Gemma 3 270M
(the bundled GGUF), CPU, float32, B=1.

    python benchmarks/speed/window_cache.py                  # a 3,072-token prompt (GPL-3), 32 greedy steps
    python benchmarks/speed/window_cache.py --prompt-len 1024

One process; the two loops' decode steps are interleaved one by one (so that load from other processes hits both
alike); medians. The greedy tokens of the two must be the same (checked). Records the load average before and
after: run it alone. Writes benchmarks/results/window_cache.json.
"""
import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from attnlab.bench import machine_info
from attnlab.generation import Generator
from attnlab.models import load_model, read_text_ids

RESULTS = Path(__file__).resolve().parents[1] / "results"  # benchmarks/results

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--prompt-len", type=int, default=3072)
parser.add_argument("--new", type=int, default=32)
parser.add_argument("--json", type=Path, default=RESULTS / "window_cache.json")
args = parser.parse_args()
load_before = os.getloadavg()[0]
torch.set_grad_enabled(False)
model, tok, _ = load_model("gemma3-270m")
model.eval()
ids = read_text_ids(tok, "/usr/share/common-licenses/GPL-3", args.prompt_len, min_tokens=args.prompt_len)
max_len = args.prompt_len + args.new + 1
loops = {"window": Generator(model, 1, max_len), "every token": Generator(model, 1, max_len, sliding=False)}
rows = {}
for name, gen in loops.items():
    t0 = time.perf_counter()
    logits = gen.prefill(ids)
    rows[name] = {"prefill_ms": (time.perf_counter() - t0) * 1e3, "tokens": [int(logits.argmax(-1))], "steps": [],
                  "allocated_bytes": sum(t.numel() * t.element_size() for c in gen.caches for t in c.tensors()),
                  "rows_per_layer": sorted({c.capacity for c in gen.caches})}
for _ in range(args.new):
    for name, gen in loops.items():
        r = rows[name]
        t0 = time.perf_counter()
        logits = gen.step(torch.tensor([r["tokens"][-1]]))
        r["steps"].append((time.perf_counter() - t0) * 1e3)
        r["tokens"].append(int(logits.argmax(-1)))
same = rows["window"]["tokens"] == rows["every token"]["tokens"]
out = {"machine": machine_info(), "command": f"python benchmarks/speed/window_cache.py --prompt-len {args.prompt_len} "
       f"--new {args.new}", "load_before": load_before, "load_after": os.getloadavg()[0], "same_tokens": same,
       "rows": {n: {"allocated_bytes": r["allocated_bytes"], "rows_per_layer": r["rows_per_layer"],
                    "prefill_ms": r["prefill_ms"], "step_ms": statistics.median(r["steps"])} for n, r in rows.items()}}
w, e = out["rows"]["window"], out["rows"]["every token"]
print(f"Gemma 3 270M, attnlab's loop, prompt {args.prompt_len}, {args.new} greedy steps, float32, "
      f"load {load_before:.2f} -> {out['load_after']:.2f}; same tokens: {same}")
print("| caches | rows per layer | allocated | prefill ms | decode step ms (median) |")
print("|---|---|---|---|---|")
for n, r in out["rows"].items():
    print(f"| {n} | {r['rows_per_layer']} | {r['allocated_bytes'] / 2 ** 20:.1f} MiB | {r['prefill_ms']:.0f} | "
          f"{r['step_ms']:.2f} |")
print(f"window / every token: {w['allocated_bytes'] / e['allocated_bytes']:.3f} of the bytes, "
      f"{w['step_ms'] / e['step_ms']:.3f} of the step time")
args.json.write_text(json.dumps(out, indent=2) + "\n")
if not same:
    raise SystemExit("the two loops generated different tokens")
