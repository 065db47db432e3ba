"""A transformers folder in the source's own architecture, healed for transformers' QuantizedCache.

`attnlab shrink --format transformers` keeps every attention layer's shape (the original attention, only its
cache coded: shrink/plan.py's native candidates) and heals the weights through the codes of transformers'
QuantizedCache (quanto backend: modules/lowbit.py's quanto4, quanto2). `export_transformers` writes such a
model as the folder `save_pretrained` writes for its own class (LlamaForCausalLM, Qwen3ForCausalLM,
Gemma3ForCausalLM, ...): `AutoModelForCausalLM.from_pretrained(OUT)` loads it with no attnlab import. The
attnlab modules go back into transformers' attention layers with models.adapters.from_attnlab. Its
generation_config.json names the cache it was healed for (cache_implementation "quantized" and the
cache_config transformers passes to QuantizedCache), so that a plain `model.generate(...)` runs with it; the
config's "attnlab" entry says who wrote it and for which cache. Written atomically (io.folders.write_folder).
"""
from __future__ import annotations

import copy
from pathlib import Path

from .adapters import check_own_attention, family, from_attnlab

RESIDUAL_LENGTH = 128  # transformers' QuantizedCache default: the newest tokens it keeps unquantised


def quantized_cache_config(storage: str) -> dict:
    """The cache_config of transformers' QuantizedCache that an attnlab storage ("quanto4", "quanto2") copies."""
    from ..modules import lowbit

    low = lowbit.QUANTO_FORMATS.get(storage)
    if low is None:
        raise ValueError(f"{storage!r} is not a transformers QuantizedCache code attnlab heals for: "
                         f"{', '.join(lowbit.QUANTO_FORMATS)}")
    return {"backend": "quanto", "nbits": low.bits, "axis_key": 0, "axis_value": 0, "q_group_size": low.group,
            "residual_length": RESIDUAL_LENGTH}


def check_transformers_export(model) -> None:
    """ValueError, one line, unless every attention layer is a GQA of the config's own heads (what the source's
    class holds)."""
    if family(model) != "llama":
        raise ValueError("--format transformers writes a causal language model (Llama, Qwen3, Gemma 3, ...)")
    check_own_attention(model, "--format transformers writes that; a converted model goes out with --format deepseek")


def export_transformers(model, folder, tokenizer=None, *, force: bool = False, storage: str | None = None) -> dict:
    """Write an attnlab'd model whose attention kept its shape as a transformers folder (module docstring).
    storage: the QuantizedCache code it was healed for (its cache_config goes into generation_config.json);
    None: the default cache. Returns {"path", "architecture", "cache_config"}."""
    from ..io.folders import write_folder
    from .store import sources_of

    check_transformers_export(model)
    cache = None if storage is None else quantized_cache_config(storage)
    out = from_attnlab(copy.deepcopy(model))
    out.config.attnlab = {"written_by": "attnlab", "cache_config": cache}
    if cache is not None:
        out.generation_config.cache_implementation = "quantized"
        out.generation_config.cache_config = dict(cache)

    def write(tmp: Path) -> None:
        out.save_pretrained(str(tmp))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))

    path = write_folder(Path(folder), write, force=force, sources=sources_of(model),
                        info={"what": "transformers export"})
    return {"path": str(path), "architecture": out.config.model_type, "cache_config": cache}
