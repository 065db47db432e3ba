"""`attnlab export`: a converted model out to the engines people serve with (models/export*.py do the work)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .base import UsageProblem, console, quiet_transformers

FORMATS = ("deepseek", "gguf")


def folder_source(model) -> bool:
    """True when the model was loaded from a transformers folder (its tokenizer files can be copied as they are)."""
    source = getattr(model, "attnlab_source", None)
    return source is not None and Path(source).is_dir()


def export(source: str = typer.Argument(..., help="A converted-model folder (attnlab convert / attnlab heal)."),
           fmt: str = typer.Option(..., "--format", help="deepseek (a DeepseekV3 folder transformers loads) or gguf "
                                   "(one file llama.cpp runs as deepseek2)."),
           out: Path = typer.Option(..., "--out", help="Folder (deepseek) or .gguf file (gguf) to write."),
           force: bool = typer.Option(False, "--force/--no-force", metavar="", help="Overwrite an existing --out."),
           gguf_pre: Optional[str] = typer.Option(None, "--gguf-pre", help="gguf from a folder source: llama.cpp's "
                                                  "pre-tokenizer name when tokenizer.json is not plain ByteLevel."),
           calibration: Optional[Path] = typer.Option(None, "--calibration", help="gguf of an MLA without a latent "
                                                      "norm: a text file to fit one on (llama.cpp always applies "
                                                      "it): one more, nearly constant, latent channel "
                                                      "(latent_norm.add_steady_channels); error reported per layer."),
           calibration_tokens: int = typer.Option(2048, "--calibration-tokens", help="Tokens of it to use."),
           exact_f32: bool = typer.Option(False, "--exact-f32/--no-exact-f32", metavar="",
                                          help="gguf of an MLA without a latent norm: write the exact linear form "
                                               "instead (F32, nothing extra cached); llama.cpp's quantisers (Q8_0, "
                                               "Q4_K_M) destroy it, so never quantise such a file.")):
    """Write a converted model in a standard format, with the tokenizer, for transformers or llama.cpp.

    gguf needs an MLA whose kept rotary frequencies llama.cpp can turn (convert with --rope-select rorope, --rope-dim
    within the source's limit that the error names) and a latent norm (convert --latent-norm steady, or --calibration).
    Example: attnlab export smol-mla --format gguf --calibration corpus.txt --out smol-mla.gguf
    """
    from .. import models as hf

    if fmt not in FORMATS:
        raise UsageProblem(f"--format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    if fmt != "gguf" and (calibration is not None or exact_f32):
        raise UsageProblem(f"{'--calibration' if calibration is not None else '--exact-f32'} applies to --format "
                           "gguf; the DeepSeek export is exact without a latent norm (one constant latent channel)")
    if calibration is not None and exact_f32:
        raise UsageProblem("give --calibration (a fitted norm, survives quantisation) or --exact-f32 (exact, F32 "
                           "only), not both")
    if calibration_tokens < 1:
        raise UsageProblem(f"--calibration-tokens must be a positive number of tokens, got {calibration_tokens}")
    from ..io.folders import check_output
    check_output(out, force=force, sources=hf.source_paths(source))  # before loading anything
    quiet_transformers()
    model, tok, _ = hf.load_model(source)
    modules = hf.attnlab_modules(model)
    if fmt == "deepseek":
        hf.export_deepseek(model, out, tokenizer=None if folder_source(model) else tok, force=force)
        cached, how = _cached(modules[0], constant=True)
    else:
        normless = [i for i, m in enumerate(modules) if getattr(m, "kv_norm", None) is None]
        if (calibration is not None or exact_f32) and not normless:
            raise UsageProblem(f"every layer of {source} already has a latent norm: "
                               f"{'--calibration' if calibration is not None else '--exact-f32'} is not needed")
        if calibration is not None:
            from ..models.export.deepseek_gguf import gguf_rope_limit
            hf.check_gguf_exportable(modules, limit=gguf_rope_limit(model), exact_f32=True)  # before fitting
            _fit_steady(model, tok, calibration, calibration_tokens)
        hf.export_gguf(model, out, tokenizer=tok, force=force, pre_tokenizer=gguf_pre, exact_f32=exact_f32)
        m0 = hf.attnlab_modules(model)[0]  # read again: fitting the steady channel replaced the modules
        cached, how = _cached(m0, constant=False)
        if m0.latent_dim % 32 or m0.rope_dim % 32:
            console.print(f"note: llama.cpp's quantised KV caches (--cache-type-k q8_0: blocks of 32) need a latent "
                          f"({m0.latent_dim}) and a rope key ({m0.rope_dim}) that are multiples of 32; this file runs "
                          "with f16/f32 caches only")
    console.print(f"the export caches {cached} values per token per layer ({how})")
    console.print(f"wrote {out}")


def _cached(m, constant: bool) -> tuple[int, str]:
    """(values per token per layer, what they are) that the exported model caches."""
    extra = constant and m.kv_norm is None  # DeepSeek's constant channel
    parts = [f"latent {m.latent_dim}"] + ["1 constant channel"] * extra + [f"rope {m.rope_dim}"]
    return m.latent_dim + extra + m.rope_dim, " + ".join(parts)


def _fit_steady(model, tok, calibration: Path, calibration_tokens: int) -> None:
    """Give every layer a latent norm with a steady channel fitted on the text (in place); print the errors."""
    from .. import models as hf
    from ..models.export.latent_norm import add_steady_channels

    ids = hf.read_text_ids(tok, calibration, calibration_tokens)
    if ids.numel() == 0:
        raise UsageProblem(f"{calibration}: 0 tokens; calibration needs text")
    errors = add_steady_channels(model, ids)
    console.print("latent norms fitted (steady channel, one more cached number per token): output error per "
                  "layer (added by the norm) " + " ".join(f"{e:.2e}" for e in errors)
                  + f"; max {max(errors):.2e}, mean {sum(errors) / len(errors):.2e}")
