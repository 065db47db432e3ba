"""Bad sources are refused before a model is built from them; good ones next to them still load the same model.

Sources: tiny GGUF files written here with gguf.GGUFWriter from a random transformers model
(llama.cpp's tensor names, Q/K rows in llama.cpp's rotary order), tiny transformers folders
(tiny_checkpoints.make_checkpoint), text files, and converted-model folders from save_model.
Oracles: each refusal's message names the file and the offending value (built from what the
test wrote, not pasted from a run); the valid sources give the logits of the transformers
model they were written from.
"""
import json
import re
import shutil

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
from attnlab import models as hf  # noqa: E402
from attnlab.models.evaluate import read_text_ids  # noqa: E402
from attnlab.models.load import inspect_checkpoint, load_checkpoint  # noqa: E402
from tiny_checkpoints import TEXT, make_checkpoint  # noqa: E402

H, G, D, F, L, V = 4, 2, 64, 128, 2, 96  # heads, KV heads, width, MLP width, layers, vocabulary of the GGUF models
HEAD = D // H
LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


# -- GGUF ------------------------------------------------------------------------------------------
def tiny_model(kind="llama", tied=False, layers=L):
    import transformers as T

    cfg_cls, model_cls = {"llama": (T.LlamaConfig, T.LlamaForCausalLM),
                          "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM)}[kind]
    torch.manual_seed(0)
    model = model_cls(cfg_cls(vocab_size=V, hidden_size=D, intermediate_size=F, num_hidden_layers=layers,
                              num_attention_heads=H, num_key_value_heads=G, max_position_embeddings=256,
                              rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=tied)).eval()
    with torch.no_grad():
        for p in model.parameters():  # norms and biases random too, so a dropped tensor would show
            p.normal_(0, 0.2)
    return model


def _rotary_rows(w, heads):
    """llama.cpp's row order of Q and K (pairs interleaved); transformers undoes it when it loads a llama GGUF."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(model, kind="llama") -> dict:
    sd = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    out = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"]}
    if not model.config.tie_word_embeddings:
        out["output.weight"] = sd["lm_head.weight"]
    for i in range(model.config.num_hidden_layers):
        for name, short in LAYER.items():
            for part in ("weight", "bias"):
                w = sd.get(f"model.layers.{i}.{name}.{part}")
                if w is None:
                    continue
                if kind == "llama" and short in ("attn_q", "attn_k"):
                    w = _rotary_rows(w, H if short == "attn_q" else G)
                out[f"blk.{i}.{short}.{part}"] = w
    return out


def write_gguf(path, tensors: dict, arch="llama", meta: dict | None = None):
    """A GGUF file of the given tensors; meta overrides the default metadata (a None value leaves a key out)."""
    values = {"block_count": L, "context_length": 256, "embedding_length": D, "feed_forward_length": F,
              "attention.head_count": H, "attention.head_count_kv": G, "rope.freq_base": 10000.0,
              "attention.layer_norm_rms_epsilon": 1e-6, "vocab_size": V}
    if arch == "llama":
        values["rope.dimension_count"] = HEAD
    values.update(meta or {})
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in values.items():
        if value is None:
            continue
        add = (w.add_float32 if isinstance(value, float) else w.add_int32 if value < 0 else w.add_uint32)
        add(f"{arch}.{key}", value)
    for name, array in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def llama():
    return tiny_model()


@pytest.fixture
def ids():
    return torch.arange(20).remainder(V)[None]


@pytest.mark.parametrize("kind,tied", [("llama", False), ("llama", True), ("qwen2", False)])
def test_valid_gguf_loads_the_model_it_was_written_from(tmp_path, ids, kind, tied):
    model = tiny_model(kind, tied)
    path = write_gguf(tmp_path / "m.gguf", gguf_tensors(model, kind), arch=kind)
    cfg = inspect_checkpoint(path)
    assert (cfg["num_hidden_layers"], cfg["tie_word_embeddings"]) == (L, tied)
    loaded, tok = load_checkpoint(path)
    assert tok is None  # no tokenizer.ggml metadata
    assert torch.equal(_logits(loaded, ids), _logits(model, ids))


def test_gguf_with_metadata_only_is_refused(tmp_path):
    """The probe: architecture llama, nothing else, loaded as a random 4096-wide Llama."""
    keys = ("block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count",
            "attention.head_count_kv", "rope.freq_base", "attention.layer_norm_rms_epsilon", "vocab_size",
            "rope.dimension_count")
    path = write_gguf(tmp_path / "bare.gguf", {}, meta={k: None for k in keys})
    with pytest.raises(ValueError, match=f"{re.escape(str(path))}: llama.block_count is missing"):
        load_checkpoint(path)
    path = write_gguf(tmp_path / "empty.gguf", {})
    with pytest.raises(ValueError, match=f"{re.escape(str(path))}: the GGUF file lacks the tensor token_embd.weight"):
        load_checkpoint(path)


@pytest.mark.parametrize("key,value,message", [
    ("block_count", 0, "llama.block_count must be a positive int, got 0"),
    ("embedding_length", -D, f"llama.embedding_length must be a positive int, got {-D}"),
    ("block_count", float(L), f"llama.block_count must be a positive int, got {float(L)}"),
    ("attention.head_count_kv", H - 1,
     f"llama.attention.head_count_kv must be a positive divisor of llama.attention.head_count \\({H}\\), got {H - 1}"),
    ("rope.freq_base", -1.0, "llama.rope.freq_base must be a positive number, got -1.0"),
    ("context_length", 0, "llama.context_length must be a positive int, got 0"),
    ("vocab_size", None, re.escape("llama.vocab_size (or tokenizer.ggml.tokens) is missing")),
])
def test_gguf_metadata_values_refused(tmp_path, llama, key, value, message):
    path = write_gguf(tmp_path / "m.gguf", gguf_tensors(llama), meta={key: value})
    with pytest.raises(ValueError, match=f"{re.escape(str(path))}: {message}"):
        inspect_checkpoint(path)


def test_gguf_missing_and_misshaped_tensors(tmp_path, llama):
    tensors = gguf_tensors(llama)
    del tensors["blk.1.attn_v.weight"]
    path = write_gguf(tmp_path / "missing.gguf", tensors)
    with pytest.raises(ValueError, match=f"{re.escape(str(path))}: the GGUF file lacks the tensor blk.1.attn_v.weight"):
        load_checkpoint(path)
    # one KV head declared, two written: GGUF's dims are PyTorch's reversed, the message gives PyTorch's order
    path = write_gguf(tmp_path / "kv.gguf", gguf_tensors(llama), meta={"attention.head_count_kv": 1})
    with pytest.raises(ValueError, match=re.escape(f"blk.0.attn_k.weight has shape [{G * HEAD}, {D}] (PyTorch order), "
                                                   f"the GGUF metadata implies [{HEAD}, {D}]")):
        inspect_checkpoint(path)
    tensors = gguf_tensors(llama)
    tensors["blk.0.ffn_down.weight"] = tensors["blk.0.ffn_down.weight"].T  # (F, D) where (D, F) belongs
    path = write_gguf(tmp_path / "t.gguf", tensors)
    with pytest.raises(ValueError, match=re.escape(f"blk.0.ffn_down.weight has shape [{F}, {D}] (PyTorch order), "
                                                   f"the GGUF metadata implies [{D}, {F}]")):
        inspect_checkpoint(path)
    tensors = gguf_tensors(llama)
    tensors["output.weight"] = tensors["output.weight"][:-1]
    path = write_gguf(tmp_path / "out.gguf", tensors)
    with pytest.raises(ValueError, match=re.escape(f"output.weight has shape [{V - 1}, {D}]")):
        inspect_checkpoint(path)


def test_gguf_blocks_beyond_block_count(tmp_path, llama):
    path = write_gguf(tmp_path / "m.gguf", gguf_tensors(llama), meta={"block_count": L - 1})
    with pytest.raises(ValueError, match=re.escape(f"{path}: the GGUF file holds tensors of {L} blocks (blk.{L - 1}), "
                                                   f"llama.block_count is {L - 1}")):
        load_checkpoint(path)


def test_gguf_tensor_transformers_would_drop(tmp_path, llama):
    tensors = gguf_tensors(llama)
    tensors["blk.0.attn_q.bias"] = np.ones(H * HEAD, np.float32)  # llama.cpp reads it; transformers' Llama has no bias
    path = write_gguf(tmp_path / "m.gguf", tensors)
    with pytest.raises(ValueError, match=re.escape(f"{path}: blk.0.attn_q.bias has no place in transformers' llama")):
        inspect_checkpoint(path)


@pytest.mark.parametrize("arch,message", [("gemma2", "not supported: model_type 'gemma2': Gemma 2 uses logit soft"),
                                          ("gpt2", "not supported: unknown model_type 'gpt2'")])
def test_gguf_unsupported_architecture(tmp_path, llama, arch, message):
    path = write_gguf(tmp_path / "m.gguf", gguf_tensors(llama), arch=arch)
    with pytest.raises(ValueError, match=f"{re.escape(str(path))}: {message}"):
        load_checkpoint(path)


@pytest.mark.parametrize("keep", [0.5, -1])
def test_truncated_gguf(tmp_path, llama, keep):
    full = write_gguf(tmp_path / "full.gguf", gguf_tensors(llama)).read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(full[:int(len(full) * keep)] if keep > 0 else full[:keep])
    cut = re.escape(f"{path}: truncated or corrupt GGUF file ({path.stat().st_size} bytes)")
    with pytest.raises(ValueError, match=cut):
        load_checkpoint(path)
    path.write_bytes(b"")
    with pytest.raises(ValueError, match=f"{re.escape(str(path))}: truncated or corrupt GGUF file \\(0 bytes\\)"):
        inspect_checkpoint(path)


def test_gguf_with_inf_weight_refused(tmp_path, llama):
    tensors = gguf_tensors(llama)
    tensors["blk.1.ffn_down.weight"][3, 5] = np.inf
    path = write_gguf(tmp_path / "m.gguf", tensors)
    with pytest.raises(ValueError, match=re.escape(f"{path}: the weight model.layers.1.mlp.down_proj.weight "
                                                   f"(blk.1.ffn_down.weight) holds 0 NaN and 1 inf values")):
        load_checkpoint(path)


# -- transformers folders --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("src")
    model, tok = make_checkpoint("llama", root / "llama")
    ids = tok(TEXT, return_tensors="pt").input_ids[:, :32]
    return dict(path=root / "llama", model=model, tok=tok, ids=ids, logits=_logits(model, ids))


def _copy(folder, tmp_path, name="copy"):
    dst = tmp_path / name
    shutil.copytree(folder["path"], dst)
    return dst


def _config(d):
    return json.loads((d / "config.json").read_text())


def _write_config(d, cfg):
    (d / "config.json").write_text(json.dumps(cfg))


def _rewrite_shard(d, name, change):
    """Apply change(tensors) to the safetensors shard holding `name` (and drop from the index what it drops)."""
    from safetensors.torch import load_file, save_file

    index_path = d / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = d / index["weight_map"][name]
    tensors = load_file(str(shard))
    change(tensors)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != shard.name or k in tensors}
    index_path.write_text(json.dumps(index))


def test_valid_folder_still_loads_the_same_model(folder):
    cfg = inspect_checkpoint(folder["path"])
    assert cfg["num_hidden_layers"] == folder["model"].config.num_hidden_layers
    model, tok = load_checkpoint(folder["path"])
    assert tok is not None
    assert torch.equal(_logits(model, folder["ids"]), folder["logits"])


def _bad_values(cfg):
    H_ = cfg["num_attention_heads"]
    return [("num_hidden_layers", -1, "num_hidden_layers must be a positive int, got -1"),
            ("hidden_size", 0, "hidden_size must be a positive int, got 0"),
            ("vocab_size", "320", "vocab_size must be a positive int, got '320'"),
            ("intermediate_size", 128.0, "intermediate_size must be a positive int, got 128.0"),
            ("num_attention_heads", True, "num_attention_heads must be a positive int, got True"),
            ("num_key_value_heads", H_ - 1,
             f"num_key_value_heads must be a positive divisor of num_attention_heads ({H_}), got {H_ - 1}"),
            ("num_key_value_heads", 0, f"num_key_value_heads must be a positive divisor of num_attention_heads "
                                       f"({H_}), got 0"),
            ("head_dim", -16, "head_dim must be a positive int, got -16"),
            ("max_position_embeddings", 0, "max_position_embeddings must be a positive int, got 0"),
            ("rope_theta", "big", "rope_theta must be a positive number, got 'big'"),
            ("rope_parameters", {"rope_type": "default", "rope_theta": -1.0},
             "rope_parameters.rope_theta must be a positive number, got -1.0")]


def test_config_values_refused(folder, tmp_path):
    d = _copy(folder, tmp_path)
    good = _config(d)
    for key, value, message in _bad_values(good):
        _write_config(d, {**good, key: value})
        for check in (inspect_checkpoint, load_checkpoint):
            with pytest.raises(ValueError, match=re.escape(f"{d / 'config.json'}: {message}")):
                check(d)
    cfg = dict(good)
    del cfg["hidden_size"]
    _write_config(d, cfg)
    with pytest.raises(ValueError, match=re.escape(f"{d / 'config.json'}: hidden_size is missing")):
        inspect_checkpoint(d)


def test_config_that_is_a_list_refused(folder, tmp_path):
    d = _copy(folder, tmp_path)
    _write_config(d, [_config(d)])
    with pytest.raises(ValueError, match=re.escape(f"{d / 'config.json'} holds a JSON list, not an object")):
        load_checkpoint(d)
    assert not hf.is_checkpoint(d)


def test_config_with_fewer_layers_than_the_shards(folder, tmp_path):
    d = _copy(folder, tmp_path)
    layers = _config(d)["num_hidden_layers"]
    _write_config(d, {**_config(d), "num_hidden_layers": layers - 1})
    with pytest.raises(ValueError, match=re.escape(f"{d}: the shards hold tensors of {layers} layers "
                                                   f"(model.layers.{layers - 1}), config.json has num_hidden_layers "
                                                   f"{layers - 1}")):
        load_checkpoint(d)


def test_untied_config_without_lm_head(tmp_path):
    """A tied checkpoint (no lm_head.weight saved) loads the same model; told it is untied, it is refused
    (transformers would give it a random output layer)."""
    model, tok = make_checkpoint("llama", tmp_path / "tied", tie_word_embeddings=True)
    d = tmp_path / "tied"
    ids = tok(TEXT, return_tensors="pt").input_ids[:, :16]
    loaded, _ = load_checkpoint(d)
    assert torch.equal(_logits(loaded, ids), _logits(model, ids))
    _write_config(d, {**_config(d), "tie_word_embeddings": False})
    with pytest.raises(ValueError, match=re.escape(f"{d}: the checkpoint lacks lm_head.weight")):
        inspect_checkpoint(d)


def test_qwen2_without_its_biases(tmp_path):
    make_checkpoint("qwen2", tmp_path / "q")
    d = tmp_path / "q"
    name = "model.layers.1.self_attn.k_proj.bias"
    _rewrite_shard(d, name, lambda t: t.pop(name))
    with pytest.raises(ValueError, match=re.escape(f"{d}: the checkpoint lacks {name}")):
        inspect_checkpoint(d)


def test_index_naming_a_shard_outside_the_folder(folder, tmp_path):
    d = _copy(folder, tmp_path)
    index_path = d / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = "../elsewhere.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=re.escape(f"{index_path} names '../elsewhere.safetensors' as a shard")):
        inspect_checkpoint(d)


@pytest.mark.parametrize("value,counts", [(float("nan"), "1 NaN and 0 inf"), (float("-inf"), "0 NaN and 1 inf")])
def test_folder_with_non_finite_weight_refused(folder, tmp_path, value, counts):
    d = _copy(folder, tmp_path)
    name = "model.layers.1.self_attn.v_proj.weight"

    def poison(tensors):
        tensors[name][2, 3] = value
    _rewrite_shard(d, name, poison)
    inspect_checkpoint(d)  # the headers are fine: only the loaded values show it
    with pytest.raises(ValueError, match=re.escape(f"{d}: the weight {name} holds {counts} values")):
        load_checkpoint(d)


def test_folder_without_tokenizer(folder, tmp_path):
    d = _copy(folder, tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (d / name).unlink()
    model, tok = load_checkpoint(d)
    assert tok is None
    assert torch.equal(_logits(model, folder["ids"]), folder["logits"])  # conversions without text still work
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    with pytest.raises(ValueError, match=re.escape(f"cannot read {text}: the model has no tokenizer files "
                                                   "(tokenizer.json, tokenizer_config.json")):
        read_text_ids(tok, text)


# -- text files ------------------------------------------------------------------------------------
def test_read_text_ids_values(folder, tmp_path):
    tok = folder["tok"]
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    full = tok(TEXT, return_tensors="pt").input_ids
    assert torch.equal(read_text_ids(tok, text), full)
    assert torch.equal(read_text_ids(tok, text, 5), full[:, :5])
    for bad in (0, -5, 2.5, True, "10"):
        message = f"max_tokens must be None (all) or a positive int, got {bad!r}"
        with pytest.raises(ValueError, match=re.escape(message)):
            read_text_ids(tok, text, bad)
    with pytest.raises(ValueError, match="max_tokens 1 keeps fewer tokens than the 2 needed"):
        read_text_ids(tok, text, 1, min_tokens=2)
    with pytest.raises(ValueError, match=re.escape("min_tokens must be an int >= 0, got -1")):
        read_text_ids(tok, text, min_tokens=-1)


def test_read_text_ids_too_short(folder, tmp_path):
    tok = folder["tok"]
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match=re.escape(f"{empty} is empty or whitespace only (0 characters)")):
        read_text_ids(tok, empty)
    word = tmp_path / "word.txt"
    word.write_text("the")
    n = tok("the", return_tensors="pt").input_ids.shape[1]
    assert torch.equal(read_text_ids(tok, word, min_tokens=n), tok("the", return_tensors="pt").input_ids)
    with pytest.raises(ValueError, match=re.escape(f"{word} holds {n} token(s); at least {n + 1} needed")):
        read_text_ids(tok, word, min_tokens=n + 1)


# -- load_model's sources --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def converted(folder, tmp_path_factory):
    """An exact MLA conversion of the tiny folder saved in attnlab's format, and its logits."""
    model, _ = load_checkpoint(folder["path"])
    hf.to_attnlab(model)
    hf.convert_model(model, "mla")
    out = tmp_path_factory.mktemp("conv") / "mla"
    hf.save_model(model, str(folder["path"]), out)
    return dict(path=out, logits=_logits(model, folder["ids"]))


def _copy_converted(converted, tmp_path):
    dst = tmp_path / "conv"
    shutil.copytree(converted["path"], dst)
    return dst


def test_load_model_paths_that_are_nothing(tmp_path):
    wanted = re.escape("expected a bundled model name (smollm2, minilm, gemma3-270m), a checkpoint")
    with pytest.raises(ValueError, match=f"no such file or folder; {wanted}"):
        hf.load_model(str(tmp_path / "nope"))
    note = tmp_path / "notes.txt"
    note.write_text("hi")
    with pytest.raises(ValueError, match=f"{re.escape(str(note))} is a file but not a .gguf; {wanted}"):
        hf.load_model(str(note))
    with pytest.raises(ValueError, match=f"{re.escape(str(tmp_path))} has no config.json; {wanted}"):
        hf.load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(["model_type"]))
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'config.json'} holds a JSON list, not an object")):
        hf.load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"name": "x"}))
    message = f"{tmp_path / 'config.json'} is not an attnlab converted model (format None, not 'attnlab-model')"
    with pytest.raises(ValueError, match=re.escape(message)):
        hf.load_model(str(tmp_path))


def test_load_model_converted_folder_reloads(folder, converted):
    model, tok, meta = hf.load_model(str(converted["path"]))
    assert tok is not None and meta["base"] == str(folder["path"].resolve())
    assert torch.equal(_logits(model, folder["ids"]), converted["logits"])


def test_load_model_converted_folder_layers_refused(converted, tmp_path):
    d = _copy_converted(converted, tmp_path)
    cfg_path = d / "config.json"
    meta = json.loads(cfg_path.read_text())
    n = len(meta["layers"])
    cfg_path.write_text(json.dumps({k: v for k, v in meta.items() if k != "layers"}))
    with pytest.raises(ValueError, match=re.escape(f'{cfg_path} lacks "layers"')):
        hf.load_model(str(d))
    cfg_path.write_text(json.dumps({**meta, "layers": {"0": meta["layers"][0]}}))
    with pytest.raises(ValueError, match=re.escape(f'{cfg_path}: "layers" must be a non-empty list of module records')):
        hf.load_model(str(d))
    cfg_path.write_text(json.dumps({**meta, "layers": meta["layers"][:-1]}))
    with pytest.raises(ValueError, match=re.escape(f"{d / 'attention.safetensors'} holds weights of layer {n - 1}, "
                                                   f"{cfg_path} lists {n - 1} layers")):
        hf.load_model(str(d))
    cfg_path.write_text(json.dumps({**meta, "base": 7}))
    with pytest.raises(ValueError, match=re.escape(f"{cfg_path}: its base model 7 is gone")):
        hf.load_model(str(d))


def test_load_model_base_with_another_layer_count(folder, converted, tmp_path):
    n = folder["model"].config.num_hidden_layers
    make_checkpoint("llama", tmp_path / "deeper", num_hidden_layers=n + 1)
    d = _copy_converted(converted, tmp_path)
    meta = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**meta, "base": str(tmp_path / "deeper")}))
    with pytest.raises(ValueError, match=re.escape(f"{d / 'config.json'} lists {n} attention layers, its base model "
                                                   f"{tmp_path / 'deeper'} has {n + 1}")):
        hf.load_model(str(d))
