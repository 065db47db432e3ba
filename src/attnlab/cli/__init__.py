"""The `attnlab` command (extra [cli]: typer, rich, matplotlib): one file per subcommand group over the library.

- app.py      the typer app, the entry point main(), errors as one line with exit status 2
- base.py     the console, UsageProblem, small writers
- study.py    tour, kv          - bench.py    bench
- convert.py  convert           - run.py      eval, generate
- heal.py     heal              - export.py   export
- shrink.py   shrink: a KV budget in, a healed model out
- plots.py    the figures (matplotlib)
"""
from .app import app, main

__all__ = ["app", "main"]
