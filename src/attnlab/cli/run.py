"""`attnlab eval` (perplexity and KV bytes) and `attnlab generate` (attnlab's own generation loop)."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from .base import Busy, UsageProblem, positive


def eval_(source: str = typer.Argument(..., help="A model (smollm2, gemma3-270m) or a folder written by attnlab convert."),
          text: Path = typer.Option(..., "--text", help="An English text file to score."),
          max_tokens: int = typer.Option(2048, "--max-tokens", help="Score at most this many tokens."),
          window: int = typer.Option(512, "--window", help="Tokens per forward pass."),
          kv_dtype: Optional[str] = typer.Option(None, "--kv-dtype", help="KV-cache storage to score and count: "
                                                 "fp32, bf16, int8, fp8 (int8/g<N>, fp8/g<N>: a scale per N "
                                                 "channels); llama.cpp's q8_0, q5_0, q4_0, q4_1; int4, int2 "
                                                 "(/g<N>, +r8 for an MLA's rope key); KIVI's kivi4, kivi2; "
                                                 "default the model's own.")):
    """Perplexity of a causal model on a text, and its KV-cache bytes per token.

    With --kv-dtype the keys and values go through that storage (quantised and read back) before
    attention, as cached decode reads them, and the bytes count its scales.
    Example: attnlab eval smollm2-mla256 --text /usr/share/common-licenses/GPL-3 --kv-dtype int8
    Example: attnlab eval smollm2 --text /usr/share/common-licenses/GPL-3 --kv-dtype q4_0   (llama.cpp's cache type)
    """
    from .. import models as hf
    from ..modules.cache import check_kv_dtype

    check_kv_dtype(kv_dtype)  # before loading anything: one line naming the value and the choices
    positive("--max-tokens", max_tokens, integer=True)
    if window < 2:
        raise UsageProblem(f"--window must be at least 2 tokens (a token and the one it predicts), got {window}")
    with Busy(f"loading {source}") as busy:
        model, tok, meta = hf.load_model(source)
        if hf.family(model) != "llama":
            raise UsageProblem("eval scores causal language models (smollm2 and its conversions)")
        ids = hf.read_text_ids(tok, text, max_tokens, min_tokens=2)
        if kv_dtype is not None:
            hf.set_kv_dtype(model, kv_dtype)
        n = len(hf.windows(ids, window))
        ppl = hf.perplexity(model, ids, window=window,
                            progress=lambda i: busy.update(f"scoring {ids.shape[1]} tokens: window {i + 1} of {n}"))
    print(f"perplexity: {ppl:.4f}")
    print(f"tokens: {ids.shape[1]}")
    stored, sixteen = hf.kv_bytes_per_token(model), hf.kv_bytes_per_token(model, kv_dtype="bf16")
    print(f"kv bytes per token: {stored} ({stored / sixteen:.1%} of its 16-bit cache, {sixteen})")
    if kv_dtype is not None:
        print(f"kv storage: {kv_dtype}")


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
    from ..modules.cache import check_kv_dtype

    check_sampling(temperature, top_k, top_p)
    check_kv_dtype(kv_dtype)
    positive("--max-new-tokens", max_new_tokens, integer=True)
    with Busy(f"loading {source}"):
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
