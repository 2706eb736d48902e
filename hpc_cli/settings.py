"""Settings: profile TOML < environment HPC_* < CLI flags, with derived defaults (spec §14.2).

A profile file is a TOML document with the sections below. Every key can also be set by an
environment variable ``HPC_<SECTION>__<KEY>`` (for example ``HPC_CACHE__HOST_CACHE_MIB=0``) and
most by a CLI flag. The layers merge key by key, highest first: CLI flags, then the environment,
then the profile file, then the defaults; a flag left unset never masks a lower layer.

:func:`load_settings` returns a :class:`ResolvedSettings` with the validated settings, the layer
every value came from, and the effective values the cache mode derives for what was left unset.
"""

from __future__ import annotations

import difflib
import os
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal, Mapping

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, EnvSettingsSource, SettingsConfigDict

from hpc_cli.errors import ConfigError, HpcError

ENV_PREFIX = "HPC_"
LAYERS = ("default", "profile", "env", "cli", "derived")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSettings(_Section):
    name: str = Field("builtin:tiny", description="a checkpoint directory or builtin:NAME")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="weights and activations; auto = bfloat16 on CUDA, float32 on CPU")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda when available")
    max_model_len: int | None = Field(None, ge=64, description="context limit; default the model's")


class EngineSettings(_Section):
    max_concurrency: int = Field(4, ge=1, le=8, description="lanes C (sequences decoding at once)")
    prefill_chunk: int = Field(512, ge=16, le=65536, description="tokens per prefill pass")
    kv_capacity: Literal["auto"] | int = Field(
        "auto", description="device KV pages of the main pool; auto = what the memory allows")
    device_memory_fraction: float = Field(0.85, gt=0, le=1,
                                          description="share of free device memory auto sizing may use")
    concurrent_prefill: bool = Field(False, description="admit while another lane prefills (needed by coalescing)")
    pending_timeout_ms: int = Field(600_000, ge=1, description="queue timeout of a waiting request")
    default_max_tokens: int = Field(256, ge=1, description="max_tokens when a request names none")
    cuda_graphs: bool = Field(True, description="replay decode and verify passes as CUDA graphs (dense models)")
    seed: int = Field(0, ge=-(1 << 63), lt=1 << 64,
                      description="base seed of sampling for requests that name no seed: the k-th request of a "
                                  "run draws from (seed, k); a request's own seed wins")


class KVSettings(_Section):
    profile: str = Field("bf16", description="KV storage profile (hpc-cli kv profiles)")


class SpeculativeSettings(_Section):
    backend: str = Field("none", description="speculative backend: none, mtp, dflash, dflash2")
    num_draft_tokens: int = Field(3, ge=1, le=16, description="k, drafts proposed per round")
    drafter: str | None = Field(None, description="drafter checkpoint directory (dflash, dflash2)")


class CacheSettings(_Section):
    # extra keys are the option tables of cache modes ([cache.hybrid]); checked in _validate
    model_config = ConfigDict(extra="allow", validate_assignment=True)

    mode: str = Field("hybrid", description="cache mode: hybrid, legacy, off or a plugin's (hpc-cli plugins)")
    host_cache_mib: int = Field(8192, ge=0, description="host slab pool size; 0 = device only")
    prefix_cache_file: Path | None = Field(None, description="keep the host tier across restarts (spec §5.5)")
    no_prefix_reuse: bool = Field(False, description="disable the cache entirely")
    transfer_copy: Literal["auto", "dma", "kernel"] = Field(
        "auto", description="how restores, write-through and taps move bytes on CUDA: the copy engines "
                            "(dma), the segment copy kernel, or auto (the kernel for jobs of small copies)")
    shared_cache: str | None = Field(None, description="URL of a shared cache tier below the host tier "
                                                       "(redis://HOST:PORT/DB), shared by replicas of one model "
                                                       "and profile (docs/shared-cache.md)")
    shared_cache_timeout_ms: int = Field(2000, ge=1, le=600_000,
                                         description="longest wait for one shared-tier call, and for a "
                                                     "request's lookup before it prefills without it")
    shared_cache_queue_mib: int = Field(256, ge=1, description="entries copied out for the shared tier and not "
                                                               "yet stored; past it new ones are not sent")


class ServerSettings(_Section):
    host: str = Field("127.0.0.1", description="address to bind")
    port: int = Field(8000, ge=0, le=65535, description="port to bind")
    api_key: SecretStr | None = Field(None, description="require 'Authorization: Bearer KEY' or 'x-api-key: KEY' "
                                                        "on every /v1 route; must not be empty")
    served_model_name: str | None = Field(None, description="the model id clients send; default the model name")
    tui: bool = Field(False, description="show the live cache view in the terminal")
    debug_timing: bool = Field(False, description="add usage.hpc_timing (seconds per request phase) to every "
                                                  "response; a request asks with \"hpc\": {\"timing\": true}")
    protect_metrics: bool | None = Field(None, description="require the API key on /metrics too; default on when "
                                                           "api_key is set")
    max_request_bytes: int = Field(16 << 20, ge=1024, description="largest request body; a larger one gets 413")
    max_fanout: int = Field(64, ge=1, description="most engine requests one HTTP request may make (n x prompts)")
    max_queued_requests: int = Field(256, ge=0, description="requests that may wait beyond the engine's lanes; "
                                                            "past it 429 with Retry-After")
    header_timeout_s: float = Field(10.0, gt=0, description="seconds a connection may take to send a request's "
                                                            "headers")
    body_timeout_s: float = Field(30.0, gt=0, description="seconds a request may take to send its body; "
                                                          "past it 408")
    keep_alive_timeout_s: float = Field(5.0, gt=0, description="seconds an idle keep-alive connection stays open")
    exit_on_fatal: bool = Field(True, description="exit with status 3 once the engine stopped after an error, "
                                                  "so that a supervisor restarts the server")
    allow_remote_media: bool = Field(False, description="fetch http(s) image URLs in requests (off: images come "
                                                        "inline as base64 / data: URLs only)")
    max_image_bytes: int = Field(20 << 20, ge=1024, description="largest image a request may send or the server "
                                                                "may fetch, in bytes")
    max_image_pixels: int = Field(40_000_000, ge=1, description="most pixels (width x height) of an image before "
                                                                "it is resized")
    max_images_per_request: int = Field(16, ge=0, description="most images one request may hold")
    media_fetch_timeout_s: float = Field(10.0, gt=0, description="seconds a remote image may take to download")

    @field_validator("api_key")
    @classmethod
    def _key_not_empty(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and not value.get_secret_value().strip():
            raise ValueError("an empty API key would turn authentication off; leave api_key unset instead")
        return value


class TuiSettings(_Section):
    refresh_hz: float = Field(4.0, gt=0, le=30, description="frames per second of the terminal view")


class ExpertsSettings(_Section):
    offload: bool = Field(False, description="keep MoE experts in host memory, the most-routed in device slots")
    budget_slots: int | None = Field(None, ge=0, description="device slots, one expert each (or budget_mib)")
    budget_mib: int | None = Field(None, ge=0, description="device MiB for slots, checked against free memory "
                                                            "after the KV pools are sized (or budget_slots)")
    profile_file: Path | None = Field(None, description="STRP residency profile (hpc-cli expert profile)")
    admission: Literal["profile", "first-routed", "per-layer-first-routed"] = Field(
        "profile", description="which experts get slots; none is ever evicted")
    verify: bool = Field(False, description="read every slot back at startup; a mismatch refuses to start")
    trace_file: Path | None = Field(None, description="write routing traces while serving (hpc-cli expert profile)")


class HpcSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_nested_delimiter="__",
                                      extra="forbid", validate_assignment=True)

    model: ModelSettings = ModelSettings()
    engine: EngineSettings = EngineSettings()
    kv: KVSettings = KVSettings()
    speculative: SpeculativeSettings = SpeculativeSettings()
    cache: CacheSettings = CacheSettings()
    server: ServerSettings = ServerSettings()
    tui: TuiSettings = TuiSettings()
    experts: ExpertsSettings = ExpertsSettings()

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings,
                                   dotenv_settings, file_secret_settings):
        # load_settings merges the layers itself (to know where each value came from).
        return (init_settings,)


SECTIONS = tuple(HpcSettings.model_fields)


def env_var(key: str) -> str:
    """The environment variable that sets a dotted key: cache.host_cache_mib -> HPC_CACHE__HOST_CACHE_MIB."""
    return ENV_PREFIX + key.replace(".", "__").upper()


@dataclass
class ResolvedSettings:
    settings: HpcSettings
    sources: dict[str, str]  # dotted key -> layer
    effective: dict[str, Any]  # dotted key -> value, derived values included
    profile_path: Path | None = None
    mode_options: Any = None  # the cache mode's validated options model
    raw_layers: dict[str, dict] = field(default_factory=dict)

    def source(self, key: str) -> str:
        return self.sources.get(key, "default")


# ---------------------------------------------------------------------------------------------
# Profile files
# ---------------------------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------------------------

def _env_layer(environ: Mapping[str, str] | None) -> dict[str, Any]:
    source = EnvSettingsSource(HpcSettings, case_sensitive=False)
    if environ is not None:
        source.env_vars = {k.lower(): v for k, v in environ.items()}
    try:
        data = source()
    except Exception as exc:  # pydantic-settings raises SettingsError for bad JSON values
        raise ConfigError(f"environment: {exc}", hint="check the HPC_* variables") from None
    prefix = ENV_PREFIX.lower()
    known = {s for s in SECTIONS}
    vars_ = source.env_vars
    for name in vars_:
        if name.startswith(prefix) and name not in ("hpc_load_plugins",):
            section = name[len(prefix):].split("__", 1)[0]
            if section not in known:
                raise ConfigError(f"unknown environment variable {name.upper()}",
                                  hint=f"HPC_* variables name a section: {', '.join(SECTIONS)} "
                                       "(HPC_<SECTION>__<KEY>); HPC_LOAD_PLUGINS selects plugins")
    return data


def _drop_none(d: Mapping[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, Mapping):
            sub = _drop_none(v)
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


def _merge(base: dict, top: Mapping) -> dict:
    out = dict(base)
    for k, v in top.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _origin(key: str, layers: dict[str, dict]) -> str:
    for layer in ("cli", "env", "profile"):
        flat = _flatten(layers.get(layer, {}))
        if key in flat or any(k.startswith(key + ".") for k in flat):
            return layer
    return "default"


def _describe_origin(key: str, layer: str, profile: Path | None) -> str:
    where = {"cli": "a command-line flag", "env": f"the environment ({env_var(key)})",
             "profile": f"profile {profile}" if profile else "the profile", "default": "the defaults"}[layer]
    return f"set by {where}"


def _validation_error(exc: ValidationError, layers: dict[str, dict], profile: Path | None,
                      prefix: tuple[str, ...] = (), model: Any = None) -> ConfigError:
    lines = []
    hints = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"] if not isinstance(p, int)]
        # pydantic names the union member that failed last (kv_capacity: "auto" | int); drop it
        loc = [p for p in loc if p not in ("literal['auto']", "int")]
        key = ".".join((*prefix, *loc))
        layer = _origin(key, layers)
        if err["type"] == "extra_forbidden":
            parent, _, leaf = key.rpartition(".")
            at = model if (model is not None and parent == ".".join(prefix)) else _model_at(parent)
            choices = list(at.model_fields) if at else list(SECTIONS)
            close = difflib.get_close_matches(leaf, choices, n=1)
            lines.append(f"unknown key {key} ({_describe_origin(key, layer, profile)})")
            hints.append(f"did you mean {parent + '.' if parent else ''}{close[0]}?" if close
                         else f"keys of [{parent or 'top level'}]: {', '.join(choices)}")
        else:
            value = err.get("input")
            also = "" if layer == "env" else f"; env {env_var(key)}"
            lines.append(f"{key} = {value!r}: {err['msg']} ({_describe_origin(key, layer, profile)}{also})")
    hint = "; ".join(dict.fromkeys(hints)) or "fix the value; `hpc-cli config show --sources` shows every key"
    return ConfigError("; ".join(lines), hint=hint)


def _model_at(dotted: str):
    model: Any = HpcSettings
    for part in [p for p in dotted.split(".") if p]:
        f = model.model_fields.get(part)
        if f is None or not isinstance(f.annotation, type) or not issubclass(f.annotation, BaseModel):
            return None
        model = f.annotation
    return model


# ---------------------------------------------------------------------------------------------
# Loading and validation
# ---------------------------------------------------------------------------------------------

def load_settings(profile: str | os.PathLike | None = None, cli: Mapping[str, Any] | None = None,
                  environ: Mapping[str, str] | None = None) -> ResolvedSettings:
    """Resolve settings from a profile (path or shipped name), the environment and CLI flags."""
    profile_path = resolve_profile_path(profile) if profile is not None else None
    layers = {
        "profile": read_profile(profile_path) if profile_path else {},
        "env": _env_layer(environ),
        "cli": cli_layer(cli or {}),
    }
    merged: dict[str, Any] = {}
    for layer in ("profile", "env", "cli"):
        merged = _merge(merged, layers[layer])
    try:
        settings = HpcSettings(**merged)
    except ValidationError as exc:
        raise _validation_error(exc, layers, profile_path) from None
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
                              f"({_describe_origin(key, _origin(key, layers), profile_path)})",
                              hint=exc.hint) from None
        setattr(getattr(settings, section), leaf, canonical)

    mode = regs.cache_modes.get(settings.cache.mode)
    tables = dict(settings.cache.model_extra or {})
    for name, table in tables.items():
        if name not in regs.cache_modes:
            close = difflib.get_close_matches(name, list(CacheSettings.model_fields) + regs.cache_modes.names(), n=1)
            owners = [e.name for e in regs.cache_modes if name in e.obj.options_model.model_fields]
            raise ConfigError(f"unknown key cache.{name} ({_describe_origin('cache.' + name, _origin('cache.' + name, layers), profile_path)})",
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
        raise _validation_error(exc, layers, profile_path, ("cache", mode.name), mode.options_model) from None

    sources: dict[str, str] = {}
    effective: dict[str, Any] = {}
    for section in SECTIONS:
        sec = getattr(settings, section)
        for name in type(sec).model_fields:
            key = f"{section}.{name}"
            value = getattr(sec, name)
            effective[key] = value.get_secret_value() if isinstance(value, SecretStr) else value
            sources[key] = _origin(key, layers)
    derived = mode.derive(settings, options)
    for name in type(options).model_fields:
        key = f"cache.{mode.name}.{name}"
        value = getattr(options, name)
        if value is None and name in derived:
            effective[key] = derived[name]
            sources[key] = "derived"
        else:
            effective[key] = value
            sources[key] = _origin(key, layers)
    if effective.get("server.api_key"):
        effective["server.api_key"] = "***"

    resolved = ResolvedSettings(settings, sources, effective, profile_path, options, layers)
    _validate_combinations(resolved, mode)
    mode.validate(settings, options)
    reject_foreign_tables(settings, mode)
    return resolved


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
