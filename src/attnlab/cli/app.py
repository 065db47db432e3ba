"""The attnlab command: a thin layer over the library (parse, call, render), one file per subcommand group.

Errors are one line on stderr with exit status 2; --debug shows the traceback.
"""
from __future__ import annotations

import sys

import typer

from .bench import bench
from .convert import convert
from .export import export
from .heal import heal
from .run import eval_, generate
from .shrink import shrink
from .study import kv, tour

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Run, convert and explain multi-head attention and its KV-sharing variants.")
for command in (shrink, tour, kv, bench, convert, heal, export, generate):
    app.command()(command)
app.command(name="eval")(eval_)
_state = {"debug": False}


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="Show tracebacks instead of one-line errors.")):
    _state["debug"] = debug


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the app, turning expected errors into one line on stderr and status 2."""
    args = sys.argv[1:] if argv is None else argv
    debug = "--debug" in args
    try:
        rc = app(args=args, prog_name="attnlab", standalone_mode=False)
    except typer.Exit as e:
        return e.exit_code
    except SystemExit as e:
        return int(e.code or 0)
    except KeyboardInterrupt:
        if debug:
            raise
        print("attnlab: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - the one place errors become messages
        import click
        if debug:
            raise
        if isinstance(e, click.exceptions.UsageError):
            msg = e.format_message()
        elif isinstance(e, click.exceptions.Abort):
            msg = "aborted"
        else:
            msg = str(e) or type(e).__name__
        print(f"attnlab: error: {msg.splitlines()[0] if msg else type(e).__name__}", file=sys.stderr)
        return 2
    return rc if isinstance(rc, int) else 0


if __name__ == "__main__":
    sys.exit(main())
