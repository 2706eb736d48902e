"""Shared output helpers for commands: a rich console, tables and JSON printing.

On a terminal tables are rich tables at the terminal's width whose cells wrap (fold) rather than
cut; when stdout is not a terminal (a pipe, a file) they print as plain columns, every value
whole, one row per line, so ``grep`` finds what the table holds.
"""

from __future__ import annotations

import json
import sys
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Any

import click
from rich.console import Console
from rich.table import Table
from rich.text import Text

#: the line width when stdout is not a terminal: nothing a command prints is cut or wrapped
PLAIN_WIDTH = 100_000
COLUMN_GAP = "  "


def stdout_is_terminal() -> bool:
    return sys.stdout.isatty()


def console() -> Console:
    """A console on stdout: the terminal's width on a terminal, unlimited otherwise."""
    if stdout_is_terminal():
        return Console(highlight=False, soft_wrap=False)
    return Console(highlight=False, soft_wrap=False, width=PLAIN_WIDTH, color_system=None)


def print_table(table: Table, con: Console | None = None) -> None:
    """A rich table whose cells fold on a terminal; plain whole columns otherwise."""
    if not stdout_is_terminal():
        click.echo(plain_table(table))
        return
    for column in table.columns:
        column.overflow = "fold"
        column.no_wrap = False
    (con or console()).print(table)


def _plain_cell(cell: object) -> str:
    text = cell.plain if isinstance(cell, Text) else Text.from_markup(str(cell)).plain
    return ", ".join(part.strip() for part in text.splitlines() if part.strip())


def plain_table(table: Table) -> str:
    """The table as text columns separated by two spaces, its title on the first line."""
    columns = table.columns
    rows = [[_plain_cell(c) for c in col.cells] for col in columns]
    body = [list(r) for r in zip(*rows)] if rows else []
    if table.show_header:
        body.insert(0, [_plain_cell(col.header) for col in columns])
    widths = [max((len(r[i]) for r in body), default=0) for i in range(len(columns))]
    lines = [] if table.title is None else [_plain_cell(table.title)]
    for r in body:
        cells = [v.rjust(w) if col.justify == "right" else v.ljust(w) for v, w, col in zip(r, widths, columns)]
        lines.append(COLUMN_GAP.join(cells).rstrip())
    return "\n".join(lines)


def echo_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=_default))


def _default(obj: Any) -> Any:
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "get_secret_value"):
        return "***"
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def round_half_up(value: float, digits: int) -> str:
    """Decimal rounding as tables in the spec print it (1.125 -> 1.13, 32.25 -> 32.3)."""
    q = Decimal(1).scaleb(-digits)
    return str(Decimal(repr(value)).quantize(q, rounding=ROUND_HALF_UP))
