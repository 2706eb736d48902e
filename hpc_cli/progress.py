"""Progress of long startup steps (building or loading a model) on stderr.

On a terminal a rich bar that disappears when the step ends; otherwise (a log file, a pipe) a
line when the step starts, one at every tenth of it once it has run :data:`QUIET_S` seconds, and
a line when it ends, so a slow start is never silent.
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Callable, Iterator

import click

QUIET_S = 2.0  # no tenth lines for steps shorter than this


def _echo(text: str) -> None:
    click.echo(f"hpc-cli: {text}", err=True)


@contextlib.contextmanager
def step(description: str, total: int, *, unit: str = "", enabled: bool = True,
         done: Callable[[float], str] | None = None) -> Iterator[Callable[[int], None]]:
    """``with step("building builtin:tiny", nbytes, unit="bytes") as advance: advance(n)``.
    ``done(seconds)`` words the closing line (default: the description and the seconds)."""
    if not enabled:
        yield lambda n: None
        return
    t0 = time.monotonic()
    if sys.stderr.isatty():
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        columns = [TextColumn("{task.description}"), BarColumn()]
        if unit == "bytes":
            from rich.progress import DownloadColumn

            columns.append(DownloadColumn())
        else:
            columns.append(MofNCompleteColumn())
        with Progress(*columns, TimeElapsedColumn(), console=Console(stderr=True), transient=True) as bar:
            task = bar.add_task(description, total=max(1, total))
            yield lambda n: bar.advance(task, n)
    else:
        _echo(f"{description} ...")
        state = {"done": 0, "tenth": 0}

        def advance(n: int) -> None:
            state["done"] += n
            tenth = state["done"] * 10 // max(1, total)
            if tenth > state["tenth"] and tenth < 10 and time.monotonic() - t0 >= QUIET_S:
                _echo(f"{description}: {tenth * 10}% ({time.monotonic() - t0:.0f} s)")
            state["tenth"] = max(state["tenth"], tenth)

        yield advance
    seconds = time.monotonic() - t0
    _echo(done(seconds) if done is not None else f"{description}: done in {seconds:.1f} s")
