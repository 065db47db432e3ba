"""What keeps a heal from leaving the model worse than it was converted (docs/decisions.md says why): the layer-wise
guard (after_layer), the end-to-end phase's blow-up guard (past_line, blown_up, rolled_back) and heal_model's
keep-better test (worse), which also judges the end-to-end probe. distill.Healer and run.heal_model apply them; their
part of the Healer's state is plain numbers and lists (initial_state), so checkpoints hold it as they hold the rest.
"""
from __future__ import annotations

import math

from .evaluate import flips

WINDOWS = 4  # windows on which the layer-wise guard compares a layer's start and end
GUARD_CUT = 4.0  # a layer that ended worse than it started, or an end-to-end blow-up, divides the later rates by this
BLOW_UP = 2.0  # an end-to-end step whose loss is above this many times the phase's first loss is rolled back
# worse: a fall of top-1 agreement is a sign of harm when the positions lost outnumber those gained at this level of
# a one-sided sign test (the chance that flips with no preferred direction lose that many or more)
TOP1_ALPHA = 0.01
ALPHA_VARIABLE = "ATTNLAB_TOP1_ALPHA"  # a level from 0 to 1 in its place: the protocol's variants to fit it
# an evaluation without its positions ("top1_positions": a checkpoint of an older attnlab) may fall this much instead
TOP1_TOLERANCE = 0.005


def initial_state() -> dict:
    """The guard's part of the Healer's state: the current layer's start error, each layer's (start, end) errors, the
    layers given back their start weights, the factor on both phases' learning rates, and the end-to-end steps rolled
    back (rolled_back), and those that stood past the line on a batch hard for the last good weights too
    (hard_batch)."""
    return {"layer_start_error": None, "layer_checks": [], "layers_restored": [], "lr_scale": 1.0, "rollbacks": [],
            "hard_batches": []}


# The layer-wise guard scores each layer on WINDOWS check windows before and after its steps. A layer that ended worse
# gets its start weights back and the later learning rates are divided by GUARD_CUT; one that ended better multiplies
# them by GUARD_CUT again, up to the plan's rates.
def layer_worse(before: float, after: float) -> bool:
    """The layer-wise guard's rule: a layer whose check error rose over its steps ended worse (any rise)."""
    return after > before


def after_layer(state: dict, layer: int, before: float, after: float) -> bool:
    """Record a layer's (start, end) check errors in `state` and move the rates' factor; True when the layer must get
    its start weights back (it ended worse)."""
    state["layer_checks"].append([before, after])
    if layer_worse(before, after):
        state["layers_restored"].append(layer)
        state["lr_scale"] /= GUARD_CUT
        return True
    state["lr_scale"] = min(1.0, state["lr_scale"] * GUARD_CUT)  # a near-exact layer is no sign for the others
    return False


# The blow-up guard: an end-to-end step whose loss exceeds BLOW_UP times the phase's first loss, and BLOW_UP times what
# the last good weights read on the same batch, does not stand; the trained weights go back to those of the last step
# that read well (good), the optimizer starts afresh and the rates are divided by GUARD_CUT (rolled_back). The second
# reading is taken only past the first line; a step whose batch reads as high on the good weights stands (hard_batch).
def good(state: dict, loss: float) -> bool:
    """Whether the weights an end-to-end step reads `loss` on are the blow-up guard's new fallback: the phase's first
    step, or a loss no higher than its (not merely below the BLOW_UP line, so that a slow climb goes back too)."""
    losses = state["distill_losses"]
    return not losses or loss <= losses[0]


def past_line(state: dict, loss: float) -> bool:
    """Whether the end-to-end step at state["step"] reads past the blow-up line: its loss above BLOW_UP times the
    phase's first. Never the first step, nor the step right after a rollback: its weights are the last good ones, so
    a high loss there is its batch's and it stands. Past the line, blown_up asks the last good weights."""
    losses, rollbacks = state["distill_losses"], state["rollbacks"]
    if not losses or (rollbacks and rollbacks[-1]["step"] == state["step"]):
        return False
    return loss > BLOW_UP * losses[0]


def blown_up(state: dict, loss: float, good_loss: float | None = None) -> bool:
    """Whether the end-to-end step at state["step"] must not stand: past the line (past_line) and, where the last good
    weights' loss on the same batch is given (good_loss), above BLOW_UP times that too. A step past the line on a
    batch that reads as high on the good weights is a hard batch, not a blow-up: it stands (hard_batch records it)."""
    return past_line(state, loss) and (good_loss is None or loss > BLOW_UP * good_loss)


def hard_batch(state: dict, loss: float, good_loss: float) -> None:
    """Record an end-to-end step past the line that stands: its batch read `good_loss` on the last good weights."""
    state["hard_batches"].append({"step": state["step"], "loss": loss, "good_loss": good_loss})


def rolled_back(state: dict, loss: float, good_loss: float | None = None) -> None:
    """Record a rollback of the end-to-end step at state["step"] (its loss, the phase's first, the last good weights'
    on its batch) and divide the rates' factor by GUARD_CUT; the Healer puts the weights of the last good step (good)
    back and starts a new optimizer."""
    state["lr_scale"] /= GUARD_CUT
    state["rollbacks"].append({"step": state["step"], "loss": loss, "start": state["distill_losses"][0],
                               "good_loss": good_loss, "lr_scale": state["lr_scale"]})


def guard_line(report: dict) -> str | None:
    """One line on what the guards did in a heal report: the layers the layer-wise guard gave back, the end-to-end
    steps that stood past the blow-up line and those rolled back (None when none of these happened)."""
    parts = []
    layers = report.get("layers_restored") or []
    if layers:
        parts.append(f"layer-wise: {len(layers)} of {len(report.get('layer_checks') or layers)} layers ended worse on "
                     f"the check windows than they started and kept their start weights (layers "
                     f"{', '.join(map(str, layers))})")
    cut = report.get("layer_cut")
    if cut:
        parts.append(f"layer {cut['layer']}, cut off after {cut['steps']} of its {cut['of']} layer-wise steps, "
                     + ("read worse than it started and kept its start weights" if cut["restored"] else
                        "read better than it started and kept its trained weights")
                     + f" (check error {cut['before']:.4g} -> {cut['after']:.4g})")
    hard = report.get("hard_batches") or []
    if hard:
        parts.append(f"end-to-end: {len(hard)} step(s) past {BLOW_UP:g}x the first loss stood: their batches read as "
                     f"high on the last good weights (steps {', '.join(str(h['step']) for h in hard)})")
    rollbacks = report.get("rollbacks") or []
    if rollbacks:
        steps = ", ".join(f"{r['step']} ({r['loss']:.3g})" for r in rollbacks)
        parts.append(f"end-to-end: {len(rollbacks)} step(s) whose loss passed {BLOW_UP:g}x the first "
                     f"({rollbacks[0]['start']:.3g}) rolled back to the last good weights (steps {steps})")
    if not parts:
        return None
    return "; ".join(parts) + f"; the later steps ran at {report['lr_scale']:g} of the plan's learning rates"


def probe_line(report: dict) -> str | None:
    """One line on the end-to-end probe's verdict in a heal report (None when the plan had no probe, or the phase ended
    before its probe step)."""
    probe = report.get("probe")
    if not probe:
        return None
    if "perplexity" not in probe:
        return f"probe: {probe['verdict']}"
    kl = f"KL to the teacher {probe['kl_before']:.4g} -> {probe['kl']:.4g} nats per token, " \
        if probe.get("kl_before") is not None and probe.get("kl") is not None else ""
    top1 = f"top-1 agreement {probe['top1_before']:.4f} -> {probe['top1_agreement']:.4f}, " \
        if probe.get("top1_before") is not None else ""
    return (f"probe after {probe['step']} end-to-end steps on the held-out text: {kl}{top1}perplexity "
            f"{probe['before']:.3f} -> {probe['perplexity']:.3f}; {probe['verdict']}")


def switch_line(report: dict) -> str | None:
    """One line on the verdict on an end-to-end phase after a layer-wise one (heal_model's report["layer_wise"]), or
    None when there was none to judge."""
    entry = report.get("layer_wise")
    if not entry:
        return None
    if "evaluation" not in entry:
        return entry["verdict"]
    steps = entry.get("end_to_end_steps")
    line = "the end-to-end phase" + (f" ({steps} steps)" if steps else "") + f": {entry['verdict']}"
    start, end = entry["evaluation"].get("kl"), (report.get("end_to_end") or report.get("after") or {}).get("kl")
    if steps and start is not None and end is not None:
        line += f", KL to the teacher {start:.4g} after the layer-wise phase, {end:.4g} after the end-to-end one"
    return line + (f" ({entry['reason']})" if entry.get("reason") else "")


def _texts(result: dict) -> list[dict]:
    return result.get("texts") or [result]


# The keep-better test (worse, reason) compares the student with the teacher, not with the text: KL and top-1 agreement
# on every held-out text, never perplexity; a fall of top-1 agreement counts only when the positions it lost outnumber
# those it gained beyond chance (sign_test at top1_alpha() on evaluate.flips). heal_model applies it three ways: the
# converted student against the healed one, the probe of an end-to-end phase run first, and the layer-wise phase's
# student against the end-to-end phase's after it (switch_line says what that verdict was).
def reason(before: dict | None, after: dict | None) -> str | None:
    """Why `after` is worse than `before` (worse), in words naming the text and the figures; None when it is not."""
    if before is None or after is None:
        return None
    b_texts, a_texts = _texts(before), _texts(after)
    if len(b_texts) != len(a_texts):
        raise ValueError(f"cannot compare evaluations of {len(b_texts)} and {len(a_texts)} held-out texts")
    n, alpha = len(b_texts), top1_alpha()
    for i, (b, a) in enumerate(zip(b_texts, a_texts)):
        where = "on the held-out text" if n == 1 else f"on held-out text {i + 1} of {n}"
        figures = (f"(top-1 agreement {b['top1_agreement']:.4f} -> {a['top1_agreement']:.4f}, perplexity "
                   f"{b['perplexity']:.3f} -> {a['perplexity']:.3f})")
        if b.get("kl") is not None and a.get("kl") is not None and a["kl"] > b["kl"]:
            return f"the KL to the teacher {where} rose from {b['kl']:.5g} to {a['kl']:.5g} nats per token {figures}"
        kl = f", KL {b['kl']:.5g} -> {a['kl']:.5g}" if b.get("kl") is not None and a.get("kl") is not None else ""
        fell = (f"the top-1 agreement with the teacher {where} fell from {b['top1_agreement']:.4f} to "
                f"{a['top1_agreement']:.4f}")
        counts = flips(b, a)
        if counts is not None:
            lost, gained = counts
            chance = sign_test(lost, gained)
            if chance < alpha:
                return (f"{fell}: {lost} positions lost, {gained} gained (a sign test's chance {chance:.2g}, below "
                        f"{alpha:g}; perplexity {b['perplexity']:.3f} -> {a['perplexity']:.3f}{kl})")
        elif a["top1_agreement"] < b["top1_agreement"] - TOP1_TOLERANCE:
            return (f"{fell}, by more than {TOP1_TOLERANCE:g} (perplexity {b['perplexity']:.3f} -> "
                    f"{a['perplexity']:.3f}{kl})")
    return None


def top1_alpha() -> float:
    """TOP1_ALPHA, or ATTNLAB_TOP1_ALPHA where set; ValueError naming a value that is not a number from 0 to 1."""
    from ..runtime.environment import env_number

    return env_number(ALPHA_VARIABLE, TOP1_ALPHA, 0.0, 1.0, "from 0 to 1")


def sign_test(lost: int, gained: int) -> float:
    """The chance that `lost` + `gained` flips, each a loss or a gain with equal odds, lose `lost` or more: the
    one-sided sign test of top-1 agreement that fell (1.0 when it did not fall)."""
    if lost < 0 or gained < 0:
        raise ValueError(f"flips are counts, got lost={lost}, gained={gained}")
    n = lost + gained
    if lost <= gained:
        return 1.0
    return sum(math.comb(n, k) for k in range(lost, n + 1)) / 2 ** n


def worse(before: dict | None, after: dict | None) -> bool:
    """Whether a healed student is worse than the converted one: on any held-out text its mean KL(teacher ||
    student) rose, or its top-1 agreement fell beyond chance (sign_test below TOP1_ALPHA on evaluate.flips).
    before, after: evaluations of the same windows (evaluate_pair's, or evaluate_texts' with "texts"). Perplexity
    never decides. Without "kl" (an older checkpoint) top-1 alone decides; without positions, a fall past
    TOP1_TOLERANCE."""
    return reason(before, after) is not None
