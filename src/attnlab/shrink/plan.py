"""The planner: a KV budget in, the conversion that meets it best out, chosen by measuring candidates.

Notation: L layers, G KV heads, d head size; V = 2 G d values per token and layer in the original
GQA cache; a compressed MLA caches r (latent) + p (rope key) values per token and layer.

A budget is a fraction of the original's cache (`50%`, `0.5`) or bytes per token for the whole model (`6000`), both
against the original's cache in 16 bits (2 V L bytes per token). Without `--context` a plan counts every token held in
every layer, and what a sequence holds whatever its length (a "+c4" rope key's newest group, a "+w16" window's rows,
in 16 bits) spread over sizes.DEFAULT_CONTEXT tokens (4,096, or max_position_embeddings where shorter).
A candidate is a conversion (r, p, what keeps rotating, BKV, a fitted latent norm) and a cache storage: 16-bit; for
attnlab's own format also 8-bit with per-token scales, and few-bit latents (modules/lowbit.py) rotated first by an
orthogonal matrix folded into the weights (convert/rotate.py). A few-bit candidate takes the largest latent that fits
(fit()), up to V - p. A candidate meets the budget when its measured bytes per token do.

What a budget allows is checked before any work (shrink/feasible.py). Candidates are ranked by rank(): the mean
KL(teacher || student) of the next-token distributions on windows the calibration did not use, a 2-bit latent's
counted TWO_BIT_MARGIN times. Each candidate converts the teacher's own attention modules with calibration inputs
computed once, is measured and swapped out again: nothing is copied. The rounds (methods of _Planner):
0. the original attention in each engine cache code that fits (natives);
1. what keeps rotating and BKV, at a rope share of about 30% of the values (selection);
2. the winner in each other storage, then each few-bit storage that can hold every value (storage);
3. the split between latent and rope key for the winner's two best storages, SPLIT_SHARES in order (split_shares);
   where a 2-bit latent wins, each storage of more bits at about its split (more_bits); the winner with BKV the other
   way, and where it cuts rank the best candidate on the other side of the 2-bit margin so too (bkv_checks);
4. asked for (per_layer=True), where the winner cuts rank in attnlab's format: a latent size per layer, each layer's
   cost measured alone (shrink/layer_costs.py), chosen within the bytes (shrink/per_layer.py) and measured as one
   more candidate (per_layer). Off by default (docs/decisions.md);
5. asked for (layer_bits=True; shrink --no-heal asks), where the winner codes every layer alike in a few-bit latent
   with its rope key apart: each layer's latent and key bits a step up or down, by two single-layer KLs a layer
   (shrink/layer_bits.py), chosen within the bytes (shrink/per_layer.py) and measured as one more candidate
   (layer_bits), also after the keys-whole round.
Within the constraints of the output format: a DeepSeek export needs the same frequencies in every layer (RoRoPE by
score chosen for all layers at once); a GGUF needs distinct kept frequencies that llama.cpp can turn (RoRoPE by
frequency, rope_dim within gguf_rope_limit), a latent norm (fitted here, trained by the heal), and sizes in multiples
of 32 where they allow it (llama.cpp's q8_0 blocks); attnlab's own format takes any of them.

Round 0 plans the original attention, only its cache coded: for a GGUF whose source llama.cpp runs in its own
architecture (llama, qwen3, gemma3: models/export_native.py) in each of llama.cpp's cache types that fits, and for a
transformers folder in each GQA storage of attnlab.hf.KVCache that fits (TRANSFORMERS_CACHE). A transformers folder
also holds converted plans, as a DeepSeek folder does. A model with per-head q/k norms (Qwen3, Gemma 3) has one layout
only, its keys whole (convert/decoupled.py): the rope key is every KV head's whole key and the latent holds the
values, in each storage with the largest latent the bytes allow, measured in one round (keys_whole).

plan()'s arguments: calibration_ids (1, N), the calibration text; proxy_ids (1, M), the text candidates are scored on,
in up to `proxy_windows` windows of `window` tokens (None: the calibration text's first windows); storages, those that
may be chosen; time_budget (runtime.Budget), once spent or at a stop request no new candidate starts (one is always
measured); max_candidates, no more candidates than this, in the same order (round 4 comes after them); progress(i,
label), called before each candidate; calibrate=False, conversions on the weights alone; context, bytes per token
counted at that sequence length (None: every token held); per_layer, run round 4; layer_ids (1, K), the text round
4's costs read (None: the proxy windows); layer_bits, run round 5.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch

from .feasible import feasible, keys_whole, native_storages
from .layer_bits import bits_label, ladder
from .sizes import (FORMATS, LLAMA_CPP_CACHE, KVBudget, Layout, cached_extra, few_bit, fit, layer_bytes, latent_bits,
                    layers_bytes, original_sizes, planned_bytes, splits, spread_context, storage_ok)

# rope shares of the values tried by round 3, the likelier winners first, so that a count that runs out keeps them
SPLIT_SHARES = (0.2, 0.25, 0.35, 0.4, 0.5)
# A 2-bit latent is ranked as if its proxy were this many times what it measured (rank(); docs/decisions.md)
TWO_BIT_MARGIN = 1.2


@dataclass
class Candidate:
    """One conversion and cache storage, and what it measured."""
    latent_dim: int
    rope_dim: int
    rope_select: str
    balance: bool
    kv_dtype: str  # "bf16", "int8" or a few-bit storage ("int4/g32+r8", ...)
    latent_norm: bool  # a steady latent channel and norm (export.add_steady_channels): GGUF's route
    bytes_per_token: int = 0
    proxy: float | None = None  # mean KL(teacher || student) on the calibration windows
    round: int = 0

    extra: int = 0  # latent values the export adds (DeepSeek's constant channel, GGUF's steady channel)
    rotation: str | None = None  # an orthogonal rotation of the latent folded into the weights (convert/rotate.py)
    layers: list[int] | None = None  # the converted layers (None: all); the others keep the original's attention
    kept_dtype: str | None = None  # the storage of the kept layers' cache
    latent_dims: list[int] | None = None  # a per-layer plan's latent size in each layer (round 4); latent_dim: mean
    kv_dtypes: list[str] | None = None  # a bits-by-layer plan's storage of each layer (round 5); kv_dtype: the winner's

    @property
    def values(self) -> int:
        return self.latent_dim + self.extra + self.rope_dim

    @property
    def native(self) -> bool:
        """The original's own attention in every layer, only its cache coded (layers == []: none converted): what a
        GGUF in the source's own architecture holds (native_storages). Its latent_dim and rope_dim are then the values
        and the keys it caches, as in the keys-whole layout."""
        return self.layers == []

    def label(self) -> str:
        if self.native:
            kind = "llama.cpp's " if self.kv_dtype.split(",")[0] in (*LLAMA_CPP_CACHE, "iq4_nl") else ""
            return f"the original attention, its cache in {kind}{self.kv_dtype}"
        n = 0 if self.layers is None else len(self.layers)
        kept = "" if self.layers is None else f" in {n} global layer{'s' * (n != 1)}, the sliding ones kept in " \
            f"{self.kept_dtype}"
        r = f"{min(self.latent_dims)}-{max(self.latent_dims)} per layer" if self.latent_dims else self.latent_dim
        storage = bits_label(self.kv_dtypes) if self.kv_dtypes else self.kv_dtype
        return (f"r={r}{'+1' if self.extra else ''} p={self.rope_dim} {self.rope_select}"
                f"{' +BKV' if self.balance else ''}{' rotated' if self.rotation else ''} {storage}{kept}")

    def to_dict(self) -> dict:
        each = {"values_each_layer": [r + self.extra + self.rope_dim for r in self.latent_dims]} if self.latent_dims \
            else {}
        return {**asdict(self), "values_per_token_per_layer": self.values, **each, "label": self.label()}


@dataclass
class PlanResult:
    best: Candidate
    measured: list[Candidate] = field(default_factory=list)
    budget: str = ""
    original_bytes_16bit: int = 0
    budget_bytes: float = 0.0
    note: str = ""
    context: int | None = None  # the sequence length bytes per token are counted at (None: every token held)
    spread: int | None = None  # the tokens a sequence's fixed rows were spread over (the context, or the default)

    def to_dict(self) -> dict:
        ranked = sorted((c for c in self.measured if c.proxy is not None), key=rank)
        return {"chosen": self.best.to_dict(), "budget": self.budget, "budget_bytes": self.budget_bytes,
                "context": self.context, "fixed_rows_over": self.spread,
                "original_bytes_per_token_16bit": self.original_bytes_16bit, "note": self.note,
                "candidates": [c.to_dict() for c in ranked]}


def _bkv_flipped(c: Candidate) -> Candidate:
    """The candidate c with BKV the other way (the same sizes, selection, storage and norm): planner round 3."""
    return Candidate(c.latent_dim, c.rope_dim, c.rope_select, not c.balance, c.kv_dtype, c.latent_norm, extra=c.extra,
                     round=3)


def rank(cand: Candidate) -> float:
    """What candidates are ranked by (the planner's every choice of a winner): the proxy, a 2-bit latent's times
    TWO_BIT_MARGIN."""
    return cand.proxy * (TWO_BIT_MARGIN if latent_bits(cand.kv_dtype) == 2 else 1.0)


# -- measuring ----------------------------------------------------------------------------------------
def teacher_log_probs(teacher, windows: torch.Tensor) -> list[torch.Tensor]:
    """The teacher's next-token log-probabilities on each proxy window (1, T, V), kept for every candidate."""
    with torch.no_grad():
        return [teacher(w[None]).logits.float().log_softmax(-1) for w in windows]


def proxy_kl(student, windows: torch.Tensor, reference: list[torch.Tensor]) -> float:
    """Mean KL(teacher || student) per position over the proxy windows."""
    from .layer_costs import kl_sum

    total, count = 0.0, 0
    with torch.no_grad():
        for w, t in zip(windows, reference):
            total += kl_sum(t, student(w[None]).logits.float().log_softmax(-1))
            count += w.numel()
    return total / count


def apply(model, cand: Candidate, calibration_ids: torch.Tensor | None, inputs=None) -> None:
    """Convert the model in place to the candidate: decoupled-RoPE MLA, the steady latent channel, the storage; a
    candidate that converts some layers (cand.layers) stores the others' caches in cand.kept_dtype."""
    from ..models.adapters import attnlab_modules
    from ..models.convert import convert_model
    from ..models.evaluate import set_kv_dtype
    from ..models.export import add_steady_channels

    if cand.native:  # nothing converted: every layer the original's, its cache in the engine's code
        set_kv_dtype(model, cand.kv_dtype)
        return
    convert_model(model, "mla", latent_dim=cand.latent_dims or cand.latent_dim, rope_dim=cand.rope_dim,
                  calibration_ids=calibration_ids, pair_selection=cand.rope_select, balance=cand.balance,
                  inputs=inputs, layers=cand.layers)
    if cand.latent_norm:
        if calibration_ids is None:
            raise ValueError("a latent norm for a GGUF is fitted on calibration text: give text, or --format attnlab")
        add_steady_channels(model, calibration_ids)
    converted = [m for i, m in enumerate(attnlab_modules(model)) if cand.layers is None or i in cand.layers]
    if cand.rotation:
        from ..convert.rotate import rotate_latent

        for m in converted:
            rotate_latent(m, cand.rotation)
    if cand.layers is None:
        set_kv_dtype(model, cand.kv_dtypes or cand.kv_dtype)
        return
    set_kv_dtype(model, cand.kept_dtype)  # the kept layers'
    for m in converted:
        m.kv_dtype = cand.kv_dtype


def plan(teacher, calibration_ids: torch.Tensor, budget: KVBudget, *, fmt: str = "attnlab",
         storages=("bf16", "int8"), proxy_windows: int = 4, window: int = 256, time_budget=None,
         progress=None, calibrate: bool = True, proxy_ids: torch.Tensor | None = None,
         context: int | None = None, max_candidates: int | None = None, per_layer: bool = False,
         layer_ids: torch.Tensor | None = None, layer_bits: bool = False) -> PlanResult:
    """Choose the conversion and storage that meet `budget` with the lowest proxy, in rounds (module docstring: the
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
            from ..models.export_gguf import gguf_rope_limit
            self.max_rope = min(self.max_rope, gguf_rope_limit(teacher))
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
        self.windows = _windows((calibration_ids if proxy_ids is None else proxy_ids)[0], window, proxy_windows)
        self.reference = teacher_log_probs(self.teacher, self.windows)

    # -- what the rounds share -------------------------------------------------------------------------------
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
            cand.proxy = proxy_kl(self.teacher, self.windows, self.reference)
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
                          self.context, self.spread)

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
        if per_layer and self.fmt == "attnlab":
            self.per_layer(layer_ids)
        self.layer_bits()
        note = "" if len(self.measured) > 1 else "only one candidate fitted the time given to planning"
        return self.result(min(self.measured, key=rank), note)

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
        """The one round of a model with per-head q/k norms: the keys whole (rope key `whole`) in each storage and
        layout, the latent as large as the bytes allow."""
        options = self.options
        todo = [(lay, storage, v) for i in range(max(len(ps) for _, ps in options))
                for lay, ps in options for storage, v in list(ps.items())[i:i + 1]]  # each storage in every layout
        for lay, storage, v in todo:
            if not self.spent():
                self.measure(Candidate(v - whole, whole, "frequency", False, storage, False,
                                       rotation="random" if few_bit(storage) else None, round=1,
                                       layers=None if lay.layers is None else list(lay.layers),
                                       kept_dtype=lay.kept_dtype), lay)
        self.layer_bits()
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

    def per_layer(self, layer_ids: torch.Tensor | None) -> None:
        """Round 4, where the winner cuts rank: each layer alone at per_layer_sizes() (shrink/layer_costs.py), the
        sizes of least summed KL within the bytes (shrink/per_layer.py), measured as one candidate past the count."""
        from ..convert.report import unreported
        from .layer_costs import Prefix, layer_costs
        from .per_layer import choose_per_layer

        best = min(self.converted(), key=rank)
        sizes = per_layer_sizes(best, self.V)
        if len(sizes) <= 1 or self.stopped():
            return
        L = self.L
        prefix = Prefix(self.teacher, self.windows if layer_ids is None else _windows(layer_ids[0], self.window))

        def change(layer: int, r: int) -> None:
            if self.stopped():  # a stop request (or the clock) ends round 4 with nothing measured
                raise _Cut
            with unreported():
                self.convert(Candidate(r, best.rope_dim, best.rope_select, best.balance, best.kv_dtype, False,
                                       rotation=best.rotation, layers=[layer], kept_dtype=None))

        def counted(done: int, total: int) -> None:
            if self.progress and done % len(sizes) == 0:
                self.progress(len(self.measured), f"per layer: {done // len(sizes)} of {L} layers measured alone "
                                                  f"at r={', '.join(map(str, sizes))}")

        try:
            costs = layer_costs(prefix, L, sizes, change, self.restore, progress=counted)
        except _Cut:
            costs = None
        rows = self.byte_rows([(r, best.rope_dim, best.kv_dtype) for r in sizes])
        dims = [sizes[o] for o in choose_per_layer(costs, rows, int(self.budget_bytes))] if costs else []
        if len(set(dims)) > 1:
            self.measure(Candidate(round(sum(dims) / L), best.rope_dim, best.rope_select, best.balance,
                                   best.kv_dtype, False, rotation=best.rotation, round=4, latent_dims=dims))


    def byte_rows(self, options) -> list[list[int]]:
        """Each converted layer's whole bytes per token in each (latent, rope key, storage) option, as the budget
        counts them at its window: the sizes rounds 4 and 5 choose within."""
        row = {w: [math.ceil(layer_bytes(r, p, storage, self.spread, w)) for r, p, storage in options]
               for w in set(self.converted_layers)}  # one row per kind of layer
        return [row[w] for w in self.converted_layers]

    def layer_bits(self) -> None:
        """Round 5, if asked, where the winner codes every layer alike in a Ladder's storage: each layer's two probes
        measured alone (shrink/layer_bits.py), the bits of least modelled KL within the bytes (shrink/per_layer.py),
        measured as one candidate past the count. Not for a GGUF, whose llama.cpp cache has one type."""
        from .per_layer import choose_per_layer

        best = min(self.measured, key=rank)
        steps = ladder(best.kv_dtype)
        if not self.layer_bits_asked or self.fmt not in ("attnlab", "transformers") or steps is None or \
                best.layers is not None or best.latent_dims or best.kv_dtypes or self.stopped():
            return
        probes = self.probes(best, steps)
        if probes is None:
            return
        options = steps.options()
        costs = [[steps.cost(v, k, b, key) for b, key in options] for v, k in probes]
        latent = best.latent_dim + best.extra
        rows = self.byte_rows([(latent, best.rope_dim, steps.spell(b, key)) for b, key in options])
        picks = choose_per_layer(costs, rows, int(self.budget_bytes))
        storages = [steps.spell(*options[o]) for o in picks]
        if storages != [best.kv_dtype] * len(storages):
            self.measure(Candidate(best.latent_dim, best.rope_dim, best.rope_select, best.balance, best.kv_dtype,
                                   best.latent_norm, extra=best.extra, rotation=best.rotation, round=5,
                                   kv_dtypes=storages))

    def probes(self, best: Candidate, steps) -> list[tuple[float, float]] | None:
        """(V, K) of each layer: the KL with that layer alone in steps' value and key probe, the teacher converted to
        `best` with plain caches, on COST_WINDOWS proxy windows (shrink/layer_costs.py); None when a stop or the
        clock cut it short."""
        from ..convert.report import unreported
        from ..models.adapters import attnlab_modules
        from .layer_bits import COST_WINDOWS
        from .layer_costs import Prefix

        try:
            with unreported():
                self.convert(Candidate(best.latent_dim, best.rope_dim, best.rope_select, best.balance, None,
                                       best.latent_norm, extra=best.extra, rotation=best.rotation))
            modules = list(attnlab_modules(self.teacher))
            prefix = Prefix(self.teacher, self.windows[:COST_WINDOWS])
            out = []
            for i, m in enumerate(modules):
                if self.stopped():
                    return None
                if self.progress:
                    self.progress(len(self.measured), f"bits by layer: layer {i + 1} of {len(modules)} measured alone")
                pair = []
                for probe in (steps.value_probe(), steps.key_probe()):
                    m.kv_dtype = probe
                    try:
                        pair.append(prefix.kl(i))
                    finally:
                        m.kv_dtype = None
                out.append(tuple(pair))
            return out
        finally:
            self.restore()


class _Cut(Exception):
    """Round 4 ended by a stop request or the planning clock before its costs were measured."""


PER_LAYER_SHARES = (0.7, 1.4)  # round 4's latent sizes beside the uniform winner's own, as shares of it
PER_LAYER_STEP = 16  # ... rounded to multiples of this


def per_layer_sizes(best: Candidate, values: int) -> list[int]:
    """Round 4's latent sizes for a winner that cuts rank: its latent and PER_LAYER_SHARES of it in multiples of
    PER_LAYER_STEP, from PER_LAYER_STEP to `values` - its rope key, each once, ascending. [] for a winner that keeps
    every value, is per-layer already or converts some layers only."""
    ceiling = values - best.rope_dim
    if best.latent_dims or best.layers is not None or best.latent_dim >= ceiling:
        return []
    out = {best.latent_dim}
    for share in PER_LAYER_SHARES:
        r = int(round(best.latent_dim * share / PER_LAYER_STEP)) * PER_LAYER_STEP
        out.add(min(ceiling, max(PER_LAYER_STEP, r)))
    return sorted(out)


def _windows(ids: torch.Tensor, window: int, count: int | None = None) -> torch.Tensor:
    """(W, window) token windows from ids (N,): its first `count` whole windows (all for None), or the ids as one
    window when shorter than one."""
    ids = ids if count is None else ids[: count * window]
    if ids.numel() < window:
        return ids[None]
    return ids[: ids.numel() // window * window].reshape(-1, window)
