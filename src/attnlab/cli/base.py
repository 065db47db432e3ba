"""What every attnlab subcommand shares: the console it prints to, the one-line usage error, small writers."""
from __future__ import annotations

import shutil
from pathlib import Path

from rich.console import Console

console = Console(width=max(140, shutil.get_terminal_size((140, 40)).columns))


class UsageProblem(Exception):
    """A problem with what the user asked for: reported in one line, exit status 2."""


def write_atomic(path: Path, data: bytes) -> None:
    """Write via a temporary file in the same folder, so a failure leaves nothing half-written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)



def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
