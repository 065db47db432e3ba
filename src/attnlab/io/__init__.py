"""What attnlab reads and writes on disk: atomic folders, and attnlab module checkpoints.

- folders.py  atomic writes; JSON and safetensors read with one-line errors
- modules.py  save and load one attention module (model.safetensors + config.json)
"""
from .folders import read_json, read_tensors, write_folder
from .modules import (
           CLASSES,
           FORMAT,
           load_module,
           load_weights,
           module_from_record,
           module_record,
           save_module,
)

__all__ = ["read_json", "read_tensors", "write_folder", "CLASSES", "FORMAT", "load_module", "load_weights",
           "module_from_record", "module_record", "save_module"]
