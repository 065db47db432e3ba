"""Write a converted Llama-family model as a standard DeepSeek-V3 checkpoint, which transformers loads alone.

`export_deepseek` writes config.json (model_type deepseek_v3, every layer dense), safetensors shards with an index and
the source's tokenizer files. Only the decoupled-RoPE layout maps to DeepSeek (check_exportable); an MLA without a
latent norm is exported exactly through one constant latent channel (constant_channel).
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch

from ...modules.mla import MultiHeadLatentAttention
from ..adapters import _layers, attnlab_modules, family

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json")
SHARD_BYTES = 2 * 1024 ** 3
NEEDS_LATENT = ("--format deepseek needs --latent-dim: the exact conversion's rope_after_up layout rotates keys "
                "after the up-projection, which DeepSeek cannot express (decoupled RoPE only)")


# -- checks ---------------------------------------------------------------------------------------------
NO_KEY_NORM = ("layer {i} normalises every query and key head (per-head q/k norms, qk_norm_eps={eps}: Qwen3, "
               "Gemma 3), and DeepSeek-V3's MLA (llama.cpp's deepseek2 too) has no per-head key norm: keep attnlab's "
               "format")


def check_exportable(modules) -> None:
    """Refuse, naming the layer and the reason, what DeepSeek's layout cannot hold."""
    first = modules[0]
    for i, m in enumerate(modules):
        if getattr(m, "k_head_norm", None) is not None:
            raise ValueError(NO_KEY_NORM.format(i=i, eps=m.k_head_norm.eps))
        if not isinstance(m, MultiHeadLatentAttention):
            raise ValueError(f"layer {i} is {type(m).__name__}, not an MLA: convert with --to mla first")
        if m.rope_after_up:
            raise ValueError(f"layer {i} has the exact rope_after_up layout (keys rotated after the up-projection), "
                             "which DeepSeek cannot express; convert with --latent-dim (decoupled RoPE)")
        if not m.rope_dim:
            raise ValueError(f"layer {i} has no decoupled rope key (rope_dim 0); DeepSeek needs qk_rope_head_dim > 0")
        q = m.W_Q if m.W_Q is not None else m.W_UQ
        if q.bias is not None and bool(q.bias.detach().any()):
            raise ValueError(f"layer {i} has a query bias (Qwen2's q_proj bias): DeepSeek's q_proj has none, and "
                             "the bias's product with each key varies from key to key, so it cannot be folded")
        if m.W_UV.bias is not None and bool(m.W_UV.bias.detach().any()) or \
                m.W_DKV.bias is not None and bool(m.W_DKV.bias.detach().any()):
            raise ValueError(f"layer {i} has latent or value biases; this export does not fold them")
        shape, first_shape = _shape(m), _shape(first)  # the cache's storage may differ (config.json names each)
        if shape != first_shape:
            raise ValueError(f"layer {i}'s shape differs from layer 0's ({shape} vs {first_shape}); "
                             "a DeepSeek config holds one shape for all layers")
        if not torch.equal(m.rope.inv_freq, first.rope.inv_freq) or m.rope.scaling != first.rope.scaling:
            raise ValueError(f"layer {i} keeps other rotary frequencies than layer 0 (chosen layer by layer: "
                             "--rope-select norm, or rorope-score with shared_planes=False); DeepSeek has one rotary "
                             "embedding for all layers: convert with --rope-select frequency, rorope or rorope-score "
                             "(whole models: one allocation for all layers)")


def _shape(m: MultiHeadLatentAttention) -> dict:
    """m's config() without its cache storage: what a DeepSeek config must hold alike in every layer."""
    return {k: v for k, v in m.config().items() if k != "kv_dtype"}


# -- one layer ----------------------------------------------------------------------------------------
# Mapping of one layer (attnlab -> DeepSeek):
#     W_Q * (attnlab scale / DeepSeek scale)  -> q_proj        (the scale difference, exact)
#     [W_DKV; W_KR]                           -> kv_a_proj_with_mqa
#     kv_norm, or the constant channel        -> kv_a_layernorm
#     per head [W_UK_h; W_UV_h]               -> kv_b_proj
#     W_O                                     -> o_proj
# DeepSeek's softmax scale is 1/sqrt(qk_nope + qk_rope); attnlab's conversions keep the original 1/sqrt(head_dim), so
# the ratio multiplies q_proj. A model given a latent norm first (latent_norm.py, as llama.cpp needs it) is exported
# as it is.
def deepseek_scale(m: MultiHeadLatentAttention) -> float:
    return (m.head_dim + m.rope_dim) ** -0.5


def deepseek_attention_tensors(m: MultiHeadLatentAttention, prefix: str) -> dict[str, torch.Tensor]:
    """DeepseekV3Attention's tensors for one attnlab MLA (names under `prefix`, source dtype kept).

    An MLA without a latent norm gets the constant channel (see constant_channel): latent r + 1.
    """
    H, d, dv, r = m.num_heads, m.head_dim, m.v_head_dim, m.latent_dim
    ratio = m.scale / deepseek_scale(m)
    w = lambda lin: lin.weight.detach()  # noqa: E731
    scaled = lambda lin: (w(lin).to(torch.float64) * ratio).to(w(lin).dtype)  # noqa: E731
    out = {}
    if m.W_Q is not None:
        out["q_proj.weight"] = scaled(m.W_Q)
    else:
        out["q_a_proj.weight"] = w(m.W_DQ)
        out["q_a_layernorm.weight"] = m.q_norm.weight.detach()
        out["q_b_proj.weight"] = scaled(m.W_UQ)
    kv_b = torch.cat([w(m.W_UK).reshape(H, d, r), w(m.W_UV).reshape(H, dv, r)], 1)  # (H, d + dv, r)
    dt = m.W_DKV.weight.dtype
    kv_a_bias = torch.zeros(r + m.rope_dim, dtype=dt)
    if m.kv_norm is not None:
        out["kv_a_proj_with_mqa.weight"] = torch.cat([w(m.W_DKV), w(m.W_KR)])  # (r + p, D)
        out["kv_a_layernorm.weight"] = m.kv_norm.weight.detach()
    else:  # the constant channel: rms(latent) ~ K / sqrt(r + 1) for every token, so the norm is a fixed scale
        K, weight, fold = constant_channel(m)
        zero = torch.zeros(1, m.dim if m.context_dim is None else m.context_dim, dtype=dt)
        out["kv_a_proj_with_mqa.weight"] = torch.cat([w(m.W_DKV), zero, w(m.W_KR)])  # (r + 1 + p, D)
        kv_a_bias = torch.cat([kv_a_bias[:r], torch.tensor([K], dtype=dt), kv_a_bias[r:]])
        out["kv_a_layernorm.weight"] = torch.full((r + 1,), weight, dtype=dt)
        kv_b = torch.cat([(kv_b.to(torch.float64) * fold).to(dt), torch.zeros(H, d + dv, 1, dtype=dt)], -1)
        r = r + 1
    out["kv_b_proj.weight"] = kv_b.reshape(H * (d + dv), r)
    out["o_proj.weight"] = w(m.W_O)
    if m.W_O.bias is not None or m.kv_norm is None:  # attention_bias: o_proj, kv_a_proj (and q_a_proj) biases
        out["o_proj.bias"] = m.W_O.bias.detach() if m.W_O.bias is not None else torch.zeros(m.dim, dtype=dt)
        out["kv_a_proj_with_mqa.bias"] = kv_a_bias
        if m.W_Q is None:
            out["q_a_proj.bias"] = torch.zeros(m.q_latent_dim, dtype=dt)
    return {prefix + k: v.contiguous() for k, v in out.items()}


def constant_channel(m: MultiHeadLatentAttention, margin: float = 2.0 ** 12):
    """(K, norm weight, fold) for exporting an MLA without a latent norm through DeepSeek's kv_a_layernorm.

    One extra latent channel holds the constant K (a kv_a_proj_with_mqa bias; its kv_b_proj column is zero), so large
    that the norm multiplies every token's latent by the same sqrt(r + 1) / K: a linear map. The norm weight is the
    power of two nearest K / sqrt(r + 1); `fold`, the rest of the undo, multiplies kv_b_proj. One cached number a token.
    """
    # K is `margin` (2^12) times a bound on |c| for inputs of rms 1 per entry scaled by the largest W_DKV row norm times
    # sqrt(dim), so mean(latent^2) = (|c|^2 + K^2) / (r + 1) is K^2 / (r + 1) to within |c|^2 / K^2 (float32 cannot
    # tell the difference). A power-of-two norm weight is exact in bfloat16 too.
    w = m.W_DKV.weight.detach().to(torch.float64)
    bound = float(w.norm(dim=1).max() * math.sqrt(m.context_dim)) * 16  # post-norm inputs of a few x rms 1
    K = 2.0 ** math.ceil(math.log2(max(bound, 1.0) * margin))
    exact = K / math.sqrt(m.latent_dim + 1)
    weight = 2.0 ** round(math.log2(exact))
    return K, weight, exact / weight


# DeepSeek derives the rotary frequencies from rope_theta and qk_rope_head_dim, while a conversion keeps each original
# pair's own frequency: they are carried exactly by a "longrope" rope type whose short_factor = long_factor = default /
# kept (one factor per pair), with factor 1, attention_factor = the source's rotary scaling, and
# original_max_position_embeddings == max_position_embeddings (so the long set is never switched to and no extra scale
# applies).
def rope_parameters(m: MultiHeadLatentAttention, max_position_embeddings: int) -> dict:
    """DeepSeek rope parameters that reproduce the MLA's kept per-pair frequencies exactly."""
    p, base = m.rope_dim, m.rope.base
    default = base ** (-torch.arange(0, p, 2, dtype=torch.float64) / p)  # (p/2,)
    kept = m.rope.inv_freq.to(torch.float64)
    if torch.allclose(kept, default, rtol=1e-12, atol=0) and m.rope.scaling == 1.0:
        return {"rope_type": "default", "rope_theta": base}
    factors = (default / kept).tolist()
    return {"rope_type": "longrope", "rope_theta": base, "short_factor": factors, "long_factor": factors,
            "factor": 1.0, "attention_factor": m.rope.scaling,
            "original_max_position_embeddings": max_position_embeddings}


def deepseek_config(src: dict, m: MultiHeadLatentAttention, *, dtype: str) -> dict:
    """config.json of the exported model, from the source's (dict) and one layer's MLA."""
    # every layer dense (first_k_dense_replace = num_hidden_layers); no query low-rank unless the MLA has one
    L = src["num_hidden_layers"]
    max_pos = int(src.get("max_position_embeddings") or 4096)
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": src["vocab_size"], "hidden_size": src["hidden_size"],
        "intermediate_size": src["intermediate_size"], "moe_intermediate_size": src["intermediate_size"],
        "num_hidden_layers": L, "first_k_dense_replace": L, "n_routed_experts": 1, "n_shared_experts": 1,
        "num_experts_per_tok": 1, "n_group": 1, "topk_group": 1, "num_mtp_layers": 0,
        "num_attention_heads": m.num_heads, "num_key_value_heads": m.num_heads,
        "kv_lora_rank": m.latent_dim + (m.kv_norm is None), "q_lora_rank": m.q_latent_dim, "qk_rope_head_dim": m.rope_dim,
        "qk_nope_head_dim": m.head_dim, "v_head_dim": m.v_head_dim,
        "hidden_act": src.get("hidden_act", "silu"), "max_position_embeddings": max_pos,
        "rms_norm_eps": src.get("rms_norm_eps", 1e-6), "tie_word_embeddings": bool(src.get("tie_word_embeddings")),
        "rope_parameters": rope_parameters(m, max_pos), "rope_interleave": bool(m.rope.interleaved),
        "attention_bias": m.W_O.bias is not None or m.kv_norm is None, "attention_dropout": 0.0,
        "bos_token_id": src.get("bos_token_id"), "eos_token_id": src.get("eos_token_id"),
        "pad_token_id": src.get("pad_token_id"), "dtype": dtype, "use_cache": True,
    }


def attnlab_entry(modules: list[MultiHeadLatentAttention], constants: list[float]) -> dict:
    """config.json's "attnlab" entry, which attnlab.hf.KVCache reads: the latent channels a cache keeps (not the
    constant one, which kv_b_proj ignores), each layer's constant K where it has one (its cache codes latent * K /
    constant channel: the MLA's own latent) and the storage the caches were planned in (a list, one a layer, where
    the layers' differ)."""
    entry = {"written_by": "attnlab", "latent_channels": modules[0].latent_dim}
    if constants:
        entry["latent_constants"] = constants
    storages = [m.kv_dtype for m in modules]
    if all(k is None for k in storages):
        return entry
    return {**entry, "kv_dtype": storages[0] if len(set(storages)) == 1 else storages}


def layer_constant(m: MultiHeadLatentAttention) -> list[float]:
    """[K] of a layer exported with the constant channel (constant_channel), [] for one with a latent norm."""
    return [] if m.kv_norm is not None else [constant_channel(m)[0]]


def check_source_config(src: dict) -> None:
    if src.get("mlp_bias"):
        raise ValueError("the source MLP has biases (mlp_bias); DeepSeek's dense MLP has none")


def export_preflight(model, target: Path, force: bool, what: str, ours=None) -> list:
    """What every export checks before writing: the target (io.folders.check_output: never the model's own
    sources, an existing one only with force and only if attnlab wrote it: ours(path) for a file), the
    family, the layers (check_exportable)."""
    from ...io.folders import check_output
    from ..store import sources_of

    check_output(target, force=force, sources=sources_of(model), ours=ours)
    if family(model) != "llama":
        raise ValueError(f"{what} takes a Llama-family causal LM (Llama, Mistral, Qwen2)")
    modules = attnlab_modules(model)
    check_exportable(modules)
    check_source_config(model.config.to_dict())
    return modules


# -- writing ------------------------------------------------------------------------------------------
class ShardWriter:
    """Write tensors into safetensors shards of at most max_bytes as they come, then an index."""

    def __init__(self, folder: Path, max_bytes: int = SHARD_BYTES):
        self.folder, self.max_bytes = Path(folder), max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.size, self.files, self.weight_map, self.total = 0, [], {}, 0

    def add(self, name: str, t: torch.Tensor) -> None:
        n = t.numel() * t.element_size()
        if self.pending and self.size + n > self.max_bytes:
            self.flush()
        self.pending[name] = t.detach().contiguous().cpu()
        self.size += n
        self.total += n

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        name = f"part-{len(self.files):05d}.safetensors"
        save_file(self.pending, str(self.folder / name), metadata={"format": "pt"})
        self.files.append(name)
        self.weight_map.update({k: name for k in self.pending})
        self.pending, self.size = {}, 0

    def close(self) -> None:
        """Name the shards model(-0000i-of-0000n).safetensors and write the index when there are several."""
        self.flush()
        n = len(self.files)
        final = {f: ("model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors")
                 for i, f in enumerate(self.files)}
        for old, new in final.items():
            (self.folder / old).rename(self.folder / new)
        if n > 1:
            index = {"metadata": {"total_size": self.total},
                     "weight_map": {k: final[v] for k, v in sorted(self.weight_map.items())}}
            (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def copy_tokenizer(source, folder: Path) -> None:
    """Copy the tokenizer (and generation config) files that sit beside the source checkpoint."""
    if source is None:
        return
    src = Path(source)
    src = src.parent if src.is_file() else src
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, folder / name)


def export_deepseek(model, folder, tokenizer=None, *, force: bool = False,
                    shard_bytes: int = SHARD_BYTES) -> Path:
    """Write an attnlab'd, converted Llama-family model as a DeepSeek-V3 checkpoint folder (atomically).

    Every layer must be a decoupled-RoPE MLA (check_exportable); one without a latent norm gets the constant channel.
    tokenizer: saved with save_pretrained; without it, tokenizer files beside the source
    checkpoint (model.attnlab_source, set by load_checkpoint) are copied.
    """
    from ...io.folders import write_folder

    folder = Path(folder)
    modules = export_preflight(model, folder, force, "export_deepseek")
    src = model.config.to_dict()
    src["tie_word_embeddings"] = bool(getattr(model.config, "tie_word_embeddings", False))
    dtype = str(modules[0]._anchor.dtype).removeprefix("torch.")
    constants = [k for m in modules for k in layer_constant(m)]
    config = {**deepseek_config(src, modules[0], dtype=dtype), "attnlab": attnlab_entry(modules, constants)}
    base = model.model

    def write(tmp: Path) -> None:
        shards = ShardWriter(tmp, shard_bytes)
        shards.add("model.embed_tokens.weight", base.embed_tokens.weight)
        for i, (layer, m) in enumerate(zip(_layers(model), modules)):
            prefix = f"model.layers.{i}."
            for k, v in deepseek_attention_tensors(m, prefix + "self_attn.").items():
                shards.add(k, v)
            for name in ("input_layernorm", "post_attention_layernorm"):
                shards.add(f"{prefix}{name}.weight", getattr(layer, name).weight)
            for name in ("gate_proj", "up_proj", "down_proj"):
                shards.add(f"{prefix}mlp.{name}.weight", getattr(layer.mlp, name).weight)
        shards.add("model.norm.weight", base.norm.weight)
        if not config["tie_word_embeddings"]:
            shards.add("lm_head.weight", model.lm_head.weight)
        shards.close()
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        else:
            copy_tokenizer(getattr(model, "attnlab_source", None), tmp)
    from ..store import sources_of

    return write_folder(folder, write, force=force, sources=sources_of(model), info={"what": "DeepSeek-V3 export"})


def check_deepseek_request(model, to: str, latent_dim: int | None) -> None:
    """Before converting: refuse what cannot end as a DeepSeek checkpoint, with the reason."""
    if to != "mla":
        raise ValueError(f"--format deepseek writes an MLA: use --to mla, not {to!r}")
    if family(model) != "llama":
        raise ValueError("--format deepseek takes a Llama-family causal LM (Llama, Mistral, Qwen2)")
    if latent_dim is None:
        raise ValueError(NEEDS_LATENT)
    for i, m in enumerate(attnlab_modules(model)):
        if getattr(m, "k_head_norm", None) is not None:
            raise ValueError(NO_KEY_NORM.format(i=i, eps=m.k_head_norm.eps))
        q = getattr(m, "W_Q", None)
        if q is not None and q.bias is not None and bool(q.bias.detach().any()):
            raise ValueError(f"layer {i} has a query bias (Qwen2's q_proj bias): DeepSeek's q_proj has none, and "
                             "the bias's product with each key varies from key to key, so it cannot be folded")
