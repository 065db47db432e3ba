"""PNG figures for the CLI (matplotlib, imported only here)."""
from __future__ import annotations

from pathlib import Path

import torch


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp, dpi=110, bbox_inches="tight")
    tmp.replace(path)
    return path


def tour_figures(folder: Path) -> list[Path]:
    """Singular values of a tiled GQA projection (Parts 6, 9) and KV bytes against context (Part 14)."""
    from ..bench.presets import AttentionConfig
    from ..modules.heads import tile_heads

    plt = _pyplot()
    folder = Path(folder)
    torch.manual_seed(0)
    D, H, G = 1024, 32, 8
    d = D // H
    tiled = tile_heads(torch.randn(G * d, D, dtype=torch.float64), H, G, "strided")
    sv = torch.linalg.svdvals(tiled)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.semilogy(sv.numpy(), ".", ms=3)
    ax.axvline(G * d, color="red", ls="--", label=f"G*d = {G * d}")
    ax.set(xlabel="index", ylabel="singular value",
           title=f"Tiled GQA projection ({D}x{D}, H={H}, G={G}): rank G*d")
    ax.set_ylim(max(float(sv.min()), 1e-18), float(sv.max()) * 10)
    ax.legend()
    paths = [_save(fig, folder / "tiled_gqa_singular_values.png")]
    plt.close(fig)
    configs = [AttentionConfig("MHA", "gqa", 1, D, H, d, num_kv_heads=H),
               AttentionConfig(f"GQA G={G}", "gqa", 1, D, H, d, num_kv_heads=G),
               AttentionConfig("MLA r=50", "mla", 1, D, H, d, latent_dim=50)]
    paths.append(kv_plot(configs, torch.float32, folder / "kv_bytes_vs_context.png"))
    return paths


def kv_plot(configs, dtype, path: Path) -> Path:
    from ..bench.presets import kv_footprint

    plt = _pyplot()
    contexts = [2 ** k for k in range(9, 18)]
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for c in configs:
        ax.loglog(contexts, [kv_footprint(c, context=n, dtype=dtype).bytes_total / 2 ** 20 for n in contexts],
                  marker="o", ms=3, label=c.name)
    ax.set(xlabel="context length (tokens)", ylabel="KV cache (MiB, batch 1)",
           title=f"KV cache against context ({str(dtype).removeprefix('torch.')})")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    out = _save(fig, Path(path))
    plt.close(fig)
    return out


def decode_plot(rows: list[dict], path: Path) -> Path:
    """Decode-step time against context length, one line per variant (rows from bench.decode_suite)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for variant in dict.fromkeys(r["variant"] for r in rows):
        pts = [(r["context"], r["ms"]) for r in rows if r["variant"] == variant]
        ax.loglog(*zip(*pts), marker="o", label=variant)
    ax.set(xlabel="context length (tokens)", ylabel="ms per decode step", title="Decode step, B=1, float32")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    out = _save(fig, Path(path))
    plt.close(fig)
    return out
