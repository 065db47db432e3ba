"""What a shrink is asked: ShrinkRequest (the user's arguments; identity() is what a resumed run must share), its
check before any work (check_request: a ValueError naming the value), and what the request alone decides: the
storages the planner may choose (storage_choices), whether the heal's work is pinned (pinned) and how many
candidates the planner measures (plan_count). pipeline.py runs it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from .sizes import (GGUF_STORAGES, LLAMA_CPP_CACHE, STORAGES, TRANSFORMERS_CACHE, llama_cpp_pair, parse_budget,
                    planned_sink, storage_ok, with_sink)

AUTO_STORAGES = {"attnlab": STORAGES, "gguf": GGUF_STORAGES, "deepseek": ("bf16",),
                 "transformers": (*TRANSFORMERS_CACHE, *(s for s in STORAGES if s not in TRANSFORMERS_CACHE))}


def storage_choices(storage: str, fmt: str = "attnlab", windows: bool = False) -> tuple[str, ...]:
    """The storages the planner may choose for --kv-dtype: every one the format holds for auto (their few-bit latents
    with sizes.planned_sink() first rows plain; none where `windows`, a budget at a context for a model with sliding
    layers, whose windows a sink would undo: cache.window_for), else the one named."""
    return with_sink(AUTO_STORAGES[fmt], 0 if windows else planned_sink()) if storage == "auto" else (storage,)


@dataclass
class ShrinkRequest:
    """What the user asked for. `identity()` is what a resumed run must share with the run it continues."""
    source: str
    kv_budget: str
    out: str
    fmt: str = "attnlab"
    minutes: float = 10.0
    text: list = field(default_factory=list)
    eval_text: list = field(default_factory=list)
    seed: int = 0
    device: str = "cpu"
    calibration: bool = True
    storage: str = "auto"  # "auto" (the planner may choose 8-bit for attnlab's format), "bf16" or "int8"
    latent_dim: int | None = None
    rope_dim: int | None = None
    # teacher-written training windows at most (no text): what the layer-wise phase reads, HealPlan.layer_windows
    # and guard.WINDOWS check windows
    windows: int = 68
    seq_len: int = 256  # tokens per training window
    tokens: int | None = None  # end-to-end heal tokens (None: as many as the time allows)
    layer_steps: int | None = None  # layer-wise steps per layer (None: sized to the time)
    batch_size: int = 4  # windows per end-to-end step, the global batch a torchrun job splits over its processes
    keep_worse: bool = False  # write the healed weights even when held-out perplexity rose (heal_model's keep_better)
    context: int | None = None  # the budget counts bytes per token at this sequence length (None: every token held)
    per_layer: bool = False  # also plan a latent size per layer (plan round 4; off by default: docs/decisions.md)
    heal: bool = True  # False (--no-heal): plan, convert and write the codec; no training windows, no heal

    def identity(self) -> dict:
        keep = ("source", "kv_budget", "fmt", "text", "eval_text", "seed", "calibration", "storage", "latent_dim",
                "rope_dim", "windows", "seq_len", "tokens", "layer_steps", "context", "batch_size", "per_layer", "heal")
        return {k: [str(x) for x in v] if isinstance(v, list) else v for k, v in asdict(self).items() if k in keep}


def check_request(req: ShrinkRequest) -> None:
    """ValueError naming the value for anything the run cannot do, before any work."""
    from .candidate import plan_bf16_asked, two_bit_margin
    from .layer_bits import planned_layer_bits
    from ..heal.guard import top1_alpha
    from .sizes import FORMATS

    if req.fmt not in FORMATS:
        raise ValueError(f"--format must be one of {', '.join(FORMATS)}, got {req.fmt!r}")
    if req.storage != "auto" and req.fmt == "gguf" and not storage_ok(req.storage, "gguf"):
        raise ValueError(f"--kv-dtype for --format gguf is the llama.cpp cache type the model is planned and healed "
                         f"for: auto, bf16 (llama.cpp's f16 cache), {', '.join(LLAMA_CPP_CACHE)}, or K and V apart as "
                         f"'q8_0,q4_0' (--cache-type-k q8_0 --cache-type-v q4_0); got {req.storage!r}")
    if req.storage != "auto" and req.fmt == "transformers" and not storage_ok(req.storage, "transformers"):
        raise ValueError(f"--kv-dtype for --format transformers is the attnlab.hf.KVCache storage the model is "
                         f"planned and healed for: auto, {', '.join(TRANSFORMERS_CACHE)}, a K/V pair of llama.cpp's "
                         f"types (the original attention), or one of attnlab's (an MLA); got {req.storage!r}")
    if req.fmt == "transformers" and str(req.out).endswith(".gguf"):
        raise ValueError(f"--format transformers writes a folder: --out {req.out} ends in .gguf (that is --format "
                         "gguf)")
    if req.storage not in ("auto", "bf16") and req.fmt == "deepseek":
        raise ValueError(f"--kv-dtype {req.storage} is not a DeepSeek folder's: its cache type is the engine's "
                         "choice (vLLM: kv_cache_dtype fp8); use auto or bf16")
    if req.storage != "auto" and req.fmt == "attnlab" and not storage_ok(req.storage):
        llama = f"; {req.storage} is a llama.cpp cache type: with --format gguf" if req.storage in LLAMA_CPP_CACHE \
            or llama_cpp_pair(req.storage) else ""
        raise ValueError(f"--kv-dtype must be auto, bf16, int8, or int2 to int7 (int4/g<N>: a scale and minimum "
                         f"per N latent channels; '+r8': the rope key in 8 bits; '+c4', '+c3', '+c2': in 4, 3, 2 "
                         f"bits per channel), got {req.storage!r}{llama}")
    parse_budget(req.kv_budget)
    planned_layer_bits()  # a bad ATTNLAB_LAYER_BITS before any work
    two_bit_margin()  # ... or ATTNLAB_TWO_BIT_MARGIN
    plan_bf16_asked()  # ... or ATTNLAB_PLAN_BF16
    top1_alpha()  # ... or ATTNLAB_TOP1_ALPHA
    if req.context is not None and (isinstance(req.context, bool) or not isinstance(req.context, int) or
                                    req.context < 1):
        raise ValueError(f"--context must be a positive number of tokens, got {req.context!r}")
    if (req.latent_dim is None) != (req.rope_dim is None):
        raise ValueError("give --latent-dim and --rope-dim together (or neither: the planner chooses)")
    if req.per_layer and (req.fmt != "attnlab" or req.latent_dim is not None):
        why = f"--format {req.fmt} holds one latent size for every layer" if req.fmt != "attnlab" else \
            "--latent-dim gives the sizes itself"
        raise ValueError(f"--per-layer plans a latent size per layer, which only the planner's --format attnlab "
                         f"plans: {why}")
    if not req.heal:
        heal_args = [f"--{n.replace('_', '-')} {getattr(req, n)}" for n in ("tokens", "layer_steps")
                     if getattr(req, n) is not None] + ["--keep-worse"] * req.keep_worse
        if heal_args:
            raise ValueError(f"{', '.join(heal_args)} size or judge the heal, and --no-heal runs none: give one or "
                             "the other")
    if req.fmt == "gguf" and not req.calibration:
        raise ValueError("--format gguf fits its latent norm on text: it cannot run with --no-calibration")
    if req.fmt == "gguf" and not str(req.out).endswith(".gguf"):
        raise ValueError(f"--format gguf writes one file: --out must end in .gguf, got {req.out}")
    if isinstance(req.minutes, bool) or not isinstance(req.minutes, (int, float)) or not req.minutes > 0:
        raise ValueError(f"--minutes must be a positive number, got {req.minutes!r}")
    for name in ("windows", "seq_len", "tokens", "layer_steps", "batch_size"):
        v = getattr(req, name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "layer_steps" else 1)):
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if isinstance(req.seed, bool) or not isinstance(req.seed, int) or not 0 <= req.seed < 2 ** 31:
        raise ValueError(f"--seed must be an integer from 0 to {2 ** 31 - 1}, got {req.seed!r}")
    for p in [*req.text, *req.eval_text]:
        if not Path(p).is_file():
            raise ValueError(f"no such text file: {p}")


def pinned(req: ShrinkRequest) -> bool:
    """Whether the request pins the heal's work (--tokens and --layer-steps both given, or --no-heal): then the
    teacher writes every window and the heal runs every step whatever the clock says, so the run gives the same
    weights under any load; --minutes is then reported against, not enforced."""
    return (req.tokens is not None and req.layer_steps is not None) or not req.heal


def plan_count(minutes: float) -> int:
    """The most candidates the planner measures for a run of `minutes` (21 at the default 10): a count, not a share
    of the clock, so that a loaded machine plans as an idle one does (docs/decisions.md)."""
    return max(3, int(2 * minutes) + 1)
