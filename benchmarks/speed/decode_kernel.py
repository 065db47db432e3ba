"""Triton absorbed-MLA decode kernel vs the PyTorch absorbed path vs SDPA: bandwidth over the latent cache.

    python benchmarks/speed/decode_kernel.py --device cuda                 # B 1 and 16, contexts 4k-32k, bf16
    python benchmarks/speed/decode_kernel.py --device cuda --sweep-splits  # also B=1 at fixed split counts
    python benchmarks/speed/decode_kernel.py --interpret                   # CPU smoke run in triton's interpreter

One decode step of one layer: q (B, H, r+p) already absorbed, a latent cache
(B, S, r+p) = [c, k_rope]. Three ways, timed in the same process:
- kernel: attnlab.kernels.absorbed_decode (one pass, split along S, heads folded);
- torch:  the module's existing absorbed path, attnlab.modules.attention.attend with one
  latent "KV head" (two matrix products and a float32 softmax);
- sdpa:   torch's scaled_dot_product_attention(enable_gqa=True) on the same views.
GB/s = bytes of cache read (B*S*(r+p)*element size) / median time; "of peak" divides
by the bandwidth of a large device-to-device copy ((read + write) / time) measured
in the same run. Several cache copies are cycled so that a step cannot be served
from the L2 cache. On CUDA the kernel is also timed replayed from a CUDA graph ("graph"
columns), which removes the Python and launch overhead as a captured decode step does. Prints a table and writes JSON (--json, default
benchmarks/results/decode_kernel.json on CUDA, nothing for --interpret unless given).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from pathlib import Path


RESULTS = Path(__file__).resolve().parents[1] / "results"  # benchmarks/results

def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--interpret", action="store_true", help="tiny CPU smoke run in triton's interpreter")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    p.add_argument("--heads", type=int, default=16, help="query heads H (DeepSeek-V2-Lite: 16)")
    p.add_argument("--latent-dim", type=int, default=512)
    p.add_argument("--rope-dim", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--reps", type=int, default=20, help="timed repetitions (median reported)")
    p.add_argument("--sweep-splits", action="store_true", help="also time B=1 at fixed split counts")
    p.add_argument("--json", default=None, help="where to write the results")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    if args.interpret:  # triton reads this once, when it is imported: before anything imports it
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.interpret:
        device = "cpu"
        args.batches, args.contexts, args.heads = [1, 2], [100, 300], 4
        args.latent_dim, args.rope_dim, args.reps, args.dtype = 32, 16, 2, "float32"
    elif device != "cuda" or not torch.cuda.is_available():
        print("benchmarks/speed/decode_kernel.py needs a CUDA device (this machine has none): the Triton kernel is "
              "compiled for GPUs. Run `python benchmarks/speed/decode_kernel.py --interpret` for a CPU smoke run in "
              "triton's interpreter.")
        return 0
    result = run(args, device)
    print_table(result)
    target = args.json or (None if args.interpret else str(RESULTS / "decode_kernel.json"))
    if target:
        write_json(Path(target), result)
        print(f"wrote {target}")
    return 0


def run(args, device) -> dict:
    import torch
    import torch.nn.functional as F

    from attnlab.modules.attention import attend
    from attnlab.bench import machine_info
    from attnlab.kernels import absorbed_decode
    from attnlab.kernels.mla_decode import plan

    dtype = getattr(torch, args.dtype)
    H, r, p = args.heads, args.latent_dim, args.rope_dim
    width = r + p
    scale = (128 + p) ** -0.5  # DeepSeek's qk head (128 + 64); any number does
    timer = Timer(device)
    peak = timer.copy_bandwidth(2048 if device == "cuda" else 256)
    rows = []
    l2 = 256 * 2 ** 20 if device == "cuda" else 0  # cycle cache copies beyond any L2
    total = len(args.batches) * len(args.contexts)
    for i, (B, S) in enumerate((b, s) for b in args.batches for s in args.contexts):
        print(f"[{i + 1}/{total}] B={B} S={S}", file=sys.stderr, flush=True)
        cache_bytes = B * S * width * torch.tensor([], dtype=dtype).element_size()
        copies = max(1, min(8, math.ceil(l2 / cache_bytes)))
        g = torch.Generator(device=device).manual_seed(0)
        kvs = [torch.randn(B, S, width, device=device, dtype=dtype, generator=g) for _ in range(copies)]
        q = torch.randn(B, H, width, device=device, dtype=dtype, generator=g)  # (B, H, r+p)
        q4 = q[:, :, None]  # (B, H, 1, r+p)

        def cycled(fn):
            state = {"i": 0}

            def step():
                state["i"] = (state["i"] + 1) % copies
                return fn(kvs[state["i"]])
            return step

        ways = {
            "kernel": lambda kv: absorbed_decode(q, kv, S, scale, r),
            "torch": lambda kv: attend(q4, kv[:, None], kv[:, None, :, :r], scale=scale),
            "sdpa": lambda kv: F.scaled_dot_product_attention(q4, kv[:, None], kv[:, None, :, :r], scale=scale,
                                                              enable_gqa=True),
        }
        row = {"batch": B, "context": S, "heads": H, "latent_dim": r, "rope_dim": p, "dtype": args.dtype,
               "cache_bytes": cache_bytes, "splits": plan(B, H, S, r, kvs[0].device,
                                                           row_bytes=width * kvs[0].element_size())["num_splits"]}
        with torch.no_grad():
            ref = ways["torch"](kvs[0])[:, :, 0].double()
            row["kernel_rel_err_vs_torch"] = float((ways["kernel"](kvs[0]).double() - ref).norm() / ref.norm())
            for name, fn in ways.items():
                try:
                    t = timer.median(cycled(fn), args.reps)
                except RuntimeError as e:  # an SDPA backend refusing these head sizes, out of memory
                    print(f"  {name}: {str(e).splitlines()[0]}", file=sys.stderr)
                    t = float("nan")
                row[f"{name}_us"] = t * 1e6
                row[f"{name}_gbs"] = cache_bytes / t / 1e9
                row[f"{name}_of_peak"] = cache_bytes / t / peak
            if device == "cuda":  # launch overhead removed: what a captured decode step sees
                try:
                    t = timer.graph_median(cycled(ways["kernel"]), args.reps)
                except RuntimeError as e:
                    print(f"  kernel in a CUDA graph: {str(e).splitlines()[0]}", file=sys.stderr)
                    t = float("nan")
            else:
                t = float("nan")
            row["kernel_graph_us"] = t * 1e6
            row["kernel_graph_gbs"] = cache_bytes / t / 1e9
            row["kernel_graph_of_peak"] = cache_bytes / t / peak
            row["kernel_speedup_vs_torch"] = row["torch_us"] / row["kernel_us"]
            row["kernel_speedup_vs_sdpa"] = row["sdpa_us"] / row["kernel_us"]
            if args.sweep_splits and B == 1:
                sms = torch.cuda.get_device_properties(device).multi_processor_count if device == "cuda" else 4
                for T in sorted({max(1, sms // 4), sms // 2, sms, 2 * sms} - {0}):
                    t = timer.median(cycled(lambda kv, T=T: absorbed_decode(q, kv, S, scale, r, num_splits=T)),
                                     args.reps)
                    row[f"kernel_gbs_splits_{T}"] = cache_bytes / t / 1e9
        rows.append(row)
        kvs = ways = None  # free this size before allocating the next
    return {"machine": machine_info(device), "copy_bandwidth_gbs": peak / 1e9,
            "command": "python benchmarks/speed/decode_kernel.py " + " ".join(sys.argv[1:]), "rows": rows}


class Timer:
    """Median time of a call: CUDA events around a burst of calls on a GPU, wall clock on the CPU."""

    def __init__(self, device):
        self.device = device

    def median(self, fn, reps: int, burst: int = 10) -> float:
        import time

        import torch
        fn()  # compile / warm up
        if self.device != "cuda":
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return statistics.median(times)
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(burst):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / burst)
        return statistics.median(times)

    def graph_median(self, fn, reps: int, burst: int = 10) -> float:
        """Median time of fn() replayed from a CUDA graph of `burst` calls (no launch overhead)."""
        import torch
        fn()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up on a side stream, as capture requires
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(burst):
                fn()
        return self.median(graph.replay, reps) / burst

    def copy_bandwidth(self, mbytes: int = 2048) -> float:
        """Bytes per second of a large device copy, counting the read and the write."""
        import torch
        src = torch.empty(mbytes * 2 ** 20, dtype=torch.uint8, device=self.device)
        dst = torch.empty_like(src)
        t = self.median(lambda: dst.copy_(src), 10, burst=3)
        return 2 * src.numel() / t


def print_table(result: dict) -> None:
    rows = result["rows"]
    print(f"machine: {result['machine'].get('gpu', result['machine']['cpu'])}; "
          f"copy bandwidth {result['copy_bandwidth_gbs']:.0f} GB/s")
    head = f"{'B':>3} {'S':>6} {'splits':>6} {'kernel us':>10} {'GB/s':>7} {'peak':>6} {'graph us':>9} " \
           f"{'GB/s':>7} {'peak':>6} {'torch us':>9} " \
           f"{'GB/s':>7} {'sdpa us':>9} {'GB/s':>7} {'x torch':>7} {'x sdpa':>7} {'rel err':>8}"
    print(head)
    for w in rows:
        print(f"{w['batch']:>3} {w['context']:>6} {w['splits']:>6} {w['kernel_us']:>10.1f} {w['kernel_gbs']:>7.0f} "
              f"{w['kernel_of_peak']:>6.0%} {w['kernel_graph_us']:>9.1f} {w['kernel_graph_gbs']:>7.0f} "
              f"{w['kernel_graph_of_peak']:>6.0%} {w['torch_us']:>9.1f} {w['torch_gbs']:>7.0f} {w['sdpa_us']:>9.1f} "
              f"{w['sdpa_gbs']:>7.0f} {w['kernel_speedup_vs_torch']:>7.2f} {w['kernel_speedup_vs_sdpa']:>7.2f} "
              f"{w['kernel_rel_err_vs_torch']:>8.1e}")
        sweep = {k: v for k, v in w.items() if k.startswith("kernel_gbs_splits_")}
        if sweep:
            print("      fixed splits: " + ", ".join(f"{k.rsplit('_', 1)[1]}: {v:.0f} GB/s" for k, v in sweep.items()))


def _finite(x):
    """NaN (a path that did not run, no peak on the CPU) becomes null: JSON has no NaN."""
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return None if isinstance(x, float) and math.isnan(x) else x


def write_json(path: Path, result: dict) -> None:
    """Written to a temporary file beside the target, then renamed: never half a file."""
    from attnlab.io.folders import replace_file

    replace_file(path, json.dumps(_finite(result), indent=1).encode())


if __name__ == "__main__":
    sys.exit(main())
