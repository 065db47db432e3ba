"""A student against its teacher on held-out text: perplexity, next-token and greedy agreement.

The report that heal and shrink print before and after training. One pass over the held-out
windows scores both models (each window: the teacher's and the student's next-token loss and
whether their most likely tokens agree); greedy agreement then runs both through attnlab's
generation loop. With a budget, the "before" evaluation scores as many windows as the budget
allows (at least one), and remembers how many, so the "after" evaluation scores the same text
and costs about the same; the teacher's most likely tokens are kept, so after training only
the student runs.
"""
from __future__ import annotations

import torch

from ..generation.loop import generate
from ..models.evaluate import check_window, default_window, kv_bytes_per_token, next_token_nll, windows
from ..runtime.budget import Stopped
from . import distributed as dd


def greedy_agreement(teacher, student, prompts: torch.Tensor, new_tokens: int = 64, *, budget=None,
                     teacher_tokens: torch.Tensor | None = None, world=None) -> dict:
    """Both models continue the same prompts (B, P) greedily for new_tokens; how alike are the continuations?

    "prefix": mean fraction of the new tokens before the first difference (strict: one
    different token ends the agreement); "tokens": mean fraction of positions that are equal.
    teacher_tokens: the teacher's continuations from an earlier call ("teacher_tokens" of its
    result), so that only the student generates. world (distributed.World of N > 1 ranks): each rank
    continues its share of the prompts (World.part) and the rows are gathered, so every rank returns the
    figures of all B prompts; the caller passes no budget then (a rank must not stop alone between collectives).
    """
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
    equal = (a == b).long()  # (b, new)
    if split:
        a, equal = dd.gather_rows(a.long(), B), dd.gather_rows(equal, B)  # (B, new)
    prefix = equal.cumprod(-1).sum(-1).float() / new_tokens  # (B,)
    return {"prefix": float(prefix.mean()), "tokens": float(equal.float().mean()), "new_tokens": new_tokens,
            "teacher_tokens": a}


def _prompts(held_out: torch.Tensor, prompts: int, prompt_len: int) -> torch.Tensor | None:
    M = held_out.shape[1]
    if M < prompt_len:
        return None
    starts = torch.linspace(0, max(0, M - prompt_len), prompts).long().unique()
    return torch.stack([held_out[0, s:s + prompt_len] for s in starts.tolist()])  # (prompts, prompt_len)


def evaluate_pair(teacher, student, held_out: torch.Tensor, *, prompts: int = 8, prompt_len: int = 32,
                  new_tokens: int = 64, window: int | None = None, budget=None, reference: dict | None = None,
                  world=None) -> dict:
    """The student against the teacher on held-out token ids (1, M): perplexity, top-1 and greedy agreement.

    budget (runtime.Budget): a window is scored if the last one's time still fits (the first always); greedy agreement
    is left out if the budget runs out before it ends; a stop request raises runtime.Stopped. reference: the result of an earlier call (the
    "before" evaluation): the same windows are scored, the teacher's cached answers are reused,
    and greedy agreement runs if it ran then. The result holds the teacher's perplexity on the
    scored windows and `tokens`, the held-out tokens scored. window: tokens per window, default 512 or the
    model's context where that is shorter (models.evaluate.default_window).

    world (distributed.World of N > 1 ranks, every rank calling with the same arguments): the windows are scored in
    rounds of N, window i by rank i mod N, each round started only if every rank's last window still fits (the
    decision agreed over the ranks); the sums of the log-likelihoods and counts are reduced over the ranks, the
    teacher's answers gathered, and the prompts of greedy agreement split (greedy_agreement), so every rank
    returns the one result, equal to one process's on the same windows up to the order of its sums.
    """
    split = world is not None and world.distributed
    size, rank = (world.size, world.rank) if split else (1, 0)
    window = default_window(student) if window is None else window
    check_window(window, held_out, student)
    chunks = windows(held_out, window)
    if reference is not None:
        chunks = chunks[:reference["windows"]]
    teacher_top = {} if reference is None else dict(enumerate(reference["_teacher_top"]))
    sums = torch.zeros(5, dtype=torch.float64)  # student's nll, its predictions, equal top-1, tokens, teacher's nll
    last = 0.0  # seconds this rank's last window took: a round starts only if one more still fits on every rank
    scored = len(chunks)
    with torch.no_grad():
        for first in range(0, len(chunks), size):
            if budget is not None and first:
                if dd.agree(budget.stop_requested):
                    raise Stopped("stop")
                if reference is None and dd.agree(budget.expired(last)):
                    scored = first
                    break
            i = first + rank
            if i >= len(chunks):  # the last round has fewer windows than ranks
                continue
            chunk = chunks[i]
            started = None if budget is None else budget.clock()
            s_logits = student(chunk).logits
            nll, n = next_token_nll(s_logits, chunk)
            if reference is None:
                t_logits = teacher(chunk).logits
                sums[4] += next_token_nll(t_logits, chunk)[0]
                teacher_top[i] = t_logits.argmax(-1)  # (1, n)
            same = int((teacher_top[i].to(s_logits.device) == s_logits.argmax(-1)).sum())
            sums[:4] += torch.tensor([nll, n, same, chunk.numel()], dtype=torch.float64)
            if started is not None:
                last = budget.clock() - started
    chunks = chunks[:scored]
    if split:
        sums = dd.all_sum(sums)
        if reference is None:  # every rank keeps every window's answers: the reference travels in checkpoints
            mine = {i: top.cpu() for i, top in teacher_top.items()}  # CPU: another rank may have no such GPU
            teacher_top = {i: top for part in dd.gather_objects(mine) for i, top in part.items()}
    s_nll, count, same, positions, t_nll = sums.tolist()
    out = {"perplexity": float(torch.exp(torch.tensor(s_nll / count))), "top1_agreement": same / positions,
           "kv_bytes_per_token": kv_bytes_per_token(student), "tokens": sum(c.shape[1] for c in chunks),
           "windows": len(chunks), "_teacher_top": [teacher_top[i] for i in range(len(chunks))]}
    if reference is None:
        out["teacher_perplexity"] = float(torch.exp(torch.tensor(t_nll / count)))
    p = _prompts(held_out, prompts, prompt_len)
    wants_greedy = p is not None and (reference is None or "greedy_agreement" in reference)
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


def public(result: dict) -> dict:
    """An evaluation without the cached answers it keeps for the next one (what a report stores)."""
    out = {k: v for k, v in result.items() if not k.startswith("_")}
    if "greedy_agreement" in out:
        out["greedy_agreement"] = {k: v for k, v in out["greedy_agreement"].items() if k != "teacher_tokens"}
    return out
