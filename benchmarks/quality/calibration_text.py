"""Does other calibration text make a better conversion? One candidate converted on several calibration texts, each
scored before any heal (docs/decisions.md, "Planner").

The candidate is the plain 12.5% command's plan on SmolLM2 (r=176 p=40 rorope rotated int3/g256+c4+w16). Its
calibration is the model's own text (what shrink writes: training_data, seeded), 2,048 or more tokens, alone or with
the judge files' tokens after the judge's 512 (Python source, then sentences) beside it. Each conversion is scored
by the KL to the original on the run's own held-out windows and on two development texts no plan or heal reads
(Apache-2.0 and Python's argparse.py, 2,048 tokens each):

    python benchmarks/quality/calibration_text.py --seed 1 --windows 20

--windows: the fixed windows the model writes (12 give 2,048 calibration tokens and the planner's 1,024; 20 give
4,096: a batch of another size writes other samples). Prints a line per calibration; run it alone.
"""
from __future__ import annotations

import argparse
import copy

PLAN = {"latent_dim": 176, "rope_dim": 40, "rope_select": "rorope", "balance": False,
        "kv_dtype": "int3/g256+c4+w16", "latent_norm": False, "rotation": "random"}


def main() -> None:
    import torch

    from attnlab import models as hf
    from attnlab.heal.data import JUDGE_TOKENS, _judge_ids, training_data
    from attnlab.heal.evaluate import evaluate_texts, public
    from attnlab.models.evaluate import read_text_ids
    from attnlab.shrink.candidate import Candidate, apply

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--windows", type=int, default=20, help="fixed windows of 256 tokens the model writes")
    args = ap.parse_args()
    teacher, tok, _ = hf.load_model("smollm2")
    train, held, _ = training_data(teacher, tok, 256, windows=args.windows, seed=args.seed, budget=None,
                                   batch_size=32, fixed=args.windows)
    own = train.reshape(1, -1)  # (1, windows x 256)
    dev = [read_text_ids(tok, "/usr/share/common-licenses/Apache-2.0")[:, :2048],
           read_text_ids(tok, argparse.__file__)[:, :2048]]
    sentences, source = (ids[:, JUDGE_TOKENS:] for ids in _judge_ids(tok))
    texts = {f"own {n}": own[:, :n] for n in (2048, 3072, 4096) if n <= own.shape[1]}
    texts["own 1024 + Python source 1024"] = torch.cat([own[:, :1024], source[:, :1024]], 1)
    texts["own 2048 + Python source 1024 + sentences"] = torch.cat([own[:, :2048], source[:, :1024], sentences], 1)
    texts["own 2048 + Python source 2048"] = torch.cat([own[:, :2048], source[:, :2048]], 1)
    if own.shape[1] >= 4096:
        texts["own 4096 + Python source 1024 + sentences"] = torch.cat([own[:, :4096], source[:, :1024], sentences], 1)
    cand = Candidate(**PLAN)
    for name, ids in texts.items():
        student = copy.deepcopy(teacher)
        apply(student, cand, ids)
        scored = public(evaluate_texts(teacher, student, [held, *dev]))["texts"]
        print(f"{name} ({ids.shape[1]} tokens): KL own / Apache-2.0 / argparse.py "
              + " / ".join(f"{t['kl']:.3f}" for t in scored), flush=True)


if __name__ == "__main__":
    main()
