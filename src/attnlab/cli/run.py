"""`attnlab eval` (perplexity and KV bytes) and `attnlab generate` (attnlab's own generation loop)."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from .base import Busy, UsageProblem, positive, quiet_transformers

ENGINES = ("attnlab", "transformers")


def _numbers(option: str, text: str | None, kind):
    """A comma-separated list of ints or floats, or a UsageProblem naming the option and the value."""
    if text is None:
        return None
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values:
        what = "integers" if kind is int else "numbers"
        raise UsageProblem(f"{option} takes comma-separated {what} (e.g. {'2048,4096' if kind is int else '0.1,0.5'})"
                           f", got {text!r}")
    return values


def _table(rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


def eval_(source: str = typer.Argument(..., help="A model (smollm2, gemma3-270m) or a folder written by attnlab convert."),
          texts: Optional[list[Path]] = typer.Option(None, "--text", help="An English text file to score; repeat "
                                                     "--text for several (one row each, then the worst)."),
          reference: Optional[str] = typer.Option(None, "--reference", help="The original model (e.g. smollm2): "
                                                  "scored on the same tokens, the same way, with its own cache "
                                                  "storage; each row adds its perplexity and the ratio "
                                                  "model/reference, and the worst row is the highest ratio."),
          max_tokens: Optional[int] = typer.Option(None, "--max-tokens", help="Score at most this many tokens of "
                                                   "each text; default 2048, or one --window where larger."),
          window: Optional[int] = typer.Option(None, "--window", help="Tokens per window: each window is scored "
                                               "afresh; default 512, or --max-tokens or the model's context "
                                               "where smaller. A text shorter than one window is refused."),
          through_cache: Optional[bool] = typer.Option(None, "--through-cache/--one-forward", help="Score each "
                                                       "window through the model's KV cache, as decoding reads "
                                                       "it: fed in chunks of --chunk tokens, each attending to "
                                                       "the earlier chunks as the cache stores them; or in one "
                                                       "forward per window. Default: through the cache when "
                                                       "--window exceeds --chunk, except for KIVI, which has no "
                                                       "cache."),
          chunk: int = typer.Option(512, "--chunk", help="Tokens per forward through the cache."),
          kv_dtype: Optional[str] = typer.Option(None, "--kv-dtype", help="KV-cache storage of MODEL (not of "
                                                 "--reference) to score and count: "
                                                 "fp32, bf16, int8, fp8 (int8/g<N>, fp8/g<N>: a scale per N "
                                                 "channels); llama.cpp's q8_0, q5_0, q4_0, q4_1; int4, int2 "
                                                 "(/g<N>, +r8 for an MLA's rope key); KIVI's kivi4, kivi2; "
                                                 "default the model's own."),
          json_out: Optional[Path] = typer.Option(None, "--json", help="Also write the rows (and the passkey "
                                                  "results) as JSON, atomically."),
          passkey: bool = typer.Option(False, "--passkey", help="Passkey retrieval: a 5-digit key hidden at "
                                       "--passkey-depths of filler prompts of --passkey-lengths tokens, greedy "
                                       "answers by attnlab's generation loop through MODEL's cache; exact-match "
                                       "accuracy per (length, depth)."),
          passkey_lengths: str = typer.Option("2048,4096,8192", "--passkey-lengths", help="Total tokens (prompt "
                                              "and answer) of the passkey prompts; longer than the model's "
                                              "context: its context."),
          passkey_depths: str = typer.Option("0.1,0.5,0.9", "--passkey-depths", help="Where the key line sits, "
                                             "as fractions of the filler (0 first, 1 last)."),
          passkey_trials: int = typer.Option(1, "--passkey-trials", help="Prompts (keys) per length and depth."),
          seed: int = typer.Option(0, "--seed", help="Seed of the passkey prompts (keys, filler order)."),
          engine: str = typer.Option("attnlab", "--engine", help="What runs the model: attnlab (its own loop "
                                     "over attnlab's modules) or transformers (transformers' own forward and "
                                     "generate over attnlab.hf.KVCache with the same storage; a --format "
                                     "transformers folder in the storage it was planned for, its MLA included).")):
    """Perplexity of a causal model on texts (a row each, then the worst), its KV bytes per token, passkey retrieval.

    Example: attnlab eval smollm2 --reference smollm2 --kv-dtype q4_0 --window 4096 --text A.txt --json q4_0.json
    Example: attnlab eval smollm2 --passkey --passkey-lengths 2048,4096 --kv-dtype q4_0
    Example: attnlab eval smollm2 --engine transformers --kv-dtype q4_0 --reference smollm2 --text A.txt --text B.txt
    """
    import json

    from .. import models as hf
    from ..hf import TransformersRunner
    from ..io.folders import replace_file
    from ..models.evaluate import default_window, score_windows
    from ..modules.storage import check_kv_dtype
    from ..shrink.layer_bits import bits_label

    fmt = check_kv_dtype(kv_dtype)  # before loading anything: one line naming the value and the choices
    texts = list(texts or [])
    _check_eval(fmt, kv_dtype, engine, through_cache, texts, passkey, reference, window, max_tokens, chunk,
                passkey_trials)
    lengths = depths = None
    if passkey:
        from ..models.passkey import check_lengths

        lengths, depths, _ = check_lengths(_numbers("--passkey-lengths", passkey_lengths, int),
                                           _numbers("--passkey-depths", passkey_depths, float), passkey_trials)
    for path in texts:  # the cheap part of reading a text, before the model loads
        if not path.is_file():
            raise UsageProblem(f"no such text file: {path}")
    if max_tokens is None:
        max_tokens = max(2048, window or 0)
    quiet_transformers()
    from ..hf.folder import planned_entry, value_bases

    planned = planned_entry(source) if engine == "transformers" else {}
    if kv_dtype is None and planned.get("kv_dtype"):  # the storage a --format transformers folder was planned for
        kv_dtype = planned["kv_dtype"]  # (a list: one a layer)
    each_layer = kv_dtype if isinstance(kv_dtype, list) else [kv_dtype]
    mla = planned.get("model_type") == "deepseek_v3"  # an MLA as DeepSeek-V3: transformers loads it itself
    with Busy(f"loading {source}") as busy:
        model, tok = _load_deepseek(source) if mla else hf.load_model(source)[:2]
        if not mla and hf.family(model) != "llama":
            raise UsageProblem("eval scores causal language models (smollm2 and its conversions)")
        limit = getattr(model.config, "max_position_embeddings", None)
        if window is None:
            window = default_window(model, min(512, max_tokens))
        elif isinstance(limit, int) and window > limit:
            raise UsageProblem(f"--window {window} exceeds {source}'s context (max_position_embeddings {limit})")
        ids = [hf.read_text_ids(tok, path, max_tokens, min_tokens=1) for path in texts]
        for path, t in zip(texts, ids):  # every text before any scoring: a short one would flatter
            if t.shape[1] < window:
                raise UsageProblem(f"{path} holds {t.shape[1]} tokens, fewer than one window of {window} "
                                   f"(--window); give a longer text or a smaller --window")
        if passkey:  # every prompt built now: a length too short for one is refused before any scoring
            from ..models.passkey import passkey_prompts

            passkey_prompts(model, tok, lengths=lengths, depths=depths, trials=passkey_trials, seed=seed)
        storages = each_layer if kv_dtype is not None or mla else [m.kv_dtype for m in hf.attnlab_modules(model)]
        kivi = [k for k in storages if k is not None and check_kv_dtype(k).evaluation_only]  # no cache to read
        cached = window > chunk and not kivi if through_cache is None else through_cache
        bases = value_bases(source, model.config.num_hidden_layers) if planned.get("value_bases") else None
        kept = planned.get("kept_dtype") if bases else None  # a keys-whole plan's layers kept as they were
        stored, sixteen = _bytes(model, kv_dtype, bases, kept, in_kvcache=mla or (bases and engine == "transformers"))
        storage = kv_dtype if isinstance(kv_dtype, list) else storages[0]
        if engine == "transformers":
            cached, model = True, model if mla else _in_transformers(model, source)
        if cached and kivi:
            raise UsageProblem(f"{source} stores its cache as {kivi[0]} (KIVI), which has no cache to score "
                               "through; use --one-forward")
        if passkey and kivi:
            raise UsageProblem(f"--passkey decodes through {source}'s cache, and {kivi[0]} (KIVI) has none")
        step = chunk if cached else None

        def score(m, t, who, path, storage=None, bases=None):
            n = len(hf.windows(t, window))
            runner = None if engine == "attnlab" else TransformersRunner(m, storage, bases, kept)
            return score_windows(m, t, window, chunk=step, runner=runner, progress=lambda i: busy.update(
                f"{who}: scoring {path.name} ({t.shape[1]} tokens): window {i + 1} of {n}"))

        ref_scores = None
        if reference is not None and texts:
            ref_model = _reference(reference, source, model, texts, ids, max_tokens, engine, busy)
            ref_scores = [score(ref_model, t, reference, path) for path, t in zip(texts, ids)]
            del ref_model
        if kv_dtype is not None and engine == "attnlab":
            hf.set_kv_dtype(model, kv_dtype)
        scores = [score(model, t, source, path, storage, bases) for path, t in zip(texts, ids)]
        report = None
        if passkey:
            report = _run_passkey(model, tok, lengths, depths, passkey_trials, seed, busy, engine, storage,
                                  (bases, kept))
    rows = _rows(texts, scores, ref_scores)
    worst = max(rows, key=lambda r: r["ratio" if ref_scores is not None else "perplexity"]) if rows else None
    how = (f"through the cache in chunks of {chunk} tokens" if cached else "one forward per window") + \
        ("" if engine == "attnlab" else ", in transformers' forward over attnlab.hf.KVCache")
    _print_rows(rows, worst, ref_scores is not None)
    if rows:
        print(f"windows: {window} tokens, {how}")
    print(f"kv bytes per token: {stored} ({stored / sixteen:.1%} of its 16-bit cache, {sixteen})")
    if kv_dtype is not None:
        print(f"kv storage: {bits_label(kv_dtype)}")
    if report is not None:
        _print_passkey(report)
    if json_out is not None:
        out = {"model": source, "reference": reference, "engine": engine, "kv_dtype": kv_dtype, "window": window,
               "max_tokens": max_tokens, "through_cache": cached, "chunk": chunk if cached else None,
               "kv_bytes_per_token": stored, "rows": rows, "worst": worst,
               "passkey": None if report is None else report.to_dict()}
        replace_file(json_out, (json.dumps(out, indent=2) + "\n").encode())


def _check_eval(fmt, kv_dtype, engine, through_cache, texts, passkey, reference, window, max_tokens, chunk,
                trials) -> None:
    """eval's options checked before anything loads: a UsageProblem naming the value."""
    if engine not in ENGINES:
        raise UsageProblem(f"--engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if engine == "transformers" and through_cache is False:
        raise UsageProblem("--engine transformers scores through its cache, as decoding reads it: drop --one-forward")
    if engine == "transformers" and fmt is not None and fmt.evaluation_only:
        raise UsageProblem(f"--kv-dtype {kv_dtype} is an evaluation baseline with no cache; --engine transformers "
                           "reads a cache")
    if not texts and not passkey:
        raise UsageProblem("nothing to do: give --text FILE (repeat it for several) and/or --passkey")
    positive("--max-tokens", max_tokens, integer=True)
    positive("--chunk", chunk, integer=True)
    positive("--passkey-trials", trials, integer=True)
    if window is not None and window < 2:
        raise UsageProblem(f"--window must be at least 2 tokens (a token and the one it predicts), got {window}")
    if window is not None and max_tokens is not None and max_tokens < window:
        raise UsageProblem(f"--max-tokens {max_tokens} keeps fewer tokens than one --window of {window}")
    if through_cache and fmt is not None and fmt.evaluation_only:
        raise UsageProblem(f"--kv-dtype {kv_dtype} (KIVI) has no cache to score through; use --one-forward")
    if reference is not None and not texts:
        raise UsageProblem("--reference scores texts against the original: give --text FILE (the passkey runs "
                           "MODEL alone)")


def _bytes(model, kv_dtype, bases, kept, in_kvcache: bool) -> tuple[int, int]:
    """(bytes per token in kv_dtype, in 16 bits): counted from the caches KVCache makes for a folder (in_kvcache: an
    MLA as DeepSeek-V3, a keys-whole plan in transformers), else from attnlab's caches of that storage."""
    from .. import models as hf

    if in_kvcache:
        from ..hf.shapes import storage_bytes
        return storage_bytes(model, kv_dtype, bases, kept), storage_bytes(model, "bf16")
    return hf.kv_bytes_per_token(model, kv_dtype=kv_dtype), hf.kv_bytes_per_token(model, kv_dtype="bf16")


def _reference(reference: str, source: str, model, texts, ids, max_tokens, engine: str, busy):
    """The --reference model (MODEL itself where the names match, before --kv-dtype applies), in transformers for
    that engine; a UsageProblem where it is not a causal LM or tokenizes a text differently."""
    from .. import models as hf

    if reference == source:
        return model
    busy.update(f"loading {reference}")
    ref_model, ref_tok, _ = hf.load_model(reference)
    if hf.family(ref_model) != "llama":
        raise UsageProblem(f"--reference {reference} is not a causal language model")
    for path, t in zip(texts, ids):
        theirs = hf.read_text_ids(ref_tok, path, max_tokens, min_tokens=2) if ref_tok is not None else t
        if tuple(theirs.shape) != tuple(t.shape) or bool((theirs != t).any()):
            raise UsageProblem(f"--reference {reference} tokenizes {path} differently from {source}: "
                               "perplexities of different tokens do not compare")
    return _in_transformers(ref_model, reference) if engine == "transformers" else ref_model


def _rows(texts, scores, ref_scores) -> list[dict]:
    """eval's row of each text: its tokens, windows and perplexity, with --reference the original's and the ratio."""
    rows = []
    for i, (path, s) in enumerate(zip(texts, scores)):
        row = {"text": str(path), "tokens": s.tokens, "scored": s.scored, "windows": s.windows,
               "perplexity": s.perplexity}
        if ref_scores is not None:
            row["reference_perplexity"] = ref_scores[i].perplexity
            row["ratio"] = s.perplexity / ref_scores[i].perplexity
        rows.append(row)
    return rows


def _print_rows(rows: list[dict], worst: dict | None, against: bool) -> None:
    """One text alone as two lines; several (or against a reference) as a table with the worst row last."""
    if len(rows) == 1 and not against:
        print(f"perplexity: {rows[0]['perplexity']:.4f}")
        print(f"tokens: {rows[0]['tokens']}")
    elif rows:
        table = [["text", "tokens", "scored", "perplexity"] + (["reference", "ratio"] if against else [])]
        named = [(Path(r["text"]).name, r) for r in rows] + [(f"worst ({Path(worst['text']).name})", worst)]
        for name, r in named:
            line = [name, str(r["tokens"]), str(r["scored"]), f"{r['perplexity']:.4f}"]
            if against:
                line += [f"{r['reference_perplexity']:.4f}", f"{r['ratio']:.4f}"]
            table.append(line)
        _table(table)


def _load_deepseek(source: str):
    """(model, tokenizer) of a DeepSeek-V3 folder attnlab wrote, loaded by transformers alone (float32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(source)


def _in_transformers(model, name: str):
    """The model in transformers' own attention (models.adapters.from_attnlab), or a UsageProblem for a converted
    one (an MLA runs in transformers as a DeepSeek-V3 export)."""
    from .. import models as hf

    kinds = {type(m).__name__ for m in hf.attnlab_modules(model)}
    if kinds != {"GroupedQueryAttention"}:
        raise UsageProblem(f"--engine transformers runs a model in its own attention; {name} holds "
                           f"{', '.join(sorted(kinds))} layers (attnlab export --format deepseek writes one "
                           "transformers runs)")
    return hf.from_attnlab(model)


def _run_passkey(model, tok, lengths, depths, trials, seed, busy, engine, storage, planned=(None, None)):
    """Passkey retrieval, greedy: attnlab's generation loop through the model's cache and its kv_dtype, or
    transformers' generate over attnlab.hf.KVCache in `storage` (engine "transformers")."""
    from ..generation.loop import generate as run_generation
    from ..hf import KVCache
    from ..models.passkey import run_passkey

    eos = getattr(model.generation_config, "eos_token_id", None) or getattr(tok, "eos_token_id", None)

    def decode(ids, n):
        if engine == "transformers":
            out = model.generate(ids, cache=KVCache(model, storage, *planned), max_new_tokens=n, do_sample=False,
                                 eos_token_id=eos, pad_token_id=eos)
            return out[0, ids.shape[1]:]
        return run_generation(model, ids, max_new_tokens=n, eos_token_id=eos)[0, ids.shape[1]:]

    return run_passkey(model, tok, lengths=lengths, depths=depths, trials=trials, seed=seed, decode=decode,
                       progress=lambda i, n: busy.update(f"passkey: prompt {i + 1} of {n}"))


def _print_passkey(report) -> None:
    print(f"passkey: seed {report.seed}, {report.trials} trial(s) per length and depth")
    table = [["length", "depth", "found", "accuracy"]]
    for c in report.cells():
        table.append([str(c["length"]), f"{c['depth']:g}", f"{c['found']}/{c['trials']}", f"{c['accuracy']:.0%}"])
    _table(table)
    found = sum(r["found"] for r in report.rows)
    print(f"passkey accuracy: {found}/{len(report.rows)} ({report.accuracy:.1%})")


def generate(source: str = typer.Argument(..., help="A model (smollm2, gemma3-270m) or a folder written by attnlab convert."),
             prompts: list[str] = typer.Argument(..., help="One prompt, or several to run as one left-padded batch."),
             max_new_tokens: int = typer.Option(32, "--max-new-tokens", help="Tokens to generate per prompt."),
             temperature: float = typer.Option(0.0, "--temperature", help="0 is greedy; above 0 samples."),
             top_k: Optional[int] = typer.Option(None, "--top-k", help="Sample among the k most likely tokens."),
             top_p: Optional[float] = typer.Option(None, "--top-p", help="Sample among the most likely tokens "
                                                   "whose probability reaches p (nucleus)."),
             seed: Optional[int] = typer.Option(None, "--seed", help="Seed of the sampler (same seed, same text)."),
             stream: bool = typer.Option(True, "--stream/--no-stream", help="Print a single prompt's tokens as "
                                         "they come."),
             kv_dtype: Optional[str] = typer.Option(None, "--kv-dtype", help="KV-cache storage: fp32, bf16, int8, "
                                                    "fp8 (int8/g<N>, fp8/g<N>: a scale per N channels); default "
                                                    "the model's own.")):
    """Continue one prompt or a batch of them with attnlab's own generation loop (static caches).

    Prints the continuations only; a line of timings goes to stderr.
    Example: attnlab generate smollm2-mla256 "The capital of France is" --max-new-tokens 16
    """
    import time

    from .. import models as hf
    from ..generation.loop import generate as run_generation
    from ..generation.sampling import check_sampling
    from ..modules.storage import check_kv_dtype

    check_sampling(temperature, top_k, top_p)
    check_kv_dtype(kv_dtype)
    positive("--max-new-tokens", max_new_tokens, integer=True)
    with Busy(f"loading {source}"):
        quiet_transformers()
        model, tok, _ = hf.load_model(source)
    if hf.family(model) != "llama":
        raise UsageProblem("generate needs a causal language model (smollm2 and its conversions)")
    if tok is None:
        raise UsageProblem(f"{source} has no tokenizer files (tokenizer.json, tokenizer_config.json ...): generate "
                           "needs one to read the prompts")
    if kv_dtype is not None:
        hf.set_kv_dtype(model, kv_dtype)  # the Generator's caches take each module's kv_dtype
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    enc = tok(list(prompts), return_tensors="pt", padding=True)
    P = enc.input_ids.shape[1]
    eos = getattr(model.generation_config, "eos_token_id", None) or tok.eos_token_id
    shown = {"text": "", "tokens": []}

    def show(column):  # one prompt: print what the new token adds to the decoded text
        shown["tokens"].append(int(column[0]))
        text = tok.decode(shown["tokens"], skip_special_tokens=True)
        if not text.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            print(text[len(shown["text"]):], end="", flush=True)
            shown["text"] = text

    live = stream and len(prompts) == 1
    t0 = time.perf_counter()
    out = run_generation(model, enc.input_ids, enc.attention_mask, max_new_tokens=max_new_tokens,
                         temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, eos_token_id=eos,
                         pad_token_id=tok.pad_token_id, stream=show if live else None)
    seconds = time.perf_counter() - t0
    if live:
        print(tok.decode(shown["tokens"], skip_special_tokens=True)[len(shown["text"]):])
    elif len(prompts) == 1:
        print(tok.decode(out[0, P:], skip_special_tokens=True))
    else:
        for i, (prompt, row) in enumerate(zip(prompts, out[:, P:])):
            print(f"--- {i + 1}: {prompt}")
            print(tok.decode(row, skip_special_tokens=True))
    new = out.shape[1] - P
    print(f"{len(prompts)} x {new} tokens in {seconds:.2f} s ({len(prompts) * new / seconds:.1f} tokens/s)",
          file=sys.stderr)
