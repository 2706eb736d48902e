"""Profile files: the shipped profiles, a profile named or given by path, and its TOML."""

from __future__ import annotations

import os
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any


from hpc_cli.errors import ConfigError



def shipped_profiles() -> list[str]:
    return sorted(p.name for p in resources.files("hpc_cli.profiles").iterdir() if p.name.endswith(".toml"))


def resolve_profile_path(name: str | os.PathLike) -> Path:
    """An existing path first, then a shipped profile of that name (``.toml`` optional)."""
    path = Path(name).expanduser()
    if path.is_file():
        return path.resolve()
    if path.is_dir():
        raise ConfigError(f"profile {name} is a directory", hint="pass a .toml file")
    shipped = resources.files("hpc_cli.profiles")
    for candidate in (str(name), f"{name}.toml"):
        entry = shipped / candidate
        if "/" not in candidate and entry.is_file():
            return Path(str(entry))
    raise ConfigError(f"profile {name} not found (no such file, and no shipped profile of that name)",
                      hint=f"shipped profiles: {', '.join(shipped_profiles())}")


def read_profile(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"profile {path}: invalid TOML: {exc}",
                          hint="fix the syntax at the line and column given (strings need quotes)") from None
    except OSError as exc:
        raise ConfigError(f"profile {path} cannot be read: {exc.strerror}", hint="check the path") from None

