"""Reading what attnlab (or the user) put on disk, with one-line errors naming the file and the problem."""
from __future__ import annotations

import json
from pathlib import Path

import torch


def read_json(path: Path) -> dict:
    """A JSON object from a file; ValueError for a missing file, bad JSON or anything but an object."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path.parent} is not an attnlab checkpoint (no {path.name})")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a JSON {type(data).__name__}, not an object")
    return data


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file (nothing is unpickled); ValueError for a missing or unreadable file."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path.parent} is not an attnlab checkpoint (no {path.name})")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
