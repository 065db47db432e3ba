"""Whole transformers models with attnlab attention (extra [hf]).

Swap a model's attention for attnlab modules and back (`to_attnlab`), convert every layer (`convert_model`), evaluate
(`perplexity`, `kv_bytes_per_token`), save and reload (`save_model`, `load_model`), load the user's own checkpoint
(`load_checkpoint`) and export the result (export/). What each submodule holds: the comment above its import.
"""
# adapters.py: swap a model's attention for attnlab modules and back
from .adapters import (FAMILIES, BertAttentionAdapter, LlamaAttentionAdapter, TransformersCache, attnlab_modules,
                       family, from_attnlab, replace_attention, to_attnlab)
# bundled.py: the real models that pip packages carry (SmolLM2, MiniLM, Gemma 3 270M)
from .bundled import MODELS, load_gemma3_270m, load_minilm, load_smollm2
# convert.py: convert every layer of a swapped model, calibrated
from .convert import DEFAULT_ROPE_PAIRS, check_convertible, convert_layers, convert_model, keys_whole_rope_dim
# evaluate.py: perplexity, top-1 agreement, sentence embeddings, KV bytes per token
from .evaluate import (attention_inputs, kv_bytes_per_token, mean_pooled, perplexity, read_text_ids, sentence_embeddings,
                       kv_fixed_bytes, set_kv_dtype, sliding_context, top1_agreement, windows)
# export/: a DeepSeek-V3 checkpoint, a deepseek2 GGUF, and the source's own architecture as a GGUF or a
# transformers folder (export/__init__.py)
from .export.deepseek import check_deepseek_request, export_deepseek
from .export.latent_norm import add_latent_norm, add_latent_norms
from .export.deepseek_gguf import check_gguf_exportable, export_gguf, is_attnlab_gguf
from .export.native_gguf import check_native, export_native
from .export.native_transformers import export_transformers
# load.py: the user's own checkpoint: a transformers folder or a GGUF file (Llama, Mistral, Qwen2)
from .load import inspect_checkpoint, is_checkpoint, load_checkpoint
# store.py: save and reload converted models
from .store import LOADERS, MODEL_FORMAT, load_model, save_model, source_paths, sources_of
# stream.py: convert a checkpoint folder layer by layer, in bounded memory
from .stream import convert_checkpoint

__all__ = ["check_convertible", "keys_whole_rope_dim", "FAMILIES", "BertAttentionAdapter", "LlamaAttentionAdapter", "TransformersCache", "attnlab_modules",
           "family", "from_attnlab", "replace_attention", "to_attnlab", "MODELS", "load_gemma3_270m", "load_minilm", "load_smollm2",
           "DEFAULT_ROPE_PAIRS", "convert_layers", "convert_model", "attention_inputs", "kv_bytes_per_token",
           "perplexity", "read_text_ids", "sentence_embeddings", "set_kv_dtype", "sliding_context", "mean_pooled", "top1_agreement", "windows",
           "LOADERS", "MODEL_FORMAT", "load_model", "source_paths", "sources_of",
           "save_model", "add_latent_norm", "add_latent_norms", "check_deepseek_request", "export_deepseek",
           "check_gguf_exportable", "export_gguf", "is_attnlab_gguf", "kv_fixed_bytes", "check_native", "export_native", "export_transformers",
           "inspect_checkpoint", "is_checkpoint", "load_checkpoint", "convert_checkpoint"]
