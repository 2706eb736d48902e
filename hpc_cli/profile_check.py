"""``hpc-cli config validate``: every problem of a profile (and the environment) in one pass.

:func:`load_settings` stops at the first layer that fails, which is right for ``serve``; a check
should say everything at once: each bad value, each unknown plugin name (KV profile, speculative
backend, cache mode) and each path that does not exist (the model's checkpoint directory, the
drafter, the expert profile, the prefix cache file's directory), then the combinations.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from pydantic import ValidationError

from hpc_cli.errors import ConfigError, HpcError

if TYPE_CHECKING:
    from pydantic_core import ErrorDetails


class ProfileProblems(ConfigError):
    """Several problems of one profile: printed as one ``error:`` / ``hint:`` pair each."""

    def __init__(self, problems: list[HpcError]) -> None:
        super().__init__("; ".join(p.message for p in problems))
        self.problems = problems

    def render(self) -> str:
        return "\n".join(p.render() for p in self.problems)


class _OneError:
    """One pydantic error, shaped as the ValidationError that settings' error wording reads."""

    def __init__(self, error: "ErrorDetails") -> None:
        self.error = error

    def errors(self) -> list["ErrorDetails"]:
        return [self.error]


def _get(merged: Mapping[str, Any], key: str, default: Any = None) -> Any:
    node: Any = merged
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node


def _value_problems(merged: dict, layers: dict, path: Path | None) -> tuple[list[HpcError], set[str]]:
    from hpc_cli import settings as st

    try:
        st.HpcSettings(**merged)
    except ValidationError as exc:
        problems: list[HpcError] = [st.validation_error(_OneError(e), layers, path) for e in exc.errors()]
        keys = {".".join(str(p) for p in e["loc"] if not isinstance(p, int)) for e in exc.errors()}
        return problems, keys
    return [], set()


def _plugin_problems(merged: dict, layers: dict, path: Path | None) -> list[HpcError]:
    from hpc_cli import plugins
    from hpc_cli import settings as st

    regs = plugins.registries()
    problems: list[HpcError] = []
    for key, registry in (("kv.profile", regs.kv_profiles), ("speculative.backend", regs.spec_backends),
                          ("cache.mode", regs.cache_modes)):
        section, leaf = key.split(".")
        value = _get(merged, key, getattr(getattr(st.HpcSettings(), section), leaf))
        if not isinstance(value, str):
            continue  # a wrong type is a value problem, reported already
        try:
            registry.canonical(value)
        except HpcError as exc:
            where = st.describe_origin(key, st.origin(key, layers), path)
            problems.append(ConfigError(f"{key} = {value!r}: {exc.message} ({where})", hint=exc.hint))
    return problems


def _model_problem(name: str) -> HpcError | None:
    if name.startswith("builtin:"):
        from hpc_cli.model.builtin import builtin_config

        try:
            builtin_config(name)
        except HpcError as exc:
            return ConfigError(f"model.name = {name!r}: {exc.message}", hint=exc.hint)
        return None
    p = Path(name).expanduser()
    hint = "a Qwen3.5 checkpoint directory (config.json, *.safetensors, tokenizer.json) or builtin:tiny"
    if not p.is_dir():
        return ConfigError(f"model.name = {name!r}: no such checkpoint directory", hint=hint)
    if not (p / "config.json").is_file():
        return ConfigError(f"model.name = {name!r}: the directory has no config.json", hint=hint)
    return None


def _path_problems(merged: dict) -> list[HpcError]:
    from hpc_cli.engine.persistence import check_cache_file_path

    problems: list[HpcError] = []
    name = _get(merged, "model.name", "builtin:tiny")
    if isinstance(name, str) and (p := _model_problem(name)) is not None:
        problems.append(p)
    drafter = _get(merged, "speculative.drafter")
    if isinstance(drafter, str) and not Path(drafter).expanduser().is_dir():
        problems.append(ConfigError(f"speculative.drafter = {drafter!r}: no such directory",
                                    hint="the drafter's checkpoint directory (dflash, dflash2)"))
    trace = _get(merged, "experts.trace_file")
    if isinstance(trace, str) and not Path(trace).expanduser().absolute().parent.is_dir():
        problems.append(ConfigError(f"experts.trace_file = {trace!r}: its directory does not exist",
                                    hint="create the directory first, or choose another path"))
    cache_file = _get(merged, "cache.prefix_cache_file")
    if isinstance(cache_file, str):
        try:
            check_cache_file_path(cache_file)
        except HpcError as exc:
            problems.append(exc)
    return problems


def check_profile(profile: str | os.PathLike, environ: Mapping[str, str] | None = None) -> list[HpcError]:
    """Every problem of ``profile`` with the environment; empty when ``serve`` would accept it.
    A profile that cannot be found or parsed is one problem (nothing else can be checked)."""
    from hpc_cli import settings as st

    try:
        path = st.resolve_profile_path(profile)
        layers = {"profile": st.read_profile(path), "env": st.env_layer(environ), "cli": {}}
    except HpcError as exc:
        return [exc]
    merged: dict[str, Any] = {}
    for layer in ("profile", "env"):
        merged = st.merge(merged, layers[layer])
    problems, bad_keys = _value_problems(merged, layers, path)
    problems += _plugin_problems(merged, layers, path)
    problems += [p for p in _path_problems(merged) if not any(k in p.message for k in bad_keys)]
    try:
        st.load_settings(profile, environ=environ)
    except HpcError as exc:  # the combinations, when nothing above explains the failure
        if not any(exc.message in p.message or p.message in exc.message for p in problems):
            problems.append(exc)
    return problems
