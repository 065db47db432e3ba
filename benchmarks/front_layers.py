"""Where the plain 12.5% command's loss is, layer by layer, and whether a wider rope key in the first layers pays
(issue `eighth`): SmolLM2-135M, no training in this script.

    python benchmarks/front_layers.py --shrunk OUT    # OUT: `attnlab shrink smollm2 --kv-budget 12.5% --out OUT`

Two parts, each a table, rows to benchmarks/front_layers.json:
- `given back`: the shrunk model with some layers' attention given back the original's (layers 0-1, layers 0-4,
  and layers 5-9 for comparison), and with every latent kept unquantised (kv_dtype None): which layers and which
  part of the coding the loss comes from;
- `front`: the original with only layers 0-4 (or 5-9) converted, untrained, at the plan's latent and rope key
  (176 and 40, RoRoPE, BKV), at twice the rope key, and at a latent of 256 (more values, the same rope key);
  calibrated on the first 8 windows of 256 tokens the teacher writes (heal.data.training_data, seed 2).
Texts: the protocol's four (benchmarks/protocol.py) and four that no part of attnlab reads (VALIDATION: Python
source, a licence, release notes, Python source with maths docstrings), the first 2,048 tokens of each, windows of
512, perplexity over the original's. A design change to the plan was decided on the validation texts, never on
the protocol's. Run it alone (the load average before and after is recorded).
"""
from __future__ import annotations

import argparse
import copy
import random
import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from protocol import TEXTS, TOKENS, WINDOW, load, text_ids, write_json  # noqa: E402

JSON = HERE / "front_layers.json"
VALIDATION = {"argparse.py": str(Path(argparse.__file__)), "Apache-2.0": "/usr/share/common-licenses/Apache-2.0",
              "git-2.27": "/usr/share/doc/git/RelNotes/2.27.0.txt", "random.py": str(Path(random.__file__))}
FRONT, NEXT = list(range(5)), list(range(5, 10))
SHAPES = ((176, 40), (176, 80), (256, 40))  # (latent, rope key) of the converted layers


def main() -> None:
    import torch

    from attnlab import models as hf
    from attnlab.heal.data import training_data
    from attnlab.models.adapters import attnlab_modules, replace_attention
    from attnlab.models.convert import convert_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shrunk", required=True, help="the plain 12.5%% command's output folder")
    args = parser.parse_args()
    teacher, tok, _ = hf.load_model("smollm2")
    texts = {n: text_ids(tok, n, TOKENS) for n in TEXTS}
    texts.update({n: hf.read_text_ids(tok, p, TOKENS) for n, p in VALIDATION.items()})

    def ratios(model) -> dict:
        with torch.no_grad():
            return {n: hf.perplexity(model, ids, window=WINDOW) / original[n] for n, ids in texts.items()}

    def show(part: str, label: str, row: dict) -> None:
        out[part][label] = row
        print(f"| {part} | {label} | " + " | ".join(f"{row[n]:.3f}" for n in texts) + " |", flush=True)

    out = {"load_before": load(), "shrunk": args.shrunk, "texts": list(texts), "given back": {}, "front": {}}
    with torch.no_grad():
        original = {n: hf.perplexity(teacher, ids, window=WINDOW) for n, ids in texts.items()}
    print("| part | model | " + " | ".join(texts) + " |\n|---|---|" + "---|" * len(texts))
    student, _, _ = hf.load_model(args.shrunk)
    mine, theirs = attnlab_modules(student), attnlab_modules(teacher)
    show("given back", "none (the shrunk model)", ratios(student))
    for name, layers in (("layers 0-1", [0, 1]), ("layers 0-4", FRONT), ("layers 5-9", NEXT)):
        replace_attention(student, [theirs[i] if i in layers else m for i, m in enumerate(mine)])
        show("given back", name, ratios(student))
    replace_attention(student, mine)
    for m in mine:
        m.kv_dtype = None
    show("given back", "every latent unquantised", ratios(student))
    del student
    train, _, _ = training_data(teacher, tok, 256, windows=12, seed=2, fixed=12)
    calibration = train[:8].reshape(1, -1)
    for name, layers in (("layers 0-4", FRONT), ("layers 5-9", NEXT)):
        for r, p in SHAPES:
            model = copy.deepcopy(teacher)
            convert_model(model, "mla", latent_dim=r, rope_dim=p, calibration_ids=calibration,
                          pair_selection="rorope", balance=True, layers=layers)
            show("front", f"{name} at r={r} p={p}", ratios(model))
    out["load_after"] = load()
    write_json(JSON, out)


if __name__ == "__main__":
    main()
