"""The command line under torchrun: what a rank other than 0 shows (nothing), who reports a problem every rank finds
alike (rank 0), and the one line a rank gives when a peer of the job stopped answering at a collective (it died, or
exceeded --collective-timeout). `heal` and `shrink` use them; attnlab.heal.distributed does the work."""
from __future__ import annotations

import contextlib
from pathlib import Path

import typer

from .base import UsageProblem

# the options heal and shrink share under torchrun
SHARD = typer.Option(False, "--shard/--no-shard", help="Under torchrun: shard the trained weights, their gradients "
                     "and the optimizer state over the processes (FSDP2) instead of replicating them (DDP).")
COLLECTIVE_TIMEOUT = typer.Option(120.0, "--collective-timeout", help="Under torchrun: seconds a process waits for "
                                  "the others at a collective of the heal before it gives up.")


class Silent:
    """The display of a rank other than 0: nothing."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def phase(self, text: str) -> None:
        pass

    def count(self, done: int, total: int | None, what: str = "") -> None:
        pass

    def step(self, info: dict) -> None:
        pass


def peer_lost(e: BaseException, world, timeout: float, checkpoint: Path) -> UsageProblem:
    """One line for a collective that failed because another rank stopped answering."""
    text = str(e)
    why = (f"no answer within --collective-timeout {timeout:g} s" if "Timed out" in text or "timeout" in text.lower()
           else "its connection closed: it stopped or died" if "closed" in text or "reset" in text
           else text.split("] ", 1)[-1].splitlines()[0][:160] if text else type(e).__name__)
    saved = f"; the last checkpoint is {checkpoint} (--resume continues)" if checkpoint.is_file() else ""
    return UsageProblem(f"rank {world.rank} of {world.size}: another process of the job stopped answering at a "
                        f"collective ({why}; the other ranks' output says more){saved}")


@contextlib.contextmanager
def rank_errors(world, timeout: float, checkpoint: Path):
    """Around a command's work under torchrun (and in one process, where it only closes nothing): a failed collective
    becomes peer_lost's line; a command-line problem every rank raises alike, or rank 0's error relayed to the others
    (distributed.Relayed), is said by rank 0 alone; another rank's own error names the rank. Leaves the process group at the end."""
    from ..heal import distributed as dd

    try:
        yield
    except (typer.Exit, UsageProblem, KeyboardInterrupt) as e:
        if isinstance(e, UsageProblem) and not world.main:
            raise typer.Exit(2) from None
        raise
    except dd.Relayed:
        if not world.main:  # rank 0's own error, which rank 0 reports
            raise typer.Exit(2) from None
        raise
    except Exception as e:
        if dd.collective_failure(e):
            raise peer_lost(e, world, timeout, checkpoint) from e
        if not world.main:
            raise UsageProblem(f"rank {world.rank} of {world.size}: {str(e) or type(e).__name__}") from e
        raise
    finally:
        dd.close_world(world)


@contextlib.contextmanager
def said_by_rank0(rank: int):
    """A UsageProblem that every rank raises alike (a command-line check): rank 0 says it, the others exit 2 quietly."""
    try:
        yield
    except UsageProblem:
        if rank:
            raise typer.Exit(2) from None
        raise
