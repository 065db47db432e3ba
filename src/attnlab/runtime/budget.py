"""A time budget and a stop request that every long loop checks, so that `--minutes` and Ctrl-C hold.

A `Budget` has an optional deadline (on an injectable clock, for tests) and a stop flag. A loop calls
`budget.check()` once per unit of work (a window, a training step), which raises `Stopped`. `share(f)` gives a phase
its part of what is left, with the same stop flag; `stop_on_signals(budget)` makes SIGINT and SIGTERM a stop request.
"""
from __future__ import annotations

import contextlib
import math
import signal
import time
from typing import Callable


class Stopped(Exception):
    """A long loop ended early: reason "stop" (a stop was requested) or "budget" (the deadline passed)."""

    def __init__(self, reason: str, message: str = ""):
        super().__init__(message or ("stopped on request" if reason == "stop" else "the time budget is spent"))
        self.reason = reason


class _Flag:
    def __init__(self):
        self.set = False


class Budget:
    """Minutes from now (None: no deadline) and a stop flag; clock() gives seconds (time.monotonic by default)."""

    def __init__(self, minutes: float | None = None, *, clock: Callable[[], float] = time.monotonic,
                 _flag: _Flag | None = None, _deadline: float | None = None):
        if minutes is not None:
            if isinstance(minutes, bool) or not isinstance(minutes, (int, float)) or not math.isfinite(minutes) \
                    or minutes <= 0:
                raise ValueError(f"a time budget must be a positive number of minutes, got {minutes!r}")
        self.clock = clock
        self.start = clock()
        self.deadline = _deadline if _deadline is not None else (
            None if minutes is None else self.start + 60.0 * float(minutes))
        self._flag = _flag or _Flag()

    # -- reading it ---------------------------------------------------------------------------
    def elapsed(self) -> float:
        """Seconds since this budget started."""
        return self.clock() - self.start

    def left(self) -> float:
        """Seconds until the deadline (inf without one; never below 0)."""
        return math.inf if self.deadline is None else max(0.0, self.deadline - self.clock())

    @property
    def stop_requested(self) -> bool:
        return self._flag.set

    def request_stop(self) -> None:
        """Ask every loop that checks this budget (or a share of it) to stop at its next check."""
        self._flag.set = True

    def expired(self, reserve: float = 0.0) -> bool:
        """True when less than `reserve` seconds are left before the deadline."""
        return self.deadline is not None and self.clock() + reserve > self.deadline

    def check(self, reserve: float = 0.0) -> None:
        """Raise Stopped if a stop was requested, or if fewer than `reserve` seconds are left."""
        if self._flag.set:
            raise Stopped("stop")
        if self.expired(reserve):
            raise Stopped("budget")

    # -- dividing it --------------------------------------------------------------------------
    def share(self, fraction: float | None = None, *, seconds: float | None = None) -> "Budget":
        """A budget for one phase: the fraction of the time left (or `seconds`), capped by this deadline.

        The share keeps this budget's stop flag; without a deadline here, `seconds` still bounds it.
        """
        if fraction is not None and not 0 < fraction <= 1:
            raise ValueError(f"a share of a budget must be a fraction in (0, 1], got {fraction!r}")
        now = self.clock()
        ends = []
        if self.deadline is not None:
            ends.append(self.deadline)
            if fraction is not None:
                ends.append(now + fraction * max(0.0, self.deadline - now))
        if seconds is not None:
            ends.append(now + max(0.0, float(seconds)))
        return Budget(clock=self.clock, _flag=self._flag, _deadline=min(ends) if ends else None)

    def unbounded(self) -> "Budget":
        """A budget without a deadline that shares this one's stop flag (what must run to its end, yet stop on
        Ctrl-C)."""
        return Budget(clock=self.clock, _flag=self._flag)

    def __repr__(self) -> str:
        left = "no deadline" if self.deadline is None else f"{self.left():.1f} s left"
        return f"Budget({left}{', stop requested' if self.stop_requested else ''})"


@contextlib.contextmanager
def stop_on_signals(budget: Budget, signals=(signal.SIGINT, signal.SIGTERM)):
    """SIGINT/SIGTERM request a stop (checked at the next loop step); a second one interrupts at once.

    Only in the main thread (elsewhere Python cannot install handlers: nothing is changed).
    The previous handlers come back when the block ends.
    """
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield budget
        return
    old = {s: signal.getsignal(s) for s in signals}

    def handler(signum, frame):
        if budget.stop_requested:
            raise KeyboardInterrupt
        budget.request_stop()

    for s in signals:
        signal.signal(s, handler)
    try:
        yield budget
    finally:
        for s, h in old.items():
            signal.signal(s, h)
