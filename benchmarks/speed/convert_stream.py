"""Peak memory and time of the streamed conversion (models/stream.py) on a Llama-3.2-1B-shape checkpoint.

    nice -n 10 python benchmarks/speed/convert_stream.py --folder /tmp/llama1b \
        --json benchmarks/results/convert_stream.json

1. Writes a random Llama-3.2-1B-shape model (16 layers, dim 2048, 32 heads, 8 KV heads,
   head_dim 64, MLP 8192, vocab 128256, tied embeddings, llama3 rope scaling) in bfloat16
   with save_pretrained (about 2.5 GB, 5 shards), unless the folder already holds it.
2. Converts it to a DeepSeek-V3 MLA checkpoint (latent 512, rope_dim 64) in a fresh child
   process, optionally calibrated on --calibration-tokens tokens of a text, and reads the
   child's peak resident memory (VmHWM in /proc/self/status) and wall time.
3. Prints a table and writes JSON: checkpoint bytes, peak RSS, the target
   (0.5 x checkpoint + 300 MB), time, and the read rate of the disk measured on the same
   shards (so "time dominated by disk reads plus SVDs" can be checked).
--keep keeps the folders (they are deleted otherwise).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

CONFIG = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
              num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
              rms_norm_eps=1e-5, tie_word_embeddings=True, rope_theta=500000.0,
              rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192})


def make(folder: Path) -> float:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    t0 = time.perf_counter()
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    model.save_pretrained(str(folder), max_shard_size="500MB")
    return time.perf_counter() - t0


def peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def child(folder: str, out: str, calibration: str | None, tokens: int) -> None:
    """Runs in a fresh process: convert, then print one JSON line."""
    import torch

    from attnlab.models.stream import convert_checkpoint

    torch.set_num_threads(os.cpu_count() or 1)
    base = peak_rss()
    ids = None
    if calibration:
        g = torch.Generator().manual_seed(0)  # the random checkpoint has no tokenizer: random token ids
        ids = torch.randint(0, CONFIG["vocab_size"], (1, tokens), generator=g)
    t0 = time.perf_counter()
    summary = convert_checkpoint(folder, out, latent_dim=512, rope_dim=64, calibration_ids=ids, force=True)
    seconds = time.perf_counter() - t0
    print(json.dumps({"seconds": seconds, "peak_rss": peak_rss(), "rss_after_imports": base,
                      "bytes_read": summary["bytes_read"], "latent_norm_errors": summary["latent_norm_output_errors"]}))


def read_rate(folder: Path) -> float:
    """Bytes per second reading the shards once more (page cache may hold them: an upper bound)."""
    t0, n = time.perf_counter(), 0
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            while chunk := fh.read(64 << 20):
                n += len(chunk)
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--folder", type=Path, default=Path("/tmp/attnlab-llama1b"))
    ap.add_argument("--calibration-tokens", type=int, default=0, help="0: no calibration")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        folder, out, cal, tokens = args.child
        return child(folder, out, cal if cal != "-" else None, int(tokens))
    made = None
    if not (args.folder / "config.json").is_file():
        made = make(args.folder)
    size = sum(f.stat().st_size for f in args.folder.glob("*.safetensors"))
    out = args.folder.with_name(args.folder.name + "-mla")
    cal = "random" if args.calibration_tokens else "-"
    proc = subprocess.run([sys.executable, __file__, "--child", str(args.folder), str(out), cal,
                           str(args.calibration_tokens)], capture_output=True, text=True)
    if proc.returncode:
        sys.exit(proc.stderr[-3000:])
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    out_size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    rate = read_rate(args.folder)
    target = 0.5 * size + 300e6
    row = {"checkpoint_bytes": size, "output_bytes": out_size, "peak_rss_bytes": r["peak_rss"],
           "rss_after_imports_bytes": r["rss_after_imports"], "target_bytes": target,
           "peak_rss_over_checkpoint": r["peak_rss"] / size, "within_target": r["peak_rss"] <= target,
           "seconds": r["seconds"], "read_seconds_at_measured_rate": size / rate, "read_rate_bytes_per_s": rate,
           "calibration_tokens": args.calibration_tokens, "make_seconds": made,
           "latent_norm_errors": r["latent_norm_errors"], "machine": f"{os.cpu_count()} cores, no GPU",
           "command": "nice -n 10 python " + " ".join(sys.argv)}
    print(f"{'checkpoint':>12} {'peak RSS':>10} {'target':>10} {'ratio':>6} {'time s':>8} {'read s':>7}")
    print(f"{size / 1e9:>10.2f}GB {r['peak_rss'] / 1e9:>8.2f}GB {target / 1e9:>8.2f}GB "
          f"{r['peak_rss'] / size:>6.2f} {r['seconds']:>8.1f} {size / rate:>7.1f}")
    if args.json:
        args.json.write_text(json.dumps(row, indent=2))
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)
        if made is not None:
            shutil.rmtree(args.folder, ignore_errors=True)


if __name__ == "__main__":
    main()
