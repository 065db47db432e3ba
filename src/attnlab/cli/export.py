"""`attnlab export`: a converted model out to the engines people serve with (models/export*.py do the work)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .base import UsageProblem, console

FORMATS = ("deepseek", "gguf")


def folder_source(model) -> bool:
    """True when the model was loaded from a transformers folder (its tokenizer files can be copied as they are)."""
    source = getattr(model, "attnlab_source", None)
    return source is not None and Path(source).is_dir()


def export(source: str = typer.Argument(..., help="A converted-model folder (attnlab convert / attnlab heal)."),
           fmt: str = typer.Option(..., "--format", help="deepseek (a DeepseekV3 folder transformers loads) or gguf "
                                   "(one file llama.cpp runs as deepseek2)."),
           out: Path = typer.Option(..., "--out", help="Folder (deepseek) or .gguf file (gguf) to write."),
           force: bool = typer.Option(False, "--force", help="Overwrite an existing --out."),
           gguf_pre: Optional[str] = typer.Option(None, "--gguf-pre", help="gguf from a folder source: llama.cpp's "
                                                  "pre-tokenizer name when tokenizer.json is not plain ByteLevel.")):
    """Write a converted model in a standard format, with the tokenizer, for transformers or llama.cpp.

    gguf needs an MLA whose kept rotary frequencies llama.cpp can turn (convert with
    --rope-select rorope and --rope-dim <= head_dim).
    Example: attnlab export smol-mla --format gguf --out smol-mla.gguf
    """
    from .. import models as hf

    if fmt not in FORMATS:
        raise UsageProblem(f"--format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    if out.exists() and not force:
        raise UsageProblem(f"{out} exists; pass --force to overwrite it")
    model, tok, _ = hf.load_model(source)
    if fmt == "deepseek":
        hf.export_deepseek(model, out, tokenizer=None if folder_source(model) else tok, force=True)
    else:
        hf.export_gguf(model, out, tokenizer=tok, force=True, pre_tokenizer=gguf_pre)
    console.print(f"wrote {out}")
