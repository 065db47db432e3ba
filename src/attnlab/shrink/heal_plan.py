"""The heal plan of a shrink run (heal_plan): what its heal does in the time it has (heal.distill.HealPlan), chosen
from the request, the converted student and a step timed on this machine. A student that keeps every value heals end
to end first with a probe (PROBE_SHARE); one cut to low rank layer-wise first (LAYER_SHARE), then end to end. Called
once, when the heal starts (shrink/pipeline.py); the run folder keeps the plan, so a resumed run heals to the same one.
"""
from __future__ import annotations

import copy
import os
import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .request import ShrinkRequest


# The constants a heal plan is sized with; what each measured is in docs/decisions.md (Heal).
LAYER_SHARE = 0.7  # the layer-wise phase's share of the heal's time where it goes first (a plan that cuts rank)
FEW_STEPS_LR = 2.5e-4  # the layer-wise rate when the time allows fewer than 50 steps a layer (in batches of 4)
# a plan that keeps every value heals end to end first and is judged after this share of its steps (HealPlan.probe):
# where the student moved away from the teacher, the converted weights come back and the layer-wise phase takes over
PROBE_SHARE = 0.4
LOW_RANK_INPUTS = "student"  # where a plan that cuts rank fits each layer (HealPlan.layer_inputs): its own inputs
AFTER_LAYERS_LR = 1e-4  # the end-to-end rate after the layer-wise phase of a plan that cuts rank (HealPlan.lr)
# bf16 steps (HealPlan.bf16) for a CPU heal of a plan that cuts rank, where the CPU multiplies bf16 natively
# (runtime.environment.cpu_bf16) and the time binds its layer-wise phase (the few-steps schedule). Off: on the
# development texts float32 did as well or better (docs/decisions.md). ATTNLAB_CPU_BF16=1 asks for them whatever the
# schedule, =0 never (the torchrun tests compare float32 sums).
CPU_BF16 = False
BF16_VARIABLE = "ATTNLAB_CPU_BF16"


def heal_plan(req: ShrinkRequest, teacher, student, train: torch.Tensor, seconds: float, device=None):
    """HealPlan for the time left (module docstring): the layer-wise steps, batch and rate (FEW_STEPS_LR where few fit)
    sized from one step of layer 0 on the teacher's hidden states, timed on `device` (the heal's; default the
    request's) under the heal's autocast; for a student that keeps every value, end to end first with a probe at
    PROBE_SHARE. The layer-wise batch is a whole number of end-to-end batches (--batch-size), so that a torchrun job
    plans what one process plans."""
    from ..heal.plan import HealPlan

    plan = HealPlan(seq_len=req.seq_len, seed=req.seed, layer_windows=min(64, train.shape[0]), tokens=req.tokens,
                    batch_size=req.batch_size)
    plan = _sized(req, plan, teacher, student, train, seconds, torch.device(device or req.device))
    plan.layer_batch = -(-plan.layer_batch // req.batch_size) * req.batch_size  # whole end-to-end batches
    return plan


def _sized(req: ShrinkRequest, plan, teacher, student, train: torch.Tensor, seconds: float, device: torch.device):
    """heal_plan's choices from the request and the time: the probe and rate for a student that keeps every value,
    and the layer-wise steps and batch (a step timed on `device`)."""
    from ..heal.plan import EVERY_VALUE_LR, MIN_LAYER_STEPS
    from ..models.adapters import attnlab_modules
    from ..runtime.environment import cpu_bf16

    mods = attnlab_modules(student)
    codes_only = all(s.kv_values_per_token >= t.kv_values_per_token for s, t in zip(mods, attnlab_modules(teacher)))
    share = LAYER_SHARE  # the layer-wise phase, then the end-to-end phase
    if codes_only:  # every value kept, none cut to low rank: end to end first, the layer-wise phase if it hurts;
        # the student starts near the teacher: a lower rate (EVERY_VALUE_LR), and float32 on the CPU (bf16's
        # rounding is not small beside what the heal corrects)
        plan.probe, share, plan.lr = PROBE_SHARE, 1.0 - PROBE_SHARE, EVERY_VALUE_LR
    else:
        plan.layer_inputs, plan.lr = LOW_RANK_INPUTS, AFTER_LAYERS_LR
    # bf16 steps on a CPU that multiplies bf16 natively, for a plan that cuts rank: ATTNLAB_CPU_BF16=1 asks for them
    # whatever the schedule, =0 never; else (CPU_BF16) where the time binds the layer-wise phase (below)
    asked = os.environ.get(BF16_VARIABLE, "")
    native = not codes_only and device.type == "cpu" and cpu_bf16()
    plan.bf16 = native and asked == "1"
    if req.layer_steps is not None:
        plan.layer_steps = req.layer_steps
        return plan
    m = copy.deepcopy(mods[0]).to(device).train()
    cuda = device.type == "cuda"

    def drained():  # CUDA runs a kernel after its call returns: a reading waits for the queue
        if cuda:
            torch.cuda.synchronize(device)
        return time.perf_counter()

    from ..models.evaluate import attention_inputs

    t0 = time.perf_counter()
    with torch.no_grad():  # layer 0's input on one window, as the phase reads it (the teacher's hidden states)
        first = attention_inputs(teacher, train[:1])[0]
    window = time.perf_counter() - t0
    # four rows of the teacher's hidden states: random inputs cost a step more than real ones (docs/decisions.md)
    x = first.reshape(1, train.shape[1], -1).to(device, m._anchor.dtype).expand(4, -1, -1).contiguous()
    layer_time = share * seconds - window * plan.layer_windows

    def schedule(bf16: bool) -> tuple[int, int, float]:
        """(layer_batch, layer_steps, layer_lr) from a step timed under the heal's autocast (on CUDA, or bf16)."""
        def step():  # as the heal's layer-wise step computes (heal.distill: bf16 autocast on CUDA and where plan.bf16)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda or bf16):
                out = m(x, is_causal=True)
            out.float().pow(2).mean().backward()

        step()  # the first call allocates: not what a step costs
        t0 = drained()
        for _ in range(2):
            step()
        step4 = (drained() - t0) / 2 * 1.3  # + the optimizer and the target
        steps8 = layer_time / max(2 * step4 * len(mods), 1e-9)
        if steps8 >= 50:
            return 8, int(min(100, steps8)), plan.layer_lr
        return 4, int(max(MIN_LAYER_STEPS, min(60, layer_time / max(step4 * len(mods), 1e-9)))), FEW_STEPS_LR

    sizes = schedule(plan.bf16)
    if native and not plan.bf16 and asked != "0" and CPU_BF16 and sizes[0] == 4:
        # the time binds the phase (its few-steps schedule): bf16 buys steps there, where it is kept if it still does
        faster = schedule(True)
        if faster[0] == 4:
            sizes, plan.bf16 = faster, True
    plan.layer_batch, plan.layer_steps, plan.layer_lr = sizes
    return plan
