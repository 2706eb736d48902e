"""Loading the settings: merge the layers, validate, derive what was left unset and check the
combinations (spec §14.2)."""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any, Mapping

from pydantic import SecretStr, ValidationError

from hpc_cli.errors import ConfigError, HpcError
from hpc_cli.settings.layers import cli_layer, describe_origin, env_layer, merge, origin, validation_error
from hpc_cli.settings.profiles import read_profile, resolve_profile_path
from hpc_cli.settings.sections import SECTIONS, CacheSettings, ExpertsSettings, HpcSettings, ResolvedSettings


def load_settings(profile: str | os.PathLike | None = None, cli: Mapping[str, Any] | None = None,
                  environ: Mapping[str, str] | None = None) -> ResolvedSettings:
    """Resolve settings from a profile (path or shipped name), the environment and CLI flags."""
    profile_path = resolve_profile_path(profile) if profile is not None else None
    layers = {
        "profile": read_profile(profile_path) if profile_path else {},
        "env": env_layer(environ),
        "cli": cli_layer(cli or {}),
    }
    merged: dict[str, Any] = {}
    for layer in ("profile", "env", "cli"):
        merged = merge(merged, layers[layer])
    try:
        settings = HpcSettings(**merged)
    except ValidationError as exc:
        raise validation_error(exc, layers, profile_path) from None
    return _resolve(settings, layers, profile_path)


def _resolve(settings: HpcSettings, layers: dict[str, dict], profile_path: Path | None) -> ResolvedSettings:
    from hpc_cli import plugins
    from hpc_cli.cache_mode import reject_foreign_tables

    regs = plugins.registries()
    for key, registry in (("kv.profile", regs.kv_profiles), ("speculative.backend", regs.spec_backends),
                          ("cache.mode", regs.cache_modes)):
        section, leaf = key.split(".")
        value = getattr(getattr(settings, section), leaf)
        try:
            canonical = registry.canonical(value)
        except HpcError as exc:
            raise ConfigError(f"{key} = {value!r}: {exc.message} "
                              f"({describe_origin(key, origin(key, layers), profile_path)})",
                              hint=exc.hint) from None
        setattr(getattr(settings, section), leaf, canonical)

    mode = regs.cache_modes.get(settings.cache.mode)
    tables = dict(settings.cache.model_extra or {})
    for name, table in tables.items():
        if name not in regs.cache_modes:
            close = difflib.get_close_matches(name, list(CacheSettings.model_fields) + regs.cache_modes.names(), n=1)
            owners = [e.name for e in regs.cache_modes if name in e.obj.options_model.model_fields]
            raise ConfigError(f"unknown key cache.{name} ({describe_origin('cache.' + name, origin('cache.' + name, layers), profile_path)})",
                              hint=f"{name} is an option of cache mode {owners[0]!r}: set it in [cache.{owners[0]}] "
                                   f"with cache.mode = {owners[0]!r}" if owners else
                              f"did you mean cache.{close[0]}?" if close else
                              f"keys of [cache]: {', '.join(CacheSettings.model_fields)}, or a mode table "
                              f"[cache.<mode>] ({', '.join(regs.cache_modes.names())})")
        # the tables of other modes are rejected by the selected mode's validate() (the coexistence
        # rules), and after it by reject_foreign_tables for a mode that does not check them
    raw_options = tables.get(mode.name, {}) or {}
    if not isinstance(raw_options, Mapping):
        raise ConfigError(f"cache.{mode.name} must be a table", hint=f"write [cache.{mode.name}] with keys under it")
    try:
        options = mode.options_model(**raw_options)
    except ValidationError as exc:
        raise validation_error(exc, layers, profile_path, ("cache", mode.name), mode.options_model) from None

    sources: dict[str, str] = {}
    effective: dict[str, Any] = {}
    for section in SECTIONS:
        sec = getattr(settings, section)
        for name in type(sec).model_fields:
            key = f"{section}.{name}"
            value = getattr(sec, name)
            effective[key] = value.get_secret_value() if isinstance(value, SecretStr) else value
            sources[key] = origin(key, layers)
    derived = mode.derive(settings, options)
    for name in type(options).model_fields:
        key = f"cache.{mode.name}.{name}"
        value = getattr(options, name)
        if value is None and name in derived:
            effective[key] = derived[name]
            sources[key] = "derived"
        else:
            effective[key] = value
            sources[key] = origin(key, layers)
    if effective.get("server.api_key"):
        effective["server.api_key"] = "***"
    k = "speculative.num_draft_tokens"
    if effective[k] is None and settings.speculative.backend != "none":
        recommended = _recommended_draft_tokens(settings.model.name)
        if recommended is not None:
            effective[k], sources[k] = recommended, "derived"

    resolved = ResolvedSettings(settings, sources, effective, profile_path, options, layers)
    _validate_combinations(resolved, mode)
    mode.validate(settings, options)
    reject_foreign_tables(settings, mode)
    return resolved


def _recommended_draft_tokens(model: str) -> int | None:
    """The k an engine of ``model`` drafts with ``speculative.num_draft_tokens`` unset (the
    checkpoint's ``generation_config.json``, else 3), read from its configuration files alone; None
    where they cannot be read (the model's load reports why)."""
    from hpc_cli.engine.config import draft_tokens
    from hpc_cli.model.builtin import config_for

    try:
        config = config_for(model)
    except HpcError:
        return None
    return draft_tokens(None, config)


def _validate_combinations(r: ResolvedSettings, mode) -> None:
    s = r.settings
    _validate_experts(s.experts)
    c = s.cache
    explicit = lambda key: r.sources.get(key, "default") not in ("default", "derived")  # noqa: E731
    if c.no_prefix_reuse:
        offending = [k for k in r.sources if k.startswith("cache.") and k not in ("cache.no_prefix_reuse", "cache.mode")
                     and explicit(k)]
        if explicit("cache.mode") and c.mode not in ("hybrid", "off"):
            offending.append("cache.mode")
        if offending:
            raise ConfigError(
                f"cache.no_prefix_reuse disables the cache, so {', '.join(offending)} cannot be set with it",
                hint="remove no_prefix_reuse, or remove the other [cache] options")
    if c.prefix_cache_file is not None:
        path = Path(c.prefix_cache_file).expanduser()
        path = path if path.is_absolute() else (Path.cwd() / path)
        path = Path(os.path.normpath(path))
        if not mode.persistent or c.no_prefix_reuse:
            raise ConfigError(f"cache.prefix_cache_file is set but cache.mode is {c.mode!r}, which keeps no "
                              "prefix cache file", hint="prefix cache files need cache.mode = 'hybrid'")
        if path.is_dir():
            raise ConfigError(f"cache.prefix_cache_file {path} is a directory",
                              hint="name a file inside it, e.g. " + str(path / "prefix.bin"))
        if path.exists() and not path.is_file():
            raise ConfigError(f"cache.prefix_cache_file {path} is not a regular file (a FIFO, device or socket "
                              "would block or corrupt the load and the save)",
                              hint="name a regular file, or a path that does not exist yet (the orderly stop "
                                   "writes it)")
        if not path.parent.is_dir():
            raise ConfigError(f"cache.prefix_cache_file {path}: the directory {path.parent} does not exist",
                              hint="create the directory first, or choose another path")
        if c.host_cache_mib == 0:
            raise ConfigError("cache.prefix_cache_file needs a host tier, but cache.host_cache_mib is 0",
                              hint="set cache.host_cache_mib (the file holds host-tier content)")
        c.prefix_cache_file = path
        r.effective["cache.prefix_cache_file"] = path
    if c.shared_cache is not None:
        _validate_shared_cache(r, c, mode)


def _validate_shared_cache(r: ResolvedSettings, c: CacheSettings, mode) -> None:
    from urllib.parse import urlsplit

    from hpc_cli import plugins

    if mode.name != "hybrid" or c.no_prefix_reuse:
        raise ConfigError(f"cache.shared_cache is set but cache.mode is {c.mode!r}",
                          hint="the shared tier shares the hybrid mode's blocks and snapshots: cache.mode = 'hybrid'")
    if c.host_cache_mib == 0:
        raise ConfigError("cache.shared_cache needs a host tier, but cache.host_cache_mib is 0",
                          hint="set cache.host_cache_mib (hits from the shared tier restore through it)")
    scheme = urlsplit(c.shared_cache).scheme
    stores = plugins.registries().shared_stores
    if scheme not in stores:
        known = ", ".join(f"{e.name}:// ({e.plugin})" for e in stores)
        raise ConfigError(f"cache.shared_cache: no shared store serves "
                          f"{scheme + ':// URLs' if scheme else 'a value without a scheme'}; registered: {known}",
                          hint="write redis://HOST:PORT/DB, e.g. redis://127.0.0.1:6379/0")
    u = urlsplit(c.shared_cache)
    if u.password:  # shown by `config show`: never the password
        r.effective["cache.shared_cache"] = c.shared_cache.replace(f":{u.password}@", ":***@", 1)


def _validate_experts(e: ExpertsSettings) -> None:
    if e.budget_slots is not None and e.budget_mib is not None:
        raise ConfigError("experts.budget_slots and experts.budget_mib are both set",
                          hint="size the expert tier one way: slots or MiB")
    if e.offload and e.admission == "profile" and e.profile_file is None:
        raise ConfigError("experts.admission = 'profile' needs experts.profile_file",
                          hint="build one with `hpc-cli expert profile TRACES --slots N -o profile.bin`, "
                               "or set experts.admission = 'per-layer-first-routed'")
    if e.offload and e.admission != "profile" and e.budget_slots is None and e.budget_mib is None:
        raise ConfigError(f"experts.admission = {e.admission!r} needs a budget",
                          hint="set experts.budget_slots or experts.budget_mib")
    if e.profile_file is not None and not Path(e.profile_file).expanduser().is_file():
        raise ConfigError(f"experts.profile_file {e.profile_file} does not exist",
                          hint="build one with `hpc-cli expert profile TRACES --slots N -o profile.bin`")
