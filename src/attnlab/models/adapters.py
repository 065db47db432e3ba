"""Swap the attention of a transformers model for attnlab modules (`to_attnlab`) and back (`from_attnlab`).

Families (FAMILIES): Llama (GQA, blocked grouping, rotate-half RoPE; also Mistral, Qwen2, Qwen3 and Gemma 3 with their
per-head q/k RMSNorm: LLAMA_LIKE) and BERT (BertModel: MHA with biases). Each attention layer becomes an adapter
around an attnlab module; in transformers' generate() it stores what that module would cache in the DynamicCache.
"""
from __future__ import annotations

import torch
from torch import nn

from ..modules.cache import _Cache
from ..modules.gqa import GroupedQueryAttention, MultiHeadAttention
from ..modules.heads import gqa_block
from ..modules.mla import MultiHeadLatentAttention
from ..modules.rope import RotaryEmbedding

# During generate() the adapter stores K and V for G heads in transformers' DynamicCache; for an MLA the latent and the
# shared rotary key, and nothing else.
FAMILIES = ("llama", "bert")
LLAMA_LIKE = ("LlamaConfig", "MistralConfig", "Qwen2Config", "Qwen3Config", "Gemma3TextConfig")  # GQA, rotate-half
QK_NORM = ("Qwen3Config", "Gemma3TextConfig")  # each query and key head RMS-normalised before RoPE (q_norm, k_norm)
# Gemma's RMSNorm scales by (1 + weight): attnlab's nn.RMSNorm holds 1 + weight
NORM_OFFSET = {"Gemma3TextConfig": 1.0}


def family(model) -> str:
    """"llama" for Llama, Mistral, Qwen2, Qwen3 and Gemma 3 (text) models (one attention layout), "bert" for BERT."""
    name = type(getattr(model, "config", None)).__name__
    if name in LLAMA_LIKE:
        from .load import check_supported
        check_supported(model.config.to_dict(), f"{name}")  # sliding windows, ...
        return "llama"
    if name == "BertConfig":
        return "bert"
    raise ValueError(f"not supported: model family {name.removesuffix('Config') or type(model).__name__!r}; "
                     f"supported: Llama, Mistral, Qwen2, Qwen3, Gemma 3 (text), BERT")


def _layers(model):
    base = getattr(model, "model", None) or getattr(model, "bert", None) or model
    if family(model) == "llama":
        return list(base.layers)
    return list(base.encoder.layer)


def decoder_layers(model) -> list[nn.Module]:
    """The model's transformer layers (a causal LM's decoder layers, BERT's encoder layers), in order."""
    return _layers(model)


def cache_keyword(forward) -> str:
    """The keyword a transformers forward takes its Cache under: `cache` from transformers 5.24 on (the old
    `past_key_values` still works there, with a FutureWarning, until 5.40), `past_key_values` before."""
    import inspect

    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


# -- the cache adapter -----------------------------------------------------------------------------
class TransformersCache(_Cache):
    """Lets an attnlab module keep its cache inside a transformers Cache (one layer of it).

    K/V (B, G, S, d) go in as they are; an MLA's [latent, rope key] (B, S, r+p) goes in as a
    one-head key with an empty value, as transformers' own DeepSeek attention stores its latent.
    """

    def __init__(self, hf_cache, layer_idx: int):  # no buffers of its own
        self.hf_cache, self.layer_idx = hf_cache, layer_idx
        self.static = False

    @property
    def length(self) -> int:
        return self.hf_cache.get_seq_length(self.layer_idx)

    def check_owner(self, module, batch_size, dtype) -> None:
        return None

    def extend(self, **new):
        if set(new) == {"k", "v"}:
            return self.hf_cache.update(new["k"], new["v"], self.layer_idx)
        kv = new["kv"][:, None]  # (B, 1, S, r+p)
        keys, _ = self.hf_cache.update(kv, kv[..., :0], self.layer_idx)
        return (keys[:, 0],)


# -- adapters --------------------------------------------------------------------------------------
class LlamaAttentionAdapter(nn.Module):
    """Stands in for LlamaAttention: same call and return, computed by an attnlab module."""

    def __init__(self, attn: nn.Module, layer_idx: int):
        super().__init__()
        self.attn, self.layer_idx = attn, layer_idx

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None,
                position_ids=None, cache=None, **kwargs):
        hf_cache = cache if cache is not None else past_key_values  # transformers >= 5.24 names it `cache`
        cache = None if hf_cache is None else TransformersCache(hf_cache, self.layer_idx)
        L = hidden_states.shape[1]
        positions = position_ids[0] if position_ids is not None and position_ids.shape[0] == 1 else position_ids
        if positions is None:
            start = 0 if cache is None else cache.length
            positions = torch.arange(start, start + L, device=hidden_states.device)
        mask = attention_mask
        if mask is not None and mask.dtype != torch.bool:
            mask = mask.to(hidden_states.dtype)
        out = self.attn(hidden_states, cache=cache, positions=positions, mask=mask, is_causal=mask is None)
        return out, None


class BertAttentionAdapter(nn.Module):
    """Stands in for BertAttention (self-attention + output dense + residual LayerNorm)."""

    def __init__(self, attn: nn.Module, output: nn.Module):
        super().__init__()
        self.attn = attn
        self.dropout, self.LayerNorm = output.dropout, output.LayerNorm

    def forward(self, hidden_states, attention_mask=None, *args, **kwargs):
        mask = attention_mask
        if mask is not None:
            mask = mask if mask.dtype == torch.bool else mask.to(hidden_states.dtype)
            mask = mask.reshape(mask.shape[0], 1, -1, mask.shape[-1]) if mask.dim() == 4 else mask
        out = self.attn(hidden_states, mask=mask)
        return self.LayerNorm(self.dropout(out) + hidden_states), None


# -- the decoder layer around the attention ------------------------------------------------------------
def decoder_block(model):
    """How a decoder layer of this causal LM wraps its attention, for loops that drive the layers themselves
    (generation.Generator): a function (layer, x, attend) -> the layer's output, attend(h) being the attention of
    the normed input. Llama, Mistral, Qwen2/3: x + attn(norm(x)), then + mlp(norm(.)). Gemma 3 norms each
    branch's output too (post_attention_layernorm, pre/post_feedforward_layernorm), its final logits uncapped."""
    cfg = model.config
    if type(cfg).__name__ != "Gemma3TextConfig":
        return _llama_block
    if getattr(cfg, "final_logit_softcapping", None) is not None:
        raise ValueError(f"final_logit_softcapping {cfg.final_logit_softcapping} is not applied by attnlab's own "
                         "generation loop yet (Gemma 3 sets it to null); use transformers' generate()")
    return _gemma_block


def _llama_block(layer, x, attend):
    h = x + attend(layer.input_layernorm(x))  # (B, L, dim)
    return h + layer.mlp(layer.post_attention_layernorm(h))


def _gemma_block(layer, x, attend):
    h = x + layer.post_attention_layernorm(attend(layer.input_layernorm(x)))  # (B, L, dim)
    return h + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(h)))


# -- swapping --------------------------------------------------------------------------------------
def _copy_linear(dst: nn.Linear, src: nn.Linear) -> None:
    with torch.no_grad():
        dst.weight.copy_(src.weight)
        if dst.bias is not None:
            dst.bias.copy_(src.bias if src.bias is not None else torch.zeros_like(dst.bias))


def _llama_rope(model, layer_type: str | None = None) -> RotaryEmbedding:
    """The RoPE of a layer; Gemma 3's rotary module holds one set of frequencies per layer type."""
    base = getattr(model, "model", model)
    return rope_from_rotary(model.config, base.rotary_emb, layer_type)


def rope_from_rotary(cfg, rot, layer_type: str | None = None) -> RotaryEmbedding:
    """attnlab's RoPE with a transformers rotary module's frequencies (any rope scaling) and attention scaling;
    layer_type: for a module holding one set per layer type (Gemma 3: `<type>_inv_freq`, rope_parameters[type])."""
    params = getattr(cfg, "rope_parameters", None) or {"rope_theta": getattr(cfg, "rope_theta", 10000.0)}
    prefix = ""
    if layer_type is not None and hasattr(rot, f"{layer_type}_inv_freq"):
        params, prefix = params[layer_type], f"{layer_type}_"
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return RotaryEmbedding(head_dim, float(params.get("rope_theta", 10000.0)), inv_freq=getattr(rot, prefix + "inv_freq"),
                           scaling=float(getattr(rot, prefix + "attention_scaling", 1.0)))


def _attention_class(model):
    """The transformers attention class of a Llama-like model (LlamaAttention, ..., Gemma3Attention)."""
    import importlib

    name = type(model.config).__name__.removesuffix("Config").removesuffix("Text")  # Gemma3TextConfig: Gemma3Attention
    mod = importlib.import_module(f"transformers.models.{name.lower()}.modeling_{name.lower()}")
    return getattr(mod, f"{name}Attention")


def attnlab_modules(model) -> list[nn.Module]:
    """The attnlab module of every layer (after to_attnlab)."""
    fam = family(model)
    mods = []
    for layer in _layers(model):
        adapter = layer.self_attn if fam == "llama" else layer.attention
        if not isinstance(adapter, (LlamaAttentionAdapter, BertAttentionAdapter)):
            raise ValueError("the model's attention is not attnlab's yet; call to_attnlab(model) first")
        mods.append(adapter.attn)
    return mods


def to_attnlab(model):
    """Replace every attention layer by an adapter around an attnlab module with the same weights (in place)."""
    fam = family(model)
    cfg = model.config
    for i, layer in enumerate(_layers(model)):
        if fam == "llama":
            a = layer.self_attn
            if isinstance(a, LlamaAttentionAdapter):
                continue
            w = a.q_proj.weight
            layer_types = getattr(cfg, "layer_types", None)
            rope = _llama_rope(model, layer_types[i] if layer_types else None)
            qk_norm = type(cfg).__name__ in QK_NORM
            pre = getattr(cfg, "query_pre_attn_scalar", None)  # Gemma 3 scales scores by its inverse square root
            m = GroupedQueryAttention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                                      head_dim=a.head_dim, bias=a.q_proj.bias is not None, grouping="blocked",
                                      rope_base=rope.base, qk_norm_eps=cfg.rms_norm_eps if qk_norm else None,
                                      softmax_scale=None if pre is None else float(pre) ** -0.5,
                                      sliding_window=getattr(a, "sliding_window", None), device=w.device,
                                      dtype=w.dtype)
            m.rope = rope
            for dst, src in ((m.W_Q, a.q_proj), (m.W_K, a.k_proj), (m.W_V, a.v_proj), (m.W_O, a.o_proj)):
                _copy_linear(dst, src)
            if qk_norm:
                offset = NORM_OFFSET.get(type(cfg).__name__, 0.0)
                with torch.no_grad():
                    m.q_head_norm.weight.copy_(a.q_norm.weight + offset)
                    m.k_head_norm.weight.copy_(a.k_norm.weight + offset)
            layer.self_attn = LlamaAttentionAdapter(m, i)
        else:
            a = layer.attention
            if isinstance(a, BertAttentionAdapter):
                continue
            s = a.self
            w = s.query.weight
            m = MultiHeadAttention(cfg.hidden_size, cfg.num_attention_heads, bias=True, device=w.device,
                                   dtype=w.dtype)
            for dst, src in ((m.W_Q, s.query), (m.W_K, s.key), (m.W_V, s.value), (m.W_O, a.output.dense)):
                _copy_linear(dst, src)
            layer.attention = BertAttentionAdapter(m, a.output)
    return model


def check_own_attention(model, converted: str) -> None:
    """ValueError, one line, unless every attention layer is a GQA with the config's own query and KV heads (what the
    source's class and file hold); `converted` ends the line: where a converted model is written instead."""
    cfg = model.config
    for i, m in enumerate(attnlab_modules(model)):
        heads = (getattr(m, "num_heads", None), getattr(m, "num_kv_heads", None))
        if not isinstance(m, GroupedQueryAttention) or heads != (cfg.num_attention_heads, cfg.num_key_value_heads):
            raise ValueError(f"layer {i} is a {type(m).__name__} with {heads[0]} query and {heads[1]} KV heads, not "
                             f"the source's attention ({cfg.num_attention_heads} and {cfg.num_key_value_heads}): "
                             f"{converted}")


def replace_attention(model, modules: list[nn.Module]):
    """Put the given attnlab modules (one per layer, e.g. converted ones) into an attnlab'd model, in place."""
    fam = family(model)
    layers = _layers(model)
    if len(modules) != len(layers):
        raise ValueError(f"got {len(modules)} modules for {len(layers)} layers")
    attnlab_modules(model)  # checks to_attnlab was called
    for layer, m in zip(layers, modules):
        (layer.self_attn if fam == "llama" else layer.attention).attn = m
    return model


def from_attnlab(model):
    """Swap back: transformers attention layers carrying the attnlab modules' weights (in place).

    Needs GQA/MHA modules of the model's own shape. An MLA is first expanded with convert.mla_to_mha (a keys-whole one:
    convert.keys_whole_to_gqa, its values of rank r); for Llama its keys and values must then tile the config's KV
    heads (modules.heads.gqa_block). Biases of Llama layers are not carried back (SmolLM2 and Llama have none).
    """
    from ..convert.exact import mla_to_mha
    from ..convert.keys_whole import keys_whole_to_gqa

    fam = family(model)
    cfg = model.config
    for i, (layer, m) in enumerate(zip(_layers(model), attnlab_modules(model))):
        if isinstance(m, MultiHeadLatentAttention):
            m = keys_whole_to_gqa(m) if m.keys_whole else mla_to_mha(m)[0]
        if fam == "llama":
            LlamaAttention = _attention_class(model)
            G = cfg.num_key_value_heads
            wk, wv = m.W_K.weight.detach(), m.W_V.weight.detach()
            if m.num_kv_heads != G:  # e.g. an expanded MLA: recover the G-head block if it is a tiling
                if m.num_kv_heads != m.num_heads:
                    raise ValueError(f"layer {i} has {m.num_kv_heads} KV heads; the config says {G}")
                wk = gqa_block(wk, m.num_heads, G, grouping="blocked", rtol=1e-5)
                wv = gqa_block(wv, m.num_heads, G, grouping="blocked", rtol=1e-5)
                if wk is None or wv is None:
                    raise ValueError(f"layer {i}'s keys/values are not {G} shared heads (Part 11): "
                                     "they do not fit the model's config")
            a = LlamaAttention(cfg, i).to(m._anchor.device, m._anchor.dtype)
            for dst, src in ((a.q_proj, m.W_Q), (a.o_proj, m.W_O)):
                _copy_linear(dst, src)
            with torch.no_grad():
                a.k_proj.weight.copy_(wk)
                a.v_proj.weight.copy_(wv)
                if a.k_proj.bias is not None:  # Qwen2: Q/K/V biases (an expanded MLA's are a tiling too)
                    for lin, src, name in ((a.k_proj, m.W_K, "key"), (a.v_proj, m.W_V, "value")):
                        b = src.bias.detach() if m.num_kv_heads == G else gqa_block(
                            src.bias.detach()[:, None], m.num_heads, G, grouping="blocked", rtol=1e-5)
                        if b is None:
                            raise ValueError(f"layer {i}'s {name} biases are not {G} shared heads")
                        lin.bias.copy_(b.reshape(-1))
            if m.k_head_norm is not None:
                offset = NORM_OFFSET.get(type(cfg).__name__, 0.0)
                with torch.no_grad():
                    a.q_norm.weight.copy_(m.q_head_norm.weight - offset)
                    a.k_norm.weight.copy_(m.k_head_norm.weight - offset)
            layer.self_attn = a.train(model.training)
        else:
            from transformers.models.bert.modeling_bert import BertAttention
            adapter = layer.attention
            a = BertAttention(cfg, layer_idx=i).to(m._anchor.device, m._anchor.dtype)
            for dst, src in ((a.self.query, m.W_Q), (a.self.key, m.W_K), (a.self.value, m.W_V),
                             (a.output.dense, m.W_O)):
                _copy_linear(dst, src)
            a.output.LayerNorm = adapter.LayerNorm
            layer.attention = a.train(model.training)  # a fresh module is in training mode (dropout on)
    return model


