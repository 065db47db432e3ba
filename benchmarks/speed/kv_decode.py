"""Decode speed of attnlab's generation loop with 8- and 4-bit KV caches against a 16-bit one, SmolLM2-135M, CPU.

    python benchmarks/speed/kv_decode.py                        # B=16, 2048-token prompts, then 8 x 8 steps
    python benchmarks/speed/kv_decode.py --batch 1 --prompt-len 512 --storages bf16,int8

Generators in one process, their decode steps interleaved one by one so that load from other
processes hits all alike: the original model (GQA cache, KVCache) and its 50% MLA (latent 132 +
rope 60, decoupled RoPE, absorbed decode on a LatentCache), each with every --storages entry
(default "bf16": the 16-bit cache, "int8": per-token scales, "int4": packed 4-bit codes in groups
of 32, read by unpacking). Activations and weights float32. The MLA is converted
without calibration: its speed does not depend on the quality of the cut, so the slow calibration
step is skipped. One prefill each (the steps continue from it; the context grows by 64 tokens over 2048).
The steps go in rounds, one step of each generator, each round starting with the next generator.
Reported: medians and their ratio (the first storage's ms/step over each one's: above 1, that
storage is faster), and the paired ratio of each round's two steps of one model (median and
quartiles), which a slow spell of the shared VM cannot tilt as long as it lasts a round. Records the load average before and after and warns above 1: run it alone.
Writes benchmarks/results/kv_decode.json.
"""
import argparse
import copy
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

from attnlab import models as hf
from attnlab.bench import machine_info
from attnlab.generation.generator import Generator
from attnlab.io.folders import replace_file

RESULTS = Path(__file__).resolve().parents[1] / "results"  # benchmarks/results

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--batch", type=int, default=16)
parser.add_argument("--prompt-len", type=int, default=2048)
parser.add_argument("--new", type=int, default=8)
parser.add_argument("--reps", type=int, default=8)
parser.add_argument("--storages", default="bf16,int8,int4", help="comma-separated; the first is the reference")
parser.add_argument("--json", type=Path, default=RESULTS / "kv_decode.json")
args = parser.parse_args()


def load() -> float:
    value = os.getloadavg()[0]
    if value > 1:
        warnings.warn(f"load average {value:.2f} > 1: something else runs; the timings are not alone")
    return value


torch.set_grad_enabled(False)
load_before = load()
teacher, tok, _ = hf.load_model("smollm2")
mla = copy.deepcopy(teacher)
hf.convert_model(mla, "mla", latent_dim=132, rope_dim=60, pair_selection="rorope", balance=True)
text = Path("/usr/share/common-licenses/GPL-3").read_text()
ids = tok(text, return_tensors="pt").input_ids[0]
rows = torch.stack([ids[i * 97: i * 97 + args.prompt_len] for i in range(args.batch)])  # (B, P), distinct rows
if rows.shape[1] < args.prompt_len:
    sys.exit(f"GPL-3 holds {ids.numel()} tokens: too few for {args.batch} prompts of {args.prompt_len}")
size = args.prompt_len + args.new * args.reps + 1
storages = args.storages.split(",")
gens = {f"{name}, {storage}": Generator(model, args.batch, size, kv_dtype=storage)
        for name, model in (("GQA", teacher), ("MLA 50%", mla)) for storage in storages}
decode = {k: [] for k in gens}
nxt = {k: g.prefill(rows).argmax(-1) for k, g in gens.items()}  # once: a B=16, 2k prefill costs about a minute here
order = list(gens)
for i in range(args.reps * args.new):
    for k in order[i % len(order):] + order[:i % len(order)]:  # a round: one step each, starting one later each time
        t = time.perf_counter()
        logits = gens[k].step(nxt[k])
        decode[k].append(time.perf_counter() - t)
        nxt[k] = logits.argmax(-1)
load_after = load()
ms = {k: 1000 * statistics.median(v) for k, v in decode.items()}
table = []
ref = storages[0]
for name in ("GQA", "MLA 50%"):
    for storage in storages:
        k, r = f"{name}, {storage}", f"{name}, {ref}"
        # paired: the two storages' steps of one round ran back to back, under the same conditions
        paired = [a / b for a, b in zip(decode[r], decode[k])]
        q1, _, q3 = statistics.quantiles(paired, n=4)
        table.append({"model": name, "storage": storage, "ms_per_step": ms[k], "speed_vs_" + ref: ms[r] / ms[k],
                      "paired_ratio_median": statistics.median(paired), "paired_ratio_quartiles": [q1, q3],
                      "kv_bytes_per_token": gens[k].kv_bytes_per_token, "ms_steps": [1000 * t for t in decode[k]]})
print(f"SmolLM2-135M, CPU float32 activations, B={args.batch}, {args.prompt_len}-token prompts, {args.new} steps x "
      f"{args.reps} (medians), load {load_before:.2f} -> {load_after:.2f}")
print(f"| model | storage | KV bytes/token | ms/step | speed / {ref} (ratio of medians) | paired ratio: median [quartiles] |")
print("|---|---|---|---|---|---|")
for r in table:
    print(f"| {r['model']} | {r['storage']} | {r['kv_bytes_per_token']} | {r['ms_per_step']:.1f} | "
          f"{r['speed_vs_' + ref]:.2f}x | {r['paired_ratio_median']:.2f}x "
          f"[{r['paired_ratio_quartiles'][0]:.2f}, {r['paired_ratio_quartiles'][1]:.2f}] |")
result = {"machine": machine_info("cpu"), "command": "python benchmarks/speed/kv_decode.py " + " ".join(sys.argv[1:]),
          "batch": args.batch, "prompt_len": args.prompt_len, "new": args.new, "reps": args.reps,
          "load_before": load_before, "load_after": load_after, "rows": table}
replace_file(args.json, json.dumps(result, indent=2).encode())
