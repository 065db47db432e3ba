"""What 8-bit KV storage costs in perplexity: real SmolLM2-135M, its GQA and a compressed MLA, CPU float32.

    python benchmarks/quality/kv_quant.py                       # 2048 held-out tokens, windows of 512
    python benchmarks/quality/kv_quant.py --groups 32 64        # per-group scales to compare with per-part ones
    python benchmarks/quality/kv_quant.py --eval-text /usr/share/common-licenses/Apache-2.0 --json other.json

Quality only, no timing. Each storage is set on every attention module (models.set_kv_dtype), so a
forward without a cache passes its keys and values through that storage, exactly as cached decode
reads them (tests/test_kv_quant.py checks the equality); perplexity is then the whole-window
perplexity of models.perplexity on held-out text (GPL-3), and bytes/token is what that storage
allocates per token for all layers, scales included (models.kv_bytes_per_token).

Models: the original GQA (30 layers, 3 KV heads of 64: 384 values per token and layer), and that
model converted to a decoupled-RoPE MLA at half the KV values (latent 132 + rope 60 = 192),
RoRoPE by score with BKV, calibrated on 2048 tokens of MPL-2.0 (the command in docs/generation.md).
ratio: perplexity over the same model's with plain float32 storage. Writes benchmarks/results/kv_quant.json,
with the load average before and after (this machine is shared).
"""
import argparse
import json
import os
from pathlib import Path

import torch

from attnlab import models as hf
from attnlab.bench import machine_info

RESULTS = Path(__file__).resolve().parents[1] / "results"  # benchmarks/results

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--eval-text", default="/usr/share/common-licenses/GPL-3")
parser.add_argument("--eval-tokens", type=int, default=2048)
parser.add_argument("--calibration-tokens", type=int, default=2048)
parser.add_argument("--window", type=int, default=512)
parser.add_argument("--groups", type=int, nargs="*", default=[32], help="channels per scale for the per-group rows")
parser.add_argument("--json", type=Path, default=RESULTS / "kv_quant.json")
args = parser.parse_args()

torch.set_grad_enabled(False)
load_before = os.getloadavg()
STORAGES = ["fp32", "bf16", "int8", "fp8"] + [f"{k}/g{g}" for g in args.groups for k in ("int8", "fp8")]


def measure(model, name: str, ev) -> list[dict]:
    rows = []
    for storage in STORAGES:
        hf.set_kv_dtype(model, storage)
        ppl = hf.perplexity(model, ev, window=args.window)
        rows.append({"model": name, "storage": storage, "bytes_per_token": hf.kv_bytes_per_token(model),
                     "perplexity": ppl})
        print(f"  {name:<28} {storage:<9} {rows[-1]['bytes_per_token']:>7} B/token  perplexity {ppl:.4f}", flush=True)
    hf.set_kv_dtype(model, None)
    base = rows[0]["perplexity"]
    for r in rows:
        r["ratio"] = r["perplexity"] / base
    return rows


model, tok, _ = hf.load_model("smollm2")
model.eval()
ev = hf.read_text_ids(tok, args.eval_text, args.eval_tokens)
cal = hf.read_text_ids(tok, "/usr/share/common-licenses/MPL-2.0", args.calibration_tokens)
rows = measure(model, "SmolLM2-135M GQA", ev)
hf.convert_model(model, "mla", latent_dim=132, rope_dim=60, calibration_ids=cal, pair_selection="rorope-score",
                 balance=True)
rows += measure(model, "SmolLM2-135M MLA r132+p60", ev)

print("\n| model | storage | KV bytes/token | perplexity | ratio |\n|---|---|---|---|---|")
for r in rows:
    print(f"| {r['model']} | {r['storage']} | {r['bytes_per_token']} | {r['perplexity']:.4f} | {r['ratio']:.4f} |")
result = {"eval_text": args.eval_text, "eval_tokens": int(ev.shape[1]), "window": args.window,
          "calibration_text": "/usr/share/common-licenses/MPL-2.0", "calibration_tokens": int(cal.shape[1]),
          "conversion": {"to": "mla", "latent_dim": 132, "rope_dim": 60, "pair_selection": "rorope-score",
                         "balance": True},
          "machine": machine_info(), "loadavg_before": list(load_before), "loadavg_after": list(os.getloadavg()),
          "rows": rows}
args.json.write_text(json.dumps(result, indent=2) + "\n")
print(f"wrote {args.json}")
