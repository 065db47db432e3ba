"""The `attnlab` command (extra [cli]: typer, rich, matplotlib): one file per subcommand group over the library.

app.py: the typer app and main() (errors as one line, exit status 2); base.py: the console, UsageProblem, small
writers; plots.py: the figures (matplotlib). Subcommands: study.py tour, kv; bench.py bench; convert.py convert;
run.py eval, generate; heal.py heal; export.py export; shrink.py shrink (a KV budget in, a healed model out).
"""
from .app import app, main

__all__ = ["app", "main"]
