"""The layers of the settings (profile < environment < CLI flags), merged key by key, and which
layer a value came from (for the errors of a value that does not validate)."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Mapping

from pydantic import BaseModel, ValidationError
from pydantic_settings import EnvSettingsSource

from hpc_cli.errors import ConfigError
from hpc_cli.settings.sections import ENV_PREFIX, PROCESS_ENV, SECTIONS, HpcSettings, env_var


def env_layer(environ: Mapping[str, str] | None) -> dict[str, Any]:
    source = EnvSettingsSource(HpcSettings, case_sensitive=False)
    if environ is not None:
        source.env_vars = {k.lower(): v for k, v in environ.items()}
    try:
        data = source()
    except Exception as exc:  # pydantic-settings raises SettingsError for bad JSON values
        raise ConfigError(f"environment: {exc}", hint="check the HPC_* variables") from None
    prefix = ENV_PREFIX.lower()
    known = {s for s in SECTIONS}
    process = {n.lower() for n in PROCESS_ENV}
    vars_ = source.env_vars
    for name in vars_:
        if name.startswith(prefix) and name not in process:
            section = name[len(prefix):].split("__", 1)[0]
            if section not in known:
                close = _closest_variable(name.upper())
                raise ConfigError(f"unknown environment variable {name.upper()}"
                                  + (f" (did you mean {close}?)" if close else ""),
                                  hint=f"HPC_* variables name a section: {', '.join(SECTIONS)} "
                                       "(HPC_<SECTION>__<KEY>), or are one of the process switches in "
                                       "docs/configuration.md (HPC_LOAD_PLUGINS selects plugins)")
    return data


def _closest_variable(name: str) -> str | None:
    """The known variable ``name`` most likely misspells: the same key under the closest
    section's name (``HPC_ENGNE__SEED`` -> ``HPC_ENGINE__SEED``), or the closest process switch."""
    body = name[len(ENV_PREFIX):]
    if "__" in body:
        section, rest = body.split("__", 1)
        close = difflib.get_close_matches(section.lower(), SECTIONS, n=1)
        return env_var(close[0]) + "__" + rest if close else None
    close = difflib.get_close_matches(name, list(PROCESS_ENV), n=1)
    return close[0] if close else None


def drop_none(d: Mapping[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            sub = drop_none(v)
            if sub:
                out[k] = sub
        elif v is not None:
            out[k] = v
    return out


def cli_layer(flags: Mapping[str, Any]) -> dict[str, Any]:
    """Dotted flags (``{"server.port": 8001, "model.name": None}``) to a nested dict, unset dropped."""
    out: dict[str, Any] = {}
    for key, value in flags.items():
        if value is None:
            continue
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def merge(base: dict, top: Mapping) -> dict:
    out = dict(base)
    for k, v in top.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = v
    return out


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def origin(key: str, layers: dict[str, dict]) -> str:
    for layer in ("cli", "env", "profile"):
        flat = flatten(layers.get(layer, {}))
        if key in flat or any(k.startswith(key + ".") for k in flat):
            return layer
    return "default"


def describe_origin(key: str, layer: str, profile: Path | None) -> str:
    where = {"cli": "a command-line flag", "env": f"the environment ({env_var(key)})",
             "profile": f"profile {profile}" if profile else "the profile", "default": "the defaults"}[layer]
    return f"set by {where}"


def validation_error(exc: ValidationError, layers: dict[str, dict], profile: Path | None,
                      prefix: tuple[str, ...] = (), model: Any = None) -> ConfigError:
    lines = []
    hints = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"] if not isinstance(p, int)]
        # pydantic names the union member that failed last (kv_capacity: "auto" | int); drop it
        loc = [p for p in loc if p not in ("literal['auto']", "int")]
        key = ".".join((*prefix, *loc))
        layer = origin(key, layers)
        if err["type"] == "extra_forbidden":
            parent, _, leaf = key.rpartition(".")
            at = model if (model is not None and parent == ".".join(prefix)) else model_at(parent)
            choices = list(at.model_fields) if at else list(SECTIONS)
            close = difflib.get_close_matches(leaf, choices, n=1)
            lines.append(f"unknown key {key} ({describe_origin(key, layer, profile)})")
            hints.append(f"did you mean {parent + '.' if parent else ''}{close[0]}?" if close
                         else f"keys of [{parent or 'top level'}]: {', '.join(choices)}")
        else:
            value = err.get("input")
            also = "" if layer == "env" else f"; env {env_var(key)}"
            lines.append(f"{key} = {value!r}: {err['msg']} ({describe_origin(key, layer, profile)}{also})")
    hint = "; ".join(dict.fromkeys(hints)) or "fix the value; `hpc-cli config show --sources` shows every key"
    return ConfigError("; ".join(lines), hint=hint)


def model_at(dotted: str):
    model: Any = HpcSettings
    for part in [p for p in dotted.split(".") if p]:
        f = model.model_fields.get(part)
        if f is None or not isinstance(f.annotation, type) or not issubclass(f.annotation, BaseModel):
            return None
        model = f.annotation
    return model

