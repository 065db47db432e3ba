"""GGUF files de-quantised once: transformers' GGUF reader, then a float32 copy on disk keyed by the file's content.

transformers de-quantises every tensor with numpy and rebuilds the tokenizer on each load of a GGUF. `load_gguf` does
that once per file content and keeps an ordinary transformers folder (float32 model.safetensors, config, tokenizer)
under $ATTNLAB_CACHE/gguf (default ~/.cache/attnlab/gguf; ATTNLAB_CACHE=off reads the GGUF every time, writes nothing).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path

MARK = "attnlab-gguf-copy.json"  # written last, after the weights, config and tokenizer: its presence says the copy is whole
LARGEST = 8 << 30  # bytes: a model larger in float32 is not copied (a 7B model would take 28 GB of disk)


def cache_root() -> Path | None:
    """The folder for de-quantised copies, or None when ATTNLAB_CACHE is "off"."""
    where = os.environ.get("ATTNLAB_CACHE", "")
    if where.strip().lower() in ("off", "0", "none", "false"):
        return None
    return (Path(where).expanduser() if where else Path.home() / ".cache" / "attnlab") / "gguf"


DIGESTS = ".digests.json"  # beside the copies (hidden: not a copy): {resolved path: [size, mtime_ns, inode, sha256]}


def file_digest(path: Path, chunk: int = 1 << 23) -> str:
    """The sha256 of a file's bytes, read in chunks. With a cache folder (cache_root), a file whose size, modification
    time (ns) and inode are those recorded when it was last hashed is not read again (a file written since has
    another time); the record is kept in DIGESTS, rewritten whole (a failed write only costs the next load a read)."""
    path = Path(path)
    st = path.stat()
    stamp = [st.st_size, st.st_mtime_ns, st.st_ino]
    root = cache_root()
    where = str(path.resolve())
    known = {}
    if root is not None:
        try:
            known = json.loads((root / DIGESTS).read_text())
        except (OSError, ValueError):
            known = {}
        entry = known.get(where) if isinstance(known, dict) else None
        if isinstance(entry, list) and len(entry) == 4 and entry[:3] == stamp and isinstance(entry[3], str):
            return entry[3]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    digest = h.hexdigest()
    if root is not None:
        known = known if isinstance(known, dict) else {}
        known[where] = [*stamp, digest]
        try:
            root.mkdir(parents=True, exist_ok=True)
            tmp = root / f"{DIGESTS}.{os.getpid()}"
            tmp.write_text(json.dumps(known))
            tmp.replace(root / DIGESTS)
        except OSError:
            pass
    return digest


def copy_key(path: Path, overrides: dict) -> str:
    """What names a copy: the file's content, the metadata overrides and transformers' version."""
    # The sha256 of the GGUF's bytes, so a file rewritten in place is a new key, never a stale copy; transformers'
    # version, because its reader may change what it builds.
    import transformers

    extra = json.dumps({"overrides": overrides, "transformers": transformers.__version__}, sort_keys=True)
    return hashlib.sha256(f"{file_digest(path)}\n{extra}".encode()).hexdigest()[:32]


def _quiet(fn):
    """Run fn with transformers' progress bars off (its GGUF reader draws one per tensor)."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    before = os.environ.get("TQDM_DISABLE")
    os.environ["TQDM_DISABLE"] = "1"
    try:
        return fn()
    finally:
        if before is None:
            del os.environ["TQDM_DISABLE"]
        else:
            os.environ["TQDM_DISABLE"] = before


def read_gguf_model(path: Path, overrides: dict):
    """(model in float32, tokenizer or None) straight from the GGUF through transformers, offline."""
    import torch

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = dict(gguf_file=path.name, **overrides)

    def read():
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), dtype=torch.float32, **kw).eval()
        try:
            tok = AutoTokenizer.from_pretrained(str(path.parent), **kw)
        except (OSError, ValueError, TypeError, KeyError):
            tok = None  # no tokenizer in the file's metadata: token ids only
        return model, tok
    return _quiet(read)


def _read_copy(folder: Path):
    import torch

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    mark = json.loads((folder / MARK).read_text())
    tok = AutoTokenizer.from_pretrained(str(folder)) if mark.get("tokenizer") else None
    return model, tok


def _save_weights(model, folder: Path) -> None:
    """model.safetensors and config.json of a model transformers' GGUF reader built. Its save_pretrained refuses such
    a model (marked as quantised by gguf, though its weights are plain float32 now), so the weights are written
    directly: each tensor once (a tied output matrix is the embedding's, which from_pretrained ties back), and the
    config without the GGUF quantisation entry."""
    from safetensors.torch import save_file

    seen, state = set(), {}
    for name, t in model.state_dict().items():
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        state[name] = t.detach().contiguous()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))


def _write_copy(root: Path, key: str, model, tok, source: Path) -> None:
    # Written into a temporary folder beside its final name and renamed into place, so a crash or two processes
    # loading the same file at once (torchrun's ranks) leave either nothing or a whole copy.
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=root))
    try:
        _save_weights(model, tmp)
        if tok is not None:
            tok.save_pretrained(str(tmp))
        (tmp / MARK).write_text(json.dumps({"source": str(source), "tokenizer": tok is not None}))
        if (root / key).exists() and not (root / key / MARK).exists():
            shutil.rmtree(root / key, ignore_errors=True)  # not a copy this module wrote whole: replaced
        try:
            tmp.rename(root / key)
        except OSError:
            if not (root / key / MARK).exists():  # not another process's whole copy: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_gguf(path, dtype=None, overrides: dict | None = None):
    """(model, tokenizer or None) of a GGUF file, from its de-quantised copy when one exists (written on the first
    load). dtype: None for float32 (what the GGUF reader gives); another is a cast of the float32 weights.
    overrides: config fields to set where transformers' GGUF reader leaves its defaults (models/load.py)."""
    import torch
    from safetensors import SafetensorError

    path = Path(path)
    overrides = dict(overrides or {})
    root = cache_root()
    key = copy_key(path, overrides) if root is not None else None
    folder = root / key if root is not None else None
    model = tok = None
    if folder is not None and (folder / MARK).exists():
        try:
            model, tok = _quiet(lambda: _read_copy(folder))
        except (OSError, ValueError, KeyError, SafetensorError) as e:  # damaged: read the GGUF again, rewrite it
            warnings.warn(f"the de-quantised copy {folder} of {path} is unreadable ({e}); reading the GGUF")
            shutil.rmtree(folder, ignore_errors=True)
            model = None
    if model is None:  # a model over LARGEST bytes, or a copy that cannot be written: a warning, and the load goes on
        model, tok = read_gguf_model(path, overrides)
        size = sum(t.numel() for t in model.state_dict().values()) * 4
        if folder is not None and size > LARGEST:
            warnings.warn(f"{path} is {size / 2**30:.1f} GiB in float32, over the {LARGEST / 2**30:.0f} GiB that "
                          f"attnlab keeps de-quantised; every load reads the GGUF")
        elif folder is not None:
            try:
                _write_copy(root, key, model, tok, path.resolve())
            except OSError as e:
                warnings.warn(f"could not keep a de-quantised copy of {path} under {root} ({e}); the next load "
                              f"reads the GGUF again (ATTNLAB_CACHE names another folder, or off)")
    if dtype is not None and dtype != torch.float32:
        model = model.to(dtype)
    return model, tok
