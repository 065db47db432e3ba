"""SmolLM2-135M -> decoupled-RoPE MLA -> DeepSeek-V3 checkpoint, run by transformers alone.

    python benchmarks/engines/export_smollm2.py --latent-dim 256 --json benchmarks/results/export_smollm2.json

Perplexity on the first --tokens tokens of GPL-3 (windows of 512), calibration on
MPL-2.0, float32: the original model, the converted MLA (attnlab), the same with the
latent norm fitted to calibration statistics (attnlab, add_latent_norms: lossy), and the exported
folder (no fitted norm: the constant latent channel makes kv_a_layernorm linear) loaded as
DeepseekV3ForCausalLM in a child process that never imports attnlab (logits and a greedy
continuation compared with attnlab's). Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

TEXT = Path("/usr/share/common-licenses/GPL-3")
CALIBRATION = Path("/usr/share/common-licenses/MPL-2.0")
PROMPT = "The capital of France is"

CHILD = textwrap.dedent('''
    import json, os, sys
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder, inputs, result = sys.argv[1:4]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    t = load_file(inputs)
    ids, window = t["ids"], 512
    total, count = 0.0, 0
    with torch.no_grad():
        for s in range(0, ids.shape[1] - 1, window):
            chunk = ids[:, s:s + window]
            if chunk.shape[1] < 2:
                break
            logits = model(chunk).logits.float()
            total += float(torch.nn.functional.cross_entropy(logits[0, :-1], chunk[0, 1:], reduction="sum"))
            count += chunk.shape[1] - 1
        first = model(ids[:, :window]).logits
    greedy = model.generate(t["prompt"], max_new_tokens=32, do_sample=False)
    save_file({"logits": first.contiguous(), "greedy": greedy}, result)
    print(json.dumps({"class": type(model).__name__, "perplexity": float(torch.exp(torch.tensor(total / count))),
                      "text": tok.decode(greedy[0, t["prompt"].shape[1]:], skip_special_tokens=True),
                      "attnlab_imported": any(m.split(".")[0] == "attnlab" for m in sys.modules)}))
''')


def run(latent_dim: int, rope_dim: int | None, tokens: int, cal_tokens: int) -> dict:
    import torch
    from safetensors.torch import load_file, save_file

    from attnlab import models as hf

    torch.set_grad_enabled(False)
    model, tok = hf.load_smollm2()
    hf.to_attnlab(model)
    ids = hf.read_text_ids(tok, TEXT, tokens)
    cal = hf.read_text_ids(tok, CALIBRATION, cal_tokens)
    prompt = tok(PROMPT, return_tensors="pt").input_ids
    row = {"latent_dim": latent_dim, "tokens": int(ids.shape[1]), "calibration_tokens": int(cal.shape[1]),
           "kv_bytes_per_token_before": hf.kv_bytes_per_token(model)}
    row["ppl_original"] = hf.perplexity(model, ids)
    hf.convert_model(model, "mla", latent_dim=latent_dim, rope_dim=rope_dim, calibration_ids=cal)
    row["ppl_mla"] = hf.perplexity(model, ids)
    row["kv_bytes_per_token_after"] = hf.kv_bytes_per_token(model)
    fitted = copy.deepcopy(model)  # the lossy alternative: a latent norm fitted to calibration statistics
    row["latent_norm_errors"] = hf.add_latent_norms(fitted, cal)
    row["ppl_mla_fitted_latent_norm"] = hf.perplexity(fitted, ids)
    del fitted
    ours_logits = model(ids[:, :512]).logits
    ours_greedy = model.generate(prompt, max_new_tokens=32, do_sample=False)
    with tempfile.TemporaryDirectory() as tmp:
        out = hf.export_deepseek(model, Path(tmp) / "smollm2-deepseek", tokenizer=tok)
        save_file({"ids": ids.contiguous(), "prompt": prompt.contiguous()}, f"{tmp}/in.safetensors")
        (Path(tmp) / "child.py").write_text(CHILD)
        proc = subprocess.run([sys.executable, f"{tmp}/child.py", str(out), f"{tmp}/in.safetensors",
                               f"{tmp}/out.safetensors"], capture_output=True, text=True, cwd=tmp)
        if proc.returncode:
            raise RuntimeError(proc.stderr[-3000:])
        child = json.loads(proc.stdout.strip().splitlines()[-1])
        theirs = load_file(f"{tmp}/out.safetensors")
    diff = (theirs["logits"].double() - ours_logits.double()).norm() / ours_logits.double().norm()
    row.update({"transformers_class": child["class"], "ppl_transformers_deepseek": child["perplexity"],
                "logits_rel_diff": float(diff), "greedy_equal": bool(torch.equal(theirs["greedy"], ours_greedy)),
                "transformers_text": child["text"], "child_imported_attnlab": child["attnlab_imported"]})
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--latent-dim", type=int, action="append")
    ap.add_argument("--rope-dim", type=int, default=None)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--calibration-tokens", type=int, default=2048)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    rows = [run(r, args.rope_dim, args.tokens, args.calibration_tokens) for r in (args.latent_dim or [256])]
    print(f"{'latent':>6} {'KV B/tok':>14} {'ppl orig':>9} {'ppl MLA':>8} {'fitted norm':>11} {'transformers':>12} "
          f"{'logit diff':>10} {'greedy':>6}")
    for r in rows:
        print(f"{r['latent_dim']:>6} {r['kv_bytes_per_token_before']:>6}->{r['kv_bytes_per_token_after']:<6} "
              f"{r['ppl_original']:>9.3f} {r['ppl_mla']:>8.3f} {r['ppl_mla_fitted_latent_norm']:>11.3f} "
              f"{r['ppl_transformers_deepseek']:>12.3f} {r['logits_rel_diff']:>10.2e} {str(r['greedy_equal']):>6}")
        print(f"  transformers' DeepseekV3 continues {PROMPT!r}: {r['transformers_text']!r}")
    if args.json:
        args.json.write_text(json.dumps({"command": "python " + " ".join(sys.argv), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
