"""Load the user's own Llama-family checkpoint: a transformers folder or a GGUF file (extra [hf]).

`inspect_checkpoint` (`inspect_gguf` for a GGUF) checks a source without loading weights, so nothing is built from
transformers' defaults or silently dropped; `load_checkpoint` loads it offline and refuses NaN or inf weights.
Families: SUPPORTED; anything else, or a bad file, size or shape, is one ValueError line naming the file and value.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

# transformers, gguf and safetensors are imported inside the functions (extra [hf]).

# llama: Llama 2/3 with any rope scaling transformers knows, SmolLM2, TinyLlama; mistral: without a sliding window
# shorter than max_position_embeddings; qwen2: biases on Q/K/V, without sliding-window layers; qwen3: per-head q/k
# norms; gemma3_text: Gemma 3's text model (per-head q/k norms, sliding-window layers with their own RoPE base, its own
# query scale; attention soft-capping refused). qwen3 and gemma3_text load, swap and convert in memory (the exact MLA,
# or the compressed one with their keys whole: models/convert.py), not by the streamed route (NOT_CONVERTED). Their
# GGUF files (architectures qwen3 and gemma3) load too, with what transformers' GGUF reader leaves out put back from
# the metadata (GGUF_FAMILY_KEYS: the head size from attention.key_length, Qwen3's not being hidden / heads; Gemma 3's
# query scale as llama.cpp sets it), and a rope scaling it would drop refused naming the field.
SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
# loaded, swapped and converted in memory (their keys whole), not by the streamed route: what it would lose
NOT_CONVERTED = {
    "qwen3": "Qwen3 normalises each query and key head (q_norm, k_norm) before RoPE, and the streamed conversion "
             "does not carry that norm (convert it in memory: the exact MLA, or the compressed one with its keys "
             "whole, --rope-select frequency)",
    "gemma3_text": "Gemma 3 normalises each query and key head (q_norm, k_norm) before RoPE and has sliding-window "
                   "layers, and the streamed conversion carries neither (convert it in memory: the exact MLA, or the "
                   "compressed one with its keys whole, --rope-select frequency)",
}
GEMMA_NORMS = ("pre_feedforward_layernorm", "post_feedforward_layernorm")  # Gemma 3's extra norms per layer
REFUSED = {
    "gemma": "Gemma's attention differs from Llama's (scaled embeddings, query pre-scaling)",
    "gemma2": "Gemma 2 uses logit soft-capping and alternating sliding-window layers",
    "phi3": "Phi-3 fuses Q/K/V into qkv_proj with partial rotary",
    "deepseek_v2": "the model is already MLA",
    "deepseek_v3": "the model is already MLA",
}


def is_checkpoint(source) -> bool:
    """True for a .gguf file or a folder whose config.json is an object naming a model_type (a transformers
    checkpoint)."""
    p = Path(str(source))
    if p.is_file() and p.suffix == ".gguf":
        return True
    cfg = p / "config.json"
    if not cfg.is_file():
        return False
    try:
        data = json.loads(cfg.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, OSError):
        return False
    return isinstance(data, dict) and "model_type" in data


def read_config(folder: Path) -> dict:
    """config.json of a transformers folder: a JSON object of a supported family with usable sizes
    (check_supported, check_sizes), else a ValueError naming the file, the key and the value."""
    folder = Path(str(folder))
    path = folder / "config.json"
    if not folder.is_dir():
        raise ValueError(f"{folder} is not a folder (a transformers checkpoint is a folder with config.json)")
    if not path.is_file():
        raise ValueError(f"{folder} has no config.json: not a transformers checkpoint")
    from ..io.readers import read_json

    cfg = read_json(path)  # bad JSON, or a list: one line naming the file
    check_supported(cfg, str(path))
    check_sizes(cfg, str(path))
    return cfg


def check_supported(cfg: dict, where: str) -> None:
    """Refuse configs attnlab would convert into a wrong model, naming the reason."""
    mt = cfg.get("model_type")
    if isinstance(mt, str) and mt in REFUSED:
        raise ValueError(f"{where}: not supported: model_type {mt!r}: {REFUSED[mt]}")
    if mt not in SUPPORTED:
        raise ValueError(f"{where}: not supported: unknown model_type {mt!r} (supported: {', '.join(SUPPORTED)})")
    window, max_pos = cfg.get("sliding_window"), cfg.get("max_position_embeddings")
    uses_window = cfg.get("use_sliding_window", mt == "mistral")  # Qwen2 has the switch; Mistral uses it if set
    if uses_window and window is not None and not _positive_int(window):
        raise ValueError(f"{where}: sliding_window must be a positive int or null, got {window!r}")
    # a max_position_embeddings that is not a positive int is check_sizes' to refuse, naming it
    if uses_window and window is not None and (max_pos is None or (_positive_int(max_pos) and window < max_pos)):
        raise ValueError(f"{where}: not supported: sliding_window {window} < max_position_embeddings {max_pos}: "
                         "attnlab attends to the whole causal context (set sliding_window to null if the model "
                         "was trained without it)")
    if cfg.get("attn_logit_softcapping") is not None:
        raise ValueError(f"{where}: not supported: attn_logit_softcapping {cfg['attn_logit_softcapping']!r}: attnlab's "
                         "attention has no score soft-capping (Gemma 3 sets it to null)")
    if cfg.get("head_dim") is not None and cfg.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{where}: not supported: partial_rotary_factor {cfg['partial_rotary_factor']}")


def _positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _positive_number(v) -> bool:
    return _positive_int(v) or (isinstance(v, float) and math.isfinite(v) and v > 0)


REQUIRED_SIZES = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")


def check_sizes(cfg: dict, where: str,
                names: dict | None = None) -> None:  # how the file spells each key (a GGUF's metadata keys)
    """Refuse sizes transformers would build a wrong model from (or fail on deep inside), naming the key and value.

    REQUIRED_SIZES must be there (else the config class's default, e.g. a 4096-wide Llama) as positive ints;
    num_key_value_heads (default num_attention_heads) a positive divisor of the heads; head_dim (default hidden_size /
    num_attention_heads, which must then divide) positive; max_position_embeddings and rope_theta positive where given.
    """
    def name(key):
        return (names or {}).get(key, key)

    for key in REQUIRED_SIZES:
        if key not in cfg:
            raise ValueError(f"{where}: {name(key)} is missing (transformers would take its default)")
        if not _positive_int(cfg[key]):
            raise ValueError(f"{where}: {name(key)} must be a positive int, got {cfg[key]!r}")
    H, D = cfg["num_attention_heads"], cfg["hidden_size"]
    G = cfg.get("num_key_value_heads")
    if G is not None and not (_positive_int(G) and H % G == 0):
        raise ValueError(f"{where}: {name('num_key_value_heads')} must be a positive divisor of "
                         f"{name('num_attention_heads')} ({H}), got {G!r}")
    d = cfg.get("head_dim")
    if d is not None and not _positive_int(d):
        raise ValueError(f"{where}: {name('head_dim')} must be a positive int, got {d!r}")
    if d is None and D % H:
        raise ValueError(f"{where}: {name('hidden_size')} {D} is not a multiple of {name('num_attention_heads')} "
                         f"{H} (and no {name('head_dim')} is given)")
    if "max_position_embeddings" in cfg and not _positive_int(cfg["max_position_embeddings"]):
        raise ValueError(f"{where}: {name('max_position_embeddings')} must be a positive int, got "
                         f"{cfg['max_position_embeddings']!r}")
    thetas = {"rope_theta": cfg.get("rope_theta")}  # transformers 5 keeps it in rope_parameters
    for group in ("rope_parameters", "rope_scaling"):
        if isinstance(cfg.get(group), dict):
            thetas[f"{group}.rope_theta"] = cfg[group].get("rope_theta")
    for key, theta in thetas.items():
        if theta is not None and not _positive_number(theta):
            raise ValueError(f"{where}: {name(key)} must be a positive number, got {theta!r}")


def shard_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint: those its index names (each must exist), else *.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, AttributeError, TypeError) as e:
            raise ValueError(f"{index} is not a safetensors index: {e}") from None
        odd = [n for n in names if not isinstance(n, str) or Path(n).name != n]
        if odd:
            raise ValueError(f"{index} names {odd[0]!r} as a shard: not a file name in {folder}")
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
    """The shape every attention, MLP, norm, embedding and output tensor must have, from the config
    (lm_head.weight unless tie_word_embeddings; Q/K/V biases for qwen2 and where attention_bias says so)."""
    D, H, F = cfg["hidden_size"], cfg["num_attention_heads"], cfg.get("intermediate_size")
    G = cfg.get("num_key_value_heads") or H
    d = cfg.get("head_dim") or D // H
    V = cfg["vocab_size"]
    biases = ("q", "k", "v") if cfg.get("model_type") == "qwen2" else (
        ("q", "k", "v", "o") if cfg.get("attention_bias") else ())
    bias_size = {"q": H * d, "k": G * d, "v": G * d, "o": D}
    shapes = {"model.embed_tokens.weight": (V, D)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}.self_attn."
        shapes.update({p + "q_proj.weight": (H * d, D), p + "k_proj.weight": (G * d, D),
                       p + "v_proj.weight": (G * d, D), p + "o_proj.weight": (D, H * d)})
        shapes.update({f"{p}{b}_proj.bias": (bias_size[b],) for b in biases})
        if cfg.get("model_type") in NOT_CONVERTED:  # qwen3, gemma3_text: per-head q/k norms
            shapes.update({p + "q_norm.weight": (d,), p + "k_norm.weight": (d,)})
        m = f"model.layers.{i}."
        if cfg.get("model_type") == "gemma3_text":
            shapes.update({m + n + ".weight": (D,) for n in GEMMA_NORMS})
        shapes.update({m + "input_layernorm.weight": (D,), m + "post_attention_layernorm.weight": (D,),
                       m + "mlp.gate_proj.weight": (F, D), m + "mlp.up_proj.weight": (F, D),
                       m + "mlp.down_proj.weight": (D, F)})
        if cfg.get("mlp_bias"):
            shapes.update({m + "mlp.gate_proj.bias": (F,), m + "mlp.up_proj.bias": (F,),
                           m + "mlp.down_proj.bias": (D,)})
    shapes["model.norm.weight"] = (D,)
    if not cfg.get("tie_word_embeddings", cfg.get("model_type") == "gemma3_text"):  # Gemma 3 ties by default
        shapes["lm_head.weight"] = (V, D)
    return shapes


def _layers_beyond(names, pattern: str, declared: int) -> int | None:
    """The number of layers the tensor names imply (highest index + 1) when it exceeds `declared`, else None."""
    import re

    found = [int(m.group(1)) for n in names if (m := re.match(pattern, n))]
    return max(found) + 1 if found and max(found) >= declared else None


def inspect_checkpoint(source) -> dict:
    """Check a transformers folder (a GGUF file: inspect_gguf) without loading its weights; returns its config (dict).

    Raises ValueError naming the file and the problem: no config.json, a config that is not a JSON object or has an
    unusable size (check_sizes), an unsupported model_type, a missing or truncated shard, a tensor missing or of the
    wrong shape, tensors of more layers than num_hidden_layers.
    """
    folder = Path(str(source))
    if folder.suffix == ".gguf" and not folder.is_dir():
        return inspect_gguf(folder)
    cfg = read_config(folder)
    where = open_shards(folder)
    for name, shape in expected_shapes(cfg).items():
        if name not in where:
            raise ValueError(f"{folder}: the checkpoint lacks {name} (config.json has "
                             f"{cfg['num_hidden_layers']} layers)")
        if where[name][1] != shape:
            raise ValueError(f"{where[name][0]}: {name} has shape {list(where[name][1])}, config.json implies "
                             f"{list(shape)}")
    found = _layers_beyond(where, r"model\.layers\.(\d+)\.", cfg["num_hidden_layers"])
    if found is not None:
        raise ValueError(f"{folder}: the shards hold tensors of {found} layers (model.layers.{found - 1}), "
                         f"config.json has num_hidden_layers {cfg['num_hidden_layers']}: layers would be dropped")
    return cfg


# GGUF metadata key (after "<architecture>.") -> transformers config key, as transformers reads them
GGUF_KEYS = {"block_count": "num_hidden_layers", "embedding_length": "hidden_size",
             "feed_forward_length": "intermediate_size", "attention.head_count": "num_attention_heads",
             "attention.head_count_kv": "num_key_value_heads", "context_length": "max_position_embeddings",
             "rope.freq_base": "rope_theta", "vocab_size": "vocab_size"}
# transformers' name of a layer's module -> llama.cpp's
GGUF_LAYER_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                    "self_attn.o_proj": "attn_output", "input_layernorm": "attn_norm",
                    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                    "mlp.down_proj": "ffn_down"}
GGUF_LAYER_NAMES.update({"self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"})  # Qwen3, Gemma 3
# Gemma 3's four norms a layer, in llama.cpp's names (its attention's output norm, then the MLP's two)
GEMMA3_LAYER_NAMES = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                      "post_feedforward_layernorm": "post_ffw_norm"}
GGUF_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
              "lm_head.weight": "output.weight"}
GGUF_MODEL_TYPES = {"gemma3": "gemma3_text"}  # a GGUF architecture whose transformers model_type differs
# metadata a family's GGUF needs beyond GGUF_KEYS (the head size: Qwen3's and Gemma 3's is not hidden / heads)
GGUF_FAMILY_KEYS = {"qwen3": {"attention.key_length": "head_dim"},
                    "gemma3": {"attention.key_length": "head_dim", "attention.sliding_window": "sliding_window"}}
GEMMA3_27B_LAYERS = 62  # llama.cpp scales Gemma 3 27B's queries by (hidden / heads) ** -0.5, the others' by head_dim's


def gguf_name(name: str, arch: str = "llama") -> str:
    """llama.cpp's name of a transformers tensor (model.layers.3.self_attn.q_proj.weight -> blk.3.attn_q.weight) in a
    GGUF of that architecture."""
    if name in GGUF_NAMES:
        return GGUF_NAMES[name]
    _, _, i, rest = name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    names = {**GGUF_LAYER_NAMES, **GEMMA3_LAYER_NAMES} if arch == "gemma3" else GGUF_LAYER_NAMES
    return f"blk.{i}.{names[module]}.{kind}"


def _field_value(field):
    """A GGUF metadata value: str, int, float or bool; an array as its list (strings decoded)."""
    from gguf import GGUFValueType

    def one(part, kind):
        return bytes(part).decode("utf-8", "replace") if kind == GGUFValueType.STRING else part.tolist()[0]

    if not field.types or not field.data:
        return None
    if field.types[0] == GGUFValueType.ARRAY:
        return [one(field.parts[j], field.types[-1]) for j in field.data]
    return one(field.parts[field.data[0]], field.types[0])


def read_gguf(path: Path):
    """A gguf.GGUFReader of the file (headers and memory-mapped data, nothing loaded); a truncated or corrupt
    file (one the reader cannot parse, or shorter than its last tensor's end) is refused naming the file."""
    from gguf import GGUFReader

    if not path.is_file():
        raise ValueError(f"no such GGUF file: {path}")
    size = path.stat().st_size
    try:
        reader = GGUFReader(str(path))
    except (ValueError, KeyError, IndexError, TypeError, OverflowError, OSError, EOFError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{path}: truncated or corrupt GGUF file ({size} bytes): {reason}") from None
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if size < end:
        raise ValueError(f"{path}: truncated GGUF file: {size} bytes on disk, its last tensor ends at byte {end}")
    return reader


def inspect_gguf(source) -> dict:
    """Check a GGUF file without loading its weights; returns the config transformers will build (dict).

    The architecture must be supported, the metadata's sizes (GGUF_KEYS; vocab_size or tokenizer.ggml.tokens) positive
    ints, every tensor there with the shape they imply (expected_shapes; GGUF lists dimensions innermost first, output
    missing when the embedding is tied), no block beyond block_count. Else a ValueError naming file and first problem.
    """
    path = Path(str(source))
    reader = read_gguf(path)
    fields = reader.fields
    if "general.architecture" not in fields:
        raise ValueError(f"{path}: no general.architecture in the GGUF metadata")
    arch = _field_value(fields["general.architecture"])
    cfg = {"model_type": GGUF_MODEL_TYPES.get(arch, arch)}
    check_supported(cfg, str(path))
    llama_like = arch in ("llama", "mistral")
    keys = {**GGUF_KEYS, **({"rope.dimension_count": "head_dim"} if llama_like else {}),
            **GGUF_FAMILY_KEYS.get(arch, {})}
    scaling = f"{arch}.rope.scaling.factor"
    if arch in GGUF_FAMILY_KEYS and scaling in fields and _field_value(fields[scaling]) not in (None, 1.0):
        raise ValueError(f"{path}: not supported yet: {scaling} = {_field_value(fields[scaling])} (a RoPE scaling "
                         f"transformers' GGUF reader does not carry for {arch}; its transformers folder loads)")
    names = {hf: f"{arch}.{key}" for key, hf in keys.items()}
    for key, hf in keys.items():
        if f"{arch}.{key}" in fields:
            cfg[hf] = _field_value(fields[f"{arch}.{key}"])
    if "vocab_size" not in cfg:  # transformers falls back to the tokenizer's vocabulary
        names["vocab_size"] = f"{arch}.vocab_size (or tokenizer.ggml.tokens)"
        if "tokenizer.ggml.tokens" in fields:
            cfg["vocab_size"] = len(fields["tokenizer.ggml.tokens"].data)
    check_sizes(cfg, str(path), names)

    tensors = {t.name: tuple(int(n) for n in reversed(list(t.shape))) for t in reader.tensors}  # PyTorch order
    cfg["tie_word_embeddings"] = "output.weight" not in tensors  # as transformers decides
    L = cfg["num_hidden_layers"]
    if arch == "gemma3":  # as llama.cpp scales the queries (transformers' default, 256, is the head size of most)
        d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        cfg["query_pre_attn_scalar"] = cfg["hidden_size"] // cfg["num_attention_heads"] \
            if cfg["num_hidden_layers"] == GEMMA3_27B_LAYERS else d
    expected = {gguf_name(k, arch): v for k, v in expected_shapes(cfg).items()}
    for name, shape in expected.items():
        if name not in tensors:
            raise ValueError(f"{path}: the GGUF file lacks the tensor {name} ({arch}.block_count is {L})")
        if tensors[name] != shape:
            raise ValueError(f"{path}: {name} has shape {list(tensors[name])} (PyTorch order), the GGUF metadata "
                             f"implies {list(shape)}")
    found = _layers_beyond(tensors, r"blk\.(\d+)\.", L)
    if found is not None:
        raise ValueError(f"{path}: the GGUF file holds tensors of {found} blocks (blk.{found - 1}), "
                         f"{arch}.block_count is {L}: blocks would be dropped")
    stray = [n for n in tensors if n.startswith("blk.") and n not in expected]
    if stray:
        raise ValueError(f"{path}: {stray[0]} has no place in transformers' {arch} model (it would be dropped)")
    return cfg


def check_finite(model, where: str, rename=None) -> None:
    """Refuse a model whose parameters hold NaN or inf, naming the first such tensor and the counts.

    One torch.aminmax per parameter (NaN reaches both ends, inf one; nothing the size of the tensor is allocated), on
    one intra-op thread, restored after. rename: how to show a parameter's name (a GGUF's tensor name beside
    transformers').
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a memory-bound pass gains nothing from threads that wait at each op's barrier
    try:
        bad = next((name for name, p in model.named_parameters() if p.is_floating_point() and p.numel()
                    and not p.is_meta and not all(math.isfinite(float(x)) for x in torch.aminmax(p.detach()))), None)
    finally:
        torch.set_num_threads(threads)
    if bad is None:
        return
    p = model.get_parameter(bad)
    nan, inf = int(torch.isnan(p).sum()), int(torch.isinf(p).sum())
    shown = rename(bad) if rename else bad
    raise ValueError(f"{where}: the weight {shown} holds {nan} NaN and {inf} inf values (of {p.numel()}): "
                     "the model cannot compute")


def _with_gguf_name(name: str) -> str:
    try:
        return f"{name} ({gguf_name(name)})"
    except (KeyError, ValueError):
        return name


GGUF_OVERRIDES = ("head_dim", "query_pre_attn_scalar", "sliding_window")


def load_checkpoint(source, dtype=None):  # dtype None: the checkpoint's own (config.json's torch_dtype; GGUF float32)
    """(model, tokenizer or None) for a transformers folder or a GGUF file, checked first (inspect_checkpoint,
    inspect_gguf), loaded offline, then its weights checked finite (check_finite).

    The tokenizer is None when the source has no tokenizer files (tokenizer.json, tokenizer_config.json, ...; a GGUF's
    tokenizer.ggml metadata): conversions without calibration need none.
    """
    import torch

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = Path(str(source))
    if p.suffix == ".gguf" and not p.is_dir():
        from .dequantized import load_gguf

        cfg = inspect_gguf(p)
        # what transformers' GGUF reader leaves at its defaults, from the metadata (inspect_gguf)
        model, tok = load_gguf(p, dtype or torch.float32, {k: cfg[k] for k in GGUF_OVERRIDES if k in cfg})
        check_finite(model, str(p), _with_gguf_name)
    else:
        inspect_checkpoint(p)
        model = AutoModelForCausalLM.from_pretrained(str(p), dtype=dtype or "auto").eval()
        check_finite(model, str(p))
        try:
            tok = AutoTokenizer.from_pretrained(str(p))
        except (OSError, ValueError, TypeError):
            tok = None  # no tokenizer files: token ids only
    model.attnlab_source = str(p.resolve())
    return model, tok
