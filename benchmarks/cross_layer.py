"""Whether a layer's latent, coded as its residual from a prediction off the layer before, pays (issue `eighth`, part
5: "cross-layer prediction of the latent ... joins the planner only if it wins on held-out text"). SmolLM2-135M,
no training in this script.

    python benchmarks/cross_layer.py --shrunk OUT    # OUT: a 3-bit plan's output (`attnlab shrink smollm2
                                                     # --kv-budget 12.5%` before 4ed6a52)

The code tried (AQUA-KV's and XQuant-CL's idea, in attnlab's terms): layer l's latent c_l is predicted as
A_l [c'_{l-1}, 1], with c'_{l-1} the previous layer's latent as its cache returns it (closed loop: what a decoder
holds), A_l fitted by least squares on the calibration text; the cache stores c_l - A_l [c'_{l-1}, 1] in the layer's
own storage (its rotation, groups and scales), and the reader adds the prediction back. Layer 0 is stored as it is.
Three parts, each a table, rows to benchmarks/cross_layer.json:
- `residual`: per layer, |c_l - A_l [c_{l-1}, 1]| / |c_l| (Frobenius norms) on the calibration text and the
  protocol's texts, the unquantised latents of the shrunk model;
- `shrunk`: the shrunk model with its latent stored directly or as the predicted residual, in its own 3 bits and
  in 2 bits (the same groups), and unquantised;
- `untrained`: the original converted (RoRoPE, BKV, rotated; the same calibration) at the shrunk plan's size in
  3 bits and at a latent of 256 in 2 bits (about the same bytes: shrink/sizes.py), stored directly or predicted.
Calibration (the fit of A_l and the conversion): the first 8 windows of 256 tokens the teacher writes
(heal.data.training_data, seed 2). Texts scored: the protocol's four and front_layers.py's four validation texts,
the first 2,048 tokens of each, windows of 512, perplexity over the original's. Run it alone (the load average
before and after is recorded). A diagnostic: its figures decide whether the code is built, nothing it computes ships.
"""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from front_layers import VALIDATION  # noqa: E402
from protocol import TEXTS, TOKENS, WINDOW, load, text_ids, write_json  # noqa: E402

JSON = HERE / "cross_layer.json"
TWO_BIT_LATENT = 256  # the 2-bit latent in the 3-bit plan's bytes with its rope key of 40 (shrink/sizes.py fit)


def main() -> None:
    import torch

    from attnlab import models as hf
    from attnlab.heal.data import training_data
    from attnlab.models.adapters import attnlab_modules
    from attnlab.modules.storage import round_trip
    from attnlab.shrink.plan import Candidate, apply

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shrunk", required=True, help="the plain 12.5%% command's output folder")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    out = {"load_before": load(), "shrunk": args.shrunk, "residual": {}, "shrunk_model": {}, "untrained": {}}
    teacher, tok, _ = hf.load_model("smollm2")
    texts = {n: text_ids(tok, n, TOKENS) for n in TEXTS}
    texts.update({n: hf.read_text_ids(tok, p, TOKENS) for n, p in VALIDATION.items()})
    original = {n: hf.perplexity(teacher, ids, window=WINDOW) for n, ids in texts.items()}
    train, _, _ = training_data(teacher, tok, 256, windows=12, seed=2, fixed=12)
    calibration = train[:8].reshape(1, -1)
    print("| part | coding | " + " | ".join(texts) + " |\n|---|---|" + "---|" * len(texts), flush=True)

    def latents(model, ids) -> list[torch.Tensor]:
        """Each layer's latent c (N, r), float64, as compress() writes it (unquantised), window by window."""
        mods = attnlab_modules(model)
        caught: dict[int, list] = {}
        for i, m in enumerate(mods):
            def wrap(source, positions=None, _m=m, _i=i):
                row = type(_m).compress(_m, source, positions)
                caught.setdefault(_i, []).append(row[0, :, :_m.latent_dim].double())
                return row
            m.compress = wrap
        try:
            for s in range(0, ids.shape[1], WINDOW):
                model(ids[:, s:s + WINDOW])
        finally:
            for m in mods:
                del m.compress
        return [torch.cat(caught[i]) for i in range(len(mods))]

    def with_one(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, torch.ones(*x.shape[:-1], 1, dtype=x.dtype)], -1)

    def predictors(model) -> list:
        c = latents(model, calibration)
        return [None] + [torch.linalg.lstsq(with_one(c[i - 1]), c[i]).solution for i in range(1, len(c))]

    def store(model, storage, maps) -> None:
        """Every layer's cache in `storage`; maps: the predictors (residual coding), or None (direct)."""
        mods = attnlab_modules(model)
        held: dict[int, torch.Tensor] = {}
        for i, m in enumerate(mods):
            m.kv_dtype = storage
            if "_as_stored" in m.__dict__:
                del m._as_stored
            if maps is None or storage is None:
                continue

            def as_stored(t, parts, role=None, _m=m, _i=i):
                r = _m.latent_dim
                if _i == 0:
                    row = round_trip(t, _m._kv_format, parts, role)
                else:
                    guess = (with_one(held[_i - 1].double()) @ maps[_i]).to(t.dtype)  # (B, S, r)
                    row = round_trip(torch.cat([t[..., :r] - guess, t[..., r:]], -1), _m._kv_format, parts, role)
                    row = torch.cat([row[..., :r] + guess, row[..., r:]], -1)
                held[_i] = row[..., :r]
                return row
            m._as_stored = as_stored

    def show(part: str, label: str, row: dict) -> None:
        out[part][label] = row
        print(f"| {part} | {label} | " + " | ".join(f"{row[n]:.3f}" for n in row) + " |", flush=True)

    def score(model) -> dict:
        return {n: hf.perplexity(model, ids, window=WINDOW) / original[n] for n, ids in texts.items()}

    student, _, _ = hf.load_model(args.shrunk)
    first = attnlab_modules(student)[0]
    plan_storage, r, p = first.kv_dtype, first.latent_dim, first.rope_dim
    if not str(plan_storage).startswith("int3/"):
        raise SystemExit(f"cross_layer.py compares a 3-bit plan's latent with 2 bits; {args.shrunk} stores "
                         f"{plan_storage} (an output of the plain 12.5% command before 4ed6a52 has the 3-bit plan)")
    two_bit = plan_storage.replace("int3", "int2")
    maps = predictors(student)
    store(student, None, None)
    seen = {"calibration": latents(student, calibration), **{n: latents(student, texts[n]) for n in TEXTS}}
    print("| residual | layer | " + " | ".join(seen) + " |", flush=True)
    for i in range(1, len(maps)):
        out["residual"][f"layer {i}"] = {
            n: float((c[i] - with_one(c[i - 1]) @ maps[i]).norm() / c[i].norm()) for n, c in seen.items()}
        print(f"| residual | layer {i} | " + " | ".join(f"{v:.3f}" for v in out["residual"][f"layer {i}"].values())
              + " |", flush=True)
    for storage in (plan_storage, two_bit):
        for name, coded in (("direct", None), ("predicted", maps)):
            store(student, storage, coded)
            show("shrunk_model", f"{storage} {name}", score(student))
    store(student, None, None)
    show("shrunk_model", "unquantised", score(student))
    del student
    for latent, storage in ((r, plan_storage), (TWO_BIT_LATENT, two_bit)):
        model = copy.deepcopy(teacher)
        apply(model, Candidate(latent, p, "rorope", True, storage, False, rotation="random"), calibration)
        maps = predictors(model)
        for name, coded in (("direct", None), ("predicted", maps)):
            store(model, storage, coded)
            show("untrained", f"r={latent} p={p} {storage} {name}", score(model))
        del model
    out["load_after"] = load()
    write_json(JSON, out)


if __name__ == "__main__":
    main()
