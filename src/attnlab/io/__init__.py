"""What attnlab reads and writes on disk: where it may write, module checkpoints, fingerprints.

folders.py: the output rules (never over the user's files), atomic writes, one writer per output. readers.py: JSON
and safetensors read with one-line errors. modules.py: save and load one attention module (model.safetensors +
config.json). fingerprint.py: which weights a checkpoint belongs to.
"""
from .fingerprint import fingerprint
from .folders import (MARKER, check_output, output_lock, remove_stale_temporaries, replace_file, replace_with,
                      write_file, write_folder, written_by_attnlab)
from .modules import CLASSES, FORMAT, load_module, load_weights, module_from_record, module_record, save_module
from .readers import read_json, read_tensors

__all__ = ["fingerprint", "MARKER", "check_output", "output_lock", "remove_stale_temporaries", "replace_file", "replace_with",
           "write_file", "write_folder", "written_by_attnlab", "CLASSES", "FORMAT", "load_module", "load_weights",
           "module_from_record", "module_record", "save_module", "read_json", "read_tensors"]
