"""A plan's candidate: one conversion and cache storage (Candidate), how it converts a model in place (apply), what
it is scored by (proxy_kl against the teacher's log-probabilities on the proxy windows) and ranked by (rank), and the
search's result (PlanResult). The planner's rounds build candidates (shrink/plan.py, shrink/layer_rounds.py)."""
from __future__ import annotations

import contextlib
import math
import os
from dataclasses import asdict, dataclass, field

import torch

from .layer_bits import bits_label
from .sizes import LLAMA_CPP_CACHE, latent_bits

# A 2-bit latent is ranked as if its proxy were this many times what it measured (rank(); docs/decisions.md)
TWO_BIT_MARGIN = 1.2
MARGIN_VARIABLE = "ATTNLAB_TWO_BIT_MARGIN"  # a number >= 1 in its place: the protocol's variants to fit it
PLAN_BF16_VARIABLE = "ATTNLAB_PLAN_BF16"  # "0" or "1": the proxy's forwards in float32 or bf16, whatever the CPU


@dataclass
class Candidate:
    """One conversion and cache storage, and what it measured."""
    latent_dim: int
    rope_dim: int
    rope_select: str
    balance: bool
    kv_dtype: str  # "bf16", "int8" or a few-bit storage ("int4/g32+r8", ...)
    latent_norm: bool  # a steady latent channel and norm (latent_norm.add_steady_channels): GGUF's route
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
    inputs: list | None = field(default=None, repr=False)  # the calibration inputs, for the conversion kept (apply)

    def to_dict(self) -> dict:
        ranked = sorted((c for c in self.measured if c.proxy is not None), key=rank)
        return {"chosen": self.best.to_dict(), "budget": self.budget, "budget_bytes": self.budget_bytes,
                "context": self.context, "fixed_rows_over": self.spread,
                "original_bytes_per_token_16bit": self.original_bytes_16bit, "note": self.note,
                "candidates": [c.to_dict() for c in ranked]}


def two_bit_margin() -> float:
    """TWO_BIT_MARGIN, or ATTNLAB_TWO_BIT_MARGIN where set; ValueError naming a value that is not a number >= 1."""
    from ..runtime.environment import env_number

    return env_number(MARGIN_VARIABLE, TWO_BIT_MARGIN, 1.0, math.inf, "of at least 1")


def rank(cand: Candidate) -> float:
    """What candidates are ranked by (the planner's every choice of a winner): the proxy, a 2-bit latent's times
    the margin (two_bit_margin)."""
    return cand.proxy * (two_bit_margin() if latent_bits(cand.kv_dtype) == 2 else 1.0)


def plan_bf16_asked() -> bool | None:
    """ATTNLAB_PLAN_BF16 where set ("0": float32, "1": bf16), else None; ValueError naming another value."""
    value = os.environ.get(PLAN_BF16_VARIABLE)
    if value not in (None, "0", "1"):
        raise ValueError(f"{PLAN_BF16_VARIABLE} must be 0 or 1, got {value!r}")
    return None if value is None else value == "1"


def proxy_bf16(model) -> bool:
    """Whether the proxy's forwards run in bf16 autocast: for a float32 model on the CPU, as plan_bf16_asked() says,
    else where the CPU multiplies bf16 natively (twice float32's rate there: runtime/environment.py)."""
    from ..runtime.environment import cpu_bf16

    asked = plan_bf16_asked()
    weight = next(model.parameters())
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and (cpu_bf16() if asked is None else asked)


def _precision(bf16: bool):
    return torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def teacher_logits(teacher, windows: torch.Tensor, bf16: bool = False) -> list[torch.Tensor]:
    """The teacher's next-token logits on the proxy windows, (B, T, V) a batch (layer_costs.batches), kept for every
    candidate; bf16: the forwards in bf16 autocast (proxy_bf16), the logits kept as they come."""
    from .layer_costs import batches

    with torch.no_grad(), _precision(bf16):
        return [teacher(batch).logits for batch in batches(windows)]


def proxy_kl(student, windows: torch.Tensor, reference: list[torch.Tensor], bf16: bool = False) -> float:
    """Mean KL(teacher || student) per position over the proxy windows, computed in float32 (reference:
    teacher_logits's, of the same precision)."""
    from ..models.divergence import kl_sum
    from .layer_costs import batches

    total, count = 0.0, 0
    with torch.no_grad(), _precision(bf16):
        for batch, t in zip(batches(windows), reference):
            total += kl_sum(t, student(batch).logits)
            count += batch.numel()
    return total / count


def apply(model, cand: Candidate, calibration_ids: torch.Tensor | None, inputs=None) -> None:
    """Convert the model in place to the candidate: decoupled-RoPE MLA, the steady latent channel, the storage; a
    candidate that converts some layers (cand.layers) stores the others' caches in cand.kept_dtype."""
    from ..models.adapters import attnlab_modules
    from ..models.convert import convert_model
    from ..models.evaluate import set_kv_dtype
    from ..models.export.latent_norm import add_steady_channels

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


def token_windows(ids: torch.Tensor, window: int, count: int | None = None) -> torch.Tensor:
    """(W, window) token windows from ids (N,): its first `count` whole windows (all for None), or the ids as one
    window when shorter than one."""
    ids = ids if count is None else ids[: count * window]
    if ids.numel() < window:
        return ids[None]
    return ids[: ids.numel() // window * window].reshape(-1, window)
