"""attnlab.hf.KVCache in transformers itself: quality, bytes held, decode speed and peak memory, beside transformers'
DynamicCache and QuantizedCache. Run alone (nothing else on the machine); each part prints a table and merges its
rows, with their provenance, into benchmarks/results/hf_kvcache.json.

    python benchmarks/quality/hf_kvcache.py quality  # perplexity / the original's, 4 report texts, windows of 512
    python benchmarks/quality/hf_kvcache.py bytes    # bytes every tensor holds after 8,192 tokens
    python benchmarks/quality/hf_kvcache.py speed    # decode tokens/s at 4,096 tokens, the caches taking turns
    python benchmarks/quality/hf_kvcache.py memory   # peak memory: a 16,384-token prompt (and a 64-token one), 256
                                                     # tokens, a process each (the long one 3 times: the median)

quality: each text's first 2,048 tokens in windows of 512, fed in chunks of 128 through the cache as decoding reads
it (QuantizedCache attends its first chunk plain and keeps its newest <= 128 tokens plain, as it does in generate);
bytes per token are those every tensor of the cache holds at the end of a window, over the window's 512 tokens.
No storage here is fitted to anything, so the four report texts choose nothing.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

BENCHMARKS = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCHMARKS))  # provenance.py and texts.py, beside the benchmark folders
from provenance import finish, provenance  # noqa: E402
from texts import REPORT_TEXTS, checked  # noqa: E402

JSON = BENCHMARKS / "results" / "hf_kvcache.json"
STORAGES = {"smollm2": ("q8_0", "q8_0,q4_0", "int4/g32", "q4_0", "iq4_nl", "int4/g64", "int3/g64", "int2/g32"),
            "gemma3-270m": ("q8_0", "int4/g32", "q4_0", "int3/g64", "int2/g32")}
# backend, bits, axis (each backend's documented axis); hqq's 3 bits fail in hqq 0.2.8 on a CPU (its dequantize
# meets a packed tensor of size 0), so they are left out
QUANTIZED = {"quanto4": ("quanto", 4, 0), "quanto2": ("quanto", 2, 0), "hqq8": ("hqq", 8, 1), "hqq4": ("hqq", 4, 1),
             "hqq2": ("hqq", 2, 1)}
TOKENS, WINDOW, CHUNK = 2048, 512, 128


def load(name: str):
    from attnlab.models import bundled

    loader = {"smollm2": bundled.load_smollm2, "gemma3-270m": bundled.load_gemma3_270m}[name]
    model, tok = loader()
    return model.eval(), tok


def make_cache(model, kind: str):
    """A fresh cache of this kind: "dynamic", a QUANTIZED name, or an attnlab storage spelling."""
    from transformers import DynamicCache, QuantizedCache

    from attnlab.hf import KVCache

    if kind == "dynamic":
        return DynamicCache(config=model.config)
    if kind in QUANTIZED:
        backend, bits, axis = QUANTIZED[kind]
        return QuantizedCache(backend, model.config, nbits=bits, axis_key=axis, axis_value=axis)
    return KVCache(model, kind)


def tensors_of(obj, seen=None) -> dict[int, int]:
    """{storage address: bytes} of every tensor reachable from obj (attributes, containers, a tensor subclass's inner
    tensors), each storage once."""
    seen = set() if seen is None else seen
    found, todo = {}, [obj]
    while todo:
        x = todo.pop()
        if x is None or isinstance(x, (str, bytes, int, float, bool, type, torch.dtype, torch.device)) or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            if hasattr(x, "__tensor_flatten__"):
                names, _ = x.__tensor_flatten__()
                todo += [getattr(x, n) for n in names]
            elif x.device.type != "meta":
                found[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
            continue
        if isinstance(x, dict):
            todo += list(x.values())
        elif isinstance(x, (list, tuple, set)):
            todo += list(x)
        elif hasattr(x, "__dict__"):
            todo += [v for k, v in vars(x).items() if k not in ("_owner", "optimizer", "quantizer")]
    return found


def held_bytes(cache) -> int:
    return sum(tensors_of(cache).values())


def score(model, ids: torch.Tensor, kind: str) -> tuple[float, int, float]:
    """(summed NLL, predictions, bytes per token held at each window's end, mean) over windows of WINDOW."""
    nll, count, held = 0.0, 0, []
    with torch.no_grad():
        for w in ids[:, :ids.shape[1] // WINDOW * WINDOW].split(WINDOW, dim=1):
            cache = make_cache(model, kind)
            for s in range(0, WINDOW - 1, CHUNK):
                chunk = w[:, s:min(s + CHUNK, WINDOW - 1)]
                logits = model(chunk, cache=cache, use_cache=True).logits[0].double()
                targets = w[0, s + 1:s + 1 + chunk.shape[1]]
                nll += float(torch.nn.functional.cross_entropy(logits, targets, reduction="sum"))
                count += targets.numel()
            held.append(held_bytes(cache) / (WINDOW - 1))
    return nll, count, statistics.mean(held)


def quality(models: list[str], caches: list[str] | None = None) -> list[dict]:
    from attnlab.models.evaluate import read_text_ids

    rows = []
    for name in models:
        model, tok = load(name)
        texts = {t: read_text_ids(tok, checked(text), TOKENS) for t, text in REPORT_TEXTS.items()}
        kinds = ["dynamic", *(caches or [*STORAGES[name], *(QUANTIZED if name == "smollm2" else ())])]
        base = {}
        for kind in kinds:
            for text, ids in texts.items():
                nll, n, held = score(model, ids, kind)
                ppl = math.exp(nll / n)
                base.setdefault(text, ppl)
                rows.append({"model": name, "cache": kind, "text": text, "perplexity": ppl,
                             "ratio": ppl / base[text], "bytes_per_token": held})
                print(f"{name:12} {kind:10} {text:12} ppl {ppl:8.4f}  x{ppl / base[text]:.4f}  "
                      f"{held:8.0f} B/token", flush=True)
    return rows


def bytes_held(models: list[str], tokens: int = 8192) -> list[dict]:
    """Every kind's tensors after `tokens` tokens of random keys and values (the bytes do not depend on them), in the
    activations' 16 bits (bf16), against DynamicCache's."""
    from attnlab.hf.shapes import layer_shapes, text_config

    rows = []
    for name in models:
        model, _ = load(name)
        shapes = layer_shapes(text_config(model))
        kinds = ["dynamic", *STORAGES[name], *(QUANTIZED if name == "smollm2" else ())]
        for kind in kinds:
            cache = make_cache(model, kind)
            g = torch.Generator().manual_seed(0)
            for start in range(0, tokens, 512):
                for i, s in enumerate(shapes):
                    k = torch.randn(1, s.num_kv_heads, 512, s.head_dim, generator=g).to(torch.bfloat16)
                    cache.update(k, k.clone(), i)
            held = held_bytes(cache)
            rows.append({"model": name, "cache": kind, "tokens": tokens, "bytes": held})
        dyn = rows[-len(kinds)]["bytes"]
        for r in rows[-len(kinds):]:
            r["of_dynamic"] = r["bytes"] / dyn
            print(f"{name:12} {r['cache']:10} {r['bytes'] / 2**20:9.1f} MiB  {r['of_dynamic']:.1%} of DynamicCache's")
    return rows


def speed(context: int = 4096, steps: int = 16, reps: int = 3) -> list[dict]:
    """Decode steps at `context` tokens: the prompt's keys and values handed to each kind of cache, then `steps`
    one-token forwards timed; kinds alternate, reps times; the median step."""
    model, tok = load("smollm2")
    kinds = ["dynamic", "q4_0", "int4/g32", "int3/g64", "q8_0", "int4/g32+c4+w16", "quanto4"]
    ids = torch.randint(100, 40000, (1, context + steps), generator=torch.Generator().manual_seed(0))
    prompt = make_cache(model, "dynamic")
    with torch.no_grad():
        for s in range(0, context, 512):
            model(ids[:, s:s + 512], cache=prompt, use_cache=True)
    times = {k: [] for k in kinds}
    for _ in range(reps):
        for kind in kinds:
            cache = make_cache(model, kind)
            for i, layer in enumerate(prompt.layers):
                cache.update(layer.keys, layer.values, i)
            with torch.no_grad():
                t0 = time.perf_counter()
                for j in range(steps):
                    model(ids[:, context + j:context + j + 1], cache=cache, use_cache=True)
                times[kind].append((time.perf_counter() - t0) / steps)
    base = statistics.median(times["dynamic"])
    rows = []
    for kind in kinds:
        step = statistics.median(times[kind])
        rows.append({"model": "smollm2", "cache": kind, "context": context, "step_s": step, "tokens_per_s": 1 / step,
                     "of_dynamic": base / step})
        print(f"smollm2 {kind:10} {1 / step:7.1f} tokens/s  {base / step:.2f}x DynamicCache's", flush=True)
    return rows


def memory_child(kind: str, prompt_len: int, new: int) -> dict:
    """One process: the prompt fed in chunks of 1,024, then `new` greedy tokens; peak resident memory (ru_maxrss)."""
    import resource

    model, _ = load("smollm2")
    rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # noqa: E731 (Linux: KiB)
    loaded = rss()
    cache = make_cache(model, kind)
    ids = torch.randint(100, 40000, (1, prompt_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for s in range(0, prompt_len, 1024):
            logits = model(ids[:, s:s + 1024], cache=cache, use_cache=True, logits_to_keep=1).logits
        for _ in range(new):
            nxt = logits[:, -1:].argmax(-1)
            logits = model(nxt, cache=cache, use_cache=True).logits
    return {"cache": kind, "prompt": prompt_len, "new": new, "rss_loaded": loaded, "rss_peak": rss(),
            "cache_bytes": held_bytes(cache)}


SHORT = 64  # a prompt this short grows no cache to speak of: its peak is the forward's own (weights, workspaces)


def _child(kind: str, prompt_len: int, new: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "memory-child", "--cache", kind, "--prompt", str(prompt_len),
                          "--new", str(new)], capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"memory-child {kind} failed: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def memory(prompt_len: int = 16384, new: int = 256, repeats: int = 3) -> list[dict]:
    """Peak resident memory of fresh processes per cache: the long prompt's (the median of `repeats` runs: the
    allocator keeps freed blocks as it happens to), and a SHORT prompt's, whose difference is what the prompt's
    length made the process hold (the cache and the attention's working rows)."""
    rows = []
    for kind in ("dynamic", "q4_0", "int3/g64", "int4/g32+c4+w16"):
        runs = sorted((_child(kind, prompt_len, new) for _ in range(repeats)), key=lambda r: r["rss_peak"])
        row = {**runs[len(runs) // 2], "rss_peaks": [r["rss_peak"] for r in runs]}
        rows.append({"model": "smollm2", **row, "rss_peak_short": _child(kind, SHORT, new)["rss_peak"]})
    dyn = rows[0]
    for r in rows:
        r["peak_over_loaded_of_dynamic"] = (r["rss_peak"] - r["rss_loaded"]) / (dyn["rss_peak"] - dyn["rss_loaded"])
        r["grown_of_dynamic"] = (r["rss_peak"] - r["rss_peak_short"]) / (dyn["rss_peak"] - dyn["rss_peak_short"])
        r["cache_of_dynamic"] = r["cache_bytes"] / dyn["cache_bytes"]
        print(f"smollm2 {r['cache']:16} peak {r['rss_peak'] / 2**30:5.2f} GiB, "
              f"+{(r['rss_peak'] - r['rss_loaded']) / 2**30:5.2f} over the loaded model ({r['peak_over_loaded_of_dynamic']:.0%} of DynamicCache's), "
              f"+{(r['rss_peak'] - r['rss_peak_short']) / 2**30:5.2f} over a {SHORT}-token prompt's "
              f"({r['grown_of_dynamic']:.0%}); cache {r['cache_bytes'] / 2**20:7.1f} MiB ({r['cache_of_dynamic']:.0%})",
              flush=True)
    return rows


def table() -> str:
    """Markdown tables of the rows in JSON: quality (median and worst over the texts, bytes per token over the float32
    DynamicCache's), bytes, speed, memory."""
    data = json.loads(JSON.read_text())
    out = []
    rows = list(data.get("quality", {}).get("rows", {}).values())
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        texts = list(dict.fromkeys(r["text"] for r in mine))
        base = {r["text"]: r["bytes_per_token"] for r in mine if r["cache"] == "dynamic"}
        out += [f"| {model}: cache | bytes/token at 511 tokens (of float32 DynamicCache's) | "
                + " | ".join(texts) + " | median | worst |", "|---" * (len(texts) + 4) + "|"]
        caches = sorted({r["cache"] for r in mine if r["cache"] != "dynamic"},
                        key=lambda c: -next(r["bytes_per_token"] for r in mine if r["cache"] == c))
        for c in caches:
            by = {r["text"]: r for r in mine if r["cache"] == c}
            ratios = [by[t]["ratio"] for t in texts]
            held = statistics.mean(by[t]["bytes_per_token"] / base[t] for t in texts)
            kind = f"QuantizedCache {c}" if c in QUANTIZED else f"KVCache {c}"
            out.append(f"| {kind} | {statistics.mean(by[t]['bytes_per_token'] for t in texts):,.0f} ({held:.1%}) | "
                       + " | ".join(f"{x:.3f}x" for x in ratios)
                       + f" | {statistics.median(ratios):.3f}x | {max(ratios):.3f}x |")
        out.append("")
    for part, head in (("bytes", "| model | cache | bytes after 8,192 tokens (bf16 rows) | of DynamicCache's |"),
                       ("speed", "| model | cache | decode tokens/s at 4,096 tokens | of DynamicCache's |"),
                       ("memory", "| model | cache | peak RSS | above the loaded model | of DynamicCache's | above a "
                                  f"{SHORT}-token prompt's peak | of DynamicCache's | cache |")):
        prows = list(data.get(part, {}).get("rows", {}).values())
        if not prows:
            continue
        out += [head, "|---" * head.count("|") + "|"[:0]]
        out[-1] = "|---" * (head.count("|") - 1) + "|"
        for r in prows:
            if part == "bytes":
                out.append(f"| {r['model']} | {r['cache']} | {r['bytes'] / 2**20:.1f} MiB | {r['of_dynamic']:.1%} |")
            elif part == "speed":
                out.append(f"| {r['model']} | {r['cache']} | {r['tokens_per_s']:.1f} | {r['of_dynamic']:.2f}x |")
            else:
                grown = "n/a | n/a" if "rss_peak_short" not in r else \
                    f"{(r['rss_peak'] - r['rss_peak_short']) / 2**30:.2f} GiB | {r['grown_of_dynamic']:.0%}"
                if len(r.get("rss_peaks", [])) > 1:  # the median run of several, and their range
                    grown += f" ({min(r['rss_peaks']) / 2**30:.2f}-{max(r['rss_peaks']) / 2**30:.2f} GiB peaks)"
                out.append(f"| {r['model']} | {r['cache']} | {r['rss_peak'] / 2**30:.2f} GiB | "
                           f"{(r['rss_peak'] - r['rss_loaded']) / 2**30:.2f} GiB | "
                           f"{r['peak_over_loaded_of_dynamic']:.0%} | {grown} | {r['cache_bytes'] / 2**20:.0f} MiB "
                           f"({r['cache_of_dynamic']:.0%}) |")
        out.append("")
    return "\n".join(out)


KEYS = {"quality": ("model", "cache", "text"), "bytes": ("model", "cache"), "speed": ("model", "cache"),
        "memory": ("model", "cache")}


def save(part: str, rows: list[dict], prov: dict) -> None:
    """Merge this run's rows into JSON by key (a row measured again replaced, the others kept), each naming its run's
    provenance; written whole."""
    data = json.loads(JSON.read_text()) if JSON.exists() else {}
    section = data.setdefault(part, {"runs": [], "rows": {}})
    section["runs"].append(finish(prov))
    for row in rows:
        section["rows"]["/".join(str(row[k]) for k in KEYS[part])] = {**row, "run": len(section["runs"]) - 1}
    tmp = JSON.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(JSON)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("part", choices=("quality", "bytes", "speed", "memory", "memory-child", "table"))
    p.add_argument("--models", default="smollm2,gemma3-270m")
    p.add_argument("--caches", default=None, help="quality: only these kinds (comma-separated) beside DynamicCache")
    p.add_argument("--cache", default="dynamic")
    p.add_argument("--prompt", type=int, default=16384)
    p.add_argument("--new", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3, help="memory: runs of the long prompt per cache (the median)")
    p.add_argument("--allow-dirty", action="store_true", help="a trial on uncommitted code (recorded as dirty)")
    args = p.parse_args(argv)
    if args.part == "table":
        print(table())
        return
    if args.part == "memory-child":
        print(json.dumps(memory_child(args.cache, args.prompt, args.new)))
        return
    prov = provenance(["python", "benchmarks/quality/hf_kvcache.py", *(argv or sys.argv[1:])], args.allow_dirty,
                      (str(JSON.relative_to(BENCHMARKS.parent)),))
    models = args.models.split(",")
    caches = args.caches.split(",") if args.caches else None
    rows = {"quality": lambda: quality(models, caches), "bytes": lambda: bytes_held(models), "speed": speed,
            "memory": lambda: memory(args.prompt, args.new, args.repeats)}[args.part]()
    save(args.part, rows, prov)


if __name__ == "__main__":
    main()
