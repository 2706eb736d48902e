"""The configuration reference (docs/configuration.md), generated from the settings models so
it cannot drift: every key, its type, default, environment variable and meaning."""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel, SecretStr

HEADER = """# Configuration reference

Generated from the settings models by `hpc-cli config reference` (a test keeps this file in
sync). A profile file is TOML with the sections below. Every key can also be set by the
environment variable shown and many by a flag of `hpc-cli serve`; flags win over the
environment, which wins over the profile file, which wins over the defaults. `hpc-cli config
show --profile FILE --sources` prints the effective value of every key and where it came from.
Values shown as *derived* are computed from other settings when left unset (spec §14.2).
"""


def _type_name(annotation: Any) -> str:
    """``int | None`` -> "int (optional)", ``Literal["a", "b"]`` -> "a / b", ``"auto" | int`` -> "auto / int"."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " / ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        parts = [a for a in args if a is not type(None)]
        text = " / ".join(_type_name(a) for a in parts)
        return text + (" (optional)" if len(parts) < len(args) else "")
    if annotation is SecretStr:
        return "str (secret)"
    return getattr(annotation, "__name__", str(annotation))


def _default(field: Any) -> str:
    if field.default is None:
        return "*derived*" if "default" in (field.description or "") else "unset"
    value = field.default
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return str(value)


def _rows(section: str, model: type[BaseModel]) -> list[str]:
    from hpc_cli.settings import env_var

    out = [f"## [{section}]", "", "| key | type | default | environment | meaning |", "|---|---|---|---|---|"]
    for name, field in model.model_fields.items():
        key = f"{section}.{name}"
        out.append(f"| `{name}` | {_type_name(field.annotation)} | {_default(field)} | `{env_var(key)}` | "
                   f"{(field.description or '').replace('|', '/')} |")
    return out + [""]


def reference_markdown() -> str:
    from hpc_cli import plugins
    from hpc_cli.settings import HpcSettings

    lines = [HEADER]
    for section, field in HpcSettings.model_fields.items():
        model = field.annotation
        lines += _rows(section, model)
        if section == "cache":
            for entry in plugins.registries().cache_modes:
                opts = entry.obj.options_model
                if opts.model_fields:
                    lines.append(f"Options of cache mode `{entry.name}` ({entry.plugin}):")
                    lines.append("")
                    lines += _rows(f"cache.{entry.name}", opts)
    from hpc_cli.settings.sections import PROCESS_ENV

    lines += ["## Process switches", "",
              "Environment variables that are not settings keys: read by one part of the process (a model or",
              "transfer engine used without settings, a kernel, another command). `hpc-cli serve` accepts them",
              "beside the keys' variables; any other `HPC_*` name is refused as a likely typo.", "",
              "| variable | meaning |", "|---|---|"]
    lines += [f"| `{name}` | {text.replace('|', '/')} |" for name, text in PROCESS_ENV.items()]
    return "\n".join(lines).rstrip() + "\n"

