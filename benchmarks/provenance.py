"""Where a benchmark row came from: the commit (a dirty tree refused), the machine, the versions, the environment
variables that change behaviour, and the load before and after. Each benchmark writes it beside its rows."""
from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENV_PREFIXES = ("ATTNLAB_", "OMP_", "MKL_", "OPENBLAS_", "LLAMA_", "CUDA_VISIBLE", "PYTORCH_")


def commit(allow_dirty: bool = False, results: tuple[str, ...] = ()) -> str:
    """The checked-out commit; SystemExit naming the changed files when the tree is dirty (unless allowed). results:
    the benchmark's own results files (relative to the root), whose changes are its rows, not code."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                           text=True).stdout.split("\n")
    dirty = [line[3:] for line in dirty if line.strip() and line[3:] not in results]
    if dirty and not allow_dirty:
        raise SystemExit(f"the tree has uncommitted changes ({', '.join(dirty[:5])}): commit them first, so the row "
                         "names the code that made it (or pass --allow-dirty for a trial run, recorded as dirty)")
    return head + ("-dirty" if dirty else "")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load() -> float:
    """The 1-minute load average (0.0 where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "optimum-quanto", "hqq", "numpy"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def provenance(argv: list[str], allow_dirty: bool = False, results: tuple[str, ...] = ()) -> dict:
    """Everything a row needs to be re-measured: call before the work; finish() adds the load after."""
    import torch

    return {"argv": argv, "commit": commit(allow_dirty, results), "cpu": cpu_model(), "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "versions": versions(),
            "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)},
            "load_before": load()}


def finish(prov: dict) -> dict:
    return {**prov, "load_after": load()}


def write_results(path: Path, out: dict) -> None:
    """Write a benchmark's JSON whole or not at all (a temporary file moved into place), and say where."""
    import json

    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(out, indent=2) + "\n")
    tmp.replace(path)
    print(f"wrote {path.relative_to(ROOT)}")
