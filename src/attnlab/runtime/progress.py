"""Progress as log lines: what a long run is doing, visible without a terminal (CI logs, nohup, a pipe).

`Progress.update(phase=..., step=..., total=..., loss=...)` writes a line once `every` seconds (30) have passed,
`[  2:31] heal end-to-end | step 12/170 | loss 0.3312 | 133 tok/s | left 7:48`, to `stream` (stdout: stderr is kept
for the one-line error). `line()` writes one at once. `enabled=False` turns lines off (a terminal gets the CLI's bar).
"""
from __future__ import annotations

import sys
import time
from typing import Callable, TextIO


def _clock_text(seconds: float) -> str:
    seconds = max(0, int(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """Log lines every `every` seconds of a run's progress (phase, step, loss, tokens/s, time left)."""

    def __init__(self, *, every: float = 30.0, stream: TextIO | None = None, enabled: bool = True,
                 clock: Callable[[], float] = time.monotonic, budget=None):
        self.every, self.stream, self.enabled, self.clock, self.budget = every, stream, enabled, clock, budget
        self.start = clock()
        self._last = None

    def line(self, text: str) -> None:
        """Write one line now (when enabled), stamped with the time since the start."""
        if self.enabled:
            out = self.stream or sys.stdout
            print(f"[{_clock_text(self.clock() - self.start):>6}] {text}", file=out, flush=True)
            self._last = self.clock()

    def update(self, phase: str, step: int | None = None, total: int | None = None, *, loss: float | None = None,
               tokens_per_s: float | None = None, extra: str = "") -> None:
        """Note a step; write a line if `every` seconds have passed since the last one."""
        now = self.clock()
        if self._last is not None and now - self._last < self.every:
            return
        if self._last is None:
            self._last = now
            if now - self.start < self.every:
                return
        parts = [phase]
        if step is not None:
            parts.append(f"step {step}" + (f"/{total}" if total else ""))
        if loss is not None:
            parts.append(f"loss {loss:.4f}")
        if tokens_per_s is not None:
            parts.append(f"{tokens_per_s:.0f} tok/s")
        if self.budget is not None and self.budget.deadline is not None:
            parts.append(f"left {_clock_text(self.budget.left())}")
        if extra:
            parts.append(extra)
        self.line(" | ".join(parts))
