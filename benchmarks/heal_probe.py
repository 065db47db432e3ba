"""Short probes behind HealPlan's learning rates and layer windows (SmolLM2 at the 75% cut, rorope + BKV).

    python benchmarks/heal_probe.py layer [--layer 10]      # one layer: held-out normalised MSE after layer-wise
                                                              # training, for windows x learning rate x steps (~5 min)
    python benchmarks/heal_probe.py distill [--lrs 1e-4,3e-4,1e-3] [--steps 25]
                                                              # the layer-wise phase, then end-to-end steps at each
                                                              # learning rate from the same start (~20 min)
    python benchmarks/heal_probe.py splits                   # no training: latent / rope splits at 11,520 bytes/token

Prints what it measures (no JSON: these choose settings, the tables come from heal.py). Same texts as
heal.py: calibration MPL-2.0, evaluation GPL-3, training pydoc_data.topics.
"""
from __future__ import annotations

import argparse
import copy
import time

import torch
from heal import EVALUATION, Smol, _training_text

from attnlab import models as hf
from attnlab.heal.distill import Healer
from attnlab.heal.plan import HealPlan
from attnlab.heal.losses import cosine, normalised_mse, warmup_steps
from attnlab.heal.data import text_windows
from attnlab.models.evaluate import attention_inputs


def _train(smol):
    return text_windows(smol.tok, [_training_text()], 256, eval_paths=[EVALUATION])[0]  # (N, 256)


def layer_probe(smol, layer: int) -> None:
    """Layer-wise training of one layer alone: held-out normalised MSE for several settings."""
    student = smol.convert("75%", "rorope", True)
    ids = _train(smol)[:160]
    with torch.no_grad():
        X = attention_inputs(smol.teacher, ids)[layer].reshape(160, 256, -1)  # (160, T, dim)
    teacher_m, start = hf.attnlab_modules(smol.teacher)[layer], hf.attnlab_modules(student)[layer]
    held = X[128:]  # windows no setting trains on
    with torch.no_grad():
        target = teacher_m(held, is_causal=True)

    def nmse(m):
        with torch.no_grad():
            return float(normalised_mse(m(held, is_causal=True), target))
    print(f"layer {layer}: held-out normalised MSE at the start {nmse(start):.4f}")
    for windows, lr, steps in [(32, 1e-3, 100), (32, 1e-3, 400), (128, 1e-3, 400), (32, 3e-3, 100),
                               (128, 3e-3, 400)]:
        m = copy.deepcopy(start)
        opt = torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=0.0)
        g = torch.Generator().manual_seed(0)
        for s in range(steps):
            x = X[torch.randint(windows, (8,), generator=g)]  # (8, T, dim)
            with torch.no_grad():
                t = teacher_m(x, is_causal=True)
            for group in opt.param_groups:
                group["lr"] = lr * cosine(s, steps, warmup_steps(steps))
            loss = normalised_mse(m(x, is_causal=True), t)
            opt.zero_grad()
            loss.backward()
            opt.step()
        print(f"  {windows} windows, lr {lr:g}, {steps} steps: train {loss.item():.4f}, held-out {nmse(m):.4f}",
              flush=True)


def distill_probe(smol, lrs: list[float], steps: int, layer_plan: HealPlan) -> None:
    """The layer-wise phase once, then `steps` end-to-end steps at each learning rate from that same start."""
    student = smol.convert("75%", "rorope", True)
    train = _train(smol)
    t0 = time.monotonic()
    before = hf.perplexity(student, smol.eval_ids)
    layer_plan.tokens = 1  # the run must have an end; it is stopped when the layer phase hands over
    h = Healer(smol.teacher, student, train, layer_plan,
               progress=lambda info: h.state["phase"] != "layers" and h.request_stop())
    h.run()
    h.finish()
    print(f"layer-wise (layer lr {layer_plan.layer_lr:g}, {layer_plan.layer_windows} windows): perplexity "
          f"{before:.2f} -> {hf.perplexity(student, smol.eval_ids):.2f} in {time.monotonic() - t0:.0f} s", flush=True)
    for lr in lrs:
        s = copy.deepcopy(student)
        h2 = Healer(smol.teacher, s, train, HealPlan(layer_steps=0, lr=lr, tokens=steps * 4 * 256))
        h2.run()
        h2.finish()
        kl = h2.state["distill_losses"]
        print(f"  end-to-end lr {lr:g}, {steps} steps: perplexity {hf.perplexity(s, smol.eval_ids):.2f}, "
              f"KL {kl[0]:.3f} -> {sum(kl[-5:]) / 5:.3f}", flush=True)


def splits_probe(smol) -> None:
    for r, p in [(72, 24), (66, 30), (60, 36), (54, 42), (48, 48)]:
        for select in ("rorope", "rorope-score"):
            m = copy.deepcopy(smol.teacher)
            hf.convert_model(m, "mla", latent_dim=r, rope_dim=p, calibration_ids=smol.calib_ids,
                             pair_selection=select, balance=True)
            print(f"  r {r} rope_dim {p} {select} +BKV: {hf.kv_bytes_per_token(m)} bytes/token, perplexity "
                  f"{hf.perplexity(m, smol.eval_ids):.2f}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("probe", choices=("layer", "distill", "splits"))
    ap.add_argument("--layer", type=int, default=10)
    ap.add_argument("--lrs", default="1e-4,3e-4,1e-3")
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--layer-lr", type=float, default=1e-3)
    ap.add_argument("--layer-windows", type=int, default=32)
    a = ap.parse_args()
    smol = Smol(False)
    if a.probe == "layer":
        layer_probe(smol, a.layer)
    elif a.probe == "distill":
        distill_probe(smol, [float(x) for x in a.lrs.split(",")], a.steps,
                      HealPlan(layer_lr=a.layer_lr, layer_windows=a.layer_windows))
    else:
        splits_probe(smol)


if __name__ == "__main__":
    main()
