"""A student against its teacher on held-out text: evaluate_pair (one text), evaluate_texts (several, combined).

Figures: KL and top-1 agreement (what heal_model's decisions read, guard.worse; never perplexity alone), perplexity,
greedy agreement. Which positions agree is kept, packed (positions_code), so two evaluations of the same windows
compare position by position (flips: the keep-better test's sign test). heal and shrink print it before and after.
"""
from __future__ import annotations

import base64
import math

import torch

from ..generation.loop import generate
from ..models.divergence import kl_sum
from ..models.evaluate import (check_window, default_window, kv_bytes_per_token, next_token_nll, on_model,
                               windows)
from ..runtime.budget import Stopped
from . import distributed as dd


def decodes(model) -> bool:
    """Whether attnlab's loop can decode the model through its caches: not where a layer's storage is one an engine
    applies (KIVI, transformers' quanto codes: evaluation_only), which no attnlab cache holds."""
    from ..models.adapters import attnlab_modules

    return not any(m._kv_format is not None and m._kv_format.evaluation_only for m in attnlab_modules(model))


# greedy_agreement's "prefix": the mean share of new tokens before the first difference; "tokens": the share of equal
# positions. Both models run through attnlab's generation loop; over N ranks each continues its share of the prompts.
def greedy_agreement(teacher, student, prompts: torch.Tensor, new_tokens: int = 64, *, budget=None,
                     teacher_tokens: torch.Tensor | None = None, world=None) -> dict:
    """Both models continue the same prompts (B, P) greedily for new_tokens: how alike the continuations are
    ("prefix", "tokens", "prompts": B; the comment above). teacher_tokens: the teacher's continuations from an earlier
    call, so that only the student generates. world: the prompts split over the ranks, every rank gets all B figures
    (no budget then: a rank must not stop alone between collectives)."""
    B, P = prompts.shape
    split = world is not None and world.distributed
    rows = world.part(B) if split else slice(None)
    mine = prompts[rows]
    with torch.no_grad():
        if teacher_tokens is not None:
            a = teacher_tokens[rows]
        elif mine.shape[0]:
            a = generate(teacher, mine, max_new_tokens=new_tokens, budget=budget)[:, P:]  # (b, new)
        else:  # more ranks than prompts: nothing to continue here
            a = torch.zeros(0, new_tokens, dtype=torch.long)
        b = generate(student, mine, max_new_tokens=new_tokens, budget=budget)[:, P:] if mine.shape[0] else a
    a, b = a.cpu(), b.cpu()  # a reference's teacher tokens are the CPU's, whichever device generated them
    equal = (a == b).long()  # (b, new)
    if split:
        a, equal = dd.gather_rows(a.long(), B), dd.gather_rows(equal, B)  # (B, new)
    prefix = equal.cumprod(-1).sum(-1).float() / new_tokens  # (B,)
    return {"prefix": float(prefix.mean()), "tokens": float(equal.float().mean()), "new_tokens": new_tokens,
            "prompts": B, "teacher_tokens": a}


def _prompts(held_out: torch.Tensor, prompts: int, prompt_len: int) -> torch.Tensor | None:
    M = held_out.shape[1]
    if prompts < 1 or M < prompt_len:  # no prompts asked (no greedy agreement), or a text too short for one
        return None
    starts = torch.linspace(0, max(0, M - prompt_len), prompts).long().unique()
    return torch.stack([held_out[0, s:s + prompt_len] for s in starts.tolist()])  # (prompts, prompt_len)


# One pass over the held-out windows scores both models: each one's next-token loss, the KL between their next-token
# distributions at every position (in float64: models.divergence.kl_sum), and whether their most likely tokens agree.
# evaluate_pair's figures: "kl", the mean over every scored position (each predicts the next token) of KL(teacher ||
# student) in nats; "top1_agreement", the share of those positions where both models' most likely tokens are equal;
# "perplexity", exp of the student's mean next-token loss ("tokens" positions in "windows" windows of `window` tokens,
# default 512 or the model's context where shorter). With a budget the "before" evaluation scores windows while the
# last one's time still fits (the first always) and remembers how many, so the "after" one (its reference) scores the
# same text at about the same cost: the teacher runs again on each window (its full-vocabulary logits are not kept:
# their memory would grow with the windows), its most likely tokens and greedy continuations are reused. Greedy
# agreement is left out if the budget runs out first; a stop request raises runtime.Stopped. Over N ranks window i is
# scored by rank i mod N in rounds whose start every rank agrees on, the sums reduced and the teacher's answers
# gathered: every rank returns one process's result, up to the order of its sums.
def evaluate_pair(teacher, student, held_out: torch.Tensor, *, prompts: int = 8, prompt_len: int = 32,
                  new_tokens: int = 64, window: int | None = None, budget=None, reference: dict | None = None,
                  world=None) -> dict:
    """The student against the teacher on held-out token ids (1, M): "kl", "top1_agreement", "perplexity", greedy
    agreement, "tokens" and "windows" (the comment above). budget: windows scored while they fit; reference: an earlier
    result, whose windows and teacher answers are reused; window: tokens per window; world: the windows split over
    the ranks, every rank returning the one result. Without a reference the result holds the teacher's perplexity."""
    split = world is not None and world.distributed
    window = default_window(student) if window is None else window
    check_window(window, held_out, student)
    held_out = on_model(student, held_out)  # a student healed on a GPU is scored there
    chunks = windows(held_out, window)
    if reference is not None:
        chunks = chunks[:reference["windows"]]
    teacher_top = {} if reference is None else dict(enumerate(reference["_teacher_top"]))
    sums, agree, scored, last = _score_pair(teacher, student, chunks, teacher_top, reference is None, budget,
                                            (world.size, world.rank) if split else (1, 0))
    chunks = chunks[:scored]
    if split:
        sums = dd.all_sum(sums)
        agree, teacher_top = _gather_answers(agree, teacher_top, reference is None)
    s_nll, count, same, positions, t_nll, kl = sums.tolist()
    out = {"perplexity": float(torch.exp(torch.tensor(s_nll / count))), "top1_agreement": same / positions,
           "kl": kl / positions, "top1_positions": positions_code(torch.cat([agree[i] for i in range(len(chunks))])),
           "kv_bytes_per_token": kv_bytes_per_token(student), "tokens": sum(c.shape[1] for c in chunks),
           "windows": len(chunks), "_teacher_top": [teacher_top[i] for i in range(len(chunks))]}
    if reference is None:
        out["teacher_perplexity"] = float(torch.exp(torch.tensor(t_nll / count)))
    p = _prompts(held_out, prompts, prompt_len)
    wants_greedy = p is not None and (reference is None or "greedy_agreement" in reference) and decodes(student)
    if wants_greedy and (budget is None or reference is not None or not dd.agree(budget.expired(last))):
        cached = None if reference is None else reference["greedy_agreement"]["teacher_tokens"]
        try:  # before training it must fit what is left of the share; after, it runs to its end
            out["greedy_agreement"] = greedy_agreement(
                teacher, student, p, new_tokens, teacher_tokens=cached, world=world,
                budget=None if budget is None or split else budget if reference is None else budget.unbounded())
        except Stopped as e:
            if e.reason != "budget":
                raise
    return out


def _score_pair(teacher, student, chunks, teacher_top: dict, fresh: bool, budget, ranks: tuple[int, int]):
    """This rank's windows (every size-th from rank) scored by both models: (sums (6,): the student's nll, its
    predictions, equal top-1, positions, the teacher's nll, KL(teacher || student); agree {window: (n,) bool}; the
    windows scored, the last window's seconds). fresh: no reference, so the teacher's answers are recorded in
    teacher_top; budget: a round starts only if one more window still fits on every rank."""
    size, rank = ranks
    agree, sums = {}, torch.zeros(6, dtype=torch.float64)
    last, scored = 0.0, len(chunks)
    with torch.no_grad():
        for first in range(0, len(chunks), size):
            if budget is not None and first:
                if dd.agree(budget.stop_requested):
                    raise Stopped("stop")
                if fresh and dd.agree(budget.expired(last)):
                    scored = first
                    break
            i = first + rank
            if i >= len(chunks):  # the last round has fewer windows than ranks
                continue
            chunk = chunks[i]
            started = None if budget is None else budget.clock()
            s_logits = student(chunk).logits
            nll, n = next_token_nll(s_logits, chunk)
            t_logits = teacher(chunk).logits
            if fresh:
                sums[4] += next_token_nll(t_logits, chunk)[0]
                teacher_top[i] = t_logits.argmax(-1).cpu()  # (1, n), on the CPU: the reference goes in checkpoints
            sums[5] += kl_sum(t_logits, s_logits, torch.float64)
            del t_logits
            agree[i] = (teacher_top[i].to(s_logits.device) == s_logits.argmax(-1)).reshape(-1).cpu()
            sums[:4] += torch.tensor([nll, n, int(agree[i].sum()), chunk.numel()], dtype=torch.float64)
            if started is not None:
                last = budget.clock() - started
    return sums, agree, scored, last


def _gather_answers(agree: dict, teacher_top: dict, fresh: bool) -> tuple[dict, dict]:
    """Every rank's window agreements (and, fresh, the teacher's answers) on every rank, on the CPU: the reference
    travels in checkpoints, and another rank may have no such GPU."""
    mine = {i: (teacher_top[i].cpu() if fresh else None, a) for i, a in agree.items()}
    parts = dd.gather_objects(mine)
    agree = {i: a for part in parts for i, (_, a) in part.items()}
    if fresh:
        teacher_top = {i: top for part in parts for i, (top, _) in part.items()}
    return agree, teacher_top


def positions_code(agree: torch.Tensor) -> str:
    """Which positions agree (a bool vector, one entry per scored position in window order), as evaluations keep it:
    the bits packed eight to a byte, first position in the top bit of the first byte, in base64 (JSON text, a sixth
    of a character per position)."""
    bits = agree.to(torch.bool).reshape(-1).tolist()
    packed = bytearray((len(bits) + 7) // 8)
    for k, b in enumerate(bits):
        if b:
            packed[k // 8] |= 0x80 >> (k % 8)
    return base64.b64encode(bytes(packed)).decode("ascii")


def flips(before: dict, after: dict) -> tuple[int, int] | None:
    """(lost, gained): the positions where `before`'s student agreed with the teacher's most likely token and
    `after`'s does not, and the reverse; two evaluate_pair results of the same windows. None when either lacks its
    positions (an evaluation from an older attnlab) or they scored different tokens."""
    if before.get("top1_positions") is None or after.get("top1_positions") is None \
            or before["tokens"] != after["tokens"]:
        return None
    a, b = (int.from_bytes(base64.b64decode(e["top1_positions"]), "big") for e in (before, after))
    return bin(a & ~b).count("1"), bin(b & ~a).count("1")


def held_out_texts(held_out) -> list[torch.Tensor]:
    """heal_model's held-out text as a list: one tensor (1, M), or a list or tuple of them (texts of other kinds);
    a ValueError naming the problem otherwise."""
    texts = [held_out] if isinstance(held_out, torch.Tensor) else list(held_out) \
        if isinstance(held_out, (list, tuple)) else None
    if not texts or not all(isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[0] == 1 for t in texts):
        raise ValueError("held-out text must be token ids (1, M) or a non-empty list of such tensors, got "
                         f"{type(held_out).__name__}")
    return texts


def evaluate_texts(teacher, student, texts, *, budget=None, reference: dict | None = None, world=None,
                   **kw) -> dict:
    """evaluate_pair on each held-out text (one tensor or a list), and the figures over all of them: the keys of one
    evaluate_pair over every scored position of every text (sums for "tokens" and "windows"; greedy agreement only
    where every text has one), and "texts", each text's own result. budget: each text an equal part of what is left
    at its turn; reference: an earlier result of this function. kw goes to evaluate_pair."""
    texts = held_out_texts(texts)
    refs = None if reference is None else reference.get("texts") or [reference]  # an older, one-text reference
    if refs is not None and len(refs) != len(texts):
        raise ValueError(f"the evaluation to compare with scored {len(refs)} held-out text(s); this one has "
                         f"{len(texts)} (resume with the same held-out texts)")
    parts = []
    for i, text in enumerate(texts):
        mine = None if budget is None else budget if i == len(texts) - 1 or budget.deadline is None \
            else budget.share(1.0 / (len(texts) - i))
        parts.append(evaluate_pair(teacher, student, text, budget=mine, world=world,
                                   reference=None if refs is None else refs[i], **kw))
    return combine(parts)


def combine(parts: list[dict]) -> dict:
    """The figures of several evaluate_pair results over all their tokens (evaluate_texts), with "texts": the parts.
    One part's figures are its own, unrounded."""
    if len(parts) == 1:
        return {**public(parts[0]), "texts": parts}
    positions = sum(p["tokens"] for p in parts)
    predicted = sum(p["tokens"] - p["windows"] for p in parts)  # a window of n tokens predicts n - 1

    def over_positions(key):
        return sum(p[key] * p["tokens"] for p in parts) / positions

    def perplexity(key):
        return math.exp(sum(math.log(p[key]) * (p["tokens"] - p["windows"]) for p in parts) / predicted)

    out = {"perplexity": perplexity("perplexity"), "top1_agreement": over_positions("top1_agreement"),
           "kv_bytes_per_token": parts[0]["kv_bytes_per_token"], "tokens": positions,
           "windows": sum(p["windows"] for p in parts)}
    if all("kl" in p for p in parts):
        out["kl"] = over_positions("kl")
    if all("teacher_perplexity" in p for p in parts):
        out["teacher_perplexity"] = perplexity("teacher_perplexity")
    greedy = [p.get("greedy_agreement") for p in parts]
    if all(greedy):
        prompts = sum(g.get("prompts", 1) for g in greedy)
        out["greedy_agreement"] = {k: sum(g[k] * g.get("prompts", 1) for g in greedy) / prompts
                                   for k in ("prefix", "tokens")} | {"new_tokens": greedy[0]["new_tokens"],
                                                                     "prompts": prompts}
    out["texts"] = parts
    return out


def public(result: dict) -> dict:
    """An evaluation without the cached answers it keeps for the next one (what a report stores); a combined one's
    texts alike."""
    out = {k: v for k, v in result.items() if not k.startswith("_")}
    if "greedy_agreement" in out:
        out["greedy_agreement"] = {k: v for k, v in out["greedy_agreement"].items() if k != "teacher_tokens"}
    if "texts" in out:
        out["texts"] = [public(t) for t in out["texts"]]
    return out
