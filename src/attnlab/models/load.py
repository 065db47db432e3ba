"""Load the user's own Llama-family checkpoint: a transformers folder or a GGUF file.

Supported: model_type llama (Llama 2/3 with any rope scaling transformers knows, SmolLM2,
TinyLlama), mistral (without a sliding window shorter than max_position_embeddings) and
qwen2 (biases on Q/K/V; without sliding-window layers). Anything else is refused with
"not supported: <why>" rather than loaded as a wrong model.

`inspect_checkpoint(path)` checks a folder without loading weights: config.json, the
shards named by the index (present, readable safetensors headers), and every attention
and embedding tensor's shape against the config. `load_checkpoint` then loads it with
transformers (offline). transformers is imported inside the functions (extra [hf]).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

SUPPORTED = ("llama", "mistral", "qwen2")
REFUSED = {
    "qwen3": "Qwen3 normalises each query and key head (q_norm, k_norm) before RoPE; a latent shared by "
             "all heads cannot carry a per-head norm of the keys",
    "gemma": "Gemma's attention differs from Llama's (scaled embeddings, query pre-scaling)",
    "gemma2": "Gemma 2 uses logit soft-capping and alternating sliding-window layers",
    "phi3": "Phi-3 fuses Q/K/V into qkv_proj with partial rotary",
    "deepseek_v2": "the model is already MLA",
    "deepseek_v3": "the model is already MLA",
}


def is_checkpoint(source) -> bool:
    """True for a .gguf file or a folder whose config.json names a model_type (a transformers checkpoint)."""
    p = Path(str(source))
    if p.is_file() and p.suffix == ".gguf":
        return True
    cfg = p / "config.json"
    if not cfg.is_file():
        return False
    try:
        return "model_type" in json.loads(cfg.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False


def read_config(folder: Path) -> dict:
    """config.json of a transformers folder, refused with a reason unless its family is supported."""
    path = folder / "config.json"
    if not folder.is_dir():
        raise ValueError(f"{folder} is not a folder (a transformers checkpoint is a folder with config.json)")
    if not path.is_file():
        raise ValueError(f"{folder} has no config.json: not a transformers checkpoint")
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    check_supported(cfg, str(path))
    return cfg


def check_supported(cfg: dict, where: str) -> None:
    """Refuse configs attnlab would convert into a wrong model, naming the reason."""
    mt = cfg.get("model_type")
    if mt in REFUSED:
        raise ValueError(f"{where}: not supported: model_type {mt!r}: {REFUSED[mt]}")
    if mt not in SUPPORTED:
        raise ValueError(f"{where}: not supported: unknown model_type {mt!r} (supported: {', '.join(SUPPORTED)})")
    window, max_pos = cfg.get("sliding_window"), cfg.get("max_position_embeddings")
    uses_window = cfg.get("use_sliding_window", mt == "mistral")  # Qwen2 has the switch; Mistral uses it if set
    if uses_window and window is not None and (max_pos is None or window < max_pos):
        raise ValueError(f"{where}: not supported: sliding_window {window} < max_position_embeddings {max_pos}: "
                         "attnlab attends to the whole causal context (set sliding_window to null if the model "
                         "was trained without it)")
    if cfg.get("head_dim") is not None and cfg.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{where}: not supported: partial_rotary_factor {cfg['partial_rotary_factor']}")


def shard_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint: those its index names (each must exist), else *.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError) as e:
            raise ValueError(f"{index} is not a safetensors index: {e}") from None
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise ValueError(f"{folder}: missing shard {missing[0]} (named by {index.name})")
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} has no *.safetensors weights")
    return files


def open_shards(folder: Path) -> dict:
    """{tensor name: (shard path, shape)}, reading only the headers; truncated or corrupt shards are refused."""
    from safetensors import SafetensorError, safe_open

    where = {}
    for path in shard_files(folder):
        size = path.stat().st_size
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    where[name] = (path, tuple(f.get_slice(name).get_shape()))
        except (SafetensorError, OSError) as e:
            raise ValueError(f"{path}: unreadable safetensors shard ({size} bytes): {e}") from None
        _check_length(path, size)
    return where


def _check_length(path: Path, size: int) -> None:
    """The header's last data offset must equal the file's data length (a cut-off download is refused)."""
    import struct

    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: truncated shard ({size} bytes, no header)")
        n = struct.unpack("<Q", head)[0]
        try:
            header = json.loads(fh.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: corrupt shard header: {e}") from None
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end != size:
        raise ValueError(f"{path}: truncated shard: {size} bytes on disk, the header needs {8 + n + end}")


def expected_shapes(cfg: dict) -> dict[str, tuple]:
    """The shape every attention, MLP, norm and embedding tensor must have, from the config."""
    D, H, F = cfg["hidden_size"], cfg["num_attention_heads"], cfg.get("intermediate_size")
    G = cfg.get("num_key_value_heads") or H
    d = cfg.get("head_dim") or D // H
    shapes = {"model.embed_tokens.weight": (cfg["vocab_size"], D)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}.self_attn."
        shapes.update({p + "q_proj.weight": (H * d, D), p + "k_proj.weight": (G * d, D),
                       p + "v_proj.weight": (G * d, D), p + "o_proj.weight": (D, H * d)})
        m = f"model.layers.{i}."
        shapes.update({m + "input_layernorm.weight": (D,), m + "post_attention_layernorm.weight": (D,),
                       m + "mlp.gate_proj.weight": (F, D), m + "mlp.up_proj.weight": (F, D),
                       m + "mlp.down_proj.weight": (D, F)})
    shapes["model.norm.weight"] = (D,)
    return shapes


def inspect_checkpoint(source) -> dict:
    """Check a transformers folder without loading its weights; returns its config (dict).

    Raises ValueError naming the file and the problem: no config.json, an unsupported
    model_type, a missing or truncated shard, a tensor missing or of the wrong shape.
    """
    folder = Path(str(source))
    cfg = read_config(folder)
    where = open_shards(folder)
    for name, shape in expected_shapes(cfg).items():
        if name not in where:
            raise ValueError(f"{folder}: the checkpoint lacks {name} (config.json has "
                             f"{cfg['num_hidden_layers']} layers)")
        if where[name][1] != shape:
            raise ValueError(f"{where[name][0]}: {name} has shape {list(where[name][1])}, config.json implies "
                             f"{list(shape)}")
    return cfg


def load_checkpoint(source, dtype=None):
    """(model, tokenizer or None) for a transformers folder or a GGUF file, checked first, loaded offline.

    dtype: None keeps the checkpoint's own (torch_dtype in config.json; float32 for GGUF).
    """
    import torch

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = Path(str(source))
    if p.suffix == ".gguf":
        if not p.is_file():
            raise ValueError(f"no such GGUF file: {p}")
        kw = dict(gguf_file=p.name)
        folder = p.parent
        cfg = _gguf_config(p)
        check_supported(cfg, str(p))
        dtype = dtype or torch.float32
    else:
        folder, kw = p, {}
        cfg = inspect_checkpoint(p)
        dtype = dtype or "auto"
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, **kw).eval()
    try:
        tok = AutoTokenizer.from_pretrained(str(folder), **kw)
    except (OSError, ValueError, TypeError):
        tok = None  # no tokenizer files: token ids only
    model.attnlab_source = str(p.resolve())
    return model, tok


def _gguf_config(path: Path) -> dict:
    """model_type (and sliding window) of a GGUF file, from its general.architecture."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ValueError(f"{path}: no general.architecture in the GGUF metadata")
    arch = bytes(field.parts[field.data[0]]).decode()
    return {"model_type": arch}
