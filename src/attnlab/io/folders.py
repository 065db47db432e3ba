"""Files and folders attnlab writes: atomically, and never over what it did not write.

Folders are written under a temporary name beside the target and renamed into
place at the end, so a failure leaves nothing half-written.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import torch


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
