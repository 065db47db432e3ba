"""The heal's end-to-end throughput on 1 and N processes (torchrun, DDP or FSDP2): tokens/s in total and per rank.

    python benchmarks/speed/heal_ranks.py                      # SmolLM2-135M, MLA 144 + 48, 1 and 2 processes, CPU
    python benchmarks/speed/heal_ranks.py --nprocs 1,2 --shard --tokens 8192

Each run is one command a user would type, `torchrun --standalone --nproc-per-node N -m attnlab heal SRC
--out OUT --tokens T --layer-steps 0 --batch-size B --seq-len 256 --text pydoc`, on a converted SmolLM2
(`attnlab convert smollm2 --to mla --latent-dim 144 --rope-dim 48 --no-calibration`, made once), the
layer-wise phase skipped so that only end-to-end steps count. The healed folder's report gives the
training minutes and tokens: tokens/s in total = end-to-end tokens / training seconds, per rank =
that / N. Also printed: whether the N-process loss curve equals the 1-process one (the same global batch).

On this repo's 2-core CPU the N processes share the same two cores, so the figures show that the runs
work and agree, not a speed-up: state it beside them. On a machine with N GPUs (`--device cuda`) they
measure scaling. Records the load average before and after: run it alone. Writes benchmarks/results/heal_ranks.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent


def pydoc_text(folder: Path) -> Path:
    import pydoc_data.topics as topics

    path = folder / "pydoc-topics.txt"
    path.write_text("\n\n".join(topics.topics.values()), encoding="utf-8")
    return path


def run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-1500:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nprocs", default="1,2", help="comma-separated process counts; the first is the reference")
    ap.add_argument("--tokens", type=int, default=16384, help="end-to-end tokens per run (the same for every N)")
    ap.add_argument("--batch-size", type=int, default=4, help="the global batch (windows of 256 tokens)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--shard", action="store_true", help="FSDP2 instead of DDP")
    ap.add_argument("--json", type=Path, default=HERE.parent / "results" / "heal_ranks.json")
    a = ap.parse_args()
    counts = [int(n) for n in a.nprocs.split(",")]
    work = Path(tempfile.mkdtemp(prefix="attnlab-heal-ranks-"))
    src = work / "mla"
    run([sys.executable, "-m", "attnlab", "convert", "smollm2", "--to", "mla", "--latent-dim", "144", "--rope-dim",
         "48", "--no-calibration", "--out", str(src)])
    text = pydoc_text(work)
    result = {"command": "python benchmarks/speed/heal_ranks.py " + " ".join(sys.argv[1:]), "device": a.device,
              "shard": a.shard, "tokens": a.tokens, "batch_size": a.batch_size, "load_before": os.getloadavg()[0],
              "cpus": os.cpu_count(), "rows": []}
    for n in counts:
        out = work / f"healed-{n}"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), "-m",
               "attnlab", "heal", str(src), "--out", str(out), "--tokens", str(a.tokens), "--layer-steps", "0",
               "--batch-size", str(a.batch_size), "--seq-len", "256", "--text", str(text), "--device", a.device]
        if a.shard:
            cmd.append("--shard")
        t0 = time.monotonic()
        run(cmd)
        wall = time.monotonic() - t0
        heal = json.loads((out / "config.json").read_text())["heal"]
        seconds = heal["minutes"] * 60
        total = heal["distill_tokens"] / seconds
        result["rows"].append({"processes": n, "tokens_per_s": total, "tokens_per_s_per_rank": total / n,
                               "training_seconds": seconds, "wall_seconds": wall,
                               "loss_first": heal["distill_loss_first"], "loss_last": heal["distill_loss_last"]})
    result["load_after"] = os.getloadavg()[0]
    ref = result["rows"][0]
    print(f"heal, end-to-end only, {a.tokens} tokens, global batch {a.batch_size} x 256, {a.device}, "
          f"{'FSDP2' if a.shard else 'DDP'}; load {result['load_before']:.2f} -> {result['load_after']:.2f}; "
          f"{result['cpus']} CPUs")
    print("| processes | tokens/s (total) | tokens/s per rank | training s | last losses equal to 1 process (4 digits) |\n"
          "|---|---|---|---|---|")
    for r in result["rows"]:
        same = [f"{x:.4f}" for x in r["loss_last"]] == [f"{x:.4f}" for x in ref["loss_last"]]
        r["losses_equal_4_digits"] = same
        print(f"| {r['processes']} | {r['tokens_per_s']:.0f} | {r['tokens_per_s_per_rank']:.0f} | "
              f"{r['training_seconds']:.1f} | {'yes' if same else 'NO'} |")
    if a.device == "cpu" and (result["cpus"] or 0) <= max(counts):
        print(f"note: {max(counts)} processes on {result['cpus']} CPUs share the cores: correctness, not scaling")
    a.json.write_text(json.dumps(result, indent=1))
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
