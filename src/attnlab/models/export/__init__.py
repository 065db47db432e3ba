"""The exporters: a converted model written for an engine that runs it without attnlab.

- deepseek.py             a standard DeepSeek-V3 checkpoint (transformers loads it alone)
- deepseek_gguf.py        a GGUF file llama.cpp runs as deepseek2 (MLA)
- native_gguf.py          a model that kept its attention's shape, as its source GGUF's own architecture
- native_transformers.py  the same for transformers: the source's own class, planned for attnlab.hf.KVCache
- latent_norm.py          the latent norm DeepSeek and llama.cpp apply, fitted on calibration text
"""
