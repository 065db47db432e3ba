"""Run every benchmark suite at full size: prints tables and writes benchmarks/results.json.

    python benchmarks/run.py            # full sizes (a few minutes on 2 cores)
    python benchmarks/run.py --quick    # tiny sizes, seconds

The same as `attnlab bench --json benchmarks/results.json --plot benchmarks/decode.png`.
"""
import sys
from pathlib import Path

from attnlab.cli import main

here = Path(__file__).parent
sys.exit(main(["bench", "--json", str(here / "results.json"), "--plot", str(here / "decode.png"), *sys.argv[1:]]))
