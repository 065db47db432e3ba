"""Save and load attnlab modules: a folder with model.safetensors and config.json.

config.json holds {"format": "attnlab", "version": 1, "class": ..., "config": {...},
"dtype": ...}; the weights are the module's state_dict (rotary frequencies included).
Folders are written under a temporary name beside the target and renamed into
place at the end, so a failure leaves nothing half-written. Needs `safetensors`.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import torch

from .gqa import GroupedQueryAttention, MultiHeadAttention
from .mla import MultiHeadLatentAttention

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


def write_folder(folder: str | Path, write: Callable[[Path], None]) -> Path:
    """Run write(tmp) on a fresh temporary folder beside `folder`, then move it into place."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        write(tmp)
        if folder.exists():
            shutil.rmtree(folder)
        tmp.rename(folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise ValueError(f"{path.parent} is not an attnlab checkpoint (no {path.name})")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not path.is_file():
        raise ValueError(f"{path.parent} is not an attnlab checkpoint (no {path.name})")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None


def load_weights(module, state: dict[str, torch.Tensor], where: str) -> None:
    missing = set(module.state_dict()) - set(state)
    if missing:
        raise ValueError(f"{where} lacks {sorted(missing)}")
    try:
        module.load_state_dict(state)
    except RuntimeError as e:
        raise ValueError(f"{where} does not fit the config: {str(e).splitlines()[0]}") from None


def save_module(module, folder: str | Path, *, extra: dict | None = None) -> Path:
    """Write module (weights + config) to folder, atomically; returns the folder."""
    from safetensors.torch import save_file

    meta = {"format": FORMAT, "version": 1, **module_record(module), **(extra or {})}

    def write(tmp: Path) -> None:
        save_file({k: v.detach().contiguous().cpu() for k, v in module.state_dict().items()},
                  str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(meta, indent=2))
    return write_folder(folder, write)


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
