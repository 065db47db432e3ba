"""Transform coding of the latent (issue `eighth`, part 1) against the uniform latent the planner picks at 12.5%,
before any heal: SmolLM2-135M, every layer converted, the same bytes.

    python benchmarks/quality/transform_code.py     # prints a table, writes benchmarks/results/transform_code.json
    python benchmarks/quality/transform_code.py --variants uniform+refit   # some variants again (rows merged by key)

Variants (each with rotation seeds 0, 1, 2; 2,880 bytes/token is 12.5% of the original's 23,040):
- `uniform`: the planner's 12.5% plan (docs/decisions.md): latent 112 and rope key 76 (RoRoPE by frequency, BKV),
  the latent rotated by a seeded random orthogonal matrix and stored in 3 bits (int3/g64+c4: groups of 64 channels,
  the rope key in 4 bits per channel over 64 tokens);
- `tc-latent`, `tc-kv`: the same conversion with every value the row can hold in its latent (308 + 76), then
  convert/transform_code.py per layer at 96 bytes a token: the latent's principal components on the calibration text
  (metric latent, or the keys' and values' error: kv), bits by variance (2-8, 0 = cut, groups of 64), each run of
  equal bits mixed by an orthogonal matrix (the seed), the rope key as above;
- `tc-latent-n0.1`: as tc-latent with quantisation noise counted at a tenth of a cut's error (noise averages over
  the tokens a head reads, a cut does not), which keeps more components;
- `uniform+refit`: the uniform plan, then each layer's up-projections refitted in closed form against its 3-bit
  latent on the calibration text (convert/refit.py, issue `eighth` part 4); `uniform+refit-v` the values' alone;
- `per-layer`: each layer its own latent size and bits (PER_LAYER: 48 to 232 values in 3 bits, or 144 in 4), chosen
  by shrink/per_layer.py to minimise the summed KL to the original of each layer changed alone (measured on the first
  1,024 tokens of GPL-2, rotation seed 0) within the same 2,880 bytes (issue `eighth` part 2); `per-layer-judge` the
  same with the costs measured on the heal's judge texts instead (heal.data.judge_texts: everyday sentences and
  Python source, 512 tokens of each), two kinds the shrink itself judges on; `per-layer-judge-3` with three options
  only (latent 80, 112, 160 in 3 bits: half the single-layer conversions, what a planner's time allows).
Calibration: the first 2,048 tokens of Apache-2.0 (not a protocol text). Scored on the protocol's four texts
(benchmarks/quality/protocol.py; first 2,048 tokens, windows of 512), perplexity over the original's. No training: this
measures the coding alone. Run it alone (the load average before and after is recorded).
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # protocol.py beside it

from protocol import REPORT_TEXTS, TOKENS, WINDOW, load, text_ids  # noqa: E402

CALIBRATION = "/usr/share/common-licenses/Apache-2.0"
BUDGET, ROPE, LATENT, SEEDS = 2880, 76, 112, (0, 1, 2)
VARIANTS = {"uniform": None, "tc-latent": dict(metric="latent"), "tc-kv": dict(metric="kv"),
            "tc-latent-n0.1": dict(metric="latent", noise_weight=0.1), "uniform+refit": None, "uniform+refit-v": None,
            "per-layer": None, "per-layer-judge": None, "per-layer-judge-3": None}
PER_LAYER = ((48, "int3/g64+c4"), (80, "int3/g64+c4"), (112, "int3/g64+c4"), (160, "int3/g64+c4"),
             (144, "int4/g64+c4"), (232, "int3/g64+c4"))  # (latent, storage) options a layer may take
PROXY = "/usr/share/common-licenses/GPL-2"  # the per-layer costs' windows: neither calibration nor a protocol text


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of " + ", ".join(VARIANTS))
    asked = parser.parse_args().variants.split(",")
    unknown = [v for v in asked if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}: choose from {', '.join(VARIANTS)}")
    from attnlab import models as hf
    from attnlab.convert.refit import refit_up
    from attnlab.convert.rotate import rotate_latent
    from attnlab.convert.transform_code import transform_code
    from attnlab.models.adapters import attnlab_modules, replace_attention
    from attnlab.models.evaluate import attention_inputs, kv_bytes_per_token, perplexity
    from attnlab.shrink.plan import Candidate, apply
    from attnlab.shrink.per_layer import choose_per_layer
    from attnlab.shrink.plan import proxy_kl, teacher_log_probs
    from attnlab.shrink.sizes import layer_bytes
    from attnlab.models.convert import convert_model

    def convert_layer(layer: int, latent: int, storage: str, seed: int) -> None:
        convert_model(teacher, "mla", latent_dim=latent, rope_dim=ROPE, calibration_ids=cal, pair_selection="rorope",
                      balance=True, inputs=inputs, layers=[layer])
        m = attnlab_modules(teacher)[layer]
        rotate_latent(m, "random", seed=seed)
        m.kv_dtype = storage

    def restore() -> None:
        replace_attention(teacher, originals)
        for m in originals:
            m.kv_dtype = None

    import torch

    path = HERE.parent / "results" / "transform_code.json"
    before = json.loads(path.read_text()) if path.exists() else {"runs": {}}  # earlier variants' rows are kept
    out = {**before, "load_before": load(), "budget_bytes": BUDGET, "calibration": CALIBRATION, "tokens": TOKENS,
           "window": WINDOW}
    teacher, tok, _ = hf.load_model("smollm2")
    cal = hf.read_text_ids(tok, CALIBRATION, 2048)
    texts = {name: text_ids(tok, name, TOKENS) for name in REPORT_TEXTS}
    base = {name: perplexity(teacher, ids, window=WINDOW) for name, ids in texts.items()}
    inputs = attention_inputs(teacher, cal)
    originals = list(attnlab_modules(teacher))
    L = len(originals)
    picks = {}
    for variant in [v for v in asked if v.startswith("per-layer")]:  # each layer alone in each option: its KL
        options = PER_LAYER[1:4] if variant.endswith("-3") else PER_LAYER
        if variant == "per-layer":
            windows = hf.read_text_ids(tok, PROXY, 1024)[0].reshape(-1, WINDOW)
        else:
            from attnlab.heal.data import judge_texts
            windows = torch.cat([t[:, :WINDOW] for t in judge_texts(tok, WINDOW)])
        reference = teacher_log_probs(teacher, windows)
        costs, sizes, t0 = [], [], time.monotonic()
        for layer in range(L):
            row = []
            for latent, storage in options:
                convert_layer(layer, latent, storage, 0)
                row.append(proxy_kl(teacher, windows, reference))
                restore()
            costs.append(row)
            sizes.append([layer_bytes(latent, ROPE, storage) for latent, storage in options])
            print(f"layer {layer}: " + " ".join(f"{c:.4f}" for c in row), flush=True)
        picks[variant] = [PER_LAYER.index(options[o]) for o in choose_per_layer(costs, sizes, BUDGET)]
        out[variant] = {"options": options, "costs": costs, "picks": picks[variant], "seconds": time.monotonic() - t0}
    for variant in asked:
        options = VARIANTS[variant]
        for seed in SEEDS:
            t0 = time.monotonic()
            if variant in picks:  # each layer converted alone (convert_model takes a model not yet converted)
                chosen = []
                for layer, o in enumerate(picks[variant]):
                    convert_layer(layer, *PER_LAYER[o], seed)
                    chosen.append(attnlab_modules(teacher)[layer])
                    restore()
                replace_attention(teacher, chosen)
                storages = [f"{PER_LAYER[o][0]} {PER_LAYER[o][1]}" for o in picks[variant]]
            elif options is None:
                apply(teacher, Candidate(LATENT, ROPE, "rorope", True, "int3/g64+c4", False), cal, inputs=inputs)
                for m, x in zip(attnlab_modules(teacher), inputs):
                    rotate_latent(m, "random", seed=seed)
                    if variant.startswith("uniform+refit"):
                        refit_up(m, x, "v" if variant.endswith("-v") else "kv")
                storages = ["int3/g64+c4"]
            else:
                apply(teacher, Candidate(2 * 3 * 64 - ROPE, ROPE, "rorope", True, "bf16", False), cal, inputs=inputs)
                coded = [transform_code(m, x, BUDGET / L, group=64, seed=seed, **options)[0]
                         for m, x in zip(attnlab_modules(teacher), inputs)]
                replace_attention(teacher, coded)
                storages = [m.kv_dtype for m in coded]
            row = {"variant": variant, "seed": seed, "kv_bytes_per_token": kv_bytes_per_token(teacher),
                   "latent_dims": [m.latent_dim for m in attnlab_modules(teacher)], "storages": storages,
                   "ratio": {name: perplexity(teacher, ids, window=WINDOW) / base[name] for name, ids in
                             texts.items()}}
            row["seconds"] = time.monotonic() - t0
            out["runs"][f"{variant}/seed{seed}"] = row
            print(f"{variant:<15} seed {seed}  {row['kv_bytes_per_token']} B  " +
                  "  ".join(f"{k} {v:.3f}" for k, v in row["ratio"].items()), flush=True)
            restore()
    out["load_after"] = load()
    out["table"] = table(out["runs"])
    path.write_text(json.dumps(out, indent=1))
    print(f"load {out['load_before']:.2f} -> {out['load_after']:.2f}")


def table(runs: dict) -> list[dict]:
    """Per variant: the median over seeds on each text, the median text and the worst text of those medians, and the
    seeds' spread (the largest max - min over seeds on one text)."""
    rows = []
    print("| variant | " + " | ".join(REPORT_TEXTS) + " | median | worst | seeds' spread |")
    print("|---" * (len(REPORT_TEXTS) + 4) + "|")
    for variant in VARIANTS:
        runs_v = [r for r in runs.values() if r["variant"] == variant]
        if not runs_v:
            continue
        per_text = {t: statistics.median(r["ratio"][t] for r in runs_v) for t in REPORT_TEXTS}
        spread = max(max(r["ratio"][t] for r in runs_v) - min(r["ratio"][t] for r in runs_v) for t in REPORT_TEXTS)
        worst = max(per_text, key=per_text.get)
        row = {"variant": variant, "per_text": per_text, "median": statistics.median(per_text.values()),
               "worst": per_text[worst], "worst_text": worst, "spread": spread}
        rows.append(row)
        print(f"| {variant} | " + " | ".join(f"{v:.3f}x" for v in per_text.values()) +
              f" | {row['median']:.3f}x | {row['worst']:.3f}x ({worst}) | {spread:.3f} |")
    return rows


if __name__ == "__main__":
    main()
