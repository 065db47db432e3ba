"""Comparison tables for lossy conversions; prints Markdown and writes benchmarks/results/conversions.json.

    python benchmarks/quality/conversions.py

Model: attention with dim 256, 8 heads of 32, biases, float64, random weights.
Inputs: anisotropic, as real activations are: x = z @ diag(s) with z ~ N(0, I) and
s log-spaced from 1 to 1e-2 (a few directions carry most of the variance).
Calibration and evaluation use different samples of that distribution. Two MHA
models: "random" (independent heads) and "clustered" (heads of a group are a
shared head plus 30% noise, as in a model uptrained from GQA).
"""
import json
from pathlib import Path

import torch

from attnlab import GroupedQueryAttention
from attnlab.convert import gqa_to_mha, mha_to_gqa, mha_to_mla, probe_error

F64 = torch.float64
DIM, H, D_HEAD = 256, 8, 32


def inputs(n, seed):
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(0, -2, DIM, dtype=F64)
    return torch.randn(n, 64, DIM, generator=g, dtype=F64) * scale


def model(kind):
    torch.manual_seed(0)
    if kind == "random":
        m = GroupedQueryAttention(DIM, H, H, bias=True, dtype=F64)
    else:
        g = GroupedQueryAttention(DIM, H, 2, bias=True, grouping="blocked", dtype=F64)
        m, _ = gqa_to_mha(g)
        with torch.no_grad():
            for lin in (m.W_K, m.W_V):
                lin.weight.add_(0.3 * lin.weight.std() * torch.randn_like(lin.weight))
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 1:
                p.normal_(0, 0.1)
    return m


def main():
    calib, held_out = inputs(16, 1), inputs(16, 2)
    out = {"mha_to_gqa": [], "mha_to_mla": []}
    lines = ["### MHA -> GQA: output error on held-out inputs (lower is better)", "",
             "| model | G | KV values/token | mean | fit (weights) | fit (calibrated) |",
             "|---|---|---|---|---|---|"]
    for kind in ("random", "clustered"):
        m = model(kind)
        for G in (4, 2, 1):
            row = {"model": kind, "G": G}
            for name, kw in (("mean", dict(method="mean")), ("fit_weights", dict(method="fit")),
                             ("fit_calibrated", dict(method="fit", calibration=calib))):
                new, report = mha_to_gqa(m, G, grouping="blocked", **kw)
                row[name] = probe_error(m, new, held_out)
                row["kv_values"] = report.kv_values_after
            out["mha_to_gqa"].append(row)
            lines.append(f"| {kind} | {G} | {row['kv_values']} | {row['mean']:.4f} | {row['fit_weights']:.4f} | "
                         f"{row['fit_calibrated']:.4f} |")
    lines += ["", "### MHA -> MLA: output error on held-out inputs at equal latent size", "",
              "| latent r | KV values/token | weight SVD | activation-aware | energy kept (weights) |",
              "|---|---|---|---|---|"]
    m = model("random")
    for r in (16, 32, 64, 128, 256):
        plain, rep = mha_to_mla(m, latent_dim=r)
        aware, _ = mha_to_mla(m, latent_dim=r, calibration=calib)
        row = {"latent_dim": r, "weight_svd": probe_error(m, plain, held_out),
               "activation_aware": probe_error(m, aware, held_out), "energy_kept": rep.energy_kept}
        out["mha_to_mla"].append(row)
        lines.append(f"| {r} | {r} | {row['weight_svd']:.4f} | {row['activation_aware']:.4f} | "
                     f"{row['energy_kept']:.3f} |")
    print("\n".join(lines))
    path = Path(__file__).resolve().parents[1] / "results" / "conversions.json"
    path.write_text(json.dumps(out, indent=2))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
