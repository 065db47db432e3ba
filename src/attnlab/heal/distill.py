"""Heal a converted model by distillation from the unconverted one (the teacher), which stays frozen.

Notation: B windows per step, T tokens per window (seq_len), V vocabulary, N training windows.

Two phases, on token windows (data.py: the user's text, or text the teacher writes):
1. Layer-wise: each converted attention module learns, one layer at a time, to reproduce
   the teacher's attention output on the teacher's own hidden states (normalised MSE,
   AdamW, cosine learning rate). No whole-model backward: one attention layer per step.
2. End-to-end: KL(teacher || student) of the next-token distributions, training only the
   converted attention weights (or, with lora_rank, LoRA adapters on them through peft,
   merged back at the end). bf16 autocast on CUDA; float32 on CPU (on the 2-core EPYC of
   docs/ bf16 autocast measured 1.5x slower than float32).

`Healer` runs the phases as one resumable state machine: the plan, step, phase, layer,
weights, optimizer state and training windows go into one checkpoint file (torch.save,
read back with weights_only=True, written atomically), with fingerprints of the student as it
started and of the teacher, so a checkpoint of another model is refused; every batch is chosen
from (seed, phase, step) alone, so a run stopped and resumed gives the same weights as one
that was never stopped. It keeps a time budget (runtime.Budget: the deadline and the stop
request every long loop checks, the teacher's hidden states included), checkpoints every few
minutes, and stops cleanly at a step boundary when asked (request_stop, e.g. from a signal).
`heal_model` is the whole job inside one budget: evaluate before (a bounded share), train
(leaving time for the evaluation after), evaluate after.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F

from ..io.fingerprint import fingerprint
from ..io.folders import replace_with
from ..models.evaluate import kv_bytes_per_token
from ..runtime.budget import Budget, Stopped

LORA_TARGETS = ("W_Q", "W_DQ", "W_UQ", "W_K", "W_V", "W_DKV", "W_KR", "W_UK", "W_UV", "W_O")


@dataclass
class HealPlan:
    """What a heal does (everything that decides its result; the time budget is not part of it)."""
    seq_len: int = 256
    batch_size: int = 4
    tokens: int | None = None  # end-to-end tokens; None: as many as the time budget allows
    layer_steps: int = 100  # layer-wise steps per layer; 0 skips the phase
    layer_windows: int = 64  # windows whose teacher hidden states the layer-wise phase reads
    layer_batch: int = 8
    layer_lr: float = 3e-3
    lr: float = 3e-4
    warmup: int = 8
    seed: int = 0
    lora_rank: int | None = None

    def check(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in ("tokens", "lora_rank") and v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or (
                    v == 0 and f.name not in ("layer_steps", "warmup", "seed")):
                raise ValueError(f"heal plan: {f.name} must be a positive number, got {v!r}")


def _modules(model):
    from ..models.adapters import attnlab_modules
    return attnlab_modules(model)


def freeze_all_but_attention(student) -> list[torch.nn.Parameter]:
    """requires_grad only on the attnlab attention modules' parameters; returns them."""
    for p in student.parameters():
        p.requires_grad_(False)
    params = [p for m in _modules(student) for p in m.parameters()]
    for p in params:
        p.requires_grad_(True)
    return params


def kl_loss(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(teacher || student), logits (..., V)."""
    t = teacher_logits.float().log_softmax(-1).flatten(0, -2)  # (n, V)
    s = student_logits.float().log_softmax(-1).flatten(0, -2)
    return F.kl_div(s, t, log_target=True, reduction="batchmean")


def normalised_mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """mean((out - target)^2) / mean(target^2): the layer-wise phase's loss, comparable across layers."""
    return (out.float() - target.float()).pow(2).mean() / target.float().pow(2).mean().clamp_min(1e-30)


def distill_loss(teacher, student, ids: torch.Tensor) -> float:
    """KL(teacher || student) on a batch of windows (B, T), no gradients: the quantity phase 2 lowers."""
    with torch.no_grad():
        return float(kl_loss(teacher(ids).logits, student(ids).logits))


def _cosine(step: int, total: int, warmup: int, floor: float = 0.1) -> float:
    if step < warmup:
        return (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t))


def warmup_steps(steps: int) -> int:
    """Warm-up of a schedule of `steps` steps (5%, at least 1): a layer cut off by the budget after a step or two
    stays near its start."""
    return max(1, steps // 20)


def _generator(*key: int) -> torch.Generator:
    return torch.Generator().manual_seed(hash(key) & 0x7FFF_FFFF_FFFF)


def add_lora(student, rank: int) -> None:
    """LoRA adapters (peft) on every linear map of the attention modules; only those train."""
    from peft import LoraConfig, inject_adapter_in_model

    for m in _modules(student):
        names = [n for n in LORA_TARGETS if getattr(m, n, None) is not None]
        inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=rank, target_modules=names), m)
    for p in student.parameters():
        p.requires_grad_(False)
    for m in _modules(student):
        for n, p in m.named_parameters():
            p.requires_grad_("lora_" in n)


def merge_lora(student) -> None:
    """Fold the LoRA adapters into the weights and put plain nn.Linear layers back."""
    from peft.tuners.lora import LoraLayer

    for m in _modules(student):
        for name in LORA_TARGETS:
            layer = getattr(m, name, None)
            if isinstance(layer, LoraLayer):
                layer.merge()
                setattr(m, name, layer.get_base_layer())


class Healer:
    """Layer-wise then end-to-end distillation of `student` from `teacher`, resumable (module docstring).

    windows: (N, T) training token ids. checkpoint: a file path (None: no checkpoints).
    budget: a runtime.Budget (its deadline and stop request); default none of either.
    progress(info) is called after every step with a dict (phase, step, total, loss, tokens, ...).
    """

    def __init__(self, teacher, student, windows: torch.Tensor, plan: HealPlan, *, device="cpu",
                 checkpoint=None, checkpoint_seconds: float = 300.0, progress=None, budget: Budget | None = None):
        plan.check()
        if windows.dim() != 2 or windows.shape[1] != plan.seq_len or windows.shape[0] < 1:
            raise ValueError(f"training windows must be (N >= 1, seq_len = {plan.seq_len}), "
                             f"got {tuple(windows.shape)}")
        self.teacher, self.student, self.plan = teacher.eval(), student.eval(), plan
        self.device = torch.device(device)
        self.windows = windows
        self.checkpoint = None if checkpoint is None else Path(checkpoint)
        self.checkpoint_seconds, self.progress = checkpoint_seconds, progress
        self.budget = budget if budget is not None else Budget()
        self.autocast = self.device.type == "cuda"  # bf16 where the hardware has it
        self.state = {"phase": "layers" if plan.layer_steps else "distill", "layer": 0, "step": 0, "tokens": 0,
                      "total_steps": None, "elapsed": 0.0, "layer_losses": [], "distill_losses": [],
                      "steps_done": 0}
        self.fingerprints = {"student": fingerprint((f"{i}.{k}", v) for i, m in enumerate(_modules(student))
                                                    for k, v in m.state_dict().items()),
                             "teacher": fingerprint(teacher.state_dict().items())}
        for p in teacher.parameters():
            p.requires_grad_(False)
        if plan.lora_rank:
            add_lora(student, plan.lora_rank)
        else:
            freeze_all_but_attention(student)
        self.optimizer = None
        self.steps_this_run = 0
        self._inputs = None

    # -- checkpoints ---------------------------------------------------------------------------
    def request_stop(self) -> None:
        """Stop at the next step boundary (or the next window of an evaluation), after writing a checkpoint."""
        self.budget.request_stop()

    def save(self) -> None:
        """Write the checkpoint atomically (a disk that refuses it gives a one-line ValueError, no leftover)."""
        if self.checkpoint is None:
            return
        blob = {"format": "attnlab-heal", "plan": asdict(self.plan), "state": dict(self.state),
                "fingerprint": dict(self.fingerprints),
                "student": {f"{i}.{k}": v.detach().cpu() for i, m in enumerate(_modules(self.student))
                            for k, v in m.state_dict().items()},
                "optimizer": None if self.optimizer is None else self.optimizer.state_dict(),
                "windows": self.windows.cpu()}
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
        """Continue from a checkpoint of the same plan, student and teacher (weights, optimizer, phase, step, windows)."""
        marks = blob.get("fingerprint")
        if not isinstance(marks, dict):
            raise ValueError(f"{where} records no fingerprint of its models (an older attnlab wrote it); "
                             "start afresh without --resume")
        for who, what in (("student", "the converted model it started from"), ("teacher", "its teacher")):
            if marks.get(who) != self.fingerprints[who]:
                raise ValueError(f"{where} belongs to another run: {what} differs from this run's {who} "
                                 "(resume with the same model and teacher, or start afresh)")
        if blob["plan"] != asdict(self.plan):
            diff = sorted(k for k in blob["plan"] if blob["plan"][k] != asdict(self.plan).get(k))
            raise ValueError(f"{where} was made with a different plan ({', '.join(diff)} differ)")
        self.windows = blob["windows"]
        for i, m in enumerate(_modules(self.student)):
            prefix = f"{i}."
            m.load_state_dict({k[len(prefix):]: v for k, v in blob["student"].items() if k.startswith(prefix)})
        self.state = dict(blob["state"])
        self.state.setdefault("steps_done", 0)
        self._make_optimizer()
        if blob["optimizer"] is not None and self.optimizer is not None:
            self.optimizer.load_state_dict(blob["optimizer"])

    # -- phases --------------------------------------------------------------------------------
    def _make_optimizer(self):
        s = self.state
        if s["phase"] == "layers":
            params = [p for p in _modules(self.student)[s["layer"]].parameters() if p.requires_grad]
            self.optimizer = torch.optim.AdamW(params, lr=self.plan.layer_lr, weight_decay=0.0)
        elif s["phase"] == "distill":
            params = [p for p in self.student.parameters() if p.requires_grad]
            self.optimizer = torch.optim.AdamW(params, lr=self.plan.lr, weight_decay=0.0)
        else:
            self.optimizer = None

    def _layer_inputs(self, chunk: int = 8):
        """Each layer's attention input (n, T, dim) on the first layer_windows windows, from the teacher.

        Computed `chunk` windows at a time, checking the budget in between (runtime.Stopped).
        """
        if self._inputs is None:
            from ..models.evaluate import attention_inputs
            ids = self.windows[: self.plan.layer_windows].to(self.device)
            parts = []
            for start in range(0, ids.shape[0], chunk):
                if start:
                    self.budget.check()
                part = ids[start:start + chunk]
                parts.append([x.reshape(part.shape[0], part.shape[1], -1) for x in attention_inputs(self.teacher, part)])
            self._inputs = [torch.cat(layer) for layer in zip(*parts)]
        return self._inputs

    def _layer_step(self) -> float:
        s, plan = self.state, self.plan
        layer = s["layer"]
        x_all = self._layer_inputs()[layer]  # (n, T, dim)
        idx = torch.randint(x_all.shape[0], (min(plan.layer_batch, x_all.shape[0]),),
                            generator=_generator(plan.seed, 1, layer, s["step"]))
        x = x_all[idx.to(x_all.device)]  # (b, T, dim)
        with torch.no_grad():
            target = _modules(self.teacher)[layer](x, is_causal=True)  # (b, T, dim)
        for g in self.optimizer.param_groups:
            g["lr"] = plan.layer_lr * _cosine(s["step"], plan.layer_steps, warmup_steps(plan.layer_steps))
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            out = _modules(self.student)[layer](x, is_causal=True)
        loss = normalised_mse(out, target)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        s["step"] += 1
        if s["step"] == plan.layer_steps:
            s["layer_losses"].append(loss.item())
            s["layer"], s["step"] = s["layer"] + 1, 0
            if s["layer"] == len(_modules(self.student)):
                s["phase"], s["layer"] = "distill", 0
                self._inputs = None
            self._make_optimizer()
        return loss.item()

    def _batch(self, step: int) -> torch.Tensor:
        B, N = self.plan.batch_size, self.windows.shape[0]
        rows = []
        for k in range(step * B, (step + 1) * B):
            epoch, pos = divmod(k, N)
            rows.append(int(torch.randperm(N, generator=_generator(self.plan.seed, 2, epoch))[pos]))
        return self.windows[rows].to(self.device)  # (B, T)

    def _distill_step(self) -> float:
        s, plan = self.state, self.plan
        ids = self._batch(s["step"])
        for g in self.optimizer.param_groups:
            g["lr"] = plan.lr * _cosine(s["step"], s["total_steps"] or 10 ** 9, plan.warmup)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            with torch.no_grad():
                t_logits = self.teacher(ids).logits
            loss = kl_loss(t_logits, self.student(ids).logits)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for g in self.optimizer.param_groups for p in g["params"]], 1.0)
        self.optimizer.step()
        s["step"] += 1
        s["tokens"] += ids.numel()
        s["distill_losses"].append(loss.item())
        if s["total_steps"] is not None and s["step"] >= s["total_steps"]:
            s["phase"] = "done"
            self.optimizer = None
        return loss.item()

    # -- the loop ------------------------------------------------------------------------------
    def run(self, minutes: float | None = None, *, reserve: float = 0.0) -> str:
        """Train until the plan is done, the budget is spent or a stop is requested.

        minutes: a budget for this call (within the Healer's own); reserve: seconds to leave
        unspent at the end (the evaluation that follows). A step starts only if the last step's
        time plus the reserve still fits. Returns "done", "budget" (resumable) or "stopped". A
        checkpoint is written at the end in every case, and every checkpoint_seconds on the way.
        """
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
        while s["phase"] != "done":
            if budget.stop_requested:
                status = "stopped"
                break
            if budget.expired(reserve + step_time):
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
            self.steps_this_run += 1
            s["steps_done"] += 1
            s["elapsed"] = elapsed0 + clock() - start
            if phase == "distill" and s["total_steps"] is None and s["step"] == max(3, plan.warmup):
                left = (budget.left() - reserve) / max(step_time, 1e-9)  # steps the budget allows from here
                s["total_steps"] = s["step"] + max(1, int(left))
            if self.progress:
                self.progress(self._info(phase, loss, step_time))
            if clock() - last_save > self.checkpoint_seconds:
                self.save()
                last_save = clock()
        s["elapsed"] = elapsed0 + clock() - start
        self.save()
        return status

    def _info(self, phase, loss, step_time) -> dict:
        s, plan, n = self.state, self.plan, len(_modules(self.student))
        if phase == "layers":
            done = s["layer"] * plan.layer_steps + s["step"] if s["phase"] == "layers" else n * plan.layer_steps
            total = n * plan.layer_steps
            tokens = plan.layer_batch * plan.seq_len
        else:
            done, total, tokens = s["step"], s["total_steps"], plan.batch_size * plan.seq_len
        return {"phase": phase, "layer": s["layer"], "done": done, "total": total, "loss": loss,
                "tokens": s["tokens"], "tokens_per_s": tokens / max(step_time, 1e-9),
                "eta_s": None if total is None else (total - done) * step_time}

    def finish(self) -> None:
        """Merge LoRA adapters (if any) and stop tracking gradients: the student is an ordinary model again."""
        if self.plan.lora_rank:
            merge_lora(self.student)
        for p in self.student.parameters():
            p.requires_grad_(False)


def heal_model(teacher, student, windows: torch.Tensor, held_out: torch.Tensor, plan: HealPlan, *,
               minutes: float | None = None, budget: Budget | None = None, device="cpu", checkpoint=None,
               resume: bool = False, checkpoint_seconds: float = 300.0, progress=None, evaluate: bool = True,
               stop_hook=None, eval_share: float = 0.1) -> dict:
    """Measure, heal (Healer), measure again, all inside one budget; returns the report. The student heals in place.

    budget: a runtime.Budget (or minutes: a new one). The evaluation before training gets at most
    eval_share of what is left (it scores as many held-out windows as fit, at least one); training
    then stops early enough to leave the time that evaluation took for the one after it. A stop
    request (Ctrl-C, request_stop) is honoured at the next step or evaluation window: the checkpoint
    is written and the report's status is "stopped". report["trained_steps"] counts the steps of
    this call; 0 means nothing was trained (the budget was spent first).
    resume: continue from `checkpoint` (its plan, student and teacher must be this run's).
    stop_hook(healer) is called once the Healer exists (e.g. to wire a signal to request_stop).
    """
    from .data import check_pair
    from .evaluate import evaluate_pair, public

    if budget is None:
        budget = Budget(minutes)
    elif minutes is not None:
        budget = budget.share(seconds=60.0 * minutes)
    check_pair(teacher, student)
    blob = Healer.read(checkpoint) if resume else None
    healer = Healer(teacher, student, windows, plan, device=device, checkpoint=checkpoint,
                    checkpoint_seconds=checkpoint_seconds, progress=progress, budget=budget)
    report = {"plan": asdict(plan), "device": str(device)}
    if blob is not None:
        healer.restore(blob, str(checkpoint))
        report = blob["state"].get("report", report)
    if stop_hook:
        stop_hook(healer)
    status = None
    try:
        if evaluate and "before" not in report:
            t0 = budget.clock()
            before = evaluate_pair(teacher, student, held_out, budget=budget.share(eval_share))
            report["teacher"] = {"perplexity": before.pop("teacher_perplexity"),
                                 "kv_bytes_per_token": kv_bytes_per_token(teacher)}
            report["before"] = public(before)
            report["evaluation_seconds"] = budget.clock() - t0
            healer.state["reference"] = before
        healer.state["report"] = report
        status = healer.run(reserve=report.get("evaluation_seconds", 0.0) if evaluate else 0.0)
    except Stopped as e:
        healer.save()
        status = "stopped" if e.reason == "stop" else "budget"
    healer.finish()
    s = healer.state
    report.update(status=status, minutes=s["elapsed"] / 60, distill_tokens=s["tokens"],
                  distill_steps=s["step"] if s["phase"] != "layers" else 0, layer_losses=s["layer_losses"],
                  distill_loss_first=s["distill_losses"][:1], distill_loss_last=s["distill_losses"][-5:],
                  trained_steps=healer.steps_this_run, steps_done=s["steps_done"])
    if evaluate and status != "stopped" and s["steps_done"] and "reference" in s:
        try:
            report["after"] = public(evaluate_pair(teacher, student, held_out, budget=budget.unbounded(),
                                                   reference=s["reference"]))
        except Stopped:
            report["status"] = "stopped"
    return report

