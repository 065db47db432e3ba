"""Whole converted models on disk: attention.safetensors + config.json beside a base model.

The base is a bundled model's name or the path of the checkpoint (folder or GGUF file)
the conversion started from; for a folder that stands alone, export it (models/export.py).
"""
from __future__ import annotations

from .adapters import attnlab_modules, replace_attention, to_attnlab
from .bundled import load_minilm, load_smollm2

# -- whole converted models on disk ---------------------------------------------------------------
MODEL_FORMAT = "attnlab-model"
LOADERS = {"smollm2": load_smollm2, "minilm": load_minilm}


def save_model(model, base: str, folder, *, extra: dict | None = None):
    """Write the attention layers of an attnlab'd model: attention.safetensors + config.json.

    Everything else comes back from the base model's package on load, so the folder
    holds only what a conversion changed. Written atomically (nothing half-written).
    """
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    from ..io.folders import write_folder
    from ..io.modules import module_record
    from .load import is_checkpoint

    if base not in LOADERS:
        if not is_checkpoint(base):
            raise ValueError(f"unknown base model {base!r}; known: {', '.join(LOADERS)}, or a checkpoint path")
        base = str(Path(base).resolve())  # the folder (or GGUF file) the rest of the model is read from
    modules = attnlab_modules(model)
    state = {f"layers.{i}.{k}": v.detach().contiguous().cpu()
             for i, m in enumerate(modules) for k, v in m.state_dict().items()}
    meta = {"format": MODEL_FORMAT, "version": 1, "base": base, "layers": [module_record(m) for m in modules],
            **(extra or {})}

    def write(tmp):
        save_file(state, str(tmp / "attention.safetensors"))
        (tmp / "config.json").write_text(json.dumps(meta, indent=2))
    return write_folder(folder, write)


def load_model(source: str):
    """(model, tokenizer, meta) for a base model name ("smollm2", "minilm") or a folder from save_model.

    The model comes back attnlab'd (to_attnlab); a folder's attention layers replace the base's.
    """
    from pathlib import Path

    from ..io.folders import read_json, read_tensors
    from ..io.modules import load_weights, module_from_record
    from .load import is_checkpoint, load_checkpoint

    if source in LOADERS:
        model, tok = LOADERS[source]()
        return to_attnlab(model), tok, {"base": source}
    if is_checkpoint(source) and not (Path(source) / "attention.safetensors").exists():
        model, tok = load_checkpoint(source)
        return to_attnlab(model), tok, {"base": str(Path(source).resolve())}
    folder = Path(source)
    if not folder.is_dir():
        raise ValueError(f"{source!r} is neither a model name ({', '.join(LOADERS)}) nor a converted-model folder")
    meta = read_json(folder / "config.json")
    if meta.get("format") != MODEL_FORMAT or not (meta.get("base") in LOADERS or is_checkpoint(meta.get("base"))):
        raise ValueError(f"{folder / 'config.json'} is not an attnlab converted model (or its base "
                         f"{meta.get('base')!r} is gone)")
    state = read_tensors(folder / "attention.safetensors")
    modules = []
    for i, record in enumerate(meta["layers"]):
        m = module_from_record(record, f"{folder / 'config.json'} layer {i}")
        prefix = f"layers.{i}."
        load_weights(m, {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)},
                     f"{folder / 'attention.safetensors'} layer {i}")
        modules.append(m)
    base = meta["base"]
    model, tok = LOADERS[base]() if base in LOADERS else load_checkpoint(base)
    to_attnlab(model)
    replace_attention(model, modules)
    return model, tok, meta


