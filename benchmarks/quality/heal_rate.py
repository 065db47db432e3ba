"""Heal one converted student under variants of its heal plan, and score each on the heal's judge texts and on two
development texts nothing reads (docs/decisions.md).

The student and its data come from a shrink run stopped after its conversion (Ctrl-C once the log says "evaluating
the converted model before training"; the run folder OUT.shrink-run keeps data.safetensors, student/ and the heal
plan):

    attnlab shrink smollm2 --kv-budget 12.5% --out /tmp/x12/out      # Ctrl-C after the conversion
    python benchmarks/quality/heal_rate.py /tmp/x12/out.shrink-run --minutes 4 \\
        --variant seed=0 --variant layer_steps=40,layer_lr=0.00025 --variant layer_steps=40,layer_lr=0.0001
    python benchmarks/quality/heal_rate.py /tmp/x12/out.shrink-run --minutes 4.2 --variant seed=0 \
        --variant layer_inputs=student

Each variant changes the run's own heal plan (HealPlan fields, comma-separated name=value) and heals a fresh copy of
the student for --minutes with heal_model (the shrink's own call; the healed weights are kept whatever the guard
says, so that the variant itself is scored). The converted student is scored on the development texts too, once.
Prints one line per variant and writes benchmarks/results/heal_rate.json (or --json). Run it alone: the heal is
time-budgeted.
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, fields
from pathlib import Path

# 2,048 tokens of each; argparse: Python's source; docstrings: the documentation of a few of Python's library modules
# as help() shows it (reference prose like the protocol's Python docs, but none of its text: those are the language
# reference's topics)
RESULTS = Path(__file__).resolve().parents[1] / "results"  # benchmarks/results

DEV_TEXTS = ("/usr/share/common-licenses/Apache-2.0", "argparse", "docstrings")
DOC_MODULES = ("subprocess", "logging", "json", "re", "typing", "collections")


def _docstrings() -> str:
    """The public names' docstrings of DOC_MODULES longer than 200 characters, each under its dotted name."""
    import importlib
    import inspect

    out = []
    for name in DOC_MODULES:
        for key, obj in vars(importlib.import_module(name)).items():
            doc = None if key.startswith("_") else inspect.getdoc(obj)
            if doc and len(doc) > 200:
                out.append(f"{name}.{key}\n{doc}\n")
    return "\n".join(out)


def _plan(base: dict, variant: str):
    from attnlab.heal.plan import HealPlan

    plan = HealPlan(**base)
    kinds = {f.name: f.type for f in fields(HealPlan)}
    for item in filter(None, variant.split(",")):
        name, _, value = item.partition("=")
        if name not in kinds:
            raise ValueError(f"--variant {variant!r}: {name!r} is not a HealPlan field")
        kind = str(kinds[name])
        if "bool" in kind:
            if value not in ("0", "1"):
                raise ValueError(f"--variant {variant!r}: {name} is 0 or 1, got {value!r}")
            setattr(plan, name, value == "1")
            continue
        setattr(plan, name, value if kind == "str" else int(value) if "int" in kind else float(value))
    return plan


def main() -> None:
    import time

    from safetensors.torch import load_file

    from attnlab import models as hf
    from attnlab.heal.run import heal_model
    from attnlab.heal.evaluate import evaluate_texts, public
    from attnlab.io.folders import replace_file
    from attnlab.models.evaluate import read_text_ids
    from attnlab.shrink.pipeline import held_texts

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run", help="a shrink run folder (OUT.shrink-run) stopped after its conversion")
    ap.add_argument("--source", default="smollm2", help="the teacher the run converted")
    ap.add_argument("--minutes", type=float, default=4.0)
    ap.add_argument("--variant", action="append", default=[],
                    help="HealPlan fields, e.g. layer_steps=40,layer_lr=2.5e-4")
    ap.add_argument("--json", default=str(RESULTS / "heal_rate.json"), help="where the rows go")
    args = ap.parse_args()
    run = Path(args.run)
    state = json.loads((run / "state.json").read_text())
    if not state.get("heal_plan"):
        raise SystemExit(f"{run}: no heal plan yet (stop the shrink after 'evaluating the converted model')")
    data = load_file(str(run / "data.safetensors"))
    teacher, tok, _ = hf.load_model(args.source)
    paths = [p if p != "argparse" else argparse.__file__ for p in DEV_TEXTS]
    dev = [tok(_docstrings(), return_tensors="pt").input_ids[:, :2048] if p == "docstrings" else
           read_text_ids(tok, p, 2048) for p in paths]
    converted, _, _ = hf.load_model(str(run / "student"))
    before = public(evaluate_texts(teacher, converted, dev))  # the converted student on the development texts
    del converted
    rows = []
    for variant in args.variant or [""]:
        plan = _plan(state["heal_plan"], variant)
        student, _, _ = hf.load_model(str(run / "student"))
        load = os.getloadavg()[0]
        t0 = time.perf_counter()
        rep = heal_model(teacher, student, data["train"], held_texts(data), plan, minutes=args.minutes,
                         keep_better=False)
        after = public(evaluate_texts(teacher, student, dev))
        row = {"variant": variant or "the run's plan", "plan": asdict(plan), "load_before": load,
               "minutes": (time.perf_counter() - t0) / 60, "layers_restored": rep["layers_restored"],
               "end_to_end_steps": rep["distill_steps"], "layers_done": len(rep["layer_losses"]),
               "layer_cut": (rep.get("layer_cut") or {}).get("layer"), "status": rep["status"],
               "judge_kl": [[b["kl"], a["kl"]] for b, a in zip(rep["before"]["texts"], rep["after"]["texts"])],
               "judge_top1": [[b["top1_agreement"], a["top1_agreement"]]
                              for b, a in zip(rep["before"]["texts"], rep["after"]["texts"])],
               "dev": [{"path": p, "kl": t["kl"], "perplexity": t["perplexity"], "kl_converted": c["kl"],
                        "perplexity_converted": c["perplexity"]}
                       for p, t, c in zip(paths, after["texts"], before["texts"])]}
        rows.append(row)
        judge = " / ".join(f"{b:.4f} -> {a:.4f}" for b, a in row["judge_kl"])
        top1 = " / ".join(f"{b:.4f} -> {a:.4f}" for b, a in row["judge_top1"])
        devs = " / ".join(f"{d['kl_converted']:.4f} -> {d['kl']:.4f}" for d in row["dev"])
        print(f"{row['variant']}: {row['layers_done']} layers done (cut: {row['layer_cut']}), given back "
              f"{row['layers_restored']}, {row['end_to_end_steps']} end-to-end steps; "
              f"judge KL {judge}; top-1 {top1}; development texts' KL {devs}", flush=True)
    replace_file(Path(args.json), json.dumps(rows, indent=2).encode())


if __name__ == "__main__":
    main()
