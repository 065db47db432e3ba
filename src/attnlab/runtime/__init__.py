"""What every long run shares: a time budget, a stop request (Ctrl-C, SIGTERM), progress as log lines.

- budget.py    Budget: a deadline and a stop flag that every long loop checks; shares of it for phases
- progress.py  Progress: a line every ~30 s (phase, step, loss, tokens/s, time left) when nothing draws a bar
- environment.py  environment(): the Python, library versions, threads and processor a result was computed with
"""
from .budget import Budget, Stopped, stop_on_signals
from .environment import environment
from .progress import Progress

__all__ = ["Budget", "Stopped", "stop_on_signals", "Progress", "environment"]
