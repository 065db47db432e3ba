"""What a folder attnlab wrote for transformers says about its cache (config.json's "attnlab" entry): the storage it
was planned in (one, or a list of one a layer), a keys-whole plan's value bases and kept storage, and the sizes of the
model it was planned for. KVCache.from_pretrained and `attnlab eval --engine transformers` read it."""
from __future__ import annotations

SIZES = ("model_type", "num_hidden_layers", "hidden_size", "num_key_value_heads", "vocab_size", "kv_lora_rank",
         "qk_rope_head_dim")


def planned_entry(folder) -> dict:
    """{"model_type", "kv_dtype"} of a folder attnlab wrote for transformers (config.json's "attnlab" entry; no
    kv_dtype where it names none), or {} for any other folder."""
    from pathlib import Path

    from ..io.readers import read_json

    path = Path(folder) / "config.json"
    config = read_json(path) if path.is_file() else {}
    entry = config.get("attnlab")
    if not isinstance(entry, dict) or entry.get("written_by") != "attnlab":
        return {}
    named = {k: entry[k] for k in ("kv_dtype", "value_bases", "kept_dtype") if k in entry}
    return {"model_type": config.get("model_type"), **named}


def value_bases(folder, layers: int) -> list | None:
    """The value bases a folder's config names (models/export/native_transformers.py), one per layer (None where a
    layer has none), read with safetensors; None when it names none. ValueError naming the file when it does not fit."""
    from pathlib import Path

    name = planned_entry(folder).get("value_bases")
    if name is None:
        return None
    path = Path(folder) / str(name)
    if Path(name).name != name or not path.is_file():
        raise ValueError(f"{Path(folder) / 'config.json'} names value bases {name!r}, which is not a file in the "
                         "folder")
    from safetensors.torch import load_file

    held = load_file(str(path))
    bases = [held.pop(f"layers.{i}.value_basis", None) for i in range(layers)]
    if held or all(u is None for u in bases):
        raise ValueError(f"{path} holds {sorted(held) or 'no value basis'}; expected layers.<i>.value_basis for "
                         f"layers 0-{layers - 1}")
    return bases


def planned(folder):
    """(decoder config, storage) of a folder attnlab wrote with --format transformers; ValueError naming the folder."""
    from pathlib import Path

    from transformers import AutoConfig

    from .shapes import text_config

    if not (Path(folder) / "config.json").is_file():
        raise ValueError(f"{folder} has no config.json: KVCache.from_pretrained reads a folder written by "
                         "attnlab shrink --format transformers")
    entry = planned_entry(folder)
    if "kv_dtype" not in entry:
        raise ValueError(f"{Path(folder) / 'config.json'} names no attnlab storage (no \"attnlab\" entry with a "
                         "kv_dtype): write the folder with attnlab shrink --format transformers, or use "
                         "KVCache(model, kv_dtype)")
    return text_config(AutoConfig.from_pretrained(str(folder))), entry["kv_dtype"]


def check_same(model_config, folder_config, folder) -> None:
    """ValueError naming both values when a model's sizes are not those of the folder the plan was written for."""
    for name in SIZES:
        mine, theirs = getattr(model_config, name, None), getattr(folder_config, name, None)
        if mine != theirs:
            raise ValueError(f"the cache planned in {folder} is for a model with {name} {theirs!r}; this model has "
                             f"{mine!r}")
