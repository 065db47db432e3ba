"""HealPlan: what a heal does, everything that decides its result (the time budget is not part of it), and the
constants a plan is sized with (shrink/heal_plan.py sizes one for a shrink; distill.Healer runs it).

Its fields are described beside them. check() refuses a plan that cannot run, naming the field and value.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

# The end-to-end rate for a plan that keeps every value (HealPlan.lr; shrink sets it where it sets the probe): such a
# student starts next to the teacher, where HealPlan.lr's default (for a low-rank plan) blew up (docs/decisions.md)
EVERY_VALUE_LR = 1e-4
# The fewest layer-wise steps a layer that a heal plans or fits to its time (a layer's schedule warms up over
# warmup_steps of them; fewer move a layer little)
MIN_LAYER_STEPS = 5
LAYER_INPUTS = ("teacher", "student")  # HealPlan.layer_inputs


@dataclass
class HealPlan:
    """What a heal does (everything that decides its result; the time budget is not part of it)."""
    seq_len: int = 256  # tokens per window
    batch_size: int = 4  # end-to-end windows per step
    tokens: int | None = None  # end-to-end tokens; None: as many as the time budget allows
    layer_steps: int = 100  # layer-wise steps per layer; 0 skips the phase
    layer_windows: int = 64  # windows whose teacher hidden states the layer-wise phase reads
    layer_batch: int = 8  # layer-wise windows per step
    layer_lr: float = 3e-3  # the layer-wise learning rate
    lr: float = 3e-4  # the end-to-end learning rate
    warmup: int = 8  # the end-to-end phase's warm-up steps
    seed: int = 0  # what every batch is drawn from (data.batch_generator)
    lora_rank: int | None = None  # LoRA adapters of this rank train instead of the attention weights; None: no LoRA
    # with layer_steps: the end-to-end phase first, judged on the held-out texts after this share of its steps
    # (heal_model): if the student moved away from the teacher there (guard.worse), the converted weights come back
    # and the layer-wise phase takes the rest of the time, with no end-to-end phase after it; 0: the layer-wise phase
    # first, then the end-to-end phase
    probe: float = 0.0
    # where a layer of the layer-wise phase reads its inputs: "teacher", the teacher's hidden states (every layer
    # fitted alone); "student", the student's own, through the layers before it as the phase left them (each layer
    # fitted to the teacher's output from what it will really read, so that it can make up for the errors before it)
    layer_inputs: str = "teacher"
    # prompts per held-out text whose greedy continuations heal_model's evaluations compare (greedy agreement, a
    # reported figure that no decision reads); 0: none
    prompts: int = 8
    # both phases' steps (and a layer's check windows) under bf16 autocast on the CPU too (on CUDA they always are):
    # the weights, the optimizer, the teacher's layer targets and heal_model's evaluations stay float32. shrink sets it
    # for a plan that cuts rank on a CPU that multiplies bf16 natively (runtime.environment.cpu_bf16) where the time
    # binds its layer-wise phase (shrink/heal_plan.py CPU_BF16)
    bf16: bool = False

    def check(self) -> None:
        if self.layer_inputs not in LAYER_INPUTS:
            raise ValueError(f"heal plan: layer_inputs must be one of {', '.join(LAYER_INPUTS)}, got "
                             f"{self.layer_inputs!r}")
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in ("tokens", "lora_rank") and v is None or f.name == "layer_inputs":
                continue
            if f.name == "bf16":
                if not isinstance(v, bool):
                    raise ValueError(f"heal plan: {f.name} must be True or False, got {v!r}")
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or (
                    v == 0 and f.name not in ("layer_steps", "warmup", "seed", "probe", "prompts")):
                raise ValueError(f"heal plan: {f.name} must be a positive number, got {v!r}")
        if self.probe >= 1:
            raise ValueError(f"heal plan: probe is a share of the end-to-end steps, below 1, got {self.probe!r}")
