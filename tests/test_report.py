"""benchmarks/report.py: README.md's results and docs/results.md are what the results files give, and each figure in
the README's table is the median or worst of the runs its row names, recomputed here from
benchmarks/results/protocol.json."""
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTOCOL = json.loads((ROOT / "benchmarks" / "results" / "protocol.json").read_text())


def test_the_generated_files_are_current():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "report.py"), "--check"], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]


def readme_rows() -> list[list[str]]:
    """The cells of each row of the README's results table."""
    block = (ROOT / "README.md").read_text().split("<!-- results: begin -->")[1].split("<!-- results: end -->")[0]
    table = [line for line in block.splitlines() if line.startswith("|")][2:]  # after the header and its rule
    return [[c.strip() for c in line.split("|")[1:-1]] for line in table]


def shown(command: str) -> str:
    """A recorded command as the README's first column shows it."""
    command = re.sub(r" --out \S+| --seed \d+", "", command).removeprefix("attnlab shrink ")
    return re.sub(r"( --text \S+)+", " --text T", command)


def ratios(entry: dict, original: dict, texts) -> list[float]:
    return [entry[t]["perplexity"] / original[t]["perplexity"] for t in texts]


def test_each_readme_figure_is_that_of_the_runs_it_names():
    rows = readme_rows()
    assert 1 <= len(rows) <= 7 and all(len(r) == 5 for r in rows)
    for command, kv, median, worst, baseline in rows:
        runs = [r for k, r in PROTOCOL.items()
                if k.startswith("run/") and not r.get("returncode") and shown(r["command"]) == command.strip("`")]
        assert len(runs) == 3, command  # three seeds, as the sentence above the table says
        model = runs[0]["argv"][2]
        original, texts = PROTOCOL[f"baselines/{model}"]["original"], list(runs[0]["texts"])
        ours = [x for r in runs for x in ratios(r["texts"], original, texts)]
        assert len(ours) == 12 and median == f"{statistics.median(ours):.3f}x"
        assert worst.startswith(f"{max(ours):.3f}x ")
        # the baseline beside it: equal or more bytes, its figures the median and worst over the same texts
        name, pct = re.match(r"(\S+) \(([\d.]+)%\): ", baseline).groups()
        assert float(pct) >= float(kv.split("%")[0])
        theirs = ratios(PROTOCOL[f"baselines/{model}"]["baselines"][name], original, texts)
        assert baseline.endswith(f"{statistics.median(theirs):.3f}x, {max(theirs):.3f}x")
