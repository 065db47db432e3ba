"""Passkey retrieval: can a model (and its KV cache) find a number hidden in a long, dull text?

`passkey_prompt` builds a prompt (instruction, filler, the key line at a depth, more filler, the question) in token
ids; `run_passkey` has the model continue each greedily through its own cache (its kv_dtype) and counts exact answers
(`passkey_match`). Everything comes from the seed; `with_key=False` builds the control (accuracy: a guess's luck).
"""
from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

LENGTHS = (2048, 4096, 8192)
DEPTHS = (0.1, 0.5, 0.9)
KEY_DIGITS = 5

INTRO = ("There is a pass key hidden somewhere in the long text below. Read the text, find the pass key and "
         "remember it: you will be asked for it at the end.")
QUESTION = " What is the pass key? The pass key is"
# neutral filler (attnlab's own): plain statements about nothing in particular, some short for the last gaps
FILLER = (
    "The river runs past the old mill and on towards the sea.",
    "A light wind moves through the tall grass in the field.",
    "The hills are green in spring and brown at the end of summer.",
    "Clouds drift slowly over the valley.",
    "The road bends once near the farm and then runs straight to the town.",
    "Birds rest on the fence beside the orchard.",
    "The market opens early on most days of the week.",
    "A small boat is tied at the end of the wooden pier.",
    "The lamps along the street come on at dusk.",
    "Snow stays on the mountain tops until the middle of June.",
    "The library is quiet in the afternoon.",
    "Rain falls softly on the roof of the barn.",
    "The path through the woods is covered with leaves in autumn.",
    "Bread is baked each morning in the village.",
    "A bridge of grey stone crosses the stream.",
    "The bell in the square rings every hour.",
    "Sheep graze on the slope behind the church.",
    "The tide comes in twice a day.",
    "It is calm.",
    "The day goes on.",
    "All is still.",
    "Time passes.",
)


def _key_line(key: str) -> str:
    return f" The pass key is {key}. Remember it. {key} is the pass key."


class PasskeyPrompt(NamedTuple):
    """One passkey prompt: ids (1, P); the key (digits); the total length asked (prompt + answer_tokens) and the
    depth asked (a fraction of the filler); key_position: the index of the key line's first token (None without the
    key); answer_tokens: tokens to generate (the key's tokens and 2 more)."""
    ids: torch.Tensor
    key: str
    length: int
    depth: float
    key_position: int | None
    answer_tokens: int

    @property
    def prompt_tokens(self) -> int:
        return self.ids.shape[1]


def _pieces(tok, texts: Sequence[str]) -> list[list[int]]:
    return [list(tok(t, add_special_tokens=False).input_ids) for t in texts]


def check_lengths(lengths, depths, trials) -> tuple[tuple[int, ...], tuple[float, ...], int]:
    """lengths (ints >= 64), depths (numbers in [0, 1]) and trials (int >= 1) as tuples, or a ValueError/TypeError
    naming the values."""
    if isinstance(lengths, (int, str)) or not isinstance(lengths, Sequence) or not lengths:
        raise TypeError(f"lengths must be a non-empty sequence of ints, got {lengths!r}")
    bad = [n for n in lengths if isinstance(n, bool) or not isinstance(n, int) or n < 64]
    if bad:
        raise ValueError(f"passkey lengths must be ints of at least 64 tokens, got {list(lengths)} (bad: {bad})")
    if isinstance(depths, (int, float, str)) or not isinstance(depths, Sequence) or not depths:
        raise TypeError(f"depths must be a non-empty sequence of numbers in [0, 1], got {depths!r}")
    bad = [d for d in depths if isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 <= d <= 1]
    if bad:
        raise ValueError(f"passkey depths must be numbers in [0, 1] (a fraction of the prompt), got {list(depths)} "
                         f"(bad: {bad})")
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise ValueError(f"passkey trials must be an int >= 1, got {trials!r}")
    return tuple(dict.fromkeys(lengths)), tuple(float(d) for d in dict.fromkeys(depths)), trials


def passkey_prompt(tok, length: int, depth: float, *, seed: int = 0, trial: int = 0,
                   with_key: bool = True) -> PasskeyPrompt:
    """The prompt of (length, depth, seed, trial): the same ids every time.

    length: tokens of prompt and answer together; depth: where the key line starts, a fraction of the filler (0: right
    after the instruction, 1: right before the question; the nearest boundary between filler sentences). ValueError
    naming the values when the length cannot hold the instruction, the key line and the question, or with no tokenizer.
    """
    # Built in token ids from pieces each tokenised alone (the instruction, every filler sentence, the key line, the
    # question), so that the length is what was asked: the prompt is `length - answer_tokens` long (short by at most
    # the shortest filler piece's tokens minus one where the tokenizer has no one-token newline to fill the last gap).
    # The seed decides the key, the order of the sentences and where the newlines go.
    if tok is None:
        raise ValueError("a passkey prompt needs the model's tokenizer; this model came without tokenizer files")
    check_lengths([length], [depth], 1)
    rng = random.Random(f"attnlab-passkey:{seed}:{length}:{float(depth)!r}:{trial}")
    key = str(rng.randint(10 ** (KEY_DIGITS - 1), 10 ** KEY_DIGITS - 1))
    answer_tokens = len(_pieces(tok, [f" {key}"])[0]) + 2
    target = length - answer_tokens
    head = list(tok("", add_special_tokens=True).input_ids) + _pieces(tok, [INTRO])[0]
    key_ids, question = _pieces(tok, [_key_line(key), QUESTION])
    budget = target - len(head) - len(question) - (len(key_ids) if with_key else 0)
    if budget < 0:
        raise ValueError(f"a passkey prompt of {length} tokens cannot hold the instruction, the key line and the "
                         f"question ({target - budget + answer_tokens} tokens with the answer)")
    sentences = _pieces(tok, [" " + s for s in FILLER])
    newline = _pieces(tok, ["\n"])[0]
    filler: list[list[int]] = []
    left = budget
    order: list[int] = []
    while left >= max(len(s) for s in sentences):  # whole sentences in a seeded order, reshuffled each round
        if not order:
            order = list(range(len(sentences)))
            rng.shuffle(order)
        filler.append(sentences[order.pop()])
        left -= len(filler[-1])
    for s in sorted(sentences, key=len, reverse=True):  # the gap: the longest sentences that still fit
        while len(s) <= left:
            filler.append(s)
            left -= len(s)
    if len(newline) == 1:  # the last tokens: paragraph breaks between sentences, at seeded places
        for _ in range(left):
            filler.insert(rng.randint(0, len(filler)), newline)
        left = 0
    ends = [0]  # filler tokens before each boundary between pieces
    for piece in filler:
        ends.append(ends[-1] + len(piece))
    cut = min(range(len(ends)), key=lambda i: abs(ends[i] - depth * ends[-1]))  # the boundary nearest the depth
    P = target - left
    ids = head + [t for p in filler[:cut] for t in p]
    position = len(ids) if with_key else None
    ids += (key_ids if with_key else []) + [t for p in filler[cut:] for t in p] + question
    if len(ids) != P:  # the pieces above add up to P by construction: a bug, not the caller's input
        raise RuntimeError(f"passkey prompt bug: {len(ids)} tokens assembled for {P}")
    return PasskeyPrompt(torch.tensor([ids], dtype=torch.long), key, length, float(depth), position, answer_tokens)


def passkey_match(answer: str, key: str) -> bool:
    """Exact match: the first run of digits in the answer is the key, no digit more or less ("48213." and
    " 48213 is" match 48213; "4821", "482130", "48 213" and "none" do not)."""
    if not isinstance(answer, str) or not isinstance(key, str) or not key.isdigit():
        raise TypeError(f"passkey_match takes the answer text and the key's digits, got {answer!r} and {key!r}")
    found = re.search(r"\d+", answer)
    return found is not None and found.group() == key


def greedy_through_cache(model, chunk: int = 512) -> Callable[[torch.Tensor, int], torch.Tensor]:
    """decode(prompt ids (1, P), n) -> n new ids (n,), greedy, through the model's own caches (evaluate.CacheRunner:
    the prompt in chunks of `chunk` tokens, then one token per step; each module's kv_dtype)."""
    from .evaluate import CacheRunner, check_chunk

    check_chunk(chunk)

    def decode(ids: torch.Tensor, n: int) -> torch.Tensor:
        runner = CacheRunner(model, ids.shape[1] + n)
        for s in range(0, ids.shape[1], chunk):
            logits = runner.feed(ids[:, s:s + chunk], last_only=True)
        new = []
        for i in range(n):
            new.append(logits[0, -1].argmax())
            if i + 1 < n:
                logits = runner.feed(new[-1].view(1, 1), last_only=True)
        return torch.stack(new)

    return decode


class PasskeyReport(NamedTuple):
    """rows: one dict per prompt (length, depth, trial, key, answer, found, prompt_tokens, key_position);
    lengths: those run (asked ones beyond the model's context replaced by it)."""
    rows: list[dict]
    lengths: tuple[int, ...]
    depths: tuple[float, ...]
    trials: int
    seed: int

    @property
    def accuracy(self) -> float:
        return sum(r["found"] for r in self.rows) / len(self.rows)

    def cells(self) -> list[dict]:
        """One dict per (length, depth): found, trials, accuracy."""
        out = []
        for n in self.lengths:
            for d in self.depths:
                rows = [r for r in self.rows if r["length"] == n and r["depth"] == d]
                found = sum(r["found"] for r in rows)
                out.append({"length": n, "depth": d, "found": found, "trials": len(rows),
                            "accuracy": found / len(rows)})
        return out

    def to_dict(self) -> dict:
        return {"accuracy": self.accuracy, "seed": self.seed, "trials": self.trials, "lengths": list(self.lengths),
                "depths": list(self.depths), "cells": self.cells(), "rows": self.rows}


def _context_lengths(model, lengths: tuple[int, ...]) -> tuple[int, ...]:
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return tuple(dict.fromkeys(min(n, limit) for n in lengths)) if isinstance(limit, int) else lengths


def passkey_prompts(model, tok, *, lengths: Sequence[int] = LENGTHS, depths: Sequence[float] = DEPTHS,
                    trials: int = 1, seed: int = 0, with_key: bool = True) -> list[tuple[int, float, int, PasskeyPrompt]]:
    """Every prompt run_passkey decodes, as (length, depth, trial, prompt), built before any decoding (so a length
    too short for the prompt's fixed parts is refused at once); lengths above the model's max_position_embeddings
    become it, duplicates dropped."""
    lengths, depths, trials = check_lengths(lengths, depths, trials)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}")
    return [(n, d, t, passkey_prompt(tok, n, d, seed=seed, trial=t, with_key=with_key))
            for n in _context_lengths(model, lengths) for d in depths for t in range(trials)]


def run_passkey(model, tok, *, lengths: Sequence[int] = LENGTHS, depths: Sequence[float] = DEPTHS, trials: int = 1,
                seed: int = 0, decode: Callable[[torch.Tensor, int], torch.Tensor] | None = None,
                with_key: bool = True, progress: Callable[[int, int], None] | None = None) -> PasskeyReport:
    """Exact-match passkey accuracy of a causal LM at every (length, depth), `trials` prompts (keys) each.

    lengths above the model's max_position_embeddings become it (duplicates dropped); decode(prompt ids (1, P), n) ->
    the n (or fewer) new ids, default greedy_through_cache(model); with_key=False: the control prompts; progress(i,
    total): called before prompt i. ValueError/TypeError naming bad lengths, depths, trials or seed, before decoding.
    """
    cases = passkey_prompts(model, tok, lengths=lengths, depths=depths, trials=trials, seed=seed, with_key=with_key)
    # The command line passes attnlab's generation loop (generation.generate: static caches, the prompt in one forward,
    # then decode steps); tests/test_eval_protocol.py checks that it chooses the tokens greedy_through_cache chooses.
    decode = greedy_through_cache(model) if decode is None else decode
    rows = []
    for i, (n, d, t, p) in enumerate(cases):
        if progress is not None:
            progress(i, len(cases))
        new = decode(p.ids, p.answer_tokens)
        answer = tok.decode([int(x) for x in new], skip_special_tokens=True)
        rows.append({"length": n, "depth": d, "trial": t, "key": p.key, "answer": answer,
                     "found": passkey_match(answer, p.key), "prompt_tokens": p.prompt_tokens,
                     "key_position": p.key_position})
    return PasskeyReport(rows, tuple(dict.fromkeys(n for n, _, _, _ in cases)),
                         tuple(dict.fromkeys(d for _, d, _, _ in cases)), check_lengths(lengths, depths, trials)[2],
                         seed)
