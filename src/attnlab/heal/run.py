"""heal_model: one heal as a whole job inside one time budget, around the Healer of distill.py.

Evaluate the student against the teacher on the held-out texts before (a bounded share of the budget), train
(Healer.run, leaving the time that evaluation took for the one after), judge a probe of the end-to-end phase where
the plan has one (_probe: guard.worse on every held-out text), score the layer-wise phase's student where an
end-to-end phase would follow it (_switch), evaluate after, keep the layer-wise weights where the end-to-end steps
left the student farther from the teacher on any text, and the converted weights where the healed student is
farther from it than they were (guard.worse both). The report holds every figure and every
decision's reason. Over a torchrun job every rank calls it alike (distributed.py).
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


def heal_model(teacher, student, windows: torch.Tensor, held_out, plan: HealPlan, *,
               minutes: float | None = None, budget: Budget | None = None, device="cpu", checkpoint=None,
               resume: bool = False, checkpoint_seconds: float = 300.0, progress=None, evaluate: bool = True,
               stop_hook=None, eval_share: float = 0.1, world: dd.World | None = None, shard: bool = False,
               keep_better: bool = True) -> dict:
    """Measure, heal (Healer), measure again, all inside one budget; returns the report. The student heals in place.

    held_out: the held-out text the student is judged on: token ids (1, M), or a list or tuple of such tensors
    (several texts, e.g. of different kinds: the decisions below then need the student no farther from the teacher on
    every one). Each evaluation (evaluate.evaluate_texts) scores every text; report["before"], report["after"] (and
    report["healed"], report["probe"]) hold the figures over all the texts' tokens under the keys of one text
    ("kl": mean KL(teacher || student) per position, "top1_agreement", "perplexity", "tokens", "windows", ...) and
    "texts": each text's own, in order; report["teacher"] holds the teacher's perplexity over all of them and "texts":
    [{"perplexity"}] each text's. With one text the figures are that text's.
    budget: a runtime.Budget (or minutes: a new one). The evaluation before training gets at most
    eval_share of what is left (it scores as many held-out windows as fit, at least one per text, each text an equal
    part); training then stops early enough to leave the time that evaluation took for the one after it. A stop
    request (Ctrl-C, request_stop) is honoured at the next step or evaluation window: the checkpoint
    is written and the report's status is "stopped". report["trained_steps"] counts the steps of
    this call; 0 means nothing was trained (the budget was spent first).
    resume: continue from `checkpoint` (its plan, student and teacher must be this run's, and the same number of
    held-out texts).
    stop_hook(healer) is called once the Healer exists (e.g. to wire a signal to request_stop).
    world, shard: data-parallel over a torchrun job (Healer). Every rank calls heal_model with the same held-out
    texts: rank 0 reads the checkpoint and sends it to the others; the evaluations split each text's windows and
    prompts over the ranks (evaluate_pair's world), every rank gets the same figures and so the same decisions, and a
    stop during the first one on any rank stops all.
    With shard the teacher is sharded in place for the training (Healer) and comes back whole: gathered on every
    rank, an FSDP2 module that runs without collectives.
    keep_better: when the healed student is worse than the converted one before training (guard.worse: on any
    held-out text its KL to the teacher rose, or its top-1 agreement fell by more than guard.TOP1_TOLERANCE;
    perplexity alone never decides), put the converted weights back (they are the better model): report["kept"]
    says why and report["healed"] holds the healed student's figures; report["after"] is then the model returned.
    The layer-wise guard (module docstring) acts within the heal; report["layers_restored"] names the layers it
    gave their start weights back and report["lr_scale"] the factor it left on the learning rates;
    report["rollbacks"] lists the end-to-end steps the blow-up guard rolled back ({"step", "loss", "start",
    "good_loss", "lr_scale"} each), report["hard_batches"] those past its first line that stood ({"step", "loss",
    "good_loss"}: their batch read as high on the last good weights). A heal that ends (budget or stop) inside a
    layer's layer-wise steps has that layer judged by the same rule (Healer.judge_cut_layer; report["layer_cut"],
    None when no layer was cut);
    report["layer_steps_fitted"] holds the steps a layer Healer._fit_layers fitted to the time (None: the plan's).
    With keep_better, an end-to-end phase after a layer-wise one is judged as a whole (_switch): report["layer_wise"]
    holds the layer-wise student's figures where it would start ("evaluation", no greedy text) and the verdict; when
    its steps left the student farther from the teacher on any text (guard.worse), the layer-wise weights come back
    and report["end_to_end"] holds the figures of the student they replaced. With less time left there than the
    evaluation before training took, no end-to-end step is taken. Not with LoRA (plan.lora_rank): its adapters are
    merged at the end, and weights kept with them attached would not load into the merged modules.
    """
    from .data import check_pair
    from .evaluate import evaluate_texts, held_out_texts, public

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
    status = None
    try:
        if evaluate and "before" not in report:
            t0 = budget.clock()
            with healer.teacher_whole():
                before = evaluate_texts(teacher, student, texts, budget=budget.share(eval_share), world=world,
                                        prompts=plan.prompts)
            report["teacher"] = {"perplexity": before.pop("teacher_perplexity"),
                                 "kv_bytes_per_token": kv_bytes_per_token(teacher),
                                 "texts": [{"perplexity": t.pop("teacher_perplexity")} for t in before["texts"]]}
            report["before"] = public(before)
            report["evaluation_seconds"] = budget.clock() - t0
            healer.state["reference"] = before
        healer.state["report"] = report
    except Stopped as e:
        status = "stopped" if e.reason == "stop" else "budget"
    if world.distributed:  # a stop on any rank stops all (a stop request outranks a spent budget)
        status = _STATUSES[dd.largest(_STATUSES.index(status))]
    if status is None:
        reserve = report.get("evaluation_seconds", 0.0) if evaluate else 0.0
        status = healer.run(reserve=reserve)
        while status in ("probe", "switch"):
            if status == "switch":
                report["layer_wise"] = _switch(healer, texts, world, reserve, report.get("evaluation_seconds", 0.0))
            else:
                report["probe"] = _probe(healer, texts, converted, world) if evaluate else {
                    "verdict": "kept the end-to-end phase (no held-out windows to judge it on)"}
            healer.state["report"] = report
            status = healer.run(reserve=reserve)
        report["layer_cut"] = None if status == "done" else healer.judge_cut_layer()
    else:
        healer.save()
    healer.finish()
    if healer.teacher_sharded:  # whole again: the evaluation after training, and the caller's (rank 0's) own use
        dd.whole(teacher)
    s = healer.state
    report.update(status=status, minutes=s["elapsed"] / 60, distill_tokens=s["tokens"],
                  distill_steps=s["step"] if s["phase"] != "layers" else 0, layer_losses=s["layer_losses"],
                  distill_loss_first=s["distill_losses"][:1], distill_loss_last=s["distill_losses"][-5:],
                  trained_steps=healer.steps_this_run, steps_done=s["steps_done"], layer_checks=s["layer_checks"],
                  layers_restored=s["layers_restored"], lr_scale=s["lr_scale"], rollbacks=s["rollbacks"],
                  hard_batches=s["hard_batches"], layer_steps_fitted=s.get("layer_steps"),
                  layers_trained=list(healer.layers))
    if evaluate and status != "stopped" and s["steps_done"] and "reference" in s:
        try:
            report["after"] = public(evaluate_texts(teacher, student, texts, budget=budget.unbounded(),
                                                    reference=s["reference"], world=world))
        except Stopped:
            report["status"] = "stopped"
        _judge_end_to_end(healer, report)
        if keep_better and converted is not None and guard.worse(report.get("before"), report.get("after")):
            why = guard.reason(report["before"], report["after"]) or "judged worse than the converted student"
            load_attention_weights(attention_modules(student), converted)
            report["healed"], report["after"] = report["after"], copy.deepcopy(report["before"])
            report["kept"] = f"the converted weights: healed, {why}"
    return report


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
