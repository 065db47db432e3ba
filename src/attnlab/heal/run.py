"""heal_model: one heal as a whole job inside one time budget, around the Healer of distill.py.

Evaluate the student against the teacher on the held-out texts, train (Healer.run), judge an end-to-end probe
(_probe) and an end-to-end phase after a layer-wise one (_switch), evaluate again, and keep the converted weights
where the healed student is farther from the teacher on any text (guard.worse). Every rank of a torchrun job calls it.
"""
from __future__ import annotations

import copy
from dataclasses import asdict

import torch

from ..models.evaluate import kv_bytes_per_token
from ..runtime.budget import Budget, Stopped
from . import distributed as dd
from . import guard
from .distill import Healer
from .plan import HealPlan
from .trainable import attention_modules, attention_weights, load_attention_weights

_STATUSES = (None, "budget", "stopped")  # a run's end, by rank: the largest over the ranks wins


# heal_model's report holds every figure and every decision's reason. "before", "after" (and "healed", "probe"):
# evaluate.evaluate_texts' figures, over all the texts' tokens under the keys of one text ("kl", "top1_agreement",
# "perplexity", "tokens", "windows", ...) and "texts", each text's own; "teacher": the teacher's perplexity, alike;
# "trained_steps": this call's steps (0: nothing trained). With keep_better: "kept" says why, "healed" holds the healed
# student's figures, "after" the model returned; "layer_wise" the layer-wise student's figures and the verdict on the
# end-to-end phase after it (_switch), "end_to_end" the student its weights replaced. The guards (guard.py):
# "layers_restored", "lr_scale", "rollbacks", "hard_batches", "layer_cut" (a layer cut off inside its steps, judged
# alike: Healer.judge_cut_layer) and "layer_steps_fitted" (the steps a layer Healer._fit_layers fitted; None: the
# plan's).
def heal_model(teacher, student,
               windows: torch.Tensor,  # (N, T) training ids
               # token ids (1, M), or a list of them (several texts: every decision then needs the student no farther
               # from the teacher on every one)
               held_out,
               plan: HealPlan, *,
               minutes: float | None = None,  # a new Budget of that many minutes, or that share of `budget`
               # a runtime.Budget: the evaluation before training gets at most eval_share of what is left, and training
               # stops early enough to leave that time for the one after
               budget: Budget | None = None,
               device="cpu", checkpoint=None,
               resume: bool = False,  # from checkpoint: its plan, student, teacher and count of texts must be ours
               checkpoint_seconds: float = 300.0, progress=None, evaluate: bool = True,
               stop_hook=None,  # stop_hook(healer), called once the Healer exists (e.g. a signal -> request_stop)
               eval_share: float = 0.1,
               # data-parallel over a torchrun job (Healer): rank 0 reads the checkpoint and sends it to the others; the
               # evaluations split each text's windows and prompts over the ranks, so every rank takes the same
               # decisions. With shard the teacher is sharded for the training and comes back whole
               world: dd.World | None = None, shard: bool = False,
               # a healed student worse than the converted one (guard.worse) gets the converted weights back; an
               # end-to-end phase after a layer-wise one is judged as a whole (_switch), and not run with less time
               # left there than the evaluation before training took. Not with LoRA (plan.lora_rank)
               keep_better: bool = True) -> dict:
    """Measure, heal (Healer), measure again, all inside one budget; returns the report (its keys: the comment above).
    The student heals in place; with keep_better it comes back converted where the heal left it farther from the
    teacher on any held-out text. A stop request is honoured at the next step or evaluation window: the checkpoint is
    written and the status is "stopped"."""
    from .data import check_pair
    from .evaluate import held_out_texts

    texts = held_out_texts(held_out)
    if budget is None:
        budget = Budget(minutes)
    elif minutes is not None:
        budget = budget.share(seconds=60.0 * minutes)
    check_pair(teacher, student)
    world = world if world is not None else dd.World()
    if world.distributed:
        device = world.device
        blob = dd.from_rank0(lambda: Healer.read(checkpoint)) if resume else None
    else:
        blob = Healer.read(checkpoint) if resume else None
    converted = {k: v.clone() for k, v in attention_weights(attention_modules(student)).items()} \
        if (keep_better or plan.probe) and evaluate else None  # the weights as converted
    healer = Healer(teacher, student, windows, plan, device=device, checkpoint=checkpoint,
                    checkpoint_seconds=checkpoint_seconds, progress=progress, budget=budget, world=world,
                    shard=shard, judge=keep_better and evaluate and not plan.lora_rank)
    report = {"plan": asdict(plan), "device": str(device)}
    if blob is not None:
        healer.restore(blob, str(checkpoint))
        report = blob["state"].get("report", report)
    if stop_hook:
        stop_hook(healer)
    status = _measure_before(healer, report, texts, eval_share, evaluate)
    status = _train(healer, report, texts, converted, status, evaluate)
    healer.finish()
    if healer.teacher_sharded:  # whole again: the evaluation after training, and the caller's (rank 0's) own use
        dd.whole(teacher)
    _summarise(healer, report, status)
    if evaluate and status != "stopped" and healer.state["steps_done"] and "reference" in healer.state:
        _measure_after(healer, report, texts, converted if keep_better else None)
    return report


def measure_pair(teacher, student, texts, report: dict, budget: Budget, world=None, prompts: int = 8) -> dict:
    """The student against the teacher on the held-out texts (evaluate.evaluate_texts): report["teacher"],
    ["before"] and ["evaluation_seconds"] set; returns the full evaluation (the reference a later one compares to)."""
    from .evaluate import evaluate_texts, public

    t0 = budget.clock()
    before = evaluate_texts(teacher, student, texts, budget=budget, world=world, prompts=prompts)
    report["teacher"] = {"perplexity": before.pop("teacher_perplexity"),
                         "kv_bytes_per_token": kv_bytes_per_token(teacher),
                         "texts": [{"perplexity": t.pop("teacher_perplexity")} for t in before["texts"]]}
    report["before"] = public(before)
    report["evaluation_seconds"] = budget.clock() - t0
    return before


def _measure_before(healer: Healer, report: dict, texts, eval_share: float, evaluate: bool) -> str | None:
    """The evaluation before training (unless a resumed report has it), into the report and the healer's state; the
    run's status so far (None, or "stopped"/"budget" where the clock or a stop cut it), agreed over the ranks."""
    budget, world, status = healer.budget, healer.world, None
    try:
        if evaluate and "before" not in report:
            with healer.teacher_whole():
                healer.state["reference"] = measure_pair(healer.teacher, healer.student, texts, report,
                                                         budget.share(eval_share), world, healer.plan.prompts)
        healer.state["report"] = report
    except Stopped as e:
        status = "stopped" if e.reason == "stop" else "budget"
    if world.distributed:  # a stop on any rank stops all (a stop request outranks a spent budget)
        status = _STATUSES[dd.largest(_STATUSES.index(status))]
    return status


def _train(healer: Healer, report: dict, texts, converted, status: str | None, evaluate: bool) -> str:
    """The heal's phases (Healer.run), with the probe's and the switch's verdicts between them; the final status."""
    if status is not None:
        healer.save()
        return status
    one = report.get("evaluation_seconds", 0.0)
    reserve = one if evaluate else 0.0
    status = healer.run(reserve=reserve)
    while status in ("probe", "switch"):
        if status == "switch":
            report["layer_wise"] = _switch(healer, texts, healer.world, reserve, one)
        else:
            report["probe"] = _probe(healer, texts, converted, healer.world) if evaluate else {
                "verdict": "kept the end-to-end phase (no held-out windows to judge it on)"}
        healer.state["report"] = report
        status = healer.run(reserve=reserve)
    report["layer_cut"] = None if status == "done" else healer.judge_cut_layer()
    return status


def _summarise(healer: Healer, report: dict, status: str) -> None:
    """What the heal did, from the healer's state, into the report."""
    s = healer.state
    report.update(status=status, minutes=s["elapsed"] / 60, distill_tokens=s["tokens"],
                  distill_steps=s["step"] if s["phase"] != "layers" else 0, layer_losses=s["layer_losses"],
                  distill_loss_first=s["distill_losses"][:1], distill_loss_last=s["distill_losses"][-5:],
                  trained_steps=healer.steps_this_run, steps_done=s["steps_done"], layer_checks=s["layer_checks"],
                  layers_restored=s["layers_restored"], lr_scale=s["lr_scale"], rollbacks=s["rollbacks"],
                  hard_batches=s["hard_batches"], layer_steps_fitted=s.get("layer_steps"),
                  layers_trained=list(healer.layers))


def _measure_after(healer: Healer, report: dict, texts, converted: dict | None) -> None:
    """The evaluation after training, the verdict on an end-to-end phase after a switch, and (given the converted
    weights: keep_better) those weights back where the heal left the student worse (guard.worse)."""
    from .evaluate import evaluate_texts, public

    try:
        report["after"] = public(evaluate_texts(healer.teacher, healer.student, texts,
                                                budget=healer.budget.unbounded(),
                                                reference=healer.state["reference"], world=healer.world))
    except Stopped:
        report["status"] = "stopped"
    _judge_end_to_end(healer, report)
    if converted is not None and guard.worse(report.get("before"), report.get("after")):
        why = guard.reason(report["before"], report["after"]) or "judged worse than the converted student"
        load_attention_weights(attention_modules(healer.student), converted)
        report["healed"], report["after"] = report["after"], copy.deepcopy(report["before"])
        report["kept"] = f"the converted weights: healed, {why}"


def _score(healer: Healer, texts: list[torch.Tensor], world: dd.World, **kw) -> dict:
    """The student scored now, inside the heal, against the evaluation before training (its windows, the teacher's
    answers there), with the teacher gathered whole for it; the public figures. kw: evaluate_pair's (prompts=0: no
    greedy text). Every rank calls it."""
    from .evaluate import evaluate_texts, public

    with healer.teacher_whole():
        return public(evaluate_texts(healer.teacher, healer.student, texts, budget=healer.budget.unbounded(),
                                     reference=healer.state["reference"], world=world, **kw))


def _probe(healer: Healer, texts: list[torch.Tensor], converted: dict, world: dd.World) -> dict:
    """Judge the end-to-end phase at its probe point on the held-out texts of the evaluation before training
    (guard.worse: the KL to the teacher, top-1 agreement; perplexity is reported, not judged), and settle it
    (Healer.settle_probe): the figures and the verdict, for the report. Every rank calls it (the evaluation is split
    over the ranks and its figures reduced, so every rank reaches the same verdict)."""
    s = healer.state
    now = _score(healer, texts, world)
    before, step = s["report"]["before"], s["step"]
    harmful = guard.worse(before, now)
    why = guard.reason(before, now) if harmful else None
    healer.settle_probe(harmful, converted)
    verdict = ("the converted weights back and the layer-wise phase for the rest" if harmful
               else "kept the end-to-end phase")
    out = {"step": step, "perplexity": now["perplexity"], "top1_agreement": now["top1_agreement"], "kl": now.get("kl"),
           "before": before["perplexity"], "top1_before": before["top1_agreement"], "kl_before": before.get("kl"),
           "texts": now["texts"], "verdict": verdict}
    if why:
        out["reason"] = why
    return out


def _switch(healer: Healer, texts: list[torch.Tensor], world: dd.World, reserve: float, one: float) -> dict:
    """Where an end-to-end phase would follow the layer-wise one: with at least `one` evaluation's seconds left
    beyond the `reserve`, score the layer-wise student on the held-out texts (KL and top-1 against the evaluation
    before training; no greedy text, which no decision reads) and keep its weights (Healer.keep_layer_wise) for the
    verdict at the end (_judge_end_to_end); else end the heal there (Healer.end_at_switch). Returns the report's
    "layer_wise" entry. Every rank calls it, and the clock's verdict is agreed."""
    budget = healer.budget
    if healer._agree(budget.expired(reserve + one)):
        left = max(0.0, budget.left() - reserve)
        healer.end_at_switch()
        return {"verdict": f"no end-to-end phase: {left:.0f} s left, less than one evaluation ({one:.0f} s) to "
                           "judge it with"}
    t0 = budget.clock()
    now = _score(healer, texts, world, prompts=0)
    healer.keep_layer_wise()
    return {"evaluation": now, "seconds": budget.clock() - t0, "verdict": "pending"}


def _judge_end_to_end(healer: Healer, report: dict) -> None:
    """The verdict on an end-to-end phase judged at the switch (_switch), once report["after"] holds its end: the
    layer-wise weights back when the student is farther from the teacher than they left it on any held-out text
    (guard.worse), report["after"] then theirs and report["end_to_end"] the figures of the student they replaced."""
    entry = report.get("layer_wise") or {}
    if "evaluation" not in entry or "after" not in report or healer.layer_wise is None:
        return
    steps = healer.state["step"]  # the end-to-end phase's (the layer-wise phase ended at the switch)
    entry["end_to_end_steps"] = steps
    if not steps:
        entry["verdict"] = "no end-to-end step fitted after the layer-wise phase"
        return
    why = guard.reason(entry["evaluation"], report["after"])
    if why is None:
        entry["verdict"] = "kept the end-to-end phase"
        return
    load_attention_weights(attention_modules(healer.student), healer.layer_wise)
    report["end_to_end"], report["after"] = report["after"], copy.deepcopy(entry["evaluation"])
    entry["verdict"] = "the layer-wise weights back"
    entry["reason"] = f"end to end, {why}"
