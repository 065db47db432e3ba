"""Save and load attnlab modules: a folder with model.safetensors and config.json.

config.json holds {"format": "attnlab", "version": 1, "class": ..., "config": {...},
"dtype": ...}; the weights are the module's state_dict (rotary frequencies included).
The folder is written atomically (folders.write_folder). Needs `safetensors`.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..modules.gqa import GroupedQueryAttention, MultiHeadAttention
from ..modules.mla import MultiHeadLatentAttention
from .folders import write_folder
from .readers import read_json, read_tensors

CLASSES = {c.__name__: c for c in (GroupedQueryAttention, MultiHeadAttention, MultiHeadLatentAttention)}
FORMAT = "attnlab"


def module_record(module) -> dict:
    """What rebuilds the module's shape: its class (the study's MyMHA/MyGQA as what they are underneath)."""
    name = next(c.__name__ for c in type(module).__mro__ if c.__name__ in CLASSES)
    cfg = module.config()
    if name == "MultiHeadAttention":
        cfg.pop("num_kv_heads"), cfg.pop("grouping")
    return {"class": name, "config": cfg, "dtype": str(module._anchor.dtype).removeprefix("torch.")}


def module_from_record(record: dict, where: str = "config"):
    if record.get("class") not in CLASSES:
        raise ValueError(f"{where} does not describe an attnlab module (class {record.get('class')!r})")
    try:
        return CLASSES[record["class"]](**record["config"], dtype=getattr(torch, record.get("dtype", "float32")))
    except (TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"{where} has an unusable module config: {e}") from None


def load_weights(module, state: dict[str, torch.Tensor], where: str) -> None:
    missing = set(module.state_dict()) - set(state)
    if missing:
        raise ValueError(f"{where} lacks {sorted(missing)}")
    try:
        module.load_state_dict(state)
    except RuntimeError as e:
        raise ValueError(f"{where} does not fit the config: {str(e).splitlines()[0]}") from None


def save_module(module, folder: str | Path, *, extra: dict | None = None, force: bool = False,
                sources=()) -> Path:
    """Write module (weights + config) to folder, atomically; returns the folder.

    The output rules of folders.check_output apply: an existing folder is replaced only with
    force=True and only if attnlab wrote it; `sources` (e.g. the checkpoint the module came from)
    may not be the folder, lie inside it or contain it.
    """
    from safetensors.torch import save_file

    meta = {"format": FORMAT, "version": 1, **module_record(module), **(extra or {})}

    def write(tmp: Path) -> None:
        save_file({k: v.detach().contiguous().cpu() for k, v in module.state_dict().items()},
                  str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(meta, indent=2))
    return write_folder(folder, write, force=force, sources=sources, info={"what": "attnlab module"})


def load_module(folder: str | Path):
    """Rebuild a module saved by save_module. Raises ValueError for a missing, corrupt or foreign checkpoint."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"{folder} is not an attnlab checkpoint (no such folder)")
    meta = read_json(folder / "config.json")
    if meta.get("format") != FORMAT:
        raise ValueError(f"{folder / 'config.json'} is not an attnlab module checkpoint")
    module = module_from_record(meta, str(folder / "config.json"))
    load_weights(module, read_tensors(folder / "model.safetensors"), str(folder / "model.safetensors"))
    return module
