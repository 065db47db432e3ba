"""Tiny random Llama / Mistral / Qwen2 / Qwen3 / Gemma 3 checkpoints on disk (transformers configs + save_pretrained, sharded).

Shared by tests/test_models_load.py and tests/test_export.py. Nothing is downloaded: the
tokenizer is a small byte-level BPE trained here on two sentences.
"""
import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEXT = ("the quick brown fox jumps over the lazy dog; attention reads keys and values, "
        "and a latent holds them in fewer numbers. ") * 3
FAMILIES = ("llama", "mistral", "qwen2")  # loaded, swapped and converted
SWAP_ONLY = ("qwen3", "gemma3")  # loaded and swapped; only the exact and the keys-whole MLA carry their q/k norms


def make_tokenizer(folder):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=320, special_tokens=["<s>", "</s>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>")
    tok.save_pretrained(str(folder))
    return tok


def make_checkpoint(kind: str, folder, *, dtype=torch.float32, seed: int = 0, **overrides):
    """Write a 2-layer, hidden-64 model of `kind` (H=4, G=2, head_dim 16) into folder; returns (model, tok)."""
    import transformers as T

    config_cls, model_cls = {"llama": (T.LlamaConfig, T.LlamaForCausalLM),
                             "mistral": (T.MistralConfig, T.MistralForCausalLM),
                             "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM),
                             "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM),
                             "gemma3": (T.Gemma3TextConfig, T.Gemma3ForCausalLM)}[kind]
    tok = make_tokenizer(folder)
    kw = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, bos_token_id=tok.bos_token_id,
              eos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    if kind == "llama":  # Llama 3's rope scaling, so the kept frequencies are not rope_theta's default ones
        kw.update(rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    if kind == "mistral":
        kw.update(sliding_window=None)
    if kind == "qwen3":  # its own head_dim (not hidden / heads), as Qwen3's checkpoints have
        kw.update(head_dim=24)
    if kind == "gemma3":  # a sliding layer with a window of 8 (shorter than the tests' texts), then a global one,
        # each with its own RoPE base; Gemma's own query scale and head_dim
        kw.update(head_dim=24, query_pre_attn_scalar=20, sliding_window=8, layer_types=["sliding_attention",
                  "full_attention"], rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                      "full_attention": {"rope_type": "default", "rope_theta": 1e6}})
    kw.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kw)).to(dtype).eval()
    if kind == "qwen2":  # random (not zero) Q/K/V biases
        with torch.no_grad():
            for layer in model.model.layers:
                for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    lin.bias.normal_(0, 0.5)
    if kind in ("qwen3", "gemma3"):  # q/k norm gains away from their initial ones (Gemma's scale by 1 + weight)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    model.save_pretrained(str(folder), max_shard_size="100KB")
    return model, tok
