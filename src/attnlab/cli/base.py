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
    from ..io.folders import replace_file

    replace_file(path, data)



def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class RunDisplay:
    """One progress display for a long run: a rich bar on a terminal, log lines (runtime.Progress) otherwise.

    phase(text) names what runs now (and writes a log line); count(done, total) moves the bar;
    step(info) takes a Healer's progress dict (phase, layer, done, total, loss, tokens_per_s).
    """

    def __init__(self, budget=None):
        from ..runtime.progress import Progress

        self.terminal = console.is_terminal
        self.lines = Progress(enabled=not self.terminal, budget=budget)
        self._bar = self._task = None

    def __enter__(self):
        if self.terminal:
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self._bar = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                                 TextColumn("{task.fields[rate]}"), TextColumn("{task.fields[loss]}"),
                                 TimeRemainingColumn(), console=console, transient=True)
            self._bar.__enter__()
            self._task = self._bar.add_task("starting", total=None, rate="", loss="")
        return self

    def __exit__(self, *exc):
        if self._bar is not None:
            self._bar.__exit__(*exc)
        return False

    def phase(self, text: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, description=text, completed=0, total=None, rate="", loss="")
        self.lines.line(text)

    def count(self, done: int, total: int | None, what: str = "") -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=done, total=total)
        self.lines.update(what or "working", done, total)

    def step(self, info: dict) -> None:
        what = f"layer-wise (layer {info['layer']})" if info["phase"] == "layers" else "end-to-end KL"
        if self._bar is not None:
            self._bar.update(self._task, description=what, completed=info["done"], total=info["total"],
                             rate=f"{info['tokens_per_s']:.0f} tok/s", loss=f"loss {info['loss']:.4f}")
        self.lines.update(what, info["done"], info["total"], loss=info["loss"], tokens_per_s=info["tokens_per_s"])


def quiet_transformers() -> None:
    """transformers' own progress bars off: stderr holds errors (and attnlab's one display) only."""
    from transformers.utils import logging

    logging.disable_progress_bar()


def positive(name: str, value, *, integer: bool = False, allow_none: bool = True):
    """A UsageProblem naming the option unless value is a positive (finite) number (or None when allowed)."""
    import math

    if value is None and allow_none:
        return value
    if value is None or (integer and not isinstance(value, int)) or not math.isfinite(value) or value <= 0:
        raise UsageProblem(f"{name} must be a positive {'integer' if integer else 'number'}, got {value}")
    return value


class Busy:
    """What a short command is doing, on a terminal only (a transient spinner: `update(text)` changes it).

    Commands whose standard output is their result (eval, generate, export) stay quiet when it is not
    a terminal, so a pipe or a log gets the result and nothing else; long runs use RunDisplay.
    """

    def __init__(self, text: str):
        self.text, self._status = text, None

    def __enter__(self):
        if console.is_terminal:
            self._status = console.status(self.text)
            self._status.__enter__()
        return self

    def update(self, text: str) -> None:
        if self._status is not None:
            self._status.update(text)

    def __exit__(self, *exc):
        if self._status is not None:
            self._status.__exit__(*exc)
        return False
