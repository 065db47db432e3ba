"""Which levels of the heal guard's sign test (guard.TOP1_ALPHA) would have given a protocol row's heal the same
verdicts, read from the evaluations its report holds: a level inside the printed range makes the same decisions,
so the same weights and the same row. Printed only.

    python benchmarks/quality/guard_levels.py --rows dev/run/smollm2-12-text/   # every row under that prefix
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from attnlab.heal.evaluate import flips
from attnlab.heal.guard import TOP1_ALPHA, TOP1_TOLERANCE, sign_test

RESULTS = Path(__file__).resolve().parents[1] / "results" / "protocol.json"


def verdict_pairs(heal: dict, held_out: dict) -> list[tuple[str, dict, dict]]:
    """(name, before, after) for each keep-better verdict the heal reached: the probe of the end-to-end phase, the
    layer-wise phase's student against the end-to-end one after it, and the converted student against the healed."""
    pairs = []
    if (heal.get("probe") or {}).get("texts"):
        pairs.append(("probe", held_out["before"], heal["probe"]))
    layer_wise = heal.get("layer_wise") or {}
    if layer_wise.get("evaluation"):
        end = heal.get("end_to_end") or held_out["after"]  # the student the layer-wise weights replaced, if they did
        pairs.append(("switch", layer_wise["evaluation"], end))
    healed = heal.get("healed") if heal.get("kept") else held_out["after"]
    if healed and held_out.get("before"):
        pairs.append(("keep-better", held_out["before"], healed))
    return pairs


def judge(before: dict, after: dict) -> dict:
    """One verdict's figures: whether the KL rose on some text (worse at any level), else the least sign-test chance
    over the texts (worse at any level above it), and what the fixed fall of TOP1_TOLERANCE would say."""
    b_texts, a_texts = before.get("texts") or [before], after.get("texts") or [after]
    rose = [i for i, (b, a) in enumerate(zip(b_texts, a_texts)) if a.get("kl") is not None and b.get("kl") is not None
            and a["kl"] > b["kl"]]
    counts = [flips(b, a) for b, a in zip(b_texts, a_texts)]
    chances = [sign_test(*c) if c is not None else math.nan for c in counts]
    fixed = any(a["top1_agreement"] < b["top1_agreement"] - TOP1_TOLERANCE for b, a in zip(b_texts, a_texts))
    least = min((c for c in chances if not math.isnan(c)), default=math.nan)  # nan: no positions (an older row)
    return {"kl_rose_on": rose, "flips": counts, "least_chance": least, "fixed_fall": bool(rose) or fixed}


def same_range(chances: list[float]) -> tuple[float, float]:
    """The levels (low, high] whose verdicts equal TOP1_ALPHA's: worse exactly where a verdict's chance is below."""
    below = [c for c in chances if c < TOP1_ALPHA]
    above = [c for c in chances if c >= TOP1_ALPHA]
    return (max(below, default=0.0), min(above, default=1.0))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", required=True, help="the prefix of the protocol rows to read, e.g. dev/run/smollm2-12-text/")
    args = ap.parse_args(argv)
    rows = {k: v for k, v in json.loads(RESULTS.read_text()).items() if k.startswith(args.rows) and "report" in v}
    if not rows:
        print(f"no protocol row starts with {args.rows!r}", file=sys.stderr)
        return 2
    chances, differ = [], []
    print("| row | verdict | KL rose on text | lost, gained per text | least chance | worse at 0.01 | fixed fall |")
    print("|---|---|---|---|---|---|---|")
    for key, row in sorted(rows.items()):
        report = row["report"]
        for name, before, after in verdict_pairs(report.get("heal") or {}, report.get("held_out") or {}):
            j = judge(before, after)
            worse = bool(j["kl_rose_on"]) or j["least_chance"] < TOP1_ALPHA
            if not j["kl_rose_on"] and not math.isnan(j["least_chance"]):
                chances.append(j["least_chance"])
            if worse != j["fixed_fall"]:
                differ.append(f"{key} {name}")
            print(f"| {key} | {name} | {j['kl_rose_on'] or '-'} | {j['flips']} | {j['least_chance']:.3g} | "
                  f"{'yes' if worse else 'no'} | {'yes' if j['fixed_fall'] else 'no'} |")
    low, high = same_range(chances)
    print(f"\nEvery level in ({low:.3g}, {high:.3g}] gives these verdicts, {TOP1_ALPHA:g} among them.")
    print("The fixed fall of " + f"{TOP1_TOLERANCE:g} decides otherwise in: " + (", ".join(differ) or "none"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
