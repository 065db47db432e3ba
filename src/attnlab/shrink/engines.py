"""Where each shrink output runs: the engine, the flags or cache it was healed for, and what computed the report's
perplexity (docs/engines.md). The report's `runs_in`, `llama_cpp` and `transformers_cache` entries come from here.
"""
from __future__ import annotations

from .sizes import llama_cpp_types


def llama_cpp_cache(storage: str, native: bool = False) -> dict:
    """How to run a GGUF shrink in llama.cpp with the cache it was planned and healed for; native: the file is in the
    source's own architecture (the original attention, healed), else deepseek2 (MLA)."""
    k, v = llama_cpp_types(storage)
    plain = k == v == "f16"
    flags = "" if plain else f" --cache-type-k {k} --cache-type-v {v} --flash-attn on"
    what = "the original's architecture, its attention healed" if native else "deepseek2 (MLA)"
    kind = k if k == v else f"{k} K and {v} V"
    types = f"type_k/type_v {k}" if k == v else f"type_k {k}, type_v {v}"
    return {"cache_type_k": k, "cache_type_v": v, "flash_attn": not plain,
            "architecture": "source" if native else "deepseek2",
            "flags": flags.strip(),
            "note": f"{what}, planned and healed for llama.cpp's {kind} KV cache: run it with"
                    f"{flags or ' the default cache'} (llama-cpp-python: {types}"
                    f"{', flash_attn=True' if flags else ''})"}


def transformers_cache(storage: str | list | None, native: bool = True, whole: bool = False) -> dict:
    """How to run a --format transformers folder with the attnlab.hf.KVCache storage it was planned and healed for (a
    list: one a layer); native: the source's own class; whole: the source's class holding keys-whole MLAs (values
    cached as their latent); else an MLA as DeepseekV3ForCausalLM."""
    from .layer_bits import bits_label

    what = "" if native else "the source's class, its values held as the latent of rank r, " if whole else \
        "DeepseekV3ForCausalLM, an MLA whose latent "
    return {"kv_dtype": storage, "architecture": "source" if native or whole else "deepseek_v3",
            "note": "model = AutoModelForCausalLM.from_pretrained(OUT); model.generate(..., "
                    f"cache=attnlab.hf.KVCache.from_pretrained(OUT, model)) ({what}cache in {bits_label(storage)})"}


def runs_in(fmt: str, chosen: dict, whole: bool = False) -> dict:
    """Where an output of this format runs, how, and what the report's perplexity was computed by."""
    if fmt == "attnlab":
        return {"engine": "attnlab", "how": "attnlab eval / attnlab generate OUT, or attnlab.models.load_model(OUT) "
                "(attnlab's own loop; not llama.cpp or transformers' caches)",
                "scored_by": "attnlab, through the planned cache storage"}
    if fmt == "deepseek":
        return {"engine": "transformers", "how": "AutoModelForCausalLM.from_pretrained(OUT) (DeepseekV3ForCausalLM, "
                "no attnlab import; vLLM loads the same folder)",
                "scored_by": "attnlab's MLA with a 16-bit cache (the same weights; tests/test_export.py compares them)"}
    if fmt == "transformers":
        cache = transformers_cache(chosen.get("kv_dtypes") or chosen.get("kv_dtype"), chosen.get("layers") == [],
                                   whole)
        return {"engine": "transformers", "how": cache["note"],
                "scored_by": "attnlab's own loop through the same storage, which transformers' forward over "
                             "attnlab.hf.KVCache computes to float64's rounding (tests/test_hf_cache.py); attnlab eval "
                             "OUT --engine transformers scores the folder in transformers itself"}
    cache = llama_cpp_cache(chosen.get("kv_dtype") or "bf16", chosen.get("layers") == [])
    k, v = cache["cache_type_k"], cache["cache_type_v"]
    kind, flags = k if k == v else f"{k} K / {v} V", " " + cache["flags"] if cache["flags"] else ""
    arch = "its source's architecture" if cache["architecture"] == "source" else "deepseek2"
    return {"engine": "llama.cpp", "how": f"llama-cli -m OUT{flags} ({arch})",
            "scored_by": f"attnlab's copy of llama.cpp's {kind} cache (rotation and block codes, checked against "
                         "llama.cpp: tests/test_llama_cpp_cache.py); benchmarks/engines/engines.py scores the file in "
                         "llama.cpp itself"}
