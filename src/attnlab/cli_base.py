"""What every attnlab subcommand shares: the console it prints to and the one-line usage error."""
from __future__ import annotations

import shutil

from rich.console import Console

console = Console(width=max(140, shutil.get_terminal_size((140, 40)).columns))


class UsageProblem(Exception):
    """A problem with what the user asked for: reported in one line, exit status 2."""
