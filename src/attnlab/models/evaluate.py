"""Measure whole models: perplexity (one forward per window, or through the cache in chunks: CacheRunner), sentence
embeddings, KV bytes per token, attention inputs."""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .adapters import attnlab_modules


def sentence_embeddings(model, tok, sentences: list[str], batch_size: int = 32) -> torch.Tensor:
    """Mean-pooled, L2-normalised embeddings, as sentence-transformers computes them for all-MiniLM-L6-v2."""
    out = []
    for i in range(0, len(sentences), batch_size):
        enc = tok(sentences[i:i + batch_size], padding=True, truncation=True, max_length=256, return_tensors="pt")
        with torch.no_grad():
            hidden = model(**enc).last_hidden_state  # (B, L, dim)
        out.append(mean_pooled(hidden, enc["attention_mask"]))
    return torch.cat(out)

def mean_pooled(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Sentence embeddings (B, dim) from token states (B, L, dim): mean over real tokens, L2-normalised."""
    m = attention_mask[..., None].to(hidden.dtype)
    return torch.nn.functional.normalize((hidden * m).sum(1) / m.sum(1), dim=-1)

class _AllRead(Exception):
    """Raised by attention_inputs' hook on the last attention module: what is left of the forward is not needed."""


def attention_inputs(model, input_ids: torch.Tensor, *, stop: bool = True) -> list[torch.Tensor]:
    """What each attention layer reads, (N, dim) per layer, from one forward of the (attnlab'd) model.

    stop: end the forward where the last attention module is called (its attention, the last MLP, the final norm and
    the output head are not run). False runs the whole forward, for a model whose forward must not be left half-way
    (one sharded by FSDP2, whose hooks put each unit's weights back after it runs)."""
    seen: list[torch.Tensor] = []
    modules = attnlab_modules(model)

    def read(mod, args, kwargs):
        seen.append((args[0] if args else kwargs["hidden_states"]).detach().reshape(-1, mod.dim))
        if stop and len(seen) == len(modules):
            raise _AllRead()

    hooks = [m.register_forward_pre_hook(read, with_kwargs=True) for m in modules]
    try:
        with torch.no_grad():
            model(input_ids)
    except _AllRead:
        pass
    finally:
        for h in hooks:
            h.remove()
    return seen

EVAL_WINDOW = 512  # tokens per evaluation window, where the model's context allows


def default_window(model, preferred: int = EVAL_WINDOW) -> int:
    """`preferred`, or the model's context (max_position_embeddings) where that is shorter: the evaluation window
    the heal and shrink reports use, so that a model of a short context is scored, not refused."""
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return min(preferred, limit) if isinstance(limit, int) and limit >= 2 else preferred


def check_window(window: int, input_ids: torch.Tensor, model=None) -> None:
    """ValueError naming the values unless window >= 2, ids (1, N >= 2), and window within the model's context."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 2:
        raise ValueError(f"the evaluation window must be an int >= 2 tokens (a token and the one it predicts), "
                         f"got {window!r}")
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[0] != 1:
        shape = tuple(input_ids.shape) if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise ValueError(f"token ids must have shape (1, N), got {shape}")
    if input_ids.shape[1] < 2:
        raise ValueError(f"the text has {input_ids.shape[1]} token(s); a perplexity needs at least 2")
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if limit and window > limit and input_ids.shape[1] > limit:
        raise ValueError(f"the evaluation window ({window} tokens) exceeds the model's context "
                         f"(max_position_embeddings {limit}); use --window <= {limit}")


def on_model(model, ids: torch.Tensor) -> torch.Tensor:
    """Token ids on the device of the model's weights (a model healed on a GPU is scored there; ids come from the
    CPU)."""
    weight = next(model.parameters(), None)
    return ids if weight is None else ids.to(weight.device)


def next_token_nll(logits: torch.Tensor, chunk: torch.Tensor) -> tuple[float, int]:
    """(summed negative log-likelihood of each next token, count) for one window: logits (1, n, V), chunk (1, n)."""
    loss = torch.nn.functional.cross_entropy(logits[0, :-1].float(), chunk[0, 1:], reduction="sum")
    return float(loss), chunk.shape[1] - 1


def windows(input_ids: torch.Tensor, window: int, stride: int | None = None) -> list[torch.Tensor]:
    """The (1, <= window) chunks perplexity scores, one every `stride` (default window) tokens; each has >= 2 tokens."""
    stride = stride or window
    return [input_ids[:, s:s + window] for s in range(0, input_ids.shape[1] - 1, stride)
            if input_ids[:, s:s + window].shape[1] >= 2]


def perplexity(model, input_ids: torch.Tensor, window: int = 512, stride: int | None = None, *,
               budget=None, progress=None) -> float:
    """exp(mean next-token loss) over non-overlapping windows of the token ids (1, N).

    budget (runtime.Budget): checked before every window after the first (a stop request or a
    spent budget raises runtime.Stopped). progress(i) is called before window i.
    """
    check_window(window, input_ids, model)
    total, count = 0.0, 0
    with torch.no_grad():
        for i, chunk in enumerate(windows(on_model(model, input_ids), window, stride)):
            if budget is not None and i:
                budget.check()
            if progress is not None:
                progress(i)
            nll, n = next_token_nll(model(chunk).logits, chunk)
            total += nll
            count += n
    return float(torch.exp(torch.tensor(total / count)))


def causal_parts(model, what: str = "scoring through the cache"):
    """(embed_tokens, decoder layers, final norm, lm_head, attnlab modules, decoder block) of an attnlab'd
    Llama-family causal LM (the parts generation.Generator and CacheRunner drive), or a ValueError naming what is
    there (`what` needs it)."""
    from .adapters import decoder_block, family

    if getattr(model, "config", None) is None or family(model) != "llama":  # family() names other families
        raise ValueError(f"{what} needs a Llama-family causal LM; got a {type(model).__name__}")
    base, lm_head = getattr(model, "model", None), getattr(model, "lm_head", None)
    if lm_head is None or base is None or not hasattr(base, "embed_tokens"):
        raise ValueError(f"{what} needs a causal LM with an lm_head (e.g. LlamaForCausalLM); "
                         f"got a {type(model).__name__}")
    modules = attnlab_modules(model)  # ValueError unless to_attnlab(model) was called
    return base.embed_tokens, list(base.layers), base.norm, lm_head, modules, decoder_block(model)


_causal_parts = causal_parts


class CacheRunner:
    """An attnlab'd Llama-family causal LM (batch of one, no padding) fed through its modules' own static caches.

    Each layer's cache is its module's `init_cache(1, max_len, kv_dtype=...)` (default each module's own storage);
    `feed(ids)` runs the layers as generation.Generator does: a whole prompt is its prefill, one token its decode step
    (tests/test_eval_protocol.py checks both, to the bit). Unlike the Generator it returns every position's logits.
    """

    def __init__(self, model, max_len: int, *, kv_dtype: str | None = None):
        from ..modules import checks
        from ..modules.storage import check_kv_dtype

        checks.positive_int("max_len", max_len)
        check_kv_dtype(kv_dtype)
        self.embed, self.layers, self.norm, self.lm_head, self.modules, self._block = _causal_parts(model)
        limit = getattr(model.config, "max_position_embeddings", None)
        if isinstance(limit, int) and max_len > limit:
            raise ValueError(f"max_len {max_len} exceeds the model's context (max_position_embeddings {limit})")
        weight = self.embed.weight
        self.model, self.max_len, self.length = model, max_len, 0
        self.caches = [m.init_cache(1, max_len, dtype=weight.dtype, device=weight.device, kv_dtype=kv_dtype)
                       for m in self.modules]

    def reset(self) -> None:
        """Forget every cached token (the buffers stay allocated)."""
        for c in self.caches:
            c.reset()
        self.length = 0

    @torch.no_grad()
    def feed(self, ids: torch.Tensor, *, last_only: bool = False) -> torch.Tensor:
        """Append token ids (1, n) to the caches; logits (1, n, V) of every position fed (last_only: (1, 1, V))."""
        if not isinstance(ids, torch.Tensor):
            raise TypeError(f"ids must be a torch.Tensor of token ids, got {type(ids).__name__}")
        if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] < 1 or ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"ids must be integer token ids of shape (1, n >= 1), got {ids.dtype} {tuple(ids.shape)}")
        n = ids.shape[1]
        if self.length + n > self.max_len:
            raise ValueError(f"{self.length} cached + {n} new tokens = {self.length + n} exceed max_len "
                             f"{self.max_len}")
        x = self.embed(ids.to(self.embed.weight.device))  # (1, n, dim)
        # the model's decoder_block around each module: the tokens fed attend to every earlier token as its cache stores
        # it (quantised codes and scales where the storage says so) and to each other causally
        for layer, attn, cache in zip(self.layers, self.modules, self.caches):
            x = self._block(layer, x, lambda h: attn(h, cache=cache, is_causal=True))  # (1, n, dim)
        self.length += n
        return self.lm_head(self.norm(x[:, -1:] if last_only else x))  # (1, n or 1, V)


class TextScore(NamedTuple):
    """What score_windows measured: summed next-token negative log-likelihood (nats), the predictions scored,
    the tokens read, the windows."""
    nll: float
    scored: int
    tokens: int
    windows: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.scored)


def _nll(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """Summed cross-entropy of targets (n,) under logits (n, V): float32 at least (float64 stays float64), summed in
    float64."""
    x = logits if logits.dtype == torch.float64 else logits.float()
    return float(torch.nn.functional.cross_entropy(x, targets.to(x.device), reduction="none").double().sum())


def check_chunk(chunk) -> None:
    """ValueError naming the value unless chunk is None (one forward per window) or an int >= 1."""
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"chunk must be None (one forward per window) or a positive int (tokens per forward "
                         f"through the cache), got {chunk!r}")


def score_windows(model, input_ids: torch.Tensor, window: int = EVAL_WINDOW, *, chunk: int | None = None,
                  kv_dtype: str | None = None,  # the CacheRunner's storage; default each module's own
                  budget=None,  # runtime.Budget, checked before every window after the first
                  progress=None,  # progress(i): called before window i
                  runner=None) -> TextScore:  # what the chunks are fed to (reset(), feed(ids)); default a CacheRunner
    """Next-token log-likelihood of token ids (1, N) over non-overlapping windows (`windows`), each scored afresh.

    chunk None: one forward per window, each attnlab module passing its keys and values through its kv_dtype's storage
    (quantised and read back) before attention. chunk n: through the cache, as decoding reads it: each window fed in
    chunks of n tokens, each attending to the earlier chunks as the cache holds them. Returns a TextScore (.perplexity).
    """
    # For a storage that keeps each token's row alone (plain, bf16, int8, fp8, q8_0 ... q4_1, int4/g<N>) both ways give
    # the same numbers up to rounding (float64: 1e-10 relative, tests/test_eval_protocol.py); an MLA's "+c4" rope key
    # differs as decoding does (the cache holds its newest group of tokens unquantised); KIVI has no cache (a
    # ValueError). hf.score.TransformersRunner, as `runner`, feeds transformers' own forward through attnlab.hf.KVCache.
    check_window(window, input_ids, model)
    check_chunk(chunk)
    if chunk is None and kv_dtype is not None:
        raise ValueError(f"kv_dtype {kv_dtype!r} is a cache's storage: pass chunk= to score through the cache, or "
                         "set the modules' own kv_dtype (set_kv_dtype) for one forward per window")
    parts = windows(input_ids, window)
    if runner is not None and chunk is None:
        raise ValueError("a runner is fed chunks through its cache: pass chunk= with it")
    if runner is None and chunk is not None:
        runner = CacheRunner(model, max(w.shape[1] for w in parts), kv_dtype=kv_dtype)
    total = 0.0
    with torch.no_grad():
        for i, w in enumerate(parts):
            if budget is not None and i:
                budget.check()
            if progress is not None:
                progress(i)
            n = w.shape[1]
            if runner is None:
                total += _nll(model(w).logits[0, :-1], w[0, 1:])
                continue
            runner.reset()
            for s in range(0, n - 1, chunk):  # the window's last token predicts nothing here: never fed alone
                logits = runner.feed(w[:, s:s + chunk])[0]  # (c, V)
                targets = w[0, s + 1:s + 1 + chunk]
                total += _nll(logits[:targets.shape[0]], targets)
    return TextScore(total, sum(w.shape[1] - 1 for w in parts), input_ids.shape[1], len(parts))


def kv_bytes_per_token(model,
                       dtype: torch.dtype | None = None,  # the activations'; default each module's weight dtype
                       kv_dtype: str | list | None = None,  # the storage ("bf16", "int8", "fp8", ...; a list: one a
                       # module), scales counted; default each module's own kv_dtype, else plain in dtype
                       context: int | None = None):
    """KV-cache bytes per token for the whole model, read from caches the attnlab modules allocate on the meta device.

    context None: bytes per token held (an int; a sliding layer counts as a global one; what a sequence holds whatever
    its length is kv_fixed_bytes). A sequence length: bytes per token of a sequence that long (a float: a sliding
    layer's cache holds at most its window and some room, and the fixed bytes are spread over it: _Cache.bytes_at).
    """
    from ..modules import lowbit
    from ..modules.cache import window_rows
    from ..modules.storage import check_kv_dtype

    storages = each_module(model, kv_dtype)
    asked = [check_kv_dtype(k) for k in storages]
    total = 0
    for m, fmt, storage in zip(attnlab_modules(model), asked, storages):
        fmt = fmt or m._kv_format
        if fmt is not None and fmt.evaluation_only:  # KIVI, quanto: no cache here, their steady-state bytes
            kivi = lowbit.engine_bytes(m.kv_values_per_token, fmt.low)
            slides = context is not None and m.sliding_window is not None
            total += kivi * window_rows(m.sliding_window, context) / context if slides else kivi
            if context is not None:  # "+w<N>": its plain rows spread over the context
                total += _engine_fixed(m, fmt, dtype) / context
            continue
        cache = m.init_cache(1, 1, dtype=dtype or m._anchor.dtype, device="meta", kv_dtype=storage)
        total += cache.bytes_per_token if context is None else cache.bytes_at(context)
    return total


def kv_fixed_bytes(model, dtype: torch.dtype | None = None) -> int:
    """Bytes a sequence's caches hold whatever its length, beside kv_bytes_per_token's per token held: every layer's
    _Cache.fixed_bytes (a "+c4" rope key's newest group of tokens, unquantised in the activation dtype: dtype, default
    each module's weight dtype), or an evaluation-only storage's "+w<N>" rows; kv_bytes_per_token(model, context=T)
    spreads them over T tokens."""
    return sum(_engine_fixed(m, m._kv_format, dtype) if m._kv_format is not None and m._kv_format.evaluation_only
               else m.init_cache(1, 1, dtype=dtype or m._anchor.dtype, device="meta").fixed_bytes
               for m in attnlab_modules(model))


def _engine_fixed(module, fmt, dtype: torch.dtype | None) -> int:
    """The plain rows of an evaluation-only storage's "+w<N>" (KIVI's residual), in the activation dtype."""
    size = torch.empty(0, dtype=dtype or module._anchor.dtype).element_size()
    return (fmt.recent or 0) * module.kv_values_per_token * size


def sliding_context(model) -> int | None:
    """The context length a report states bytes per token at when some layer slides (its bytes depend on it): the
    model's max_position_embeddings (else 8 windows of its largest); None when no layer slides."""
    windows = [m.sliding_window for m in attnlab_modules(model) if m.sliding_window is not None]
    if not windows:
        return None
    cfg = getattr(model, "config", None)
    return int(getattr(cfg, "max_position_embeddings", 0) or 8 * max(windows))


def set_kv_dtype(model, kv_dtype: str | list | None):
    """Set kv_dtype (the cache storage, see modules/cache.py; or a list, one a module) on every attnlab module of a
    swapped model: caches, a Generator and forwards without a cache (perplexity) then use that storage. Returns the
    model."""
    from ..modules.storage import check_kv_dtype

    storages = each_module(model, kv_dtype)
    for k in storages:
        check_kv_dtype(k)  # one error before any module changes
    for m, k in zip(attnlab_modules(model), storages):
        m.kv_dtype = k
    return model


def each_module(model, kv_dtype) -> list:
    """kv_dtype for each attnlab module of the model (modules.storage.each_layer)."""
    from ..modules.storage import each_layer

    return each_layer(kv_dtype, len(list(attnlab_modules(model))))


def read_text_ids(tok, path, max_tokens: int | None = None, *, min_tokens: int = 1) -> torch.Tensor:
    """Token ids (1, N) of a text file: its first max_tokens tokens (None: all), at least min_tokens of them.

    ValueError, one line naming the value: no tokenizer (tok None: the model came without tokenizer
    files), max_tokens neither None nor a positive int, min_tokens not an int >= 0 or above max_tokens,
    a missing, unreadable or empty file, or fewer than min_tokens tokens (a perplexity needs 2).
    """
    from pathlib import Path

    if tok is None:
        raise ValueError(f"cannot read {path}: the model has no tokenizer files (tokenizer.json, "
                         "tokenizer_config.json, tokenizer.model, ...; for a GGUF, tokenizer.ggml.* metadata), "
                         "so it takes token ids only")
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise ValueError(f"max_tokens must be None (all) or a positive int, got {max_tokens!r}")
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0:
        raise ValueError(f"min_tokens must be an int >= 0, got {min_tokens!r}")
    if max_tokens is not None and max_tokens < min_tokens:
        raise ValueError(f"max_tokens {max_tokens} keeps fewer tokens than the {min_tokens} needed")
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"no such text file: {path}")
    try:
        text = p.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError) as e:
        raise ValueError(f"cannot read {path} as text: {e}") from None
    if min_tokens and not text.strip():
        raise ValueError(f"{path} is empty or whitespace only ({len(text)} characters): 0 tokens of text, "
                         f"at least {min_tokens} needed")
    ids = tok(text, return_tensors="pt").input_ids
    ids = ids if max_tokens is None else ids[:, :max_tokens]
    if ids.shape[1] < min_tokens:
        raise ValueError(f"{path} holds {ids.shape[1]} token(s); at least {min_tokens} needed")
    return ids


def top1_agreement(teacher, student, input_ids: torch.Tensor, window: int = 512, *, budget=None) -> float:
    """Fraction of positions of the token ids (1, N) where both models' most likely next token is the same."""
    check_window(window, input_ids, student)
    same, count = 0, 0
    with torch.no_grad():
        for i, start in enumerate(range(0, input_ids.shape[1], window)):
            if budget is not None and i:
                budget.check()
            chunk = input_ids[:, start:start + window]
            a, b = teacher(chunk).logits.argmax(-1), student(chunk).logits.argmax(-1)  # (1, n)
            same += int((a == b).sum())
            count += chunk.numel()
    return same / max(count, 1)
