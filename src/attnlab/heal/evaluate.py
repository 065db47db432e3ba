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


def greedy_agreement(teacher, student, prompts: torch.Tensor, new_tokens: int = 64, *, budget=None,
                     teacher_tokens: torch.Tensor | None = None) -> dict:
    """Both models continue the same prompts (B, P) greedily for new_tokens; how alike are the continuations?

    "prefix": mean fraction of the new tokens before the first difference (strict: one
    different token ends the agreement); "tokens": mean fraction of positions that are equal.
    teacher_tokens: the teacher's continuations from an earlier call ("teacher_tokens" of its
    result), so that only the student generates.
    """
    P = prompts.shape[1]
    with torch.no_grad():
        a = teacher_tokens if teacher_tokens is not None else \
            generate(teacher, prompts, max_new_tokens=new_tokens, budget=budget)[:, P:]  # (B, new)
        b = generate(student, prompts, max_new_tokens=new_tokens, budget=budget)[:, P:]
    equal = a == b  # (B, new)
    prefix = equal.long().cumprod(-1).sum(-1).float() / new_tokens  # (B,)
    return {"prefix": float(prefix.mean()), "tokens": float(equal.float().mean()), "new_tokens": new_tokens,
            "teacher_tokens": a}


def _prompts(held_out: torch.Tensor, prompts: int, prompt_len: int) -> torch.Tensor | None:
    M = held_out.shape[1]
    if M < prompt_len:
        return None
    starts = torch.linspace(0, max(0, M - prompt_len), prompts).long().unique()
    return torch.stack([held_out[0, s:s + prompt_len] for s in starts.tolist()])  # (prompts, prompt_len)


def evaluate_pair(teacher, student, held_out: torch.Tensor, *, prompts: int = 8, prompt_len: int = 32,
                  new_tokens: int = 64, window: int | None = None, budget=None, reference: dict | None = None) -> dict:
    """The student against the teacher on held-out token ids (1, M): perplexity, top-1 and greedy agreement.

    budget (runtime.Budget): a window is scored if the last one's time still fits (the first always); greedy agreement
    is left out if the budget runs out before it ends; a stop request raises runtime.Stopped. reference: the result of an earlier call (the
    "before" evaluation): the same windows are scored, the teacher's cached answers are reused,
    and greedy agreement runs if it ran then. The result holds the teacher's perplexity on the
    scored windows and `tokens`, the held-out tokens scored. window: tokens per window, default 512 or the
    model's context where that is shorter (models.evaluate.default_window).
    """
    window = default_window(student) if window is None else window
    check_window(window, held_out, student)
    chunks = windows(held_out, window)
    if reference is not None:
        chunks = chunks[:reference["windows"]]
    teacher_top = [] if reference is None else reference["_teacher_top"]
    t_nll = s_nll = 0.0
    count = same = positions = 0
    last = 0.0  # seconds the last window took: a window starts only if one more still fits
    with torch.no_grad():
        for i, chunk in enumerate(chunks):
            if budget is not None and i:
                if budget.stop_requested:
                    raise Stopped("stop")
                if reference is None and budget.expired(last):
                    chunks = chunks[:i]
                    break
            started = None if budget is None else budget.clock()
            s_logits = student(chunk).logits
            nll, n = next_token_nll(s_logits, chunk)
            s_nll, count = s_nll + nll, count + n
            if reference is None:
                t_logits = teacher(chunk).logits
                t_nll += next_token_nll(t_logits, chunk)[0]
                teacher_top.append(t_logits.argmax(-1))  # (1, n)
            same += int((teacher_top[i] == s_logits.argmax(-1)).sum())
            positions += chunk.numel()
            if started is not None:
                last = budget.clock() - started
    out = {"perplexity": float(torch.exp(torch.tensor(s_nll / count))), "top1_agreement": same / positions,
           "kv_bytes_per_token": kv_bytes_per_token(student), "tokens": sum(c.shape[1] for c in chunks),
           "windows": len(chunks), "_teacher_top": teacher_top}
    if reference is None:
        out["teacher_perplexity"] = float(torch.exp(torch.tensor(t_nll / count)))
    p = _prompts(held_out, prompts, prompt_len)
    wants_greedy = p is not None and (reference is None or "greedy_agreement" in reference)
    if wants_greedy and (budget is None or reference is not None or not budget.expired(last)):
        cached = None if reference is None else reference["greedy_agreement"]["teacher_tokens"]
        try:  # before training it must fit what is left of the share; after, it runs to its end
            out["greedy_agreement"] = greedy_agreement(
                teacher, student, p, new_tokens, teacher_tokens=cached,
                budget=None if budget is None else budget if reference is None else budget.unbounded())
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
