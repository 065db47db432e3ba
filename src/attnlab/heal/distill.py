"""Heal a converted model by distillation from the unconverted one (the teacher, frozen): `Healer`, run by run.py.

1. Layer-wise (layer_wise.py): each converted attention learns the teacher's attention output, one layer at a time.
2. End-to-end (end_to_end.py): KL(teacher || student) of the next-token distributions. With a probe (HealPlan.probe)
phase 2 runs first and is judged (settle_probe). Healer: one resumable, time-budgeted state machine (comments below).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import asdict
from pathlib import Path

import torch

from ..io.fingerprint import fingerprint
from ..io.folders import replace_with
from ..runtime.budget import Budget, Stopped
from . import distributed as dd
from . import guard
from .data import converted_layers
from .end_to_end import EndToEnd
from .layer_wise import LayerWise
from .plan import HealPlan
from .trainable import add_lora, freeze_all_but_attention, merge_lora
from .trainable import attention_modules as _modules
from .trainable import attention_weights, load_attention_weights
from .trained import TrainedPart

# Notation: B windows per step, T tokens per window (seq_len), V vocabulary, N training windows.


def _check_split(world: dd.World, plan: HealPlan, windows: torch.Tensor) -> None:
    """ValueError naming the numbers unless the world's size divides the global batches (checked before any work)."""
    n = world.size
    if n == 1:
        return
    if plan.batch_size % n:
        raise ValueError(f"batch_size {plan.batch_size} does not split over {n} processes: the global batch "
                         f"must be a multiple of {n}")
    if plan.layer_steps:
        b = min(plan.layer_batch, plan.layer_windows, windows.shape[0])
        if b % n:
            raise ValueError(f"the layer-wise batch of {b} windows (layer_batch {plan.layer_batch}, at most the "
                             f"{min(plan.layer_windows, windows.shape[0])} layer-wise windows) does not split "
                             f"over {n} processes: it must be a multiple of {n}")


# Healer runs the phases as one resumable state machine: the plan, step, phase, layer, weights, optimizer state and
# training windows go into one checkpoint file (torch.save, read back with weights_only=True, written atomically) with
# fingerprints of the student as it started and of the teacher, so a checkpoint of another model is refused. Every
# batch is chosen from (seed, phase, step) alone, so a run stopped and resumed gives the same weights as one never
# stopped. It keeps a time budget (runtime.Budget: the deadline and the stop request every long loop checks, the
# teacher's hidden states included), checkpoints every checkpoint_seconds and stops at a step boundary when asked.
#
# Data-parallel (distributed.py, under torchrun): with a world of N > 1 ranks plan.batch_size and the layer-wise batch
# stay the global batches; rank k computes rows [k B/N, (k+1) B/N) of the batch one process would pick, the trained
# part is wrapped (DDP, or FSDP2 with shard=True), the losses are built so that the averaged gradient is the
# one-process one (the layer-wise loss divides by the whole batch's target power), the recorded losses are the whole
# batch's, every stop is agreed, and rank 0 alone writes the checkpoint, in the one-process format. With FSDP2 the
# frozen teacher is sharded too (every teacher forward a collective); heal_model gathers it whole for the evaluations
# and leaves it whole. The teacher's layer inputs and the evaluations' windows are split over the ranks and gathered
# (distributed.gather_rows). Without a world (or with one process) none of this runs.
class Healer(LayerWise, EndToEnd):
    """Layer-wise then end-to-end distillation of `student` from `teacher`, resumable (the comments above). windows:
    (N, T) training ids; checkpoint: a file (None: none); budget: a runtime.Budget; progress(info) after every step.
    world: N > 1 ranks to train data-parallel (shard=True: FSDP2, else DDP). judge: run() returns "switch" where an
    end-to-end phase would follow the layer-wise one, for heal_model to judge (keep_layer_wise, end_at_switch)."""

    def __init__(self, teacher, student, windows: torch.Tensor, plan: HealPlan, *, device="cpu",
                 checkpoint=None, checkpoint_seconds: float = 300.0, progress=None, budget: Budget | None = None,
                 world: dd.World | None = None, shard: bool = False, judge: bool = False):
        plan.check()
        if windows.dim() != 2 or windows.shape[1] != plan.seq_len or windows.shape[0] < 1:
            raise ValueError(f"training windows must be (N >= 1, seq_len = {plan.seq_len}), "
                             f"got {tuple(windows.shape)}")
        self.world = world if world is not None else dd.World()
        if shard and not self.world.distributed:
            raise ValueError(f"shard=True (FSDP2) needs a process group of 2 or more ranks; the world has "
                             f"{self.world.size}")
        self.shard = bool(shard)
        _check_split(self.world, plan, windows)
        self.teacher, self.student, self.plan = teacher.eval(), student.eval(), plan
        self.layers = converted_layers(teacher, student)  # what trains: a layer the conversion kept stays the teacher's
        self.device = self.world.device if self.world.distributed else torch.device(device)
        self.windows = windows
        self.checkpoint = None if checkpoint is None else Path(checkpoint)
        self.checkpoint_seconds, self.progress = checkpoint_seconds, progress
        self.budget = budget if budget is not None else Budget()
        # both phases' steps under bf16 autocast: on CUDA, and on the CPU where the plan says so (HealPlan.bf16: shrink
        # sets it where the CPU multiplies bf16 natively); float32 otherwise
        self.autocast = self.device.type == "cuda" or plan.bf16
        probing = bool(plan.probe and plan.layer_steps)
        self.state = {"phase": "layers" if plan.layer_steps and not probing else "distill", "layer": self.layers[0],
                      "step": 0, "tokens": 0,
                      "total_steps": None, "elapsed": 0.0, "layer_losses": [], "distill_losses": [],
                      "steps_done": 0, "layer_steps": None, **guard.initial_state(), **_probe_state(probing),
                      "switch": None}
        self.fingerprints = {"student": fingerprint(attention_weights(_modules(student)).items()),
                             "teacher": fingerprint(teacher.state_dict().items())}
        for p in teacher.parameters():
            p.requires_grad_(False)
        self.teacher_sharded = self.shard  # FSDP2: the frozen teacher sharded too (each rank 1/N of it)
        if self.shard and not dd.sharded(teacher):
            teacher.to(self.device)
            layers = list(getattr(getattr(teacher, "model", None), "layers", []))
            dd.shard_frozen(teacher, self.world, [*_modules(teacher), *layers])
            with torch.no_grad():  # a first forward through the root, every rank together: FSDP2 then knows the root
                teacher(windows[:1, :2].to(self.device))  # (a rank's first call may else be a unit alone: generation)
            dd.whole(teacher, False)  # the root keeps its weights gathered after a forward: sharded again
        if plan.lora_rank:
            add_lora(student, plan.lora_rank, self.layers)
        else:
            freeze_all_but_attention(student, self.layers)
        self._attn = _modules(student)  # the student's own attention modules (what checkpoints hold)
        self.optimizer = None
        self.steps_this_run = 0
        self._inputs = self._check_x = None
        self._stream = self._stream_start = None  # layer_inputs "student": (layer, the residual stream into it)
        self._own = None  # layer_inputs "student": (layer, its inputs, its check windows' inputs) from the student
        self._start_weights = None  # the layer-wise phase's current layer as it started (the guard's fallback)
        self._good = None  # end-to-end: the trained parameters at the last step that read well (the blow-up guard's)
        self._rolled_back = False  # the last end-to-end step was rolled back (progress says so)
        # heal_model judges the end-to-end phase that follows a layer-wise one: run() stops where it would start
        # ("switch"), and the layer-wise phase's weights are kept here (keep_layer_wise) for a verdict at the end
        self.judge = bool(judge)
        self.layer_wise = None
        self.trained = TrainedPart(student, self._attn, self.world, self.shard, self.device,  # what a phase trains
                                   self.layers)

    # -- checkpoints ---------------------------------------------------------------------------
    def request_stop(self) -> None:
        """Stop at the next step boundary (or the next window of an evaluation), after writing a checkpoint."""
        self.budget.request_stop()

    def save(self) -> None:
        """Write the checkpoint atomically (a disk that refuses it gives a one-line ValueError, no leftover).

        Over N ranks every rank calls it (FSDP2 gathers the shards); rank 0 alone writes, in the
        one-process format (full weights, the optimizer state by parameter index).
        """
        if self.checkpoint is None:
            return
        good = self._good_weights()
        self.trained.sync()
        # an optimizer without state yet (a new layer, a rollback) is saved as none: FSDP2's gathering of its state
        # (torch.distributed.checkpoint) would first initialise it with a step of zero gradients, and the next real
        # step would then be AdamW's second, not its first (the same on every rank: each has taken the same steps)
        optimizer = None if self.optimizer is None or not self.optimizer.state \
            else self.trained.optimizer_state(self.optimizer)
        if not self.world.main:
            return
        blob = {"format": "attnlab-heal", "plan": asdict(self.plan), "state": dict(self.state),
                "fingerprint": dict(self.fingerprints),
                "student": {k: v.cpu() for k, v in attention_weights(self._attn).items()},
                "optimizer": optimizer,
                "windows": self.windows.cpu(),
                "layer_start": None if self._start_weights is None else dict(self._start_weights),
                "distill_good": good, "layer_wise": self.layer_wise}
        replace_with(self.checkpoint, lambda tmp: torch.save(blob, tmp))

    @staticmethod
    def read(path) -> dict:
        """A checkpoint's contents (weights_only: nothing is unpickled), or a one-line ValueError."""
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"no heal checkpoint at {path} (nothing to resume)")
        try:
            blob = torch.load(path, weights_only=True, map_location="cpu")
        except Exception as e:  # noqa: BLE001 - any unreadable file is one kind of problem for the user
            raise ValueError(f"cannot read the heal checkpoint {path}: {str(e).splitlines()[0]}") from None
        if not isinstance(blob, dict) or blob.get("format") != "attnlab-heal":
            raise ValueError(f"{path} is not an attnlab heal checkpoint")
        return blob

    def restore(self, blob: dict, where: str = "the checkpoint") -> None:
        """Continue from a checkpoint of the same plan, student and teacher (weights, optimizer, phase, step, windows).

        A checkpoint written by any number of ranks restores on any number (every rank passes the blob).
        """
        marks = blob.get("fingerprint")
        if not isinstance(marks, dict):
            raise ValueError(f"{where} records no fingerprint of its models (an older attnlab wrote it); "
                             "start afresh without --resume")
        for who, what in (("student", "the converted model it started from"), ("teacher", "its teacher")):
            if marks.get(who) != self.fingerprints[who]:
                raise ValueError(f"{where} belongs to another run: {what} differs from this run's {who} "
                                 "(resume with the same model and teacher, or start afresh)")
        # a plan from before these fields: their defaults
        made = {"probe": 0.0, "layer_inputs": "teacher", "prompts": HealPlan.prompts, **blob["plan"]}
        if made != asdict(self.plan):
            diff = sorted(k for k in made if made[k] != asdict(self.plan).get(k))
            raise ValueError(f"{where} was made with a different plan ({', '.join(diff)} differ)")
        _check_split(self.world, self.plan, blob["windows"])
        self.trained.release()
        self.windows = blob["windows"]
        load_attention_weights(self._attn, blob["student"])
        self.state = {"steps_done": 0, **guard.initial_state(), **_probe_state(False), "switch": None,
                      **blob["state"]}
        self._start_weights = blob.get("layer_start")
        self.layer_wise = blob.get("layer_wise")
        good = None
        if blob.get("distill_good") is not None and self.state["phase"] == "distill":
            # the blow-up guard's copy, in the form of the trained parameters (FSDP2: this rank's shards of them)
            load_attention_weights(self._attn, blob["distill_good"])
            self._make_optimizer()
            good = [p.detach().clone() for p in self._trained_params()]
            self.trained.release()
            load_attention_weights(self._attn, blob["student"])
        self._make_optimizer()
        self._good = good
        if blob["optimizer"] is not None and self.optimizer is not None:
            self.trained.load_optimizer_state(self.optimizer, blob["optimizer"])

    # -- what is trained, and its wrapper over N ranks ---------------------------------------------
    def _make_optimizer(self):
        """The optimizer of what the phase trains (a new one per layer and phase), wrapped first over N ranks
        (trained.py: DDP around the module itself, or FSDP2 around a twin of each attention module it holds)."""
        s = self.state
        if s["phase"] != "distill":
            self._good = None
        if s["phase"] not in ("layers", "distill"):
            self.trained.release()
            self.optimizer = None
            return
        params = self.trained.wrap(s["phase"], s["layer"])
        # lr_scale: the guards' factor (guard.py); the end-to-end phase starts at the one the last layer left
        lr = (self.plan.layer_lr if s["phase"] == "layers" else self.plan.lr) * s["lr_scale"]
        self.optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)

    def _trained_params(self) -> list[torch.nn.Parameter]:
        """What the optimizer steps, in its order (FSDP2: the twins' sharded parameters)."""
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _put(self, values: list[torch.Tensor]) -> None:
        """Copy `values` (from _trained_params, cloned) into the trained parameters, in place."""
        with torch.no_grad():
            for p, v in zip(self._trained_params(), values, strict=True):
                p.copy_(v)

    def _agree(self, flag: bool) -> bool:
        return dd.agree(flag) if self.world.distributed else flag

    def _loss_value(self, loss: torch.Tensor) -> float:
        """The whole batch's loss: this rank's, or the mean of the ranks' (equal rows each)."""
        return dd.global_mean(loss.detach()) if self.world.distributed else loss.item()

    def _check(self) -> None:
        """budget.check(), agreed over the ranks (any rank's stop or deadline stops all)."""
        if not self.world.distributed:
            self.budget.check()
        elif self._agree(self.budget.stop_requested):
            raise Stopped("stop")
        elif self._agree(self.budget.expired()):
            raise Stopped("budget")

    # -- the loop ------------------------------------------------------------------------------
    def run(self, minutes: float | None = None, *, reserve: float = 0.0) -> str:
        """Train until the plan is done, the budget is spent or a stop is requested, leaving `reserve` seconds; a
        checkpoint at the end and every checkpoint_seconds. Returns "done", "budget" (resumable), "stopped", "probe"
        at the plan's probe point (settle_probe, then run again) or "switch" (judge=True: keep_layer_wise or
        end_at_switch, then run again). Over N ranks every decision is agreed."""
        plan, s = self.plan, self.state
        budget = self.budget if minutes is None else self.budget.share(seconds=60.0 * minutes)
        if plan.tokens is None and budget.deadline is None:
            raise ValueError("give a number of tokens, a time budget in minutes, or both")
        if plan.tokens is not None and s["total_steps"] is None:
            s["total_steps"] = max(1, math.ceil(plan.tokens / (plan.batch_size * plan.seq_len)))
        self.teacher.to(self.device)
        self.student.to(self.device)
        if self.optimizer is None:
            self._make_optimizer()
        clock = budget.clock
        start = clock()
        last_save, step_time, status, elapsed0 = start, 0.0, "done", s["elapsed"]
        self.steps_this_run = 0
        layer_clock = None  # (layer, time after its first step): the layer-wise step time, for _fit_layers
        while s["phase"] != "done":
            if s["phase"] == "distill" and s["probe"] == "pending" and s["probe_step"] is not None \
                    and s["step"] >= s["probe_step"]:  # the same step on every rank: the steps are counted alike
                status = "probe"
                break
            if self.judge and s["phase"] == "distill" and s["switch"] is None and s["probe"] is None \
                    and self.plan.layer_steps:
                status = "switch"
                break
            if self._agree(budget.stop_requested):
                status = "stopped"
                break
            if self._agree(budget.expired(reserve + step_time)):
                status = "budget"
                break
            phase = s["phase"]
            now = clock()
            try:
                loss = self._layer_step() if phase == "layers" else self._distill_step()
            except Stopped as e:  # the teacher's hidden states were cut short
                status = "stopped" if e.reason == "stop" else "budget"
                break
            step_time = clock() - now
            if phase == "layers":
                layer_clock = self._time_layer(layer_clock, budget, reserve)
            self.steps_this_run += 1
            s["steps_done"] += 1
            s["elapsed"] = elapsed0 + clock() - start
            if phase == "distill" and s["total_steps"] is None and s["step"] == max(3, plan.warmup):
                # steps the budget allows from here (the probe's evaluation costs about what the last one will)
                left = (budget.left() - reserve * (2 if s["probe"] == "pending" else 1)) / max(step_time, 1e-9)
                total = s["step"] + max(1, int(left))
                s["total_steps"] = dd.broadcast_object(total, patient=False) if self.world.distributed else total
            if phase == "distill" and s["probe"] == "pending" and s["probe_step"] is None \
                    and s["total_steps"] is not None:
                # that share of the phase's steps, and never inside the warm-up (docs/decisions.md: the probe); a
                # phase too short for that has no probe (keep_better rules at its end)
                s["probe_step"] = max(plan.warmup + 1, round(plan.probe * s["total_steps"]))
            if self.progress:
                self.progress({**self._info(phase, loss, step_time),
                               "rolled_back": phase == "distill" and self._rolled_back})
            if self._agree(clock() - last_save > self.checkpoint_seconds):
                self.save()
                last_save = clock()
        s["elapsed"] = elapsed0 + clock() - start
        self.save()
        self.trained.detach(sync=self.checkpoint is None)  # save() synced the weights already
        return status

    def _info(self, phase, loss, step_time) -> dict:
        s, plan, n = self.state, self.plan, len(self.layers)
        if phase == "layers":
            steps = self.layer_steps
            done = self.layers.index(s["layer"]) * steps + s["step"] if s["phase"] == "layers" else n * steps
            total = n * steps
            tokens = plan.layer_batch * plan.seq_len
        else:
            done, total, tokens = s["step"], s["total_steps"], plan.batch_size * plan.seq_len
        return {"phase": phase, "layer": s["layer"], "done": done, "total": total, "loss": loss,
                "tokens": s["tokens"], "tokens_per_s": tokens / max(step_time, 1e-9),
                "eta_s": None if total is None else (total - done) * step_time}

    @contextlib.contextmanager
    def teacher_whole(self):
        """A sharded teacher gathered whole for the block (an evaluation: the ranks score different windows, each on
        its own, with no collective), sharded again after it; an unsharded teacher as it is."""
        if self.teacher_sharded:
            dd.whole(self.teacher)
        try:
            yield self.teacher
        finally:
            if self.teacher_sharded:
                dd.whole(self.teacher, False)

    def settle_probe(self, harmful: bool, start_weights: dict | None = None) -> None:
        """The verdict on the end-to-end phase at its probe point (HealPlan.probe): kept, or, when `harmful` (the
        student moved away from the teacher on the held-out text: guard.worse), the student's attention weights back
        to `start_weights` ({"<layer>.<name>": ...}, as the heal started) and the layer-wise phase for the rest, with
        no end-to-end phase after it, at the plan's rates (the end-to-end phase's rollbacks cut its own rate, which
        says nothing of the layer-wise one)."""
        s = self.state
        if not harmful:
            s["probe"] = "kept"
            return
        if start_weights is None:
            raise ValueError("switching to the layer-wise phase needs the weights the heal started from")
        self.trained.release()
        load_attention_weights(self._attn, start_weights)
        s.update(phase="layers", layer=self.layers[0], step=0, probe="switched", lr_scale=1.0)
        self._make_optimizer()

    def keep_layer_wise(self) -> None:
        """At the switch (run() returned "switch"): keep the layer-wise phase's weights ({"<layer>.<name>": ...} on
        the CPU, in checkpoints too) for heal_model's verdict on the end-to-end phase, which then runs."""
        self.layer_wise = {k: v.detach().cpu().clone() for k, v in attention_weights(self._attn).items()}
        self.state["switch"] = "judged"

    def end_at_switch(self) -> None:
        """At the switch: no end-to-end phase (too little time is left to judge one); the heal is done."""
        self.state.update(phase="done", switch="skipped")
        self._make_optimizer()  # none: the trained weights are the student's own again

    def finish(self) -> None:
        """Merge LoRA adapters (if any) and stop tracking gradients: the student is an ordinary model again."""
        if self.world.distributed:  # drop the wrappers (FSDP2: the trained weights into the student first)
            self.trained.release()
            self.optimizer = None
        if self.plan.lora_rank:
            merge_lora(self.student)
        for p in self.student.parameters():
            p.requires_grad_(False)


def _probe_state(probing: bool) -> dict:
    """The probe's part of the Healer's state: "pending" (the end-to-end phase runs first and is judged at probe_step),
    "kept" or "switched" (the verdict), None (no probe); probe_step is set once the end-to-end phase knows its steps:
    HealPlan.probe of them, and past the warm-up."""
    return {"probe": "pending" if probing else None, "probe_step": None}

