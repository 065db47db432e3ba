"""The planner: a KV budget in, the conversion that meets it best out, chosen by measuring candidates: plan().

A candidate (shrink/candidate.py) is a conversion (r, p, what keeps rotating, BKV, a latent norm) and a cache storage,
applied to the teacher in place, measured and ranked by rank(): the mean KL(teacher || student) on held-out windows, a
2-bit latent's counted TWO_BIT_MARGIN times. The rounds are _Planner's methods, in the order _Planner.run calls them.
"""
from __future__ import annotations

import torch

from . import layer_rounds
from .candidate import (Candidate, PlanResult, apply, proxy_bf16, proxy_kl, rank, teacher_logits,
                        token_windows)
from .feasible import feasible, keys_whole, native_storages
from .sizes import (FORMATS, LLAMA_CPP_CACHE, KVBudget, Layout, cached_extra, few_bit, fit, layer_bytes, latent_bits,
                    layers_bytes, original_sizes, planned_bytes, splits, spread_context, storage_ok)

# Notation: L layers, G KV heads, d head size; V = 2 G d values per token and layer in the original GQA cache; a
# compressed MLA caches r (latent) + p (rope key) values per token and layer.

# rope shares of the values tried by round 3, the likelier winners first, so that a count that runs out keeps them
SPLIT_SHARES = (0.2, 0.25, 0.35, 0.4, 0.5)
def _bkv_flipped(c: Candidate) -> Candidate:
    """The candidate c with BKV the other way (the same sizes, selection, storage and norm): planner round 3."""
    return Candidate(c.latent_dim, c.rope_dim, c.rope_select, not c.balance, c.kv_dtype, c.latent_norm, extra=c.extra,
                     round=3)


# A budget is a fraction of the original's cache (`50%`, `0.5`) or bytes per token for the whole model (`6000`), both
# against the original's cache in 16 bits (2 V L bytes per token); what it allows is checked before any work
# (shrink/feasible.py). Without a context a plan counts every token held in every layer, and what a sequence holds
# whatever its length (a "+c4" rope key's newest group, a "+w16" window's rows, in 16 bits) spread over
# sizes.DEFAULT_CONTEXT tokens (4,096, or max_position_embeddings where shorter). Storages: 16-bit; for attnlab's own
# format also 8-bit with per-token scales, and few-bit latents (modules/lowbit.py) rotated first by an orthogonal
# matrix folded into the weights (convert/rotate.py); a few-bit candidate takes the largest latent that fits (fit()),
# up to V - p. A candidate meets the budget when its measured bytes per token do.
def plan(teacher,
         calibration_ids: torch.Tensor,  # (1, N), the calibration text
         budget: KVBudget, *, fmt: str = "attnlab",
         storages=("bf16", "int8"),  # those that may be chosen
         # the text candidates are scored on is cut into up to proxy_windows windows of `window` tokens
         proxy_windows: int = 4, window: int = 256,
         # a runtime.Budget: once spent, or at a stop request, no new candidate starts (one is always measured)
         time_budget=None,
         progress=None,  # progress(i, label), called before each candidate
         calibrate: bool = True,  # False: conversions on the weights alone
         proxy_ids: torch.Tensor | None = None,  # (1, M), the proxy's text; None: the calibration text's first windows
         context: int | None = None,  # bytes per token counted at this sequence length; None: every token held
         max_candidates: int | None = None,  # no more candidates than this, in the same order (round 4 comes after)
         per_layer: bool = False,  # run round 4
         layer_ids: torch.Tensor | None = None,  # (1, K), the text round 4's costs read; None: the proxy windows
         layer_bits: bool = False) -> PlanResult:  # run round 5
    """Choose the conversion and storage that meet `budget` with the lowest proxy, in rounds (the comments above: the
    arguments). The teacher is converted and restored for every candidate and comes back unchanged. ValueError for
    an unknown format or a max_candidates that is not a positive integer."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    planner = _Planner(teacher, budget, fmt, storages, context, time_budget=time_budget, progress=progress)
    planner.prepare(calibration_ids, proxy_ids, proxy_windows, window, calibrate)
    if max_candidates is not None and (isinstance(max_candidates, bool) or not isinstance(max_candidates, int) or
                                       max_candidates < 1):
        raise ValueError(f"max_candidates must be a positive integer, got {max_candidates!r}")
    planner.max_candidates, planner.layer_bits_asked = max_candidates, layer_bits
    return planner.run(per_layer, layer_ids)


class _Planner:
    """One search: what the budget and format allow, the proxy's windows and the teacher's log-probabilities on
    them, the candidates measured, and the count and clock that end it. Its rounds are methods (module docstring)."""

    def __init__(self, teacher, budget: KVBudget, fmt: str, storages, context: int | None, *, time_budget,
                 progress):
        self.teacher, self.budget, self.fmt, self.context = teacher, budget, fmt, context
        self.time_budget, self.progress, self.max_candidates = time_budget, progress, None
        self.layer_bits_asked = False
        self.L, self.G, self.d, self.V = original_sizes(teacher)
        self.original, self.budget_bytes, self.options = feasible(teacher, budget, fmt, storages, context)
        storages = [s for s in storages if storage_ok(s, fmt)] or ["bf16"]
        self.native = native_storages(teacher, self.budget_bytes, fmt, storages, context)
        self.spread = spread_context(teacher, context)  # where the fixed rows are counted (the context, or default)
        self.max_rope = self.G * self.d
        if fmt == "gguf" and self.options:
            from ..models.export.deepseek_gguf import gguf_rope_limit
            self.max_rope = min(self.max_rope, gguf_rope_limit(teacher))
        # the output format's constraints: a DeepSeek export needs the same frequencies in every layer (RoRoPE by score
        # chosen for all layers at once); a GGUF needs distinct kept frequencies that llama.cpp can turn (RoRoPE by
        # frequency, rope_dim within gguf_rope_limit), a latent norm (fitted here, trained by the heal) and sizes in
        # multiples of 32 where they allow it (llama.cpp's q8_0 blocks); attnlab's own format takes any of them
        self.selections = [("rorope", True), ("rorope", False)] if fmt == "gguf" else \
            [("rorope-score", True), ("rorope", True), ("rorope-score", False), ("rorope", False)]
        # a GGUF's latent norm gets its steady channel now, a DeepSeek folder its constant channel at export: either
        # caches one value more per token and layer (cached_extra)
        self.norm, self.extra = fmt == "gguf", cached_extra(fmt)
        self.aligned = {"block": 32, "extra": self.extra} if fmt == "gguf" else {}  # llama.cpp's q8_0 cache blocks
        self.measured: list[Candidate] = []

    def prepare(self, calibration_ids: torch.Tensor, proxy_ids, proxy_windows: int, window: int,
                calibrate: bool) -> None:
        """The teacher's modules as they came, the calibration inputs, and the proxy windows with their reference."""
        from ..models.adapters import attnlab_modules
        from ..models.evaluate import attention_inputs

        self.originals = list(attnlab_modules(self.teacher))
        self.storages_before = [m.kv_dtype for m in self.originals]
        inputs = attention_inputs(self.teacher, calibration_ids)
        self.calibration = (calibration_ids, inputs) if calibrate else (None, None)
        self.window = window
        self.windows = token_windows((calibration_ids if proxy_ids is None else proxy_ids)[0], window, proxy_windows)
        self.bf16 = proxy_bf16(self.teacher)  # the proxy's forwards in bf16 where the CPU multiplies it natively
        self.reference = teacher_logits(self.teacher, self.windows, self.bf16)

    # -- what the rounds share -------------------------------------------------------------------------------
    # Each candidate converts the teacher's own attention modules with calibration inputs computed once, is measured
    # and swapped out again: nothing is copied (shrink/candidate.py).
    def split(self, values: int, shares, storage: str) -> list[tuple[int, int]]:
        """(latent, rope) pairs of a row of `values` (the extra channel included) in that storage."""
        return splits(values - self.extra, shares, max_rope=self.max_rope, strict=storage in LLAMA_CPP_CACHE,
                      **self.aligned)

    def convert(self, cand: Candidate) -> None:
        """The teacher converted in place to `cand`, calibrated unless the plan was asked not to be."""
        ids, inputs = self.calibration
        apply(self.teacher, cand, ids, inputs=inputs)

    def restore(self) -> None:
        """The teacher as it came, after a candidate or a single-layer change."""
        from ..models.adapters import replace_attention

        replace_attention(self.teacher, self.originals)
        for m, k in zip(self.originals, self.storages_before):  # a kept layer is the teacher's own module
            m.kv_dtype = k

    def measure(self, cand: Candidate, where: Layout | None = None) -> Candidate:
        """Fit `cand` to the room, convert the teacher to it, count its bytes and score its proxy; then restore."""
        from ..convert.report import unreported

        if cand.native or cand.latent_dims or cand.kv_dtypes:  # native: llama.cpp rotates its own cache; rounds 4-5:
            pass  # sizes fitted, rotation set
        elif few_bit(cand.kv_dtype):  # the latent a few-bit row can afford with this rope key; rotated for the codes
            where = where or self.every
            cand.latent_dim = fit(cand.latent_dim, cand.rope_dim, cand.kv_dtype, where.counted(self.context),
                                  where.room, cand.extra, ceiling=self.V - cand.rope_dim, context=self.spread)
            if cand.latent_dim < 1:  # this rope key alone takes the room (at a context: its fixed rows); not a plan
                return cand
            cand.rotation = None if cand.latent_norm else "random"
        elif cand.kv_dtype in LLAMA_CPP_CACHE:  # llama.cpp's blocks too: rotated past the norm (convert/rotate.py)
            cand.rotation = "random"
        if self.progress:
            self.progress(len(self.measured), cand.label())
        try:
            with unreported():  # a candidate is scored and dropped: its conversion report is not read
                self.convert(cand)
            # what the caches allocate; a DeepSeek export's constant channel comes on top of the attnlab model
            added = self.L * (layer_bytes(3, 2, cand.kv_dtype) - layer_bytes(2, 2, cand.kv_dtype)) \
                if self.fmt == "deepseek" else 0
            cand.bytes_per_token = planned_bytes(self.teacher, self.context, self.spread) + added
            if cand.bytes_per_token > self.budget_bytes:
                raise RuntimeError(f"planner bug: {cand.label()} takes {cand.bytes_per_token} bytes/token, over the "
                                   f"budget's {self.budget_bytes:.0f}")
            cand.proxy = proxy_kl(self.teacher, self.windows, self.reference, self.bf16)
        finally:
            self.restore()
        self.measured.append(cand)
        return cand

    def converted(self) -> list[Candidate]:
        """The candidates measured that convert (what the rounds after round 0 build on)."""
        return [c for c in self.measured if not c.native]

    def stopped(self) -> bool:
        """The planning clock ran out, or a stop was requested."""
        tb = self.time_budget
        return tb is not None and (tb.expired() or tb.stop_requested)

    def spent(self, reserve: int = 0) -> bool:
        """No new candidate may start; `reserve` keeps places back for a later step of the same count."""
        if not self.measured:
            return False
        return (self.max_candidates is not None and len(self.measured) >= self.max_candidates - reserve) or \
            self.stopped()

    def measure_new(self, cand: Candidate) -> None:
        """Measure `cand` unless a candidate of its label was measured."""
        if all(c.label() != cand.label() for c in self.measured):
            self.measure(cand)

    def result(self, best: Candidate, note: str) -> PlanResult:
        return PlanResult(best, self.measured, str(self.budget), self.original, self.budget_bytes, note,
                          self.context, self.spread, self.calibration[1])

    # -- the search ------------------------------------------------------------------------------------------
    def run(self, per_layer: bool, layer_ids: torch.Tensor | None) -> PlanResult:
        """Round 0, then (where a converted layout fits) the keys-whole round or rounds 1 to 4; the best by rank()."""
        self.natives()
        if not self.options:
            return self.natives_result()
        self.every, self.per_storage = self.options[0]  # every layer converted (the only layout rounds 1-4 use)
        self.room = self.every.room
        self.converted_layers = self.every.counted(self.context)  # as layers_bytes counts them
        whole = keys_whole(self.teacher)
        if whole is not None:
            return self.keys_whole(whole)
        self.selection()
        if not self.converted():  # round 0 took every candidate allowed
            return self.result(min(self.measured, key=rank),
                               "planning ended (its time or its count) after the original's cache types")
        self.storage()
        by_storage = self.split_shares()
        self.more_bits(by_storage)
        self.bkv_checks()
        # round 4, asked for (per_layer=True), where the winner cuts rank in attnlab's format: a latent size per layer,
        # each layer's cost measured alone (shrink/layer_costs.py), chosen within the bytes (shrink/per_layer.py) and
        # measured as one more candidate. Off by default (docs/decisions.md)
        if per_layer and self.fmt == "attnlab":
            layer_rounds.per_layer(self, layer_ids)
        # round 5, asked for (layer_bits=True; shrink asks unless ATTNLAB_LAYER_BITS=0), where the winner codes every
        # layer alike in a few-bit latent with its rope key apart: each layer's latent and key bits a step up or down,
        # by two single-layer KLs a layer (shrink/layer_bits.py), chosen within the bytes and measured as one more
        # candidate
        layer_rounds.layer_bits(self)
        note = "" if len(self.measured) > 1 else "only one candidate fitted the time given to planning"
        return self.result(min(self.measured, key=rank), note)

    # Round 0 plans the original attention, only its cache coded: for a GGUF whose source llama.cpp runs in its own
    # architecture (llama, qwen3, gemma3: models/export/native_gguf.py) in each of llama.cpp's cache types that fits,
    # and for a transformers folder in each GQA storage of attnlab.hf.KVCache that fits (TRANSFORMERS_CACHE). A
    # transformers folder also holds converted plans, as a DeepSeek folder does.
    def natives(self) -> None:
        """Round 0: the original attention in each engine cache code that fits (native_storages)."""
        G, d = self.G, self.d
        for storage in self.native:
            if not self.spent():
                self.measure(Candidate(G * d, G * d, "original", False, storage, False, round=0, layers=[],
                                       kept_dtype=storage))

    def natives_result(self) -> PlanResult:
        """The plan where no converted layout fits: round 0's best."""
        best = min(self.measured, key=rank)
        note = "" if len(self.measured) == len(self.native) else \
            "planning ended (its time or its count) before every storage"
        return self.result(best, note or "no converted layout fits: the original attention, its cache in the "
                                         "engine's codes")

    def keys_whole(self, whole: int) -> PlanResult:
        """The one round of a model with per-head q/k norms (Qwen3, Gemma 3; convert/decoupled.py): the keys whole
        (rope key `whole`, every KV head's whole key) in each storage and layout, the latent holding the values, as
        large as the bytes allow; then round 5."""
        options = self.options
        todo = [(lay, storage, v) for i in range(max(len(ps) for _, ps in options))
                for lay, ps in options for storage, v in list(ps.items())[i:i + 1]]  # each storage in every layout
        for lay, storage, v in todo:
            if not self.spent():
                self.measure(Candidate(v - whole, whole, "frequency", False, storage, False,
                                       rotation="random" if few_bit(storage) else None, round=1,
                                       layers=None if lay.layers is None else list(lay.layers),
                                       kept_dtype=lay.kept_dtype), lay)
        layer_rounds.layer_bits(self)
        best = min(self.measured, key=rank)
        note = "" if len(self.measured) == len(todo) else "planning ended (its time or its count) before every storage"
        return self.result(best, note or "per-head q/k norms: the keys whole (rope key G x d), the latent holds the "
                                         "values")

    def selection(self) -> None:
        """Round 1: what keeps rotating, and BKV, at a rope share of 30% in the first storage (16 bits if allowed)."""
        self.first = "bf16" if "bf16" in self.per_storage else next(iter(self.per_storage))
        v0 = self.per_storage[self.first]
        for sel, bkv in self.selections:
            if self.spent():
                break
            for r, p in self.split(v0, (0.3,), self.first)[:1]:
                self.measure(Candidate(r, p, sel, bkv, self.first, self.norm, extra=self.extra, round=1))

    def storage(self) -> None:
        """Round 2: the winner in each other storage at its own rope share, then each few-bit storage that holds
        every value (the whole key as the rope key, the values as the latent)."""
        best = min(self.converted(), key=rank)
        share = best.rope_dim / best.values
        for storage, v in self.per_storage.items():
            if storage == self.first or self.spent():
                continue
            for r, p in self.split(v, (share,), storage)[:1]:
                self.measure(Candidate(r, p, best.rope_select, best.balance, storage, self.norm, extra=self.extra,
                                       round=2))
        V, extra, whole_key = self.V, self.extra, self.G * self.d
        for storage in self.per_storage:
            if few_bit(storage) and not self.spent() and whole_key <= self.max_rope and \
                    layers_bytes(V - whole_key + extra, whole_key, storage, self.converted_layers, self.spread) <= \
                    self.room and all((c.latent_dim, c.rope_dim, c.kv_dtype) != (V - whole_key, whole_key, storage)
                                      for c in self.measured):
                self.measure(Candidate(V - whole_key, whole_key, best.rope_select, best.balance, storage, self.norm,
                                       extra=extra, round=2))

    def at_split(self, best: Candidate, storage: str, r: int, p: int) -> None:
        """(r, p) in `storage` with best's selection and BKV, a few-bit latent fitted to the room; once each."""
        if few_bit(storage):
            r = fit(r, p, storage, self.converted_layers, self.room, self.extra, ceiling=self.V - p,
                    context=self.spread)
        if r >= 8 and all((c.latent_dim, c.rope_dim, c.rope_select, c.kv_dtype) != (r, p, best.rope_select, storage)
                          for c in self.measured):
            self.measure(Candidate(r, p, best.rope_select, best.balance, storage, self.norm, extra=self.extra,
                                   round=3))

    def split_shares(self) -> dict[str, Candidate]:
        """Round 3: SPLIT_SHARES for the winner's selection in the two best storages by proxy, interleaved so that
        the count cuts both alike. Returns the best candidate of each storage before it, best first."""
        best = min(self.converted(), key=lambda c: c.proxy)
        by_storage: dict[str, Candidate] = {}
        for c in sorted(self.converted(), key=lambda c: c.proxy):
            by_storage.setdefault(c.kv_dtype, c)
        tops = list(by_storage)[:2]
        pairs = {s: self.split(self.per_storage[s], SPLIT_SHARES, s) for s in tops}
        for i in range(max(len(v) for v in pairs.values())):
            for storage in tops:
                if not self.spent(reserve=1) and i < len(pairs[storage]):
                    self.at_split(best, storage, *pairs[storage][i])
        return by_storage

    def more_bits(self, by_storage: dict[str, Candidate]) -> None:
        """Round 3, where a 2-bit latent wins by proxy: each few-bit storage of more bits at the share of
        SPLIT_SHARES nearest the winner's (round 2's best of them first)."""
        best = min(self.converted(), key=lambda c: c.proxy)
        if latent_bits(best.kv_dtype) != 2:
            return
        near = min(SPLIT_SHARES, key=lambda x: abs(x - best.rope_dim / best.values))
        more = [s for s in sorted(by_storage, key=lambda s: by_storage[s].proxy) if (latent_bits(s) or 0) > 2] + \
            [s for s in self.per_storage if (latent_bits(s) or 0) > 2 and s not in by_storage]
        for storage in more:
            for r, p in self.split(self.per_storage[storage], (near,), storage)[:1]:
                if not self.spent(reserve=1):
                    self.at_split(best, storage, r, p)

    def bkv_checks(self) -> None:
        """Round 3's end: the winner with BKV the other way (within the count); where it cuts rank, the best few-bit
        candidate on the other side of the 2-bit margin so too (one past the count)."""
        best = min(self.converted(), key=rank)
        if not self.spent():
            self.measure_new(_bkv_flipped(best))
        best = min(self.converted(), key=rank)
        rivals = [c for c in self.converted() if (latent_bits(c.kv_dtype) == 2) != (latent_bits(best.kv_dtype) == 2)
                  and few_bit(c.kv_dtype) and not c.latent_dims]
        if rivals and best.latent_dim + best.rope_dim < self.V and not self.stopped():
            self.measure_new(_bkv_flipped(min(rivals, key=rank)))
