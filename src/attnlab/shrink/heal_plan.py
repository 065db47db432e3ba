"""The heal plan of a shrink run: what its heal does in the time it has (heal.distill.HealPlan), chosen from the
request, the converted student and a step timed on this machine.

A student that keeps every value (only its codes differ from the original's) heals end to end first, with a probe
that can switch to the layer-wise phase; one cut to low rank heals layer-wise first (LAYER_SHARE of the time), then
end to end at AFTER_LAYERS_LR. The layer-wise steps a layer are sized from one step of layer 0 timed on the
teacher's hidden states, with a lower rate where few fit (FEW_STEPS_LR); once running, the layer-wise phase cuts its
steps to the time it really has where they would not fit (heal.distill.Healer._fit_layers). On a CPU that multiplies
bf16 natively a plan that cuts rank heals in bf16, as on CUDA, where the time binds its layer-wise phase (CPU_BF16),
and is then timed so. shrink/pipeline.py calls heal_plan once, when the heal starts, and the run folder keeps
the plan (a resumed run heals to the same plan).
"""
from __future__ import annotations

import copy
import os
import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .request import ShrinkRequest


# The layer-wise phase's share of the heal's time where it goes first (a plan that cuts rank). Measured on SmolLM2 at
# 12.5% (docs/decisions.md): an end-to-end step costs 6.5 s on this CPU and
# in a 10-minute run gets a handful, at a warm-up rate; 40 and 60 layer-wise steps a layer (about 0.7 and all of the
# time) healed better than 25 (0.45) with the end-to-end steps after it, on every judge and development text.
LAYER_SHARE = 0.7
# The layer-wise rate when the time allows fewer than 50 steps a layer (in batches of 4). Measured on SmolLM2 at
# 12.5% (docs/decisions.md): at 1e-3 every other layer of the first half
# ended its steps worse than it started (layer 0: 0.146 -> 1.82) and was given back, and with 40 steps a layer the
# errors on the run's own text fell while the KL on Python source rose past the conversion's; 2.5e-4 gave no layer
# back and the lowest KL on every judge and development text; 1e-4 was worse than it on every one.
FEW_STEPS_LR = 2.5e-4
# A plan that keeps every value (only codes differ from the original) heals end to end first and is judged on the
# held-out windows after PROBE_SHARE of its steps (HealPlan.probe): if their perplexity rose, the converted weights
# come back and the layer-wise phase, sized to the rest of the time, takes over. Measured (docs/decisions.md): on
# SmolLM2 the end-to-end phase heals such plans and a layer-wise phase first made them worse (its guard gave 16 of
# 30 layers back and cut every later rate to 1/16); on Gemma 3 270M the end-to-end phase raised held-out perplexity
# at every rate tried and the layer-wise phase healed.
PROBE_SHARE = 0.4
# Where the layer-wise phase of a plan that cuts rank reads a layer's inputs (HealPlan.layer_inputs): the student's
# own, through the layers healed before it, so that each layer is fitted to what it will really read. Measured on
# SmolLM2 at 12.5% (docs/decisions.md): on the same converted student in the
# same 4.2 minutes, KL to the original fell on every judge text (0.41 -> 0.32, 0.38 -> 0.32, 0.63 -> 0.43) and on
# both development texts (0.76 -> 0.68, 0.55 -> 0.48) against the teacher's hidden states.
LOW_RANK_INPUTS = "student"
# The end-to-end rate after the layer-wise phase of a plan that cuts rank (HealPlan.lr). Once each layer has been
# fitted on its own inputs the student is near the teacher, as a plan that keeps every value starts. Measured on
# SmolLM2 at 12.5% (docs/decisions.md): at HealPlan's default 3e-4 the 11-12 steps a 10-minute
# run has left raised the KL on every held-out text in three seeds of three (0.223 -> 0.289, 0.246 -> 0.332 and
# 0.341 -> 0.455 in seed 0) and the heal gave them back; from the same layer-wise student 1e-4 lowered it on every
# judge text (0.224/0.246/0.334 -> 0.216/0.212/0.318) and development text (0.537/0.368/0.310 -> 0.489/0.327/0.265).
AFTER_LAYERS_LR = 1e-4
# Whether a CPU heal of a plan that cuts rank runs its steps under bf16 autocast (HealPlan.bf16) where the CPU
# multiplies bf16 natively (runtime.environment.cpu_bf16) and the time binds its layer-wise phase (the few-steps
# schedule, FEW_STEPS_LR: sized from a float32 step, then from a bf16 one). Measured on the 2-core AMD EPYC
# (avx512_bf16), torch 2.13, SmolLM2 at 12.5%, alone (docs/decisions.md):
# a layer-wise step 1.26x faster, an end-to-end step 1.76x (benchmarks/speed/heal_step.py); the plain command's
# heal, 41-48 steps a layer in bf16 against 25-31 in float32, lower on every text in every seed (median 1.299x
# against 1.336x, worst 1.584x against 1.632x). Where the whole schedule (100 steps of 8 at 3e-3) fits in float32, as
# with the user's text in 30 minutes, bf16 only buys end-to-end steps, and there it lost seed 2: every layer from the
# fourth ended its steps 1.3-5x farther from the teacher, Python docs 1.634x against float32's 1.364x. A plan that
# keeps every value heals in float32 (its student starts within bf16's rounding of the teacher).
# ATTNLAB_CPU_BF16=1 in the environment asks for bf16 steps whatever the schedule, =0 keeps a heal float32 (to
# compare with float32 runs: the torchrun tests hold a job to one process's float32 sums).
CPU_BF16 = True
BF16_VARIABLE = "ATTNLAB_CPU_BF16"


def heal_plan(req: ShrinkRequest, teacher, student, train: torch.Tensor, seconds: float, device=None):
    """HealPlan for the time left: the layer-wise phase sized to LAYER_SHARE of it, timed on this machine; when no
    layer was cut to low rank, the end-to-end phase first with a probe at PROBE_SHARE of its steps, and the
    layer-wise phase sized to the rest, in case the probe finds the end-to-end phase harmful.

    A layer step is timed on layer 0 (forward and backward, twice, after an untimed first call) on the teacher's hidden
    states of one window, whose computing is timed too; on `device`, the heal's (default: the request's), with the
    heal's bf16 autocast (on CUDA; on a CPU that multiplies bf16 natively, CPU_BF16) and the GPU's queue drained
    before each reading (timed on the CPU, a CUDA heal was planned at the CPU's speed). Measured on SmolLM2 at a 50%
    cut (docs/decisions.md): with few steps per layer a lower rate and smaller batches do better at equal time (20
    steps of 4 windows at lr 1e-3 beat 10 of 8), with 100 steps the defaults (8 windows, lr 3e-3) do best; at 12.5%,
    40 steps of 4 at 2.5e-4 beat 1e-3 and 1e-4 (FEW_STEPS_LR). The end-to-end batch is the request's (--batch-size),
    and the layer-wise batch is rounded up to a whole number of them, so that any number of processes that splits the
    one splits the other, and a torchrun job plans what one process plans.
    """
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
        # the student starts near the teacher, where 3e-4 doubled the end-to-end loss in 8 steps (issue hold), and
        # where bf16's rounding is not small beside what the heal corrects (CPU_BF16): float32 on the CPU
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
    # four rows of the teacher's hidden states, not random ones: random inputs of unit variance cost the step 2.5
    # times what real ones do on SmolLM2 here (0.20 s against 0.08), which sized 11 steps a layer where 40 fit
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
