"""A transformers folder in the source's own architecture, planned and healed for an attnlab.hf.KVCache storage.

`export_transformers` writes the folder `save_pretrained` writes for the model's own class (LlamaForCausalLM, ...):
`AutoModelForCausalLM.from_pretrained(OUT)` loads it with no attnlab import, and `attnlab.hf.KVCache.from_pretrained
(OUT)` makes the cache it was planned for, from the config's "attnlab" entry (who wrote it, the storage).
"""
from __future__ import annotations

import copy
from pathlib import Path

from ..adapters import attnlab_modules, check_own_attention, family, from_attnlab


# `attnlab shrink --format transformers` keeps every attention layer's shape (the original attention, only its cache
# coded: shrink/plan.py's native candidates) and heals the weights through the codes of the storage it plans
# (shrink/sizes.py: TRANSFORMERS_CACHE). A model with per-head q/k norms (Qwen3, Gemma 3) may also hold keys-whole MLAs:
# each is written as the source's attention (convert/keys_whole.py) and its value basis U goes beside the weights, so
# that the cache holds the latent c = U^+ v, not the values.
VALUE_BASES = "attnlab_values.safetensors"  # beside the weights: each keys-whole layer's value basis U (G dv, r)


def check_transformers_export(model) -> None:
    """ValueError, one line, unless every attention layer is a GQA of the config's own heads (what the source's
    class holds) or a keys-whole MLA (convert/keys_whole.py writes it as one)."""
    if family(model) != "llama":
        raise ValueError("--format transformers writes a causal language model (Llama, Qwen3, Gemma 3, ...)")
    if any(getattr(m, "keys_whole", False) for m in attnlab_modules(model)):
        return
    check_own_attention(model, "--format transformers writes that; a converted model goes out with --format deepseek")


def value_bases(model) -> list | None:
    """Each layer's value basis (convert.keys_whole.value_basis) where it is a keys-whole MLA, None elsewhere; None
    when no layer is."""
    from ...convert.keys_whole import value_basis

    bases = [value_basis(m) if getattr(m, "keys_whole", False) else None for m in attnlab_modules(model)]
    return None if all(u is None for u in bases) else bases


def export_transformers(model, folder, tokenizer=None, *, force: bool = False, storage: str | list | None = None,
                        kept_dtype: str | None = None) -> dict:
    """Write an attnlab'd model whose attention kept its shape, or whose layers are keys-whole MLAs, as a
    transformers folder, atomically (io.folders.write_folder). storage: the KVCache storage it was planned for
    (config.json's "attnlab" entry; None: a plain cache; a list: one a layer); kept_dtype: that of the layers a
    keys-whole plan kept as they were. Returns {"path", "architecture", "kv_dtype"}."""
    from safetensors.torch import save_file

    from ...io.folders import write_folder
    from ...modules.storage import check_kv_dtype
    from ..evaluate import each_module
    from ..store import sources_of

    check_transformers_export(model)
    for k in each_module(model, storage):
        check_kv_dtype(k)
    check_kv_dtype(kept_dtype)
    bases = value_bases(model)
    kept = {"kept_dtype": kept_dtype} if bases and kept_dtype is not None and None in bases else {}
    out = from_attnlab(copy.deepcopy(model))  # the attnlab modules back into transformers' attention layers
    out.config.attnlab = {"written_by": "attnlab", "kv_dtype": storage,
                          **({"value_bases": VALUE_BASES} if bases else {}), **kept}

    def write(tmp: Path) -> None:
        out.save_pretrained(str(tmp))
        if bases:
            save_file({f"layers.{i}.value_basis": u.detach().contiguous().cpu() for i, u in enumerate(bases)
                       if u is not None}, str(tmp / VALUE_BASES))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))

    path = write_folder(Path(folder), write, force=force, sources=sources_of(model),
                        info={"what": "transformers export"})
    return {"path": str(path), "architecture": out.config.model_type, "kv_dtype": storage}
