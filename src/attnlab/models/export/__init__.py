"""The exporters: a converted model written for an engine that runs it without attnlab.

deepseek.py: a standard DeepSeek-V3 checkpoint transformers loads alone; deepseek_gguf.py: a GGUF llama.cpp runs as
deepseek2 (MLA); native_gguf.py, native_transformers.py: a model that kept its attention's shape, as its source's own
architecture (the folder planned for attnlab.hf.KVCache); latent_norm.py: DeepSeek's latent norm, fitted on text.
"""
