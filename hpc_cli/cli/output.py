"""Shared output helpers for commands: a rich console and JSON printing."""

from __future__ import annotations

import json
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Any

import click
from rich.console import Console


def console() -> Console:
    return Console(highlight=False, soft_wrap=False)


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
