"""The cost of one sampled draw against the decode step it ends, real SmolLM2-135M logits, CPU float32.

    python benchmarks/speed/sampling.py            # 32 rows (shrink's batch), temperature 1, top-p 0.95, 40 steps

What shrink's teacher does when it writes its own training text (heal.data.teacher_windows): 32 windows at once,
temperature 1, top-p 0.95. The logits are the model's own, recorded while it writes (every other row from a token
drawn from the vocabulary, as heal.data does), then each draw is timed on them, interleaved, in one process:
- `sample`: generation.sampling.sample, the top-CANDIDATES tokens first and only the rows whose nucleus is wider
  drawn from the whole vocabulary;
- `whole batch`: every row drawn from the whole vocabulary (filtered_probs: a sort of 49,152 scores a row), which
  is what sample did for the whole batch whenever one row's nucleus was wider than its candidates;
- `decode step`: the model's forward for one token of every row, for scale.
Medians of each step's time; the ratio is over `whole batch` in the same run. Writes benchmarks/results/sampling.json.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from attnlab.bench import machine_info
from attnlab.generation.generator import Generator
from attnlab.generation.sampling import CANDIDATES, filtered_probs, sample
from attnlab.heal.data import PROMPTS, vocabulary_prompts
from attnlab.models import load_smollm2, to_attnlab

RESULTS = Path(__file__).resolve().parents[1] / "results"  # benchmarks/results

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--rows", type=int, default=32)
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--top-p", type=float, default=0.95)
parser.add_argument("--json", type=Path, default=RESULTS / "sampling.json")
args = parser.parse_args()

torch.set_grad_enabled(False)
model, tok = load_smollm2()
model = to_attnlab(model.eval())
drawn = vocabulary_prompts(tok, args.rows, seed=0)
prompts = [p for pair in zip(PROMPTS * args.rows, drawn) for p in pair][: args.rows]
first = torch.tensor([tok(p).input_ids[0] for p in prompts])[:, None]  # (B, 1): each prompt's first token
gen = Generator(model, args.rows, args.steps + 2)
g = torch.Generator().manual_seed(0)


def timed(f):
    t = time.perf_counter()
    r = f()
    return r, time.perf_counter() - t


times = {"sample": [], "whole batch": [], "decode step": []}
wide = []
logits = gen.prefill(first)  # (B, V)
for step in range(args.steps):
    scores = logits.float()
    top = scores.topk(CANDIDATES, dim=-1).values
    wide.append(int(((top - scores.logsumexp(-1, keepdim=True)).exp().sum(-1) < args.top_p).sum()))
    nxt, t = timed(lambda: sample(logits, 1.0, None, args.top_p, g))
    times["sample"].append(t)
    _, t = timed(lambda: torch.multinomial(filtered_probs(logits, 1.0, None, args.top_p), 1, generator=g))
    times["whole batch"].append(t)
    logits, t = timed(lambda: gen.step(nxt))
    times["decode step"].append(t)

base = statistics.median(times["whole batch"])
rows = [{"what": k, "ms_per_step": 1000 * statistics.median(v), "vs_whole_batch": statistics.median(v) / base}
        for k, v in times.items()]
result = {"machine": machine_info(), "command": "python benchmarks/speed/sampling.py " + " ".join(sys.argv[1:]),
          "rows_per_step": args.rows, "steps": args.steps, "top_p": args.top_p, "candidates": CANDIDATES,
          "wide_rows_per_step": {"median": statistics.median(wide), "max": max(wide),
                                 "steps_with_one": sum(w > 0 for w in wide)},
          "rows": rows}
print(f"{args.rows} rows, top-p {args.top_p}: rows with a nucleus wider than {CANDIDATES} tokens, median "
      f"{statistics.median(wide)} a step (at least one in {result['wide_rows_per_step']['steps_with_one']} of "
      f"{args.steps} steps)")
print(f"{'':14}{'ms a step':>10}{'vs whole batch':>16}")
for r in rows:
    print(f"{r['what']:14}{r['ms_per_step']:10.1f}{r['vs_whole_batch']:16.3f}")
args.json.write_text(json.dumps(result, indent=2) + "\n")
