"""The whole-model benchmark: prints a markdown table and writes benchmarks/model.json.

    python benchmarks/model.py                 # CPU: real SmolLM2-135M weights (about 10 minutes on 2 cores)
    python benchmarks/model.py --quick         # a tiny random model, seconds (checks that everything runs)
    python benchmarks/model.py --device cuda   # the Llama-3.2-1B shape, random bf16 weights

The same rows as `attnlab bench --suite model --json benchmarks/model.json`; see
attnlab/bench_model.py for what each column measures.
"""
import argparse
import json
import sys
from pathlib import Path

from attnlab.bench import machine_info
from attnlab.bench.model import markdown, model_suite
from attnlab.io.folders import replace_file

here = Path(__file__).parent
parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--quick", action="store_true")
parser.add_argument("--device", default="cpu")
parser.add_argument("--json", type=Path, default=here / "model.json")
parser.add_argument("--point", action="append", metavar="B,PROMPT,STEPS",
                    help="grid point (repeat); default attnlab.bench.model.CPU_GRID or CUDA_GRID")
args = parser.parse_args()
grid = tuple(tuple(int(v) for v in p.split(",")) for p in args.point) if args.point else None

rows = model_suite(quick=args.quick, device=args.device, grid=grid,
                   progress=lambda what: print(f"done: {what}", file=sys.stderr, flush=True))
result = {"machine": machine_info(args.device), "command": "python benchmarks/model.py " + " ".join(sys.argv[1:]),
          "quick": args.quick, "model": rows}
print(markdown(rows))
replace_file(args.json, json.dumps(result, indent=2).encode())
print(f"wrote {args.json}")
