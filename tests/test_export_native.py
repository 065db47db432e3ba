"""A GGUF written back in its source's own architecture (models/export/native_gguf.py), and the shrink plan that keeps the
original attention with only llama.cpp's cache codes (shrink/plan.py, round 0).

Oracles: transformers' GGUF reader (it undoes llama.cpp's query/key row order; a file it reads back must give the
model the export was given), gguf's own reader and de-quantiser (an untouched tensor is the source's byte for byte),
llama-cpp-python where installed (the written file runs, with the cache type the report names). Tiny models: a
2-layer Llama written as llama.cpp's converter writes one (its rows permuted by the converter's rule, checked against
transformers' reader first) with SmolLM2's tokenizer fields, and the Qwen3 / Gemma 3 files of test_gguf_families."""
import json

import gguf
import numpy as np
import pytest
import torch
from test_gguf_families import _model, _write
from tiny_checkpoints import TEXT

from attnlab import models as hf
from attnlab.models.export.deepseek_gguf import copy_gguf_fields
from attnlab.models.export.native_gguf import check_native, export_native, permute_rows
from attnlab.models.load import gguf_name
from attnlab.shrink import ShrinkRequest, parse_budget, plan, shrink
from attnlab.shrink.candidate import apply
from reference import rel_err

D, H, G, HEAD, F, LAYERS = 128, 2, 1, 64, 128, 2


def _smollm2_gguf():
    from attnlab.models.bundled import MODELS, _package_dir

    return sorted(_package_dir(MODELS["smollm2"]).glob("*.gguf"))[0]


def _converter_order(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter's row order (convert_hf_to_gguf's permute), written out here from its definition: the
    two rotary halves of each head interleaved."""
    d = w.shape[0] // heads
    return torch.stack([w.reshape(heads, d, -1)[:, :d // 2], w.reshape(heads, d, -1)[:, d // 2:]], 2).reshape(w.shape)


def _write_llama(path, vocab: int, tokenizer_from=None):
    """(path, the transformers model written there): a tiny Llama as llama.cpp's converter writes one (query and key
    rows in the converter's order), with the tokenizer fields of the GGUF `tokenizer_from` when given."""
    import transformers as T

    cfg = T.LlamaConfig(vocab_size=vocab, hidden_size=D, intermediate_size=F, num_attention_heads=H,
                        num_key_value_heads=G, head_dim=HEAD, num_hidden_layers=LAYERS, max_position_embeddings=512,
                        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in {"block_count": LAYERS, "context_length": 512, "embedding_length": D, "feed_forward_length": F,
                       "attention.head_count": H, "attention.head_count_kv": G, "rope.dimension_count": HEAD,
                       "rope.freq_base": 10000.0, "attention.layer_norm_rms_epsilon": 1e-5,
                       "vocab_size": vocab}.items():
        (w.add_float32 if isinstance(value, float) else w.add_uint32)(f"llama.{key}", value)
    if tokenizer_from is not None:
        copy_gguf_fields(w, gguf.GGUFReader(str(tokenizer_from)), lambda key: key.startswith("tokenizer."))
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        value = t.detach().float()
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            value = _converter_order(value, H if "q_proj" in name else G)
        w.add_tensor(gguf_name(name), np.ascontiguousarray(value.numpy()))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, model


@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory):
    """A tiny Llama GGUF of 97 tokens and no tokenizer (what the weights' tests need)."""
    return _write_llama(tmp_path_factory.mktemp("native") / "tiny-llama.gguf", 97)


@pytest.fixture(scope="module")
def llama_gguf_tokenizer(tmp_path_factory):
    """A tiny Llama GGUF with SmolLM2's vocabulary and tokenizer fields (what a shrink needs: it reads text)."""
    source = _smollm2_gguf()
    vocab = len(gguf.GGUFReader(str(source)).fields["tokenizer.ggml.tokens"].data)
    return _write_llama(tmp_path_factory.mktemp("native") / "tiny-llama-tok.gguf", vocab, source)


def test_permute_rows_is_what_transformers_gguf_reader_undoes():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    undo = LlamaTensorProcessor(config={})._reverse_permute_weights
    torch.manual_seed(1)
    for rows, heads in ((6 * 64, 6), (2 * 8, 2), (12, 1)):
        w = torch.randn(rows, 5)
        assert torch.equal(torch.from_numpy(undo(permute_rows(w, heads).numpy(), heads, heads)), w)
        assert torch.equal(permute_rows(w, heads), _converter_order(w, heads))
    with pytest.raises(ValueError, match="10 rows are not 4 heads of an even size"):
        permute_rows(torch.zeros(10, 3), 4)


def _ids(n: int = 24, vocab: int = 97):
    """Token ids that visit the vocabulary in a fixed order."""
    return (torch.arange(n) * 7 + 3).remainder(vocab)[None]


def _changed(model):
    """The model's attention moved as a heal moves it: one projection of each kind in some layer, and a norm."""
    mods = hf.attnlab_modules(model)
    torch.manual_seed(2)
    with torch.no_grad():
        for lin in (mods[0].W_Q, mods[1].W_K, mods[1].W_V, mods[0].W_O):
            lin.weight.add_(0.05 * torch.randn_like(lin.weight))
        if mods[0].k_head_norm is not None:
            mods[0].k_head_norm.weight.mul_(1.1)
    return model


def _same_bytes(a, b, name) -> bool:
    ta = next(t for t in a.tensors if t.name == name)
    tb = next(t for t in b.tensors if t.name == name)
    return ta.tensor_type == tb.tensor_type and np.array_equal(np.asarray(ta.data).view(np.uint8),
                                                                np.asarray(tb.data).view(np.uint8))


def _round_trip(source, tmp_path, vocab):
    model, _ = hf.load_checkpoint(source)
    hf.to_attnlab(model)
    untouched = export_native(model, tmp_path / "same.gguf")
    assert untouched["rewritten"] == [] and untouched["architecture"] == gguf.GGUFReader(str(source)).fields[
        "general.architecture"].contents()
    src, same = gguf.GGUFReader(str(source)), gguf.GGUFReader(str(tmp_path / "same.gguf"))
    assert [t.name for t in same.tensors] == [t.name for t in src.tensors]
    assert all(_same_bytes(src, same, t.name) for t in src.tensors)
    assert {k for k in same.fields if not k.startswith("GGUF.")} == \
        {k for k in src.fields if not k.startswith("GGUF.")} | {"attnlab.written_by"}
    _changed(model)
    changed = export_native(model, tmp_path / "changed.gguf", cache_types=("q4_0", "q8_0"))
    back, _ = hf.load_checkpoint(tmp_path / "changed.gguf")
    hf.to_attnlab(back)
    ids = _ids(24, vocab)
    with torch.no_grad():
        assert rel_err(back(ids).logits, model(ids).logits) <= 1e-6  # float32 written, float32 read
    new = gguf.GGUFReader(str(tmp_path / "changed.gguf"))
    assert all(_same_bytes(src, new, t.name) for t in src.tensors if t.name not in changed["rewritten"])
    assert all(not _same_bytes(src, new, name) for name in changed["rewritten"])
    assert new.fields["attnlab.cache_type_k"].contents() == "q4_0"
    assert new.fields["attnlab.cache_type_v"].contents() == "q8_0"
    return changed["rewritten"]


def test_a_llama_gguf_round_trips_through_transformers_reader(llama_gguf, tmp_path):
    """The tiny Llama loads as the model it was written from (the converter's order, undone by transformers); after a
    change to its attention the export rewrites exactly the changed tensors, and transformers reads back the changed
    model; an untouched model gives the source's tensors byte for byte."""
    path, model = llama_gguf
    loaded, _ = hf.load_checkpoint(path)
    ids = _ids(24, 97)
    with torch.no_grad():
        assert rel_err(loaded(ids).logits, model(ids).logits) <= 1e-5
    rewritten = _round_trip(path, tmp_path, 97)
    assert sorted(rewritten) == ["blk.0.attn_output.weight", "blk.0.attn_q.weight", "blk.1.attn_k.weight",
                                 "blk.1.attn_v.weight"]


@pytest.mark.parametrize("kind", ["qwen3", "gemma3"])
def test_qwen3_and_gemma3_ggufs_round_trip_norms_included(tmp_path, kind):
    source = _write(tmp_path / f"{kind}.gguf", _model(kind), kind)
    rewritten = _round_trip(source, tmp_path, 97)
    assert "blk.0.attn_k_norm.weight" in rewritten and "blk.0.attn_q_norm.weight" not in rewritten


def test_what_cannot_be_written_natively_is_refused_in_one_line(llama_gguf, tmp_path):
    from tiny_checkpoints import make_checkpoint

    folder = tmp_path / "llama"
    make_checkpoint("llama", folder)
    model, _, _ = hf.load_model(str(folder))
    with pytest.raises(ValueError, match=r"a K/V pair \(q8_0,q4_0\) is planned only for the original attention in "
                                         r"its own architecture.* written as deepseek2"):
        plan(model, _ids(128, 97), parse_budget("45%"), fmt="gguf", storages=("q8_0,q4_0",), window=32)
    with pytest.raises(ValueError, match=r"this model came from .*llama: load a \.gguf"):
        check_native(model)
    model, _ = hf.load_checkpoint(llama_gguf[0])
    hf.to_attnlab(model)
    hf.convert_model(model, "mla", latent_dim=16, rope_dim=8, layers=[1])
    with pytest.raises(ValueError, match=r"layer 1 is a MultiHeadLatentAttention .*written as deepseek2"):
        check_native(model)


def _q4_0_bytes() -> int:
    """The tiny Llama's cache in q4_0, by hand: K and V of G heads of 64 values, blocks of 32 in 18 bytes, 2 layers."""
    return LAYERS * 2 * G * HEAD // 32 * 18


def test_a_gguf_plan_keeps_the_original_attention_where_a_llama_cpp_type_fits(llama_gguf):
    """For a GGUF source llama.cpp runs, --format gguf plans the original attention in each of llama.cpp's cache types
    that fits (round 0), at the bytes those caches allocate; below the smallest, where no converted row fits either,
    the error names that smallest."""
    path, _ = llama_gguf
    model, _ = hf.load_checkpoint(path)
    hf.to_attnlab(model)
    cal = _ids(128, 97)
    original = LAYERS * 2 * G * HEAD * 2
    result = plan(model, cal, parse_budget("30%"), fmt="gguf", storages=("q8_0", "q4_0"), window=32)
    native = [c for c in result.measured if c.native]
    assert [c.kv_dtype for c in native] == ["q4_0"] and native[0].round == 0  # q8_0 (53%) does not fit 30%
    assert native[0].bytes_per_token == _q4_0_bytes() <= 0.3 * original
    assert native[0].values == 2 * G * HEAD
    assert native[0].label() == "the original attention, its cache in llama.cpp's q4_0"
    probe = hf.load_checkpoint(path)[0]
    hf.to_attnlab(probe)
    apply(probe, native[0], cal)
    assert [m.kv_dtype for m in hf.attnlab_modules(probe)] == ["q4_0"] * LAYERS
    assert hf.kv_bytes_per_token(probe) == _q4_0_bytes()
    with pytest.raises(ValueError, match=rf"nor does the original attention in llama.cpp's cache types: the smallest, "
                                         rf"q4_0, takes {_q4_0_bytes()} bytes/token \(28.1%\)"):
        plan(model, cal, parse_budget("10%"), fmt="gguf", storages=("q4_0",), window=32)


def test_a_kv_pair_is_planned_for_the_original_attention_only(llama_gguf):
    """K in q8_0 and V in q4_0 (llama.cpp's --cache-type-k q8_0 --cache-type-v q4_0): a round-0 plan of the original
    attention at the bytes of half a row in each (by hand); no converted (deepseek2) layout is tried in it, and a
    budget below it names its bytes."""
    path, _ = llama_gguf
    model, _ = hf.load_checkpoint(path)
    hf.to_attnlab(model)
    cal = _ids(128, 97)
    pair = LAYERS * G * HEAD // 32 * (34 + 18)  # K: q8_0 blocks of 34 bytes, V: q4_0 blocks of 18, per 32 values
    result = plan(model, cal, parse_budget("45%"), fmt="gguf", storages=("q8_0,q4_0", "q4_0"), window=32)
    assert [(c.kv_dtype, c.round) for c in result.measured if c.native] == [("q8_0,q4_0", 0), ("q4_0", 0)]
    assert [c.bytes_per_token for c in result.measured if c.native] == [pair, _q4_0_bytes()]
    assert all(c.kv_dtype != "q8_0,q4_0" for c in result.measured if not c.native)
    with pytest.raises(ValueError, match=rf"below what a K/V pair holds, which only the original attention can use: "
                                         rf"q8_0,q4_0 takes {pair} bytes/token \(40.6%\)"):
        plan(model, cal, parse_budget("35%"), fmt="gguf", storages=("q8_0,q4_0",), window=32)


@pytest.mark.parametrize("storage, budget", [("q4_0", "30%"), ("q8_0,q4_0", "45%")])
def test_a_gguf_shrink_of_a_llama_gguf_writes_its_own_architecture(llama_gguf_tokenizer, tmp_path, storage, budget):
    """shrink --format gguf --kv-dtype q4_0 on a llama GGUF at 30% (and K in q8_0 with V in q4_0 at 45%): the original
    attention planned, healed through that cache, written as a llama GGUF whose untouched tensors are the source's;
    the report and the file's metadata name llama.cpp's flags; where llama-cpp-python is installed, llama.cpp runs
    the file with that cache."""
    path, _ = llama_gguf_tokenizer
    out = tmp_path / "s.gguf"
    text = tmp_path / "t.txt"
    text.write_text(TEXT * 40)
    report = shrink(ShrinkRequest(source=str(path), kv_budget=budget, out=str(out), fmt="gguf", storage=storage,
                                  text=[str(text)], minutes=5, seq_len=32, tokens=4 * 32 * 4, layer_steps=2,
                                  windows=16))
    k, v = (storage.split(",") * 2)[:2]
    held = LAYERS * G * HEAD // 32 * {"q4_0": 18, "q8_0": 34}[k] + LAYERS * G * HEAD // 32 * 18
    assert report["plan"]["chosen"]["layers"] == [] and report["kv_bytes_per_token"]["shrunk"] == held
    assert report["llama_cpp"]["architecture"] == "source" and \
        report["llama_cpp"]["flags"] == f"--cache-type-k {k} --cache-type-v {v} --flash-attn on"
    assert report["runs_in"] == {**report["runs_in"], "engine": "llama.cpp",
                                 "how": f"llama-cli -m OUT --cache-type-k {k} --cache-type-v {v} --flash-attn on "
                                        "(its source's architecture)"}
    written = report["written"]
    src, new = gguf.GGUFReader(str(path)), gguf.GGUFReader(str(out))
    assert new.fields["general.architecture"].contents() == "llama"
    assert [new.fields[key].contents() for key in ("attnlab.cache_type_k", "attnlab.cache_type_v")] == [k, v]
    assert all(_same_bytes(src, new, t.name) for t in src.tensors if t.name not in written["rewritten"])
    assert written["copied"] + len(written["rewritten"]) == len(src.tensors)
    assert json.loads((tmp_path / "s.gguf.shrink.json").read_text())["written"] == written
    llama_cpp = pytest.importorskip("llama_cpp")
    ids = _ids(24, 49152)
    model, _ = hf.load_checkpoint(out)  # transformers' reading of the file
    with torch.no_grad():
        want = model(ids).logits[0]
    for kind in ("F16", storage.upper()):  # llama.cpp's reading of it, its default cache and the one planned
        kinds = (kind.split(",") * 2)[:2]
        llm = llama_cpp.Llama(model_path=str(out), n_ctx=64, type_k=getattr(llama_cpp, f"GGML_TYPE_{kinds[0]}"),
                              type_v=getattr(llama_cpp, f"GGML_TYPE_{kinds[1]}"), flash_attn=True, logits_all=True,
                              verbose=False)
        try:
            llm.eval(ids[0].tolist())
            got = torch.from_numpy(np.array(llm.scores[:24]))
        finally:
            llm.close()
        # f16 K/V agree to f16's rounding; q4_0's codes move the logits by several percent (tests/test_llama_cpp_cache)
        assert rel_err(got, want) <= (1e-2 if kind == "F16" else 0.3), kind
