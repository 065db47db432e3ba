"""Qwen3 and Gemma 3 GGUF files (architectures qwen3, gemma3) load through attnlab.models as the model they were
written from: a tiny random transformers model (the oracle) is written in llama.cpp's names and conventions
(Gemma 3's norms stored as 1 + weight, as llama.cpp's converter stores them), loaded with load_checkpoint, and its
logits compared in float32. Both models have what transformers' GGUF reader would get wrong by itself: a head size
that is not hidden / heads (Qwen3's default is 128) and Gemma 3's query scale (its default, 256, is not this
head size)."""
import gguf
import numpy as np
import pytest
import torch

from attnlab import models as hf
from attnlab.models.load import gguf_name, inspect_gguf
from reference import rel_err

D, H, G, HEAD, F, V, WINDOW = 64, 4, 2, 24, 96, 97, 8


def _model(kind: str):
    import transformers as T

    kw = dict(vocab_size=V, hidden_size=D, intermediate_size=F, num_attention_heads=H, num_key_value_heads=G,
              head_dim=HEAD, max_position_embeddings=128, rms_norm_eps=1e-6)
    if kind == "gemma3":  # six layers in llama.cpp's pattern: five sliding, one global (its own RoPE base)
        cfg = T.Gemma3TextConfig(num_hidden_layers=6, sliding_window=WINDOW, query_pre_attn_scalar=HEAD,
                                 rope_theta=1e6, tie_word_embeddings=True, **kw)
        model = T.Gemma3ForCausalLM(cfg)
    else:
        cfg = T.Qwen3Config(num_hidden_layers=2, rope_theta=1e6, tie_word_embeddings=False, **kw)
        model = T.Qwen3ForCausalLM(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model.float().eval()


def _write(path, model, kind: str, drop: str | None = None, extra: dict | None = None):
    cfg = model.config
    w = gguf.GGUFWriter(str(path), kind)
    meta = {"block_count": cfg.num_hidden_layers, "context_length": 128, "embedding_length": D,
            "feed_forward_length": F, "attention.head_count": H, "attention.head_count_kv": G,
            "attention.key_length": HEAD, "attention.value_length": HEAD, "rope.freq_base": 1e6,
            "attention.layer_norm_rms_epsilon": 1e-6, "vocab_size": V}
    if kind == "gemma3":
        meta["attention.sliding_window"] = WINDOW
    meta.update(extra or {})
    for key, value in meta.items():
        if key != drop:
            (w.add_float32 if isinstance(value, float) else w.add_uint32)(f"{kind}.{key}", value)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        value = t.detach().float()
        if kind == "gemma3" and name.endswith("norm.weight"):
            value = value + 1  # llama.cpp stores Gemma's norms as the factor itself
        w.add_tensor(gguf_name(name, kind), np.ascontiguousarray(value.numpy()))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("kind", ["qwen3", "gemma3"])
def test_a_qwen3_or_gemma3_gguf_loads_the_model_it_was_written_from(tmp_path, kind):
    model = _model(kind)
    path = _write(tmp_path / f"{kind}.gguf", model, kind)
    cfg = inspect_gguf(path)
    assert cfg["head_dim"] == HEAD and cfg["model_type"] == model.config.model_type
    loaded, _ = hf.load_checkpoint(path)
    ids = torch.arange(20).remainder(V)[None]  # past the window of 8
    with torch.no_grad():
        want = model(ids).logits
        assert rel_err(loaded(ids).logits, want) <= 1e-5
        swapped = hf.to_attnlab(loaded)
        assert rel_err(swapped(ids).logits, want) <= 1e-5  # attnlab's modules: q/k norms, scale, windows carried
    windows = [m.sliding_window for m in hf.attnlab_modules(swapped)]
    assert windows == ([WINDOW] * 5 + [None] if kind == "gemma3" else [None, None])


def test_a_gguf_without_its_head_size_or_with_a_rope_scaling_is_refused_naming_the_field(tmp_path):
    """Without attention.key_length the head size would be hidden / heads (16), not the tensors' 24: the shape check
    names the tensor; a RoPE scaling factor transformers' reader would drop is refused naming the key."""
    model = _model("qwen3")
    path = _write(tmp_path / "q.gguf", model, "qwen3", drop="attention.key_length")
    with pytest.raises(ValueError, match=r"blk\.0\.attn_q\.weight has shape \[96, 64\].*implies \[64, 64\]"):
        inspect_gguf(path)
    path = _write(tmp_path / "g.gguf", _model("gemma3"), "gemma3", extra={"rope.scaling.factor": 8.0})
    with pytest.raises(ValueError, match=r"not supported yet: gemma3\.rope\.scaling\.factor = 8\.0"):
        inspect_gguf(path)
