"""attnlab's copies of llama.cpp's cache types against llama.cpp itself: SmolLM2-135M's perplexity, CPU.

    python benchmarks/engines/llama_cpp_cache.py                       # GPL-3, 4096 tokens, windows of 512
    python benchmarks/engines/llama_cpp_cache.py --texts /usr/share/common-licenses/GPL-3,/usr/share/common-licenses/Apache-2.0
    python benchmarks/engines/llama_cpp_cache.py --weights bundled --no-rotation # the shipped Q4_1 file; rotation off too

For each cache type (K and V the same: f16, q8_0, q5_0, q4_1, q4_0, iq4_nl) and each text: the cache's bytes per
token (attnlab's allocation, all layers, scales counted; f16 counted as 2 bytes a value), attnlab's perplexity
(every attention module's kv_dtype set, the untouched model; f16 is attnlab's plain float32 cache) and llama.cpp's
through llama-cpp-python (n_ctx = the window, flash attention, the same token ids, one window per context reset),
their ratio, and the spread of the ratio from window to window (the standard deviation of the per-window log
ratio; a 4-bit cache changes perplexity by several percent from window to window depending on which values
land on which side of a code boundary, so one window agrees with llama.cpp to that spread, the mean over N
windows to about spread / sqrt(N)).

--weights f32 (the default): llama.cpp runs the bundled GGUF de-quantized to F32 by llama.cpp itself
(llama_model_quantize, ALL_F32), the weights attnlab's loader de-quantizes, so that only the cache differs;
--weights bundled: the Q4_1 file as shipped (llama.cpp then rounds each projection's input to 8 bits, about
0.5% perplexity before any cache). --no-rotation adds each quantized type with LLAMA_ATTN_ROT_DISABLE=1 on both
sides (llama.cpp reads it when a context is made, attnlab on each call). Writes benchmarks/results/llama_cpp_cache.json
with the machine and the load average before and after (this machine is shared). Needs llama-cpp-python.

tests/test_llama_cpp_cache.py imports the helpers below (f32_copy, llama_cpp_windows, attnlab_windows,
perplexity_of); the command runs only under __main__.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parents[1] / "results"  # benchmarks/results

CACHE_TYPES = ("f16", "q8_0", "q5_0", "q4_1", "q4_0", "iq4_nl")
DEFAULT_TEXTS = "/usr/share/common-licenses/GPL-3"
WINDOW = 512


def kv_dtype_of(cache_type: str) -> str | None:
    """attnlab's kv_dtype for a llama.cpp cache type: its own spelling, f16 plain (attnlab's float32 cache; f16's
    rounding of K/V is far below what a perplexity shows: 1e-4 of it on SmolLM2); "K,V" (K and V apart, two of the
    quantized types) as it is."""
    types = cache_type.split(",")
    if len(types) > 2 or any(t not in CACHE_TYPES for t in types) or (len(types) == 2 and "f16" in types):
        raise ValueError(f"cache type must be one of {', '.join(CACHE_TYPES)} or 'K,V' of two quantized ones, got "
                         f"{cache_type!r}")
    return None if cache_type == "f16" else cache_type


def f32_copy(source: Path, out: Path, threads: int = 2) -> Path:
    """The GGUF `source` with every tensor de-quantized to F32 by llama.cpp itself (llama_model_quantize, ALL_F32,
    requantizing allowed) at `out`; ValueError naming the files if llama.cpp refuses."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread, params.ftype = threads, llama_cpp.LLAMA_FTYPE_ALL_F32
    params.allow_requantize = params.pure = True
    params.output_tensor_type = params.token_embedding_type = llama_cpp.GGML_TYPE_F32
    params.quantize_output_tensor = True
    if llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params)) != 0:
        raise ValueError(f"llama.cpp could not write an F32 copy of {source} at {out}")
    return out


def llama_cpp_windows(gguf: Path, ids: torch.Tensor, cache_type: str, window: int = WINDOW,
                      threads: int = 2) -> list[tuple[float, int]]:
    """(summed next-token NLL, count) of each window of the ids (1, N) as llama.cpp scores it with K and V in
    `cache_type` ("K,V": type_k K, type_v V; a fresh context, flash attention: what a quantized V needs; the context
    is reset per window)."""
    import llama_cpp
    import numpy as np

    from attnlab.models.evaluate import next_token_nll, windows

    kv_dtype_of(cache_type)
    k, v = (getattr(llama_cpp, f"GGML_TYPE_{t.upper()}") for t in (cache_type.split(",") * 2)[:2])
    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=window, n_batch=window, n_ubatch=window, logits_all=True,
                          type_k=k, type_v=v, flash_attn=True, n_threads=threads, n_threads_batch=threads,
                          verbose=False)
    out = []
    try:
        for chunk in windows(ids, window):
            llm.reset()
            llm.eval(chunk[0].tolist())
            logits = torch.from_numpy(np.array(llm.scores[:chunk.shape[1]]))[None]  # (1, n, V)
            out.append(next_token_nll(logits, chunk))
    finally:
        llm.close()
    return out


def attnlab_windows(model, ids: torch.Tensor, cache_type: str, window: int = WINDOW) -> list[tuple[float, int]]:
    """(summed next-token NLL, count) of each window as attnlab scores it with every attention module's kv_dtype
    set to the cache type (the windows and the loss of models.perplexity, which these sum to); the model keeps
    that kv_dtype."""
    from attnlab.models.evaluate import next_token_nll, set_kv_dtype, windows

    set_kv_dtype(model, kv_dtype_of(cache_type))
    with torch.no_grad():
        return [next_token_nll(model(chunk).logits, chunk) for chunk in windows(ids, window)]


def perplexity_of(rows: list[tuple[float, int]]) -> float:
    return math.exp(sum(n for n, _ in rows) / sum(c for _, c in rows))


def spread(ours: list[tuple[float, int]], theirs: list[tuple[float, int]]) -> float | None:
    """The standard deviation of the per-window log ratio (ours over theirs), None for a single window."""
    logs = [a / c - b / d for (a, c), (b, d) in zip(ours, theirs)]
    if len(logs) < 2:
        return None
    mean = sum(logs) / len(logs)
    return math.sqrt(sum((x - mean) ** 2 for x in logs) / (len(logs) - 1))


def main(argv=None) -> None:
    import argparse
    import json
    import os
    import tempfile
    import time

    from attnlab import models as hf
    from attnlab.bench import machine_info
    from attnlab.modules.rotation import ROTATION_ENV

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", default=DEFAULT_TEXTS, help="comma-separated text files")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens of each text (from its start)")
    parser.add_argument("--window", type=int, default=WINDOW)
    parser.add_argument("--types", default=",".join(CACHE_TYPES), help="comma-separated cache types")
    parser.add_argument("--weights", choices=("f32", "bundled"), default="f32")
    parser.add_argument("--no-rotation", action="store_true", help="also each quantized type with "
                        f"{ROTATION_ENV}=1")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=RESULTS / "llama_cpp_cache.json")
    args = parser.parse_args(argv)
    types = [t.strip() for t in args.types.split(",") if t.strip()]
    for t in types:
        kv_dtype_of(t)
    texts = [t.strip() for t in args.texts.split(",") if t.strip()]

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    model, tok, _ = hf.load_model("smollm2")
    model.eval()
    runs = [(t, False) for t in types] + ([(t, True) for t in types if t != "f16"] if args.no_rotation else [])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        gguf = Path(model.attnlab_source)
        if args.weights == "f32":
            gguf = f32_copy(gguf, Path(tmp) / "smollm2-f32.gguf", args.threads)
        for text in texts:
            ids = hf.read_text_ids(tok, text, args.tokens, min_tokens=2)
            for cache_type, off in runs:
                if off:
                    os.environ[ROTATION_ENV] = "1"
                try:
                    start = time.perf_counter()
                    theirs = llama_cpp_windows(gguf, ids, cache_type, args.window, args.threads)
                    middle = time.perf_counter()
                    ours = attnlab_windows(model, ids, cache_type, args.window)
                    end = time.perf_counter()
                finally:
                    os.environ.pop(ROTATION_ENV, None)
                kv = kv_dtype_of(cache_type) or "bf16"  # f16: 2 bytes a value, as bf16
                row = {"text": text, "tokens": int(ids.shape[1]), "cache_type": cache_type, "rotation": not off,
                       "kv_bytes_per_token": hf.kv_bytes_per_token(model, kv_dtype=kv),
                       "attnlab": perplexity_of(ours), "llama_cpp": perplexity_of(theirs),
                       "windows": len(ours), "spread": spread(ours, theirs),
                       "seconds": {"llama_cpp": round(middle - start, 1), "attnlab": round(end - middle, 1)}}
                row["ratio"] = row["attnlab"] / row["llama_cpp"]
                rows.append(row)
                print(f"  {Path(text).name:<12} {cache_type:<7}{'' if row['rotation'] else ' (no rotation)':<14}"
                      f"{row['kv_bytes_per_token']:>7} B/token  attnlab {row['attnlab']:.4f}  llama.cpp "
                      f"{row['llama_cpp']:.4f}  ratio {row['ratio']:.4f}", flush=True)
        hf.set_kv_dtype(model, None)

    print("\n| text | cache type | KV bytes/token | attnlab | llama.cpp | ratio | spread per window |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        name = r["cache_type"] + ("" if r["rotation"] else f" ({ROTATION_ENV}=1)")
        sd = "" if r["spread"] is None else f"{r['spread']:.4f}"
        print(f"| {Path(r['text']).name} | {name} | {r['kv_bytes_per_token']} | {r['attnlab']:.4f} | "
              f"{r['llama_cpp']:.4f} | {r['ratio']:.4f} | {sd} |")
    import llama_cpp

    result = {"texts": texts, "tokens": args.tokens, "window": args.window, "weights": args.weights,
              "llama_cpp_python": llama_cpp.__version__, "threads": args.threads, "machine": machine_info(),
              "loadavg_before": list(load_before), "loadavg_after": list(os.getloadavg()), "rows": rows}
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
