"""Whole converted models on disk: attention.safetensors + config.json beside a base model.

The base is a bundled model's name or the path of the checkpoint (folder or GGUF file)
the conversion started from; for a folder that stands alone, export it (models/export/deepseek.py).
"""
from __future__ import annotations

import json

from .adapters import attnlab_modules, replace_attention, to_attnlab
from .bundled import load_gemma3_270m, load_minilm, load_smollm2

# -- whole converted models on disk ---------------------------------------------------------------
MODEL_FORMAT = "attnlab-model"
LOADERS = {"smollm2": load_smollm2, "minilm": load_minilm, "gemma3-270m": load_gemma3_270m}


def sources_of(model) -> list[str]:
    """The paths a loaded model reads: its base checkpoint (folder or GGUF file) and its converted-model folder."""
    return [p for p in (getattr(model, "attnlab_source", None), getattr(model, "attnlab_folder", None)) if p]


def source_paths(source) -> list[str]:
    """The paths a model source reads, before loading it: the source itself and, for a converted-model folder,
    its base checkpoint (a bundled model's name reads nothing the user owns)."""
    from pathlib import Path

    if source in LOADERS:
        return []
    out = [str(source)]
    try:
        meta = json.loads((Path(source) / "config.json").read_text())
    except (OSError, ValueError):
        return out
    base = meta.get("base") if isinstance(meta, dict) and meta.get("format") == MODEL_FORMAT else None
    return out + ([base] if isinstance(base, str) and base not in LOADERS else [])


def save_model(model, base: str, folder, *, extra: dict | None = None, force: bool = False, sources=()):
    """Write the attention layers of an attnlab'd model: attention.safetensors + config.json.

    The folder holds only what a conversion changed; the rest comes back from the base model on load. Written atomically
    under io.folders.check_output's rules: never over the model's own sources (sources_of(model), the base and
    `sources`), an existing folder only with force and only if attnlab wrote it.
    """
    from pathlib import Path

    from safetensors.torch import save_file

    from ..io.folders import check_output, write_folder
    from ..io.modules import module_record
    from .load import is_checkpoint

    if base not in LOADERS:
        if not is_checkpoint(base):
            raise ValueError(f"unknown base model {base!r}; known: {', '.join(LOADERS)}, or a checkpoint path")
        base = str(Path(base).resolve())  # the folder (or GGUF file) the rest of the model is read from
    sources = [*sources, *sources_of(model), *([base] if base not in LOADERS else [])]
    check_output(folder, force=force, sources=sources)
    modules = attnlab_modules(model)
    state = {f"layers.{i}.{k}": v.detach().contiguous().cpu()
             for i, m in enumerate(modules) for k, v in m.state_dict().items()}
    meta = {"format": MODEL_FORMAT, "version": 1, "base": base, "layers": [module_record(m) for m in modules],
            **(extra or {})}

    def write(tmp):
        save_file(state, str(tmp / "attention.safetensors"))
        (tmp / "config.json").write_text(json.dumps(meta, indent=2))
    return write_folder(folder, write, force=force, sources=sources, info={"what": "attnlab converted model"})


def load_model(source: str):
    """(model, tokenizer, meta) for a bundled name (LOADERS), a checkpoint (models/load.py) or a save_model folder.

    The model comes back attnlab'd (to_attnlab), a folder's attention layers replacing the base's. Anything else is one
    ValueError line naming what was looked for; so is a folder whose config.json is not an object or lacks "format",
    "base" or "layers" (a module record a layer), whose weights hold more layers, or whose base has another count.
    """
    from pathlib import Path

    from ..io.modules import load_weights, module_from_record
    from ..io.readers import read_json, read_tensors
    from .load import is_checkpoint, load_checkpoint

    if isinstance(source, str) and source in LOADERS:
        model, tok = LOADERS[source]()
        return to_attnlab(model), tok, {"base": source}
    folder = Path(str(source))
    if is_checkpoint(folder) and not (folder / "attention.safetensors").exists():
        model, tok = load_checkpoint(folder)
        return to_attnlab(model), tok, {"base": str(folder.resolve())}
    wanted = (f"a bundled model name ({', '.join(LOADERS)}), a checkpoint (a .gguf file, or a folder whose "
              f"config.json names a model_type) or a converted-model folder (config.json with format "
              f"{MODEL_FORMAT!r}, and attention.safetensors)")
    if not folder.exists():
        raise ValueError(f"{str(source)!r}: no such file or folder; expected {wanted}")
    if not folder.is_dir():
        raise ValueError(f"{folder} is a file but not a .gguf; expected {wanted}")
    cfg = folder / "config.json"
    if not cfg.is_file():
        raise ValueError(f"{folder} has no config.json; expected {wanted}")
    meta = read_json(cfg)  # a list, a string, bad JSON: one line naming the file
    if meta.get("format") != MODEL_FORMAT:
        raise ValueError(f"{cfg} is not an attnlab converted model (format {meta.get('format')!r}, not "
                         f"{MODEL_FORMAT!r}); expected {wanted}")
    base = meta.get("base")
    if not isinstance(base, str) or not (base in LOADERS or is_checkpoint(base)):
        raise ValueError(f"{cfg}: its base model {base!r} is gone or not a model (a bundled name: "
                         f"{', '.join(LOADERS)}, or a checkpoint path)")
    records = meta.get("layers")
    if "layers" not in meta:
        raise ValueError(f'{cfg} lacks "layers" (one module record per attention layer)')
    if not isinstance(records, list) or not records or not all(
            isinstance(r, dict) and isinstance(r.get("config"), dict) for r in records):
        raise ValueError(f'{cfg}: "layers" must be a non-empty list of module records ({{"class": ..., '
                         f'"config": {{...}}}}), got {str(records)[:80]}')
    state = read_tensors(folder / "attention.safetensors")
    beyond = sorted({int(k.split(".")[1]) for k in state if k.startswith("layers.") and k.split(".")[1].isdigit()
                     and int(k.split(".")[1]) >= len(records)})
    if beyond:
        raise ValueError(f"{folder / 'attention.safetensors'} holds weights of layer {beyond[-1]}, "
                         f"{cfg} lists {len(records)} layers")
    modules = []
    for i, record in enumerate(records):
        m = module_from_record(record, f"{cfg} layer {i}")
        prefix = f"layers.{i}."
        load_weights(m, {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)},
                     f"{folder / 'attention.safetensors'} layer {i}")
        modules.append(m)
    model, tok = LOADERS[base]() if base in LOADERS else load_checkpoint(base)
    model.attnlab_folder = str(folder.resolve())
    to_attnlab(model)
    layers = len(attnlab_modules(model))
    if layers != len(modules):
        raise ValueError(f"{cfg} lists {len(modules)} attention layers, its base model {base} has {layers}")
    replace_attention(model, modules)
    return model, tok, meta


