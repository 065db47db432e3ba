"""Perplexity in plain transformers, through its own QuantizedCache, of a model folder or GGUF: no attnlab import.

    python benchmarks/hf_cache_ppl.py --model OUT --ids ids.json --json s.json --cache '{"backend":"quanto","nbits":4}'
    python benchmarks/hf_cache_ppl.py --model DIR --gguf-file F.gguf --ids ids.json --json scores.json   # no cache

ids.json: {text name: [token ids]}, scored in windows of --window tokens. With --cache, each window is decoded
token by token through a fresh QuantizedCache built from that cache_config (what generate() builds for
cache_implementation "quantized"), every token's next-token loss taken from that step's logits: the first token is
the cache's prefill, and from then on each step reads the older tokens as the cache stores them (quantized beyond
its residual window). Without --cache, one forward over each window with no cache (the reference). Writes
{"perplexity": {text: value}, "nll": {text: [sum, count]}, "attnlab_imported": bool, ...}. benchmarks/engines.py
runs it in its own process so that nothing of attnlab is loaded.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch


def load(model: str, gguf_file: str | None):
    from transformers import AutoModelForCausalLM

    kw = {"gguf_file": gguf_file} if gguf_file else {}
    return AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, **kw).eval()


def window_nll(model, ids: torch.Tensor, cache: dict | None) -> tuple[float, int]:
    """(summed next-token NLL, count) over ids (1, W), float64 sums."""
    targets = ids[0, 1:]
    if cache is None:
        logits = model(ids, use_cache=False).logits[0, :-1]
        return float(torch.nn.functional.cross_entropy(logits.double(), targets, reduction="sum")), targets.numel()
    from transformers import QuantizedCache

    config = dict(cache)
    past = QuantizedCache(backend=config.pop("backend"), config=model.config, **config)
    total = 0.0
    for t in range(ids.shape[1] - 1):
        logits = model(ids[:, t:t + 1], past_key_values=past, use_cache=True).logits[0, -1]
        total += float(torch.nn.functional.cross_entropy(logits.double()[None], targets[t:t + 1], reduction="sum"))
    return total, targets.numel()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--gguf-file", default=None)
    p.add_argument("--ids", required=True)
    p.add_argument("--json", required=True)
    p.add_argument("--cache", default=None, help="QuantizedCache's cache_config as JSON (backend, nbits, ...)")
    p.add_argument("--window", type=int, default=512)
    args = p.parse_args()
    cache = json.loads(args.cache) if args.cache else None
    texts = json.loads(open(args.ids).read())
    model = load(args.model, args.gguf_file)
    out = {"model": args.model, "gguf_file": args.gguf_file, "cache": cache, "window": args.window, "nll": {},
           "perplexity": {}}
    t0 = time.monotonic()
    with torch.no_grad():
        for name, ids in texts.items():
            ids = torch.tensor(ids)[None]
            s, n = 0.0, 0
            for start in range(0, ids.shape[1] - 1, args.window):
                a, b = window_nll(model, ids[:, start:start + args.window], cache)
                s, n = s + a, n + b
            out["nll"][name], out["perplexity"][name] = [s, n], math.exp(s / n)
            print(f"  {name:<12} {out['perplexity'][name]:.4f}", flush=True)
    out["seconds"] = time.monotonic() - t0
    out["attnlab_imported"] = any(m == "attnlab" or m.startswith("attnlab.") for m in sys.modules)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
