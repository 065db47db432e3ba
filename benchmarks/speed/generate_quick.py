"""Quick timing of attnlab's generation loop against transformers' own (sdpa), real SmolLM2-135M, CPU float32.

    python benchmarks/speed/generate_quick.py                   # B=1, 512-token prompt, 24 decode steps, 3 repeats
    python benchmarks/speed/generate_quick.py --prompt-len 2048

One process; the steps of the three are interleaved one by one (transformers, attnlab's loop,
attnlab's fixed-shape CUDA-graph step run eagerly), so load from other processes hits all alike;
medians; each ratio is over transformers in the same run. Writes benchmarks/results/generate_quick.json.
The whole-model benchmark with every variant is `attnlab bench --suite model`.
"""
import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from attnlab.bench import machine_info
from attnlab.generation.generator import Generator
from attnlab.io.folders import replace_file
from attnlab.models import load_smollm2, to_attnlab
from attnlab.models.adapters import cache_keyword

RESULTS = Path(__file__).resolve().parents[1] / "results"  # benchmarks/results

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--prompt-len", type=int, default=512)
parser.add_argument("--new", type=int, default=24)
parser.add_argument("--reps", type=int, default=3)
parser.add_argument("--json", type=Path, default=RESULTS / "generate_quick.json")
args = parser.parse_args()

from transformers import DynamicCache  # noqa: E402

torch.set_grad_enabled(False)
ref, tok = load_smollm2()
ref.eval().config._attn_implementation = "sdpa"
ours = to_attnlab(copy.deepcopy(ref))
ids = tok(Path("/usr/share/common-licenses/GPL-3").read_text(), return_tensors="pt").input_ids[:, :args.prompt_len]
size = ids.shape[1] + args.new + 1
gens = {"attnlab loop": Generator(ours, 1, size), "attnlab fixed-shape": Generator(ours, 1, size, fixed_shape=True)}
prefill = {k: [] for k in ["transformers sdpa", *gens]}
decode = {k: [] for k in prefill}


def timed(f):
    t = time.perf_counter()
    r = f()
    return r, time.perf_counter() - t


keyword = cache_keyword(ref.forward)  # `cache` from transformers 5.24, `past_key_values` before
for _ in range(args.reps):
    cache = DynamicCache(config=ref.config)
    out, t = timed(lambda: ref(input_ids=ids, **{keyword: cache}, use_cache=True, logits_to_keep=1))
    prefill["transformers sdpa"].append(t)
    nxt = {"transformers sdpa": out.logits[:, -1].argmax(-1)}
    for k, g in gens.items():
        logits, t = timed(lambda: g.prefill(ids))
        prefill[k].append(t)
        nxt[k] = logits.argmax(-1)
    for _ in range(args.new):
        out, t = timed(lambda: ref(input_ids=nxt["transformers sdpa"][:, None], **{keyword: cache}, use_cache=True))
        decode["transformers sdpa"].append(t)
        nxt["transformers sdpa"] = out.logits[:, -1].argmax(-1)
        for k, g in gens.items():
            logits, t = timed(lambda: g.step(nxt[k]))
            decode[k].append(t)
            nxt[k] = logits.argmax(-1)
        if not all(torch.equal(nxt["transformers sdpa"], v) for v in nxt.values()):
            sys.exit("the loops chose different tokens")

ms = lambda xs: 1000 * statistics.median(xs)  # noqa: E731
base_p, base_d = ms(prefill["transformers sdpa"]), ms(decode["transformers sdpa"])
rows = [{"loop": k, "prefill_ms": ms(prefill[k]), "decode_ms_per_token": ms(decode[k]),
         "prefill_vs_transformers": ms(prefill[k]) / base_p, "decode_vs_transformers": ms(decode[k]) / base_d}
        for k in prefill]
print(f"SmolLM2-135M, CPU float32, B=1, {ids.shape[1]}-token prompt, {args.new} steps x {args.reps} (medians)")
print("| loop | prefill ms | decode ms/token | prefill / transformers | decode / transformers |")
print("|---|---|---|---|---|")
for r in rows:
    print(f"| {r['loop']} | {r['prefill_ms']:.0f} | {r['decode_ms_per_token']:.1f} | "
          f"{r['prefill_vs_transformers']:.2f} | {r['decode_vs_transformers']:.2f} |")
result = {"machine": machine_info("cpu"),
          "command": "python benchmarks/speed/generate_quick.py " + " ".join(sys.argv[1:]),
          "prompt_len": int(ids.shape[1]), "new": args.new, "reps": args.reps, "rows": rows}
replace_file(args.json, json.dumps(result, indent=2).encode())
