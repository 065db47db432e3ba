"""Save and load attnlab modules: a folder with model.safetensors and config.json.

config.json holds {"format": "attnlab", "version": 1, "class": ..., "config": {...},
"dtype": ...}; the weights are the module's state_dict. Writing goes to a temporary
folder beside the target, renamed into place at the end, so a failure leaves
nothing half-written. Needs the `safetensors` package (extra [cli]).
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch

from .gqa import GroupedQueryAttention, MultiHeadAttention
from .mla import MultiHeadLatentAttention

CLASSES = {c.__name__: c for c in (GroupedQueryAttention, MultiHeadAttention, MultiHeadLatentAttention)}
FORMAT = "attnlab"


def _class_name(module) -> str:
    name = type(module).__name__
    if name not in CLASSES:  # the study's MyMHA / MyGQA save as what they are underneath
        name = next(c.__name__ for c in type(module).__mro__ if c.__name__ in CLASSES)
    return name


def save_module(module, folder: str | Path, *, extra: dict | None = None) -> Path:
    """Write module (weights + config) to folder, atomically; returns the folder."""
    from safetensors.torch import save_file

    folder = Path(folder)
    cfg = module.config()
    if isinstance(module, MultiHeadAttention):
        cfg.pop("num_kv_heads"), cfg.pop("grouping")
    meta = {"format": FORMAT, "version": 1, "class": _class_name(module), "config": cfg,
            "dtype": str(module._anchor.dtype).removeprefix("torch."), **(extra or {})}
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        state = {k: v.detach().contiguous().cpu() for k, v in module.state_dict().items()}
        save_file(state, str(tmp / "model.safetensors"))
        (tmp / "config.json").write_text(json.dumps(meta, indent=2))
        if folder.exists():
            shutil.rmtree(folder)
        tmp.rename(folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def load_module(folder: str | Path):
    """Rebuild a module saved by save_module. Raises ValueError for a missing, corrupt or foreign checkpoint."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder)
    cfg_path, weights = folder / "config.json", folder / "model.safetensors"
    if not cfg_path.is_file() or not weights.is_file():
        raise ValueError(f"{folder} is not an attnlab checkpoint (needs config.json and model.safetensors)")
    try:
        meta = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{cfg_path} is not valid JSON: {e}") from None
    if meta.get("format") != FORMAT or meta.get("class") not in CLASSES:
        raise ValueError(f"{cfg_path} does not describe an attnlab module (class {meta.get('class')!r})")
    dtype = getattr(torch, meta.get("dtype", "float32"))
    module = CLASSES[meta["class"]](**meta["config"], dtype=dtype)
    try:
        state = load_file(str(weights))
    except (SafetensorError, OSError) as e:
        raise ValueError(f"cannot read {weights}: {e}") from None
    missing = set(module.state_dict()) - set(state)
    if missing:
        raise ValueError(f"{weights} lacks {sorted(missing)}")
    try:
        module.load_state_dict(state)
    except RuntimeError as e:
        raise ValueError(f"{weights} does not fit the config: {str(e).splitlines()[0]}") from None
    return module
