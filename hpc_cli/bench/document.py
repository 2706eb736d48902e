"""A benchmark's result document: printed as JSON on stdout, and written to ``--out`` as well."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping


def emit(doc: Mapping[str, object], out: str | Path | None) -> None:
    """Print ``doc`` as indented JSON and, where ``out`` names a file, write the same text there."""
    text = json.dumps(doc, indent=1)
    print(text)
    if out:
        Path(out).write_text(text + "\n")
