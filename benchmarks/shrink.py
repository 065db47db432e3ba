"""shrink on SmolLM2-135M: the planner's choice before training, and what one `attnlab shrink` command gives.

    python benchmarks/shrink.py --part proxy [--budget 50%,25%]     # every candidate: proxy KL vs held-out perplexity
    python benchmarks/shrink.py --part run --case NAME [--redo]     # one shrink command, timed, evaluated
    python benchmarks/shrink.py --part run --case NAME --model gemma3-270m   # the same command on Gemma 3 270M
    python benchmarks/shrink.py --part curve                        # bytes/token vs perplexity: baselines, MLA bits
    python benchmarks/shrink.py --part bits                         # few-bit latent storages: groups, rope bits, rotation
    python benchmarks/shrink.py --part keys                         # every value kept: the key per token or per channel
    python benchmarks/shrink.py --part plot                         # benchmarks/kv_bytes_vs_ppl.png from the rows
    python benchmarks/shrink.py --part report                       # the tables of docs/models.md

Run it alone on the machine (it records the load average before and after each figure and warns
above 1). Rows go to benchmarks/shrink.json, merged by key.

Texts, none overlapping another:
- calibration and training: Python's documentation (pydoc_data.topics) for the "--text" cases;
  text the model writes itself for the no-text cases (shrink's default);
- evaluation: /usr/share/common-licenses/GPL-3, first 2048 tokens in windows of 512 (never
  calibrated or trained on). The shrink commands run exactly as recorded in each row's "argv" (rows before
  2026-11-25 ran with a hidden `--eval-text Apache-2.0` that their "command" left out). The headline figures,
  on four texts and three seeds, are benchmarks/protocol.py's;
- the proxy part calibrates on MPL-2.0 (its first 2048 tokens) as docs/models.md's ablation
  did, so its before-training perplexities compare with that table's, and scores the candidates
  on MPL-2.0's next 1024 tokens (the planner's proxy, shrink.plan.plan's proxy_ids).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
import warnings
from pathlib import Path

HERE = Path(__file__).parent
JSON = HERE / "shrink.json"
EVALUATION = "/usr/share/common-licenses/GPL-3"
CALIBRATION = "/usr/share/common-licenses/MPL-2.0"

CASES = {  # name: (shrink arguments, what it checks)
    "50-notext-10": (["--kv-budget", "50%", "--minutes", "10", "--kv-dtype", "bf16"],
                     "50% with no text and no other flag, 10 minutes (16-bit cache: the values cut in half)"),
    "50-notext-10-auto": (["--kv-budget", "50%", "--minutes", "10"],
                          "the same command as a user types it (--kv-dtype auto may pick 8-bit)"),
    "50-text-30": (["--kv-budget", "50%", "--minutes", "30", "--kv-dtype", "bf16", "--text", "{pydoc}"],
                   "50% with text, 30 minutes"),
    "25-text-30": (["--kv-budget", "25%", "--minutes", "30", "--kv-dtype", "bf16", "--text", "{pydoc}"],
                   "the 75% cut with text, 30 minutes, 16-bit"),
    "25-bytes-text-30": (["--kv-budget", "25%", "--minutes", "30", "--text", "{pydoc}"],
                         "25% of the original's 16-bit bytes, 8-bit storage allowed, 30 minutes"),
    "25-notext-10": (["--kv-budget", "25%"], "25% as a user types it: no text, no other flag, 10 minutes "
                     "(--kv-dtype auto may pick 4- or 2-bit latents)"),
    "25-notext-10-ctx32k": (["--kv-budget", "25%", "--context", "32768"],
                            "25% of the bytes at a 32,768-token context (a sliding layer holds its window), no text, "
                            "10 minutes: the planner may keep the sliding layers and cut the global ones"),
    "12-text-30": (["--kv-budget", "12.5%", "--minutes", "30", "--text", "{pydoc}"], "12.5% with text, 30 minutes"),
    "6-text-30": (["--kv-budget", "6.25%", "--minutes", "30", "--text", "{pydoc}"], "6.25% with text, 30 minutes"),
    "12-gguf-notext-10": (["--kv-budget", "12.5%", "--format", "gguf"],
                          "12.5% as a GGUF, no text, 10 minutes: the planner picks llama.cpp's cache type; perplexity "
                          "in llama.cpp with that cache type and with f16"),
    "50-gguf-text-30": (["--kv-budget", "50%", "--minutes", "30", "--format", "gguf", "--text", "{pydoc}"],
                        "50% as a GGUF (quantised by llama.cpp in benchmarks/export_gguf.py)"),
}


def load() -> float:
    return os.getloadavg()[0]


def note_load(row: dict, key: str) -> None:
    row[key] = load()
    if row[key] > 1:
        warnings.warn(f"load average {row[key]:.2f} > 1: something else runs; the timings are not alone")


def pydoc_text() -> Path:
    import pydoc_data.topics as topics

    path = Path(tempfile.gettempdir()) / "attnlab-bench-pydoc-topics.txt"
    path.write_text("\n\n".join(topics.topics.values()), encoding="utf-8")
    return path


def save(key: str, row: dict) -> None:
    data = json.loads(JSON.read_text()) if JSON.exists() else {}
    data[key] = row
    JSON.write_text(json.dumps(data, indent=2))


def evaluate(source: str, context: int | None = None) -> dict:
    from attnlab import models as hf

    model, tok, meta = hf.load_model(source)
    ids = hf.read_text_ids(tok, EVALUATION, 2048)
    at = {} if context is None else {"kv_bytes_per_token_at_context": hf.kv_bytes_per_token(model, context=context),
                                     "context": context}
    return {"perplexity": hf.perplexity(model, ids, window=512), "kv_bytes_per_token": hf.kv_bytes_per_token(model),
            **at}


def part_proxy(budgets: list[str]) -> None:
    """Every candidate the planner measures, with its held-out perplexity: how well the proxy ranks."""
    import copy

    from attnlab import models as hf
    from attnlab.shrink.plan import apply, plan, rank_agreement
    from attnlab.shrink.sizes import parse_budget

    teacher, tok, _ = hf.load_model("smollm2")
    full = hf.read_text_ids(tok, CALIBRATION, 2048 + 1024)
    cal, scoring = full[:, :2048], full[:, 2048:]  # calibrated on the first 2048 tokens, scored on the next 1024
    ev = hf.read_text_ids(tok, EVALUATION, 2048)
    original = hf.perplexity(teacher, ev)
    for b in budgets:
        row = {"budget": b}
        note_load(row, "load_before")
        t0 = time.monotonic()
        result = plan(teacher, cal, parse_budget(b), storages=("bf16",), proxy_ids=scoring)
        row["plan_seconds"] = time.monotonic() - t0
        cands = []
        for c in result.measured:
            m = copy.deepcopy(teacher)
            apply(m, c, cal)
            ppl = hf.perplexity(m, ev)
            cands.append({**c.to_dict(), "perplexity": ppl, "ratio": ppl / original})
            print(f"{b} {c.label():45s} proxy {c.proxy:.4f}  perplexity {cands[-1]['perplexity']:.2f}", flush=True)
        row.update(original=original, chosen=result.best.label(), candidates=cands,
                   spearman=rank_agreement([c["proxy"] for c in cands], [c["perplexity"] for c in cands]))
        note_load(row, "load_after")
        save(f"proxy-{b}", row)
        print(f"{b}: chosen {row['chosen']}, Spearman {row['spearman']:.3f}")


CURVE_FRACTIONS = (0.75, 0.5, 0.25)  # of the original's KV values per token and layer
MLA_STORAGES = ("bf16", "int8", "int4/g32+r8", "int2/g32+r8")  # the few-bit ones on a rotated latent
BASELINES = ("bf16", "int8", "q8_0", "q5_0", "q4_1", "q4_0", "kivi4", "kivi2")  # the original's cache, no training
PLOT = HERE / "kv_bytes_vs_ppl.png"


def part_curve() -> None:
    """Bytes per token against held-out perplexity, no training: the original's cache in every training-free
    storage users have today (llama.cpp's types, KIVI, int8), GQA merged to fewer KV heads (mean of the
    heads), and MLA at several sizes (RoRoPE by score with BKV, 30% of the values rotating) in 16, 8, 4 and
    2 bits (the few-bit ones with the latent rotated, the rope key in 8 bits); the healed shrink runs are
    added from their rows. Calibration MPL-2.0 (2048 tokens), evaluation GPL-3 (2048, windows of 512)."""
    import copy

    from attnlab import models as hf
    from attnlab.convert.choose import convert as convert_module
    from attnlab.convert.rotate import rotate_latent
    from attnlab.models.convert import convert_layers

    teacher, tok, _ = hf.load_model("smollm2")
    cal = hf.read_text_ids(tok, CALIBRATION, 2048)
    ev = hf.read_text_ids(tok, EVALUATION, 2048)
    first = hf.attnlab_modules(teacher)[0]
    G, d = first.num_kv_heads, first.head_dim
    values = 2 * G * d
    row = {"points": []}
    note_load(row, "load_before")

    def measure(model, kind: str, label: str, storages) -> None:
        for storage in storages:
            hf.set_kv_dtype(model, storage)
            point = {"kind": kind, "label": label, "storage": storage, "perplexity": hf.perplexity(model, ev),
                     "kv_bytes_per_token": hf.kv_bytes_per_token(model)}
            row["points"].append(point)
            print(f"{kind:9s} {label:28s} {storage:12s} {point['kv_bytes_per_token']:6d} B/token  "
                  f"perplexity {point['perplexity']:.2f}", flush=True)
        hf.set_kv_dtype(model, None)

    measure(teacher, "original", f"GQA, {G} KV heads", BASELINES)
    for g in [g for g in range(G - 1, 0, -1) if first.num_heads % g == 0]:
        m = copy.deepcopy(teacher)
        convert_layers(m, lambda mod, x: convert_module(mod, "gqa", num_kv_heads=g, method="mean", calibration=x),
                       calibration_ids=cal)
        measure(m, "gqa", f"GQA, {g} KV head{'s' * (g > 1)}", ("bf16", "int8"))
    for f in CURVE_FRACTIONS:
        total = round(f * values)
        rope = 2 * round(0.3 * total / 2)
        m = copy.deepcopy(teacher)
        hf.convert_model(m, "mla", latent_dim=total - rope, rope_dim=rope, calibration_ids=cal,
                         pair_selection="rorope-score", balance=True)
        label = f"MLA r={total - rope} p={rope} ({f:.1%} of the values)"
        measure(m, "mla", label, MLA_STORAGES[:2])
        for mod in hf.attnlab_modules(m):
            rotate_latent(mod, "random")
        measure(m, "mla", label + ", rotated", MLA_STORAGES[2:])
    note_load(row, "load_after")
    save("curve", row)
    plot()


def plot() -> None:
    """benchmarks/kv_bytes_vs_ppl.png from the curve row and the healed run rows of shrink.json: the
    original's training-free storages as one curve, untrained MLA per storage, the healed shrinks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(JSON.read_text())
    points = data["curve"]["points"]
    fig, ax = plt.subplots(figsize=(7.5, 5.8))
    base = sorted((p for p in points if p["kind"] == "original"), key=lambda p: p["kv_bytes_per_token"])
    ax.plot([p["kv_bytes_per_token"] for p in base], [p["perplexity"] for p in base], "k*-",
            label="the original, its cache quantized (no training)")
    for p in base:
        ax.annotate(p["storage"], (p["kv_bytes_per_token"], p["perplexity"]), textcoords="offset points",
                    xytext=(4, 4), fontsize=7)
    styles = {("gqa", "bf16"): ("tab:green", "s", "GQA, fewer KV heads, 16-bit"),
              ("mla", "bf16"): ("tab:blue", "o", "MLA (no training), 16-bit"),
              ("mla", "int8"): ("tab:orange", "o", "MLA (no training), 8-bit"),
              ("mla", "int4/g32+r8"): ("tab:purple", "o", "MLA (no training), 4-bit latent, rotated"),
              ("mla", "int2/g32+r8"): ("tab:brown", "o", "MLA (no training), 2-bit latent, rotated")}
    for (kind, storage), (color, marker, name) in styles.items():
        pts = sorted((p for p in points if p["kind"] == kind and p["storage"] == storage),
                     key=lambda p: p["kv_bytes_per_token"])
        if pts:
            ax.plot([p["kv_bytes_per_token"] for p in pts], [p["perplexity"] for p in pts], marker=marker,
                    color=color, linestyle="-", label=name)
    for per_channel, (color, marker, name) in {True: ("tab:cyan", "^", "MLA (no training), every value, the key per "
                                                       "channel in 4 bits (+c4), values 4/3/2-bit"),
                                               False: ("tab:olive", "v", "MLA (no training), every value, the key per "
                                                       "token")}.items():
        pts = [r for r in data.get("keys", {}).get("rows", []) if r["storage"].endswith("+c4") is per_channel]
        if pts:
            ax.scatter([r["kv_bytes_per_token"] for r in pts], [r["perplexity"] for r in pts], marker=marker,
                       color=color, zorder=4, label=name)
    # SmolLM2's runs (the curves are its own), each case's current row: the earlier ones kept under suffixed keys
    # (run-<case>-before-..., ...-probe-in-warmup) are history, not points
    healed = [data[run_key(case, "smollm2")] for case in CASES if run_key(case, "smollm2") in data]
    healed = [r for r in healed if "evaluation" in r and "note" not in r]
    if healed:
        ax.scatter([r["evaluation"]["kv_bytes_per_token"] for r in healed],
                   [r["evaluation"]["perplexity"] for r in healed], marker="D", color="tab:red", zorder=5,
                   label="attnlab shrink (healed)")
        for r in healed:
            ev = r["evaluation"]
            ax.annotate(f"{r['case']}: {ev['perplexity']:.1f}", (ev["kv_bytes_per_token"], ev["perplexity"]),
                        textcoords="offset points", xytext=(6, -10), fontsize=7, color="tab:red")
    original = next(p["perplexity"] for p in points if p["kind"] == "original" and p["storage"] == "bf16")
    ax.axhline(1.10 * original, color="grey", linestyle=":", linewidth=1, label="1.10x the original's perplexity")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_ylim(top=min(ax.get_ylim()[1], 4 * original))
    ax.set_xlabel("KV-cache bytes per token (whole model, scales and minima included)")
    ax.set_ylabel("perplexity, GPL-3 (held out)")
    ax.set_title("SmolLM2-135M: bytes per token against perplexity")
    ax.grid(True, which="both", alpha=0.3)
    fig.legend(*ax.get_legend_handles_labels(), loc="lower center", ncol=2, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.2, 1, 1))
    fig.savefig(PLOT, dpi=120)
    print(f"wrote {PLOT}")


BITS_ROWS = (("bf16", False), ("int8", False), ("int4/g32", False), ("int4/g32", True), ("int4/g64", True),
             ("int4/g32+r8", False), ("int4/g32+r8", True), ("int2/g32", True), ("int2/g32+r8", True))


def _fixed_mla(latent: int, rope: int, balance: bool):
    """(SmolLM2 converted to one MLA: RoRoPE by score, calibrated on MPL-2.0; GPL-3 ids; a row with the original's
    perplexity and the load before)."""
    import copy

    from attnlab import models as hf

    teacher, tok, _ = hf.load_model("smollm2")
    cal = hf.read_text_ids(tok, CALIBRATION, 2048)
    ev = hf.read_text_ids(tok, EVALUATION, 2048)
    row = {"original": hf.perplexity(teacher, ev), "rows": []}
    note_load(row, "load_before")
    model = copy.deepcopy(teacher)
    hf.convert_model(model, "mla", latent_dim=latent, rope_dim=rope, calibration_ids=cal,
                     pair_selection="rorope-score", balance=balance)
    return model, ev, row


def _scored(model, storage: str, ev) -> dict:
    """The model's GPL-3 perplexity and bytes per token with its caches in `storage` (set back to none after)."""
    from attnlab import models as hf

    hf.set_kv_dtype(model, storage)
    out = {"storage": storage, "perplexity": hf.perplexity(model, ev), "kv_bytes_per_token": hf.kv_bytes_per_token(model)}
    hf.set_kv_dtype(model, None)
    return out


def _rotated(model):
    import copy

    from attnlab import models as hf
    from attnlab.convert.rotate import rotate_latent

    out = copy.deepcopy(model)
    for mod in hf.attnlab_modules(out):
        rotate_latent(mod, "random")
    return out


def part_bits() -> None:
    """How to store a latent in few bits, no training: one MLA at half the original's values (r=134, p=58;
    RoRoPE by score + BKV, calibrated on MPL-2.0), each storage with and without the latent rotated (a
    random orthogonal matrix folded into the weights), evaluated on GPL-3. Chooses group size, the rope
    key's bits and the rotation by measurement."""
    plain, ev, row = _fixed_mla(134, 58, True)
    rotated = _rotated(plain)
    for storage, rot in BITS_ROWS:
        r = {**_scored(rotated if rot else plain, storage, ev), "rotated": rot}
        row["rows"].append(r)
        print(f"{storage:12s} rotated={rot!s:5s} {r['kv_bytes_per_token']:6d} B/token  perplexity {r['perplexity']:.3f}",
              flush=True)
    note_load(row, "load_after")
    save("bits", row)


KEY_ROWS = ("int4/g32+r8", "int4/g32+c4", "int4/g32", "int3/g64+c4", "int3/g64", "int2/g32+c4", "int4/g32+c2",
            "int3/g64+c2")


def part_keys() -> None:
    """Where the bytes of a few-bit cache go when nothing is cut to low rank: every value of the original kept
    (the whole key as the rope key, p = 192; the values as the latent, r = 192, rotated), the key per token
    (in 8 or 4 bits) or per channel over groups of 64 tokens (+c4), the values in 4, 3 or 2 bits; no training,
    calibrated on MPL-2.0, evaluated on GPL-3."""
    model, ev, row = _fixed_mla(192, 192, False)
    model = _rotated(model)
    for storage in KEY_ROWS:
        r = _scored(model, storage, ev)
        row["rows"].append(r)
        print(f"{storage:12s} {r['kv_bytes_per_token']:6d} B/token  perplexity {r['perplexity']:.3f} "
              f"({r['perplexity'] / row['original']:.3f}x)", flush=True)
    note_load(row, "load_after")
    save("keys", row)


def part_report() -> None:
    """The rows of shrink.json as Markdown tables (what docs/models.md shows)."""
    from attnlab.shrink.baselines import at_or_above

    data = json.loads(JSON.read_text()) if JSON.exists() else {}
    for key in sorted(k for k in data if k.startswith("proxy-")):
        r = data[key]
        print(f"\n{r['budget']}: chosen {r['chosen']}, Spearman {r['spearman']:.3f}, original {r['original']:.2f}\n")
        print("| candidate | bytes/token | proxy KL | perplexity | ratio |\n|---|---|---|---|---|")
        for c in sorted(r["candidates"], key=lambda c: c["proxy"]):
            print(f"| {c['label']} | {c['bytes_per_token']} | {c['proxy']:.4f} | {c['perplexity']:.2f} | "
                  f"{c['ratio']:.3f}x |")
    if "bits" in data:
        b = data["bits"]
        plain = next(r["perplexity"] for r in b["rows"] if r["storage"] == "bf16")
        print(f"\nfew-bit storages of MLA r=134 p=58 (original {b['original']:.2f})\n")
        print("| storage | latent rotated | KV bytes/token | share of 16-bit | perplexity | over its 16-bit cache |\n"
              "|---|---|---|---|---|---|")
        for r in b["rows"]:
            print(f"| {r['storage']} | {'yes' if r['rotated'] else 'no'} | {r['kv_bytes_per_token']} | "
                  f"{r['kv_bytes_per_token'] / 23040:.1%} | {r['perplexity']:.2f} | {r['perplexity'] / plain:.3f}x |")
    if "keys" in data:
        k = data["keys"]
        print(f"\nevery value kept, the key per token or per channel (original {k['original']:.2f})\n")
        print("| storage | KV bytes/token | share of 16-bit | perplexity | ratio |\n|---|---|---|---|---|")
        for r in k["rows"]:
            print(f"| {r['storage']} | {r['kv_bytes_per_token']} | {r['kv_bytes_per_token'] / 23040:.1%} | "
                  f"{r['perplexity']:.2f} | {r['perplexity'] / k['original']:.3f}x |")
    base = [p for p in data.get("curve", {}).get("points", []) if p["kind"] == "original"]
    if base:
        original = next(p["perplexity"] for p in base if p["storage"] == "bf16")
        print("\nthe original's cache, no training (GPL-3)\n\n| storage | KV bytes/token | share | perplexity | ratio |\n"
              "|---|---|---|---|---|")
        for p in sorted(base, key=lambda p: -p["kv_bytes_per_token"]):
            print(f"| {p['storage']} | {p['kv_bytes_per_token']} | {p['kv_bytes_per_token'] / 23040:.1%} | "
                  f"{p['perplexity']:.2f} | {p['perplexity'] / original:.3f}x |")
        mla = [p for p in data["curve"]["points"] if p["kind"] == "mla"]
        if mla:
            print("\nuntrained MLA\n\n| MLA | storage | KV bytes/token | share | perplexity | ratio |\n|---|---|---|---|---|---|")
            for p in mla:
                print(f"| {p['label']} | {p['storage']} | {p['kv_bytes_per_token']} | "
                      f"{p['kv_bytes_per_token'] / 23040:.1%} | {p['perplexity']:.2f} | {p['perplexity'] / original:.3f}x |")
    runs = [data[k] for k in sorted(data) if k.startswith("run-")]
    for r in runs:
        ev = r.get("evaluation")
        if r.get("model", "smollm2") != "smollm2":  # its baselines are in its own report (and benchmarks/gemma3.py)
            against = (r.get("report") or {}).get("baselines", {}).get("against") or {}
            if ev and against.get("baseline"):
                print(f"{r['model']} {r['case']}: {ev['perplexity']:.2f} at {ev['kv_bytes_per_token']} B; best "
                      f"baseline at >= its bytes (its report, Apache-2.0): {against['baseline']} at "
                      f"{against['baseline_bytes']} B")
            continue
        sizes = {p["storage"]: p["kv_bytes_per_token"] for p in base if p["storage"] != "bf16"}
        names = at_or_above(sizes, ev["kv_bytes_per_token"]) if ev else []
        fair = [p for p in base if p["storage"] in names]
        if fair:
            best = min(fair, key=lambda p: p["perplexity"])
            print(f"{r['case']}: {ev['perplexity']:.2f} at {ev['kv_bytes_per_token']} B; best baseline at the two "
                  f"smallest sizes >= its bytes: {best['storage']} {best['perplexity']:.2f} at {best['kv_bytes_per_token']} B "
                  f"-> {'beats' if ev['perplexity'] < best['perplexity'] else 'does not beat'} "
                  f"({ev['perplexity'] / best['perplexity']:.3f}x)")
    if runs:
        print("\n| case | command | plan | KV bytes/token | perplexity GPL-3 | ratio | wall min | load |\n"
              "|---|---|---|---|---|---|---|---|")
    for r in runs:
        ev = r.get("evaluation", {})
        print(f"| {r['case']} | `{r['command']}` | {r.get('plan', {}).get('label', '-') if isinstance(r.get('plan'), dict) else r.get('plan')} | "
              f"{ev.get('kv_bytes_per_token', '-')} | {ev.get('perplexity', float('nan')):.2f} | "
              f"{r.get('ratio', float('nan')):.3f}x | {r['wall_minutes']:.1f} | "
              f"{r['load_before']:.2f}/{r['load_after']:.2f} |")


MODELS = ("smollm2", "gemma3-270m")  # bundled models a run may shrink


def run_key(case: str, model: str) -> str:
    """The row of one run in shrink.json: run-<case> for SmolLM2 (the rows before --model), run-<model>-<case> else."""
    return f"run-{case}" if model == "smollm2" else f"run-{model}-{case}"


def llama_cpp_rows(path: Path, model: str, report: dict) -> dict:
    """A GGUF shrink in llama.cpp: GPL-3 perplexity and KV bytes per token (llama.cpp's log) with the cache type it
    was planned and healed for (flash attention on) and with llama.cpp's default f16 cache."""
    from export_gguf import llama_perplexity, open_llama

    from attnlab import models as hf

    _, tok, _ = hf.load_model(model)
    ids = hf.read_text_ids(tok, EVALUATION, 2048)[0].tolist()
    planned = report["llama_cpp"]["cache_type_k"]
    rows = {}
    for cache in dict.fromkeys((planned, "f16")):
        llm, per_token = open_llama(path, 512, logits_all=True, cache=None if cache == "f16" else cache)
        rows[cache] = {"perplexity": llama_perplexity(llm, ids)[0], "kv_bytes_per_token": per_token}
        del llm
    rows["planned"] = planned
    rows["ratio_to_f16"] = rows[planned]["perplexity"] / rows["f16"]["perplexity"]
    return rows


HEAL_KEYS = ("probe", "distill_steps", "steps_done", "layers_restored", "lr_scale", "kept")  # what the heal did


def part_run(case: str, redo: bool, model: str = "smollm2") -> None:
    """One `attnlab shrink MODEL ...` command in a child process, its wall time, and its output on GPL-3."""
    data = json.loads(JSON.read_text()) if JSON.exists() else {}
    key = run_key(case, model)
    if key in data and not redo:
        print(f"{key} is in {JSON}; --redo to run it again")
        return
    args, what = CASES[case]
    args = [a.replace("{pydoc}", str(pydoc_text())) for a in args]
    work = Path(tempfile.mkdtemp(prefix="attnlab-shrink-bench-"))
    out = work / ("out.gguf" if "gguf" in args else "out")
    command = ["attnlab", "shrink", model, *args, "--out", str(out)]  # exactly what runs: nothing added
    row = {"case": case, "model": model, "what": what, "argv": command, "command": " ".join(command)}
    note_load(row, "load_before")
    t0 = time.monotonic()
    proc = subprocess.run(command, capture_output=True, text=True)
    row["wall_minutes"] = (time.monotonic() - t0) / 60
    note_load(row, "load_after")
    row["returncode"] = proc.returncode
    if proc.returncode:
        row["stderr"] = proc.stderr[-2000:]
        save(key, row)
        raise SystemExit(f"shrink failed: {proc.stderr[-500:]}")
    report = json.loads((out / "config.json").read_text())["shrink"] if out.is_dir() and \
        (out / "attention.safetensors").exists() else json.loads(out.with_name(out.name + ".shrink.json").read_text())
    row["report"] = {k: report.get(k) for k in ("kv_bytes_per_token", "held_out", "minutes", "heal_plan", "baselines")}
    row["report"]["heal"] = {k: (report.get("heal") or {}).get(k) for k in HEAL_KEYS}
    row["plan"] = report["plan"].get("chosen")
    row["candidates"] = [{k: c.get(k) for k in ("round", "label", "bytes_per_token", "proxy")}
                         for c in report["plan"].get("candidates", [])]
    if out.is_dir() and (out / "attention.safetensors").exists():
        from attnlab import models as hf

        teacher, tok, _ = hf.load_model(model)
        ids = hf.read_text_ids(tok, EVALUATION, 2048)
        row["original"] = hf.perplexity(teacher, ids)
        row["evaluation"] = evaluate(str(out), int(args[args.index("--context") + 1]) if "--context" in args else None)
        row["ratio"] = row["evaluation"]["perplexity"] / row["original"]
    elif out.suffix == ".gguf":
        from attnlab import models as hf

        teacher, tok, _ = hf.load_model(model)
        row["original"] = hf.perplexity(teacher, hf.read_text_ids(tok, EVALUATION, 2048))
        row["llama_cpp"] = llama_cpp_rows(out, model, report)
        row["ratio"] = row["llama_cpp"][row["llama_cpp"]["planned"]]["perplexity"] / row["original"]
    row["out"] = str(out)
    save(key, row)
    print(json.dumps({k: v for k, v in row.items() if k != "report"}, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=("proxy", "run", "curve", "bits", "keys", "plot", "report"), required=True)
    ap.add_argument("--budget", default="50%,25%")
    ap.add_argument("--case", choices=sorted(CASES))
    ap.add_argument("--redo", action="store_true")
    ap.add_argument("--model", choices=MODELS, default="smollm2", help="the bundled model --part run shrinks")
    a = ap.parse_args()
    if a.part == "proxy":
        part_proxy(a.budget.split(","))
    elif a.part == "curve":
        part_curve()
    elif a.part == "keys":
        part_keys()
    elif a.part == "bits":
        part_bits()
    elif a.part == "plot":
        plot()
    elif a.part == "report":
        part_report()
    else:
        if not a.case:
            ap.error("--part run needs --case")
        part_run(a.case, a.redo, a.model)


if __name__ == "__main__":
    main()
