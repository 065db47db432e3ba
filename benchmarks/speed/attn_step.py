"""Do the 16-bit paths pay for the few-bit storages? One attention module at SmolLM2-135M's sizes, CPU.

    python benchmarks/speed/attn_step.py            # B=1, a 2,048-token cache, float32, 200 rounds
    python benchmarks/speed/attn_step.py --dtype bfloat16 --rounds 100

Modules with random weights (their speed does not depend on the weights): the GQA (dim 576, 9 query
heads, 3 KV heads of 64, blocked grouping, RoPE base 100000), the exact MLA it converts to
(`gqa_to_mla`: the latent holds the keys before rotation, RoPE after the up-projection, expanded
path) and a compressed MLA with decoupled RoPE (`gqa_to_mla_decoupled`, latent 144 + rope 48), each
on the path it picks itself (the compressed one: absorbed for decode, by cost for prefill). Two timings, each in rounds of one call per module (each round starting one module
later), so that load from other processes hits all alike:
- decode: one step from 2,047 cached tokens to 2,048 (the cache truncated back before each call);
- prefill: 2,048 tokens into an empty cache, causal.
Reported: each module's median ms and the paired ratio to the GQA within rounds (median and
quartiles; above 1: slower than the GQA). The targets of issue stack: the exact MLA's decode step
at most 1.10x the GQA's, the compressed MLA's prefill at most 1.20x. Records the load average before
and after: run it alone. Writes benchmarks/results/attn_step.json.
"""
import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from attnlab import GroupedQueryAttention
from attnlab.bench import machine_info
from attnlab.convert import gqa_to_mla, gqa_to_mla_decoupled

RESULTS = Path(__file__).resolve().parents[1] / "results"  # benchmarks/results

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--context", type=int, default=2048)
parser.add_argument("--rounds", type=int, default=200, help="decode rounds; prefill runs a tenth of them")
parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
parser.add_argument("--json", type=Path, default=RESULTS / "attn_step.json")
args = parser.parse_args()
dtype = getattr(torch, args.dtype)
torch.manual_seed(0)
load_before = os.getloadavg()[0]

gqa = GroupedQueryAttention(576, 9, 3, head_dim=64, grouping="blocked", rope_base=100000.0).eval()
exact, _ = gqa_to_mla(gqa)
compressed, _ = gqa_to_mla_decoupled(gqa, 144, 8)
modules = {"GQA": (gqa, {}), "MLA exact": (exact.eval(), {}), "MLA r144+p48": (compressed.eval(), {})}
S = args.context
caches = {}
for name, (m, _) in modules.items():
    m.to(dtype)
    caches[name] = m.init_cache(1, S)
x_prompt = torch.randn(1, S, 576, dtype=dtype)
x_step = torch.randn(1, 1, 576, dtype=dtype)


def decode(name):
    m, kw = modules[name]
    cache = caches[name]
    cache.truncate(S - 1)
    with torch.no_grad():
        m(x_step, cache=cache, **kw)


def prefill(name):
    m, kw = modules[name]
    cache = caches[name]
    cache.truncate(0)
    with torch.no_grad():
        m(x_prompt, cache=cache, is_causal=True, **kw)


def rounds(fn, n):
    names = list(modules)
    times = {k: [] for k in names}
    for i in range(n):
        for j in range(len(names)):
            name = names[(i + j) % len(names)]
            t0 = time.perf_counter()
            fn(name)
            times[name].append(time.perf_counter() - t0)
    return times


for name in modules:  # fill every cache once (prefill), then warm up both calls
    prefill(name)
    decode(name)
result = {"machine": machine_info(), "command": "python benchmarks/speed/attn_step.py " + " ".join(
    f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "json"), "load_before": load_before,
    "rows": []}
for what, fn, n in (("decode", decode, args.rounds), ("prefill", prefill, max(5, args.rounds // 10))):
    if what == "decode":
        for name in modules:
            prefill(name)  # a full cache of real keys to decode against
    times = rounds(fn, n)
    for name, ts in times.items():
        paired = sorted(t / g for t, g in zip(ts, times["GQA"]))
        q = statistics.quantiles(paired, n=4)
        result["rows"].append({"call": what, "module": name, "ms": statistics.median(ts) * 1e3,
                               "paired_ratio_to_gqa": statistics.median(paired),
                               "paired_quartiles": [q[0], q[2]], "ms_all": [t * 1e3 for t in ts]})
result["load_after"] = os.getloadavg()[0]
print(f"attention at SmolLM2-135M sizes, B=1, context {S}, {args.dtype}, load {result['load_before']:.2f} -> "
      f"{result['load_after']:.2f}")
print("| call | module | ms (median) | paired ratio to GQA: median [quartiles] |\n|---|---|---|---|")
for r in result["rows"]:
    print(f"| {r['call']} | {r['module']} | {r['ms']:.3f} | {r['paired_ratio_to_gqa']:.2f}x "
          f"[{r['paired_quartiles'][0]:.2f}, {r['paired_quartiles'][1]:.2f}] |")
if result["load_before"] > 1 or result["load_after"] > 2.5:
    print("warning: the load average says something else ran; the timings are not alone")
args.json.write_text(json.dumps(result, indent=1))
print(f"wrote {args.json}")
