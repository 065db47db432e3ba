"""What healing trains and measures on: token windows from text files, or text the teacher writes itself.

text_windows (the user's files, the last `holdout` of each held out), teacher_windows (data-free self-distillation:
the teacher continues PROMPTS or vocabulary_prompts), training_data (one of the two for a run, within a time budget),
judge_texts and planning_texts (held-out text of other kinds), batch_generator, check_pair. N windows of T tokens.
"""
from __future__ import annotations

import torch

PROMPTS = (  # varied prompts, written for this repo, that the teacher continues (teacher_windows)
    "The history of the Roman Empire begins", "In a small village by the sea, an old fisherman",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"", "Photosynthesis is the process by which",
    "Question: Why is the sky blue?\nAnswer:", "Dear hiring manager,\n\nI am writing to apply for",
    "The recipe calls for two cups of flour,", "# Installing the package\n\nTo install, run",
    "The stock market fell sharply on Monday after", "Once upon a time, in a kingdom far away,",
    "A black hole is a region of space where", "Here is a list of tips for learning a new language:\n1.",
    "The main causes of the French Revolution were", "SELECT name, email FROM users WHERE",
    "My favourite book is", "The mitochondria is often called", "In mathematics, a prime number is",
    "Climate change affects agriculture in several ways.", "The football match ended in a draw after",
    "To solve the equation 3x + 5 = 20, we", "The following is a conversation between a doctor and a patient.",
    "Shakespeare wrote Hamlet around the year", "The Internet was originally developed", "Chapter 1\n\nThe rain had",
    "Water boils at 100 degrees Celsius at sea level because", "A good night's sleep is important because",
    "The city council voted on Tuesday to", "import numpy as np\n\n# compute the mean of each column",
    "The theory of evolution by natural selection", "Travel guide: three days in Kyoto.",
    "The difference between a virus and a bacterium is", "Summary of the meeting:\n-",
)


HELD_OUT_PROMPTS = 4  # the last prompts write held-out text only (training_data)
# every DRAWN_EVERY-th training window the teacher writes starts from one token drawn from its vocabulary instead of
# a prompt of PROMPTS (vocabulary_prompts; LLM-QAT's data-free text, arXiv 2305.17888, starts every sequence so)
DRAWN_EVERY = 2
JUDGE_TOKENS = 512  # tokens of each text of judge_texts


def batch_generator(*key: int) -> torch.Generator:
    """A generator seeded by `key` alone (seed, phase, step, ...): a heal's batches are chosen from it, so a run
    stopped and resumed, or split over ranks, picks the very batches one uninterrupted process picks."""
    return torch.Generator().manual_seed(hash(key) & 0x7FFF_FFFF_FFFF)


def vocabulary_prompts(tok, n: int, seed: int = 0) -> tuple[str, ...]:
    """n one-token prompts: token ids drawn uniformly from the tokenizer's vocabulary (seeded), special tokens and
    those that decode to text which tokenises to nothing skipped, each decoded to its text. Text the teacher writes
    from them covers more of what it knows than a fixed list of prompts does (code, lists, names, other languages)."""
    g = torch.Generator().manual_seed(seed * 100003 + 7)
    special = set(tok.all_special_ids)
    out = []
    while len(out) < n:
        t = int(torch.randint(len(tok), (1,), generator=g))
        text = tok.decode([t])
        if t not in special and tok(text).input_ids:
            out.append(text)
    return tuple(out)


def _judge_files() -> list:
    """The files judge_texts and planning_texts read: everyday sentences shipped here, attnlab's attention core."""
    from pathlib import Path

    here = Path(__file__).resolve().parent
    return [here / "judge_sentences.txt", here.parent / "modules" / "attention.py"]


def _judge_ids(tok) -> list[torch.Tensor]:
    """Each of _judge_files() whole as token ids (1, M): what judge_texts and planning_texts cut their parts from."""
    return [tok(f.read_text(encoding="utf-8"), return_tensors="pt").input_ids for f in _judge_files()]


def judge_texts(tok, tokens: int = JUDGE_TOKENS) -> list[torch.Tensor]:
    """Held-out texts of other kinds than a heal's training text, for its keep-or-give-back decisions: everyday
    English sentences written for this repo (judge_sentences.txt, shipped with the package) and Python source with
    its documentation (attnlab's own attention core), each its first `tokens` token ids (1, M). Without them a heal
    on text the teacher writes would be judged on the distribution it trained on alone, which flatters a heal that
    drifts from the teacher on other text."""
    return [ids[:, :tokens] for ids in _judge_ids(tok)]


def planning_texts(tok, tokens: int) -> list[torch.Tensor]:
    """Text of the judge texts' kinds that the judge does not read: each file's next `tokens` token ids after the
    JUDGE_TOKENS judge_texts takes, (1, <= tokens) each (fewer where a file ends sooner; a file with none left is
    left out). What a shrink plan's per-layer costs are measured on beside its own text (shrink/plan.py), so that
    a plan does not fit one kind of text, while the heal's judge reads other tokens."""
    ids = [ids[:, JUDGE_TOKENS:JUDGE_TOKENS + tokens] for ids in _judge_ids(tok)]
    return [t for t in ids if t.numel()]


def _windows(ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    n = ids.numel() // seq_len
    return ids[: n * seq_len].reshape(n, seq_len)  # (N, T)


def _file_ids(tok, paths) -> list[torch.Tensor]:
    from ..models.evaluate import read_text_ids

    return [read_text_ids(tok, p)[0] for p in paths]


def _joined(parts: list[torch.Tensor], tok) -> torch.Tensor:
    """The parts one after the other, an EOS token between two where the tokenizer has one."""
    eos = getattr(tok, "eos_token_id", None)
    out = []
    for i, part in enumerate(parts):
        if i and eos is not None:
            out.append(torch.tensor([eos], dtype=part.dtype))
        out.append(part)
    return torch.cat(out)


def read_ids(tok, paths) -> torch.Tensor:
    """All the files' token ids, one after the other (an EOS token between files where the tokenizer has one)."""
    return _joined(_file_ids(tok, paths), tok)


GOLDEN = (5 ** 0.5 - 1) / 2


def spread_order(n: int) -> list[int]:
    """A permutation of range(n) whose every prefix is spread over the whole range: window floor(n * frac(k *
    GOLDEN)) for k = 0, 1, ..., each taken once (Weyl's sequence; the windows it misses follow in order). What
    a run reads first (its calibration and planning windows, the layer-wise phase's) then samples the whole text,
    every file of it, not its beginning."""
    order, seen = [], set()
    for k in range(n):
        i = int(n * ((k * GOLDEN) % 1.0))
        if i not in seen:
            seen.add(i)
            order.append(i)
    return order + [i for i in range(n) if i not in seen]


def text_windows(tok, paths, seq_len: int, *, holdout: float = 0.1, eval_paths=None):
    """(training windows (N, T), held-out ids (1, M)) from text files: the last `holdout` of each file held out (at
    least one window in all), or the eval_paths files as the held-out text. The training windows are put in
    spread_order, so that the first ones (what a shrink plan calibrates on) come from every part of the text."""
    paths = [str(p) for p in paths]
    parts = _file_ids(tok, paths)
    if eval_paths:
        held = read_ids(tok, [str(p) for p in eval_paths])
        if held.numel() < 2:
            raise ValueError(f"evaluation text {', '.join(map(str, eval_paths))} has {held.numel()} tokens; "
                             "it needs at least 2")
        train = _windows(_joined(parts, tok), seq_len)
        if train.shape[0] < 1:
            raise ValueError(f"text {', '.join(paths)} has {sum(p.numel() for p in parts)} tokens, fewer than one "
                             f"window of {seq_len}")
        return train[spread_order(train.shape[0])], held[None]
    total = sum(p.numel() for p in parts)
    share = max(holdout, seq_len / max(total, 1))  # of each file: at least one window held out in all
    cuts = [p.numel() - int(-(-p.numel() * share // 1)) for p in parts]  # each file's last share held out
    train = _windows(_joined([p[:c] for p, c in zip(parts, cuts)], tok), seq_len)
    held = _joined([p[c:] for p, c in zip(parts, cuts) if c < p.numel()], tok)
    if train.shape[0] < 1 or held.numel() < seq_len:
        raise ValueError(f"text {', '.join(paths)} has {total} tokens: too short to hold out a window of "
                         f"{seq_len} and train on another; give more text, a shorter --seq-len, or --eval-text")
    return train[spread_order(train.shape[0])], held[None]


class _TooSlow(Exception):
    """A batch of teacher text that would not fit its budget, found early in its generation (teacher_windows)."""

    def __init__(self, seconds_per_window: float):
        super().__init__("batch too slow")
        self.seconds_per_window = seconds_per_window


def _watch(budget, began: float, steps: int, n: int):
    """A stream callback that times a batch of n windows after its first 1/16 of `steps` (at least 2) and raises
    _TooSlow if the whole batch would not fit what was left of the budget when it began."""
    probe = max(2, steps // 16)
    seen = [0]
    left = budget.left()

    def watch(_column):
        seen[0] += 1
        if seen[0] == probe and probe < steps:
            per_window = (budget.clock() - began) * steps / probe / n  # the prefill counted as a step: high side
            if per_window * n > left:
                raise _TooSlow(per_window)
    return watch


def teacher_windows(teacher, tok, count: int, seq_len: int, *, seed: int = 0, batch_size: int = 8,
                    prompts=PROMPTS, progress=None, budget=None, offset: int = 0) -> torch.Tensor:
    """Up to `count` windows (n, seq_len) of text the teacher writes from the prompts (sampled, seeded), batch_size
    at a time. budget: a batch starts only where the last one's time still fits, and one timed past its first 1/16
    of steps to overrun what is left starts again with the windows that fit (at least one batch is written). A stop
    request raises runtime.Stopped. offset: where these windows start in a longer seeded sequence."""
    from ..generation.loop import generate
    from ..runtime.budget import Stopped

    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"windows to generate must be at least 1, got {count!r}")
    context = getattr(getattr(teacher, "config", None), "max_position_embeddings", None) or float("inf")
    if seq_len > context:
        raise ValueError(f"windows of {seq_len} tokens exceed the model's context (max_position_embeddings {context})")
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    out = []
    timed = budget is not None and budget.deadline is not None
    last = 0.0  # seconds the last batch took: a batch starts only if one more still fits
    start, n = 0, batch_size
    while start < count:
        n = min(n, count - start)
        if budget is not None and start:
            if budget.stop_requested:
                raise Stopped("stop")
            if budget.expired(last):
                break
        began = None if budget is None else budget.clock()
        rows = [prompts[(start + k) % len(prompts)] for k in range(n)]
        enc = [tok(p, return_tensors="pt").input_ids[0][: seq_len // 2] for p in rows]
        if max(e.numel() for e in enc) + seq_len - min(e.numel() for e in enc) > context:
            short = min(e.numel() for e in enc)  # left padding would run past the context: equal prompts
            enc = [e[:short] for e in enc]
        P = max(e.numel() for e in enc)
        ids = torch.full((len(enc), P), pad, dtype=torch.long)
        mask = torch.zeros(len(enc), P, dtype=torch.long)
        for k, e in enumerate(enc):
            ids[k, P - e.numel():], mask[k, P - e.numel():] = e, 1
        new = seq_len - min(e.numel() for e in enc)  # enough for the row with the shortest prompt
        watch = _watch(budget, began, new, n) if timed and n > 1 else None
        try:
            with torch.no_grad():
                full = generate(teacher, ids, mask, max_new_tokens=new, temperature=1.0, top_p=0.95,
                                seed=seed * 100003 + offset + start, budget=None if budget is None else budget.unbounded(),
                                stream=watch)  # (B, P + new)
        except _TooSlow as e:  # the batch again, with as many windows as fit at the cost just measured
            if start and budget.left() < e.seconds_per_window:
                break
            n = max(1, min(n - 1, int(budget.left() / e.seconds_per_window)))
            continue
        for k, e in enumerate(enc):  # the prompt (without its padding) and the continuation, cut to seq_len
            out.append(torch.cat([e, full[k, P:]])[:seq_len])
        if began is not None:
            last = budget.clock() - began
        start += n
        if progress:
            progress(len(out), count)
    return torch.stack(out)  # (n, T)


def training_data(teacher, tok, seq_len: int, *, text=None, eval_text=None, windows: int = 64, seed: int = 0,
                  budget=None, share: float = 0.3, batch_size: int = 16, fixed: int = 0,
                  progress=None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(training windows (N, T), held-out ids (1, M), what was used) for a heal run: text_windows of `text`, or
    windows the teacher writes (the held-out ones first, from the HELD_OUT_PROMPTS last prompts). The held-out windows
    and the first `fixed` training ones are written whatever the clock says; the rest within `share` of the budget
    (None: every window). progress(i, n) counts windows."""
    from ..runtime.budget import Stopped

    if text:
        train, held = text_windows(tok, text, seq_len, eval_paths=eval_text)
    else:
        if tok is None:
            raise ValueError("the teacher has no tokenizer: give --text (token windows need one)")
        if isinstance(fixed, bool) or not isinstance(fixed, int) or not 0 <= fixed <= windows:
            raise ValueError(f"fixed windows must be between 0 and windows ({windows}), got {fixed!r}")
        n = 0 if eval_text else HELD_OUT_PROMPTS
        train_prompts = PROMPTS[:len(PROMPTS) - HELD_OUT_PROMPTS]
        drawn = vocabulary_prompts(tok, windows // DRAWN_EVERY, seed)
        order = PROMPTS[len(PROMPTS) - n:] + tuple(
            drawn[i // DRAWN_EVERY] if i % DRAWN_EVERY == DRAWN_EVERY - 1 else
            train_prompts[(i - i // DRAWN_EVERY) % len(train_prompts)] for i in range(windows))
        first = n + fixed  # written whatever the clock: the same text on any machine
        written = [teacher_windows(teacher, tok, first, seq_len, seed=seed, batch_size=max(batch_size, first),
                                   prompts=order, progress=progress,
                                   budget=None if budget is None else budget.unbounded())] if first else []
        if windows > fixed:
            mine = None if budget is None else budget.share(share)
            written.append(teacher_windows(teacher, tok, windows - fixed, seq_len, seed=seed, budget=mine,
                                           batch_size=batch_size, prompts=order[first:],
                                           offset=first, progress=None if progress is None else
                                           (lambda i, _n: progress(first + i, n + windows))))
        written = torch.cat(written)
        if written.shape[0] <= n:
            raise ValueError(f"the teacher wrote {written.shape[0]} window(s) in the time given: too few to train on "
                             "(give more time, or --text)")
        train = written[n:]
        held = read_ids(tok, eval_text)[None] if eval_text else written[:n].reshape(1, -1)
        if budget is not None and budget.stop_requested:
            raise Stopped("stop")
    used = {"text": [str(x) for x in text or []], "eval_text": [str(x) for x in eval_text or []],
            "training_windows": int(train.shape[0]), "held_out_tokens": int(held.shape[1]),
            "self_generated": not text}
    return train, held, used


def converted_layers(teacher, student) -> list[int]:
    """The indices of the layers whose attention the conversion changed (another class, or other weights): the ones
    a heal trains. A layer the planner kept (shrink/sizes.py layouts) is the teacher's own and stays so; a student with
    no changed layer (nothing converted) trains every layer, as a heal always did."""
    from ..models.adapters import attnlab_modules

    def same(a, b) -> bool:
        sa, sb = a.state_dict(), b.state_dict()
        return type(a) is type(b) and sa.keys() == sb.keys() and all(
            sa[k].shape == sb[k].shape and torch.equal(sa[k].to(sb[k].device), sb[k]) for k in sa)

    pairs = list(zip(attnlab_modules(teacher), attnlab_modules(student)))
    changed = [i for i, (t, s) in enumerate(pairs) if not same(t, s)]
    return changed or list(range(len(pairs)))


def check_pair(teacher, student) -> None:
    """ValueError unless the teacher is the student's network around its attention (same shapes, same vocabulary)."""
    from ..models.adapters import attnlab_modules, family

    ft, fs = family(teacher), family(student)
    if ft != fs:
        raise ValueError(f"the teacher is a {ft} model and the student a {fs} model")
    t_mods, s_mods = attnlab_modules(teacher), attnlab_modules(student)
    if len(t_mods) != len(s_mods):
        raise ValueError(f"the teacher has {len(t_mods)} layers and the student {len(s_mods)}")
    for i, (a, b) in enumerate(zip(t_mods, s_mods)):
        if (a.dim, a.num_heads) != (b.dim, b.num_heads):
            raise ValueError(f"layer {i}: the teacher's attention has dim {a.dim}, {a.num_heads} heads; "
                             f"the student's dim {b.dim}, {b.num_heads} heads")
    vt, vs = teacher.config.vocab_size, student.config.vocab_size
    if vt != vs:
        raise ValueError(f"the teacher's vocabulary has {vt} tokens and the student's {vs}")
    rest = lambda m: {k: v.shape for k, v in m.state_dict().items() if "attn" not in k and "attention" not in k}  # noqa: E731
    ts, ss = rest(teacher), rest(student)
    if ts != ss:
        diff = sorted(set(ts.items()) ^ set(ss.items()))[:1]
        raise ValueError(f"the teacher's and the student's networks differ outside attention (e.g. {diff[0][0]})")
