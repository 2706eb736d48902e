"""The plugin host: one pluggy PluginManager("hpc_cli") and the registries it fills.

Built-in plugins are the modules in ``DEFAULT_PLUGINS``; they are registered the same way as
third-party modules found through the ``hpc_cli`` entry-point group. ``HPC_LOAD_PLUGINS=a,b``
limits which third-party plugins load (by entry-point name; an empty value loads none).
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Callable, Generic, Iterator, TypeVar

import pluggy

from hpc_cli import __version__, hookspecs
from hpc_cli.errors import PluginError

ENTRY_POINT_GROUP = "hpc_cli"
DEFAULT_PLUGINS: tuple[str, ...] = (
    "hpc_plugins.kv_profiles",
    "hpc_plugins.spec_backends",
    "hpc_plugins.cache_modes",
    "hpc_plugins.shared_redis",
)

_pm: pluggy.PluginManager | None = None
_registries: "Registries | None" = None

T = TypeVar("T")


def get_plugin_manager() -> pluggy.PluginManager:
    """The process's plugin manager, loading built-ins and entry points on first use."""
    global _pm
    if _pm is None:
        _pm = _load()
    return _pm


def reset() -> None:
    """Forget the loaded plugins (tests use this after changing HPC_LOAD_PLUGINS)."""
    global _pm, _registries
    _pm = None
    _registries = None


def _load() -> pluggy.PluginManager:
    pm = pluggy.PluginManager("hpc_cli")
    pm.add_hookspecs(hookspecs)
    for module_name in DEFAULT_PLUGINS:
        pm.register(importlib.import_module(module_name), name=module_name)
    wanted = os.environ.get("HPC_LOAD_PLUGINS")
    allow = None if wanted is None else {w.strip() for w in wanted.split(",") if w.strip()}
    found: set[str] = set()
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if allow is not None and ep.name not in allow:
            continue
        found.add(ep.name)
        if pm.get_plugin(ep.name) is not None:
            continue
        try:
            plugin = ep.load()
        except Exception as exc:  # a broken third-party plugin must name itself
            raise PluginError(
                f"plugin {ep.name!r} ({ep.value}) failed to import: {exc}",
                hint=f"fix or uninstall the package that provides it, or set HPC_LOAD_PLUGINS to exclude {ep.name}",
            ) from exc
        pm.register(plugin, name=ep.name)
        _DISTS[ep.name] = ep.dist.name if ep.dist else None
    if allow:
        missing = sorted(allow - found)
        if missing:
            raise PluginError(
                f"HPC_LOAD_PLUGINS names plugins that are not installed: {', '.join(missing)}",
                hint="run `hpc-cli plugins` to see the installed plugins",
            )
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise PluginError(f"a plugin implements an unknown hook: {exc}",
                          hint="check the hook names against docs/plugins.md") from exc
    return pm


_DISTS: dict[str, str | None] = {}


@dataclass(slots=True)
class Entry(Generic[T]):
    name: str
    obj: T
    plugin: str
    aliases: tuple[str, ...] = ()


@dataclass
class Registry(Generic[T]):
    """Named objects of one kind; refuses duplicates and explains unknown names."""

    kind: str  # "KV profile", "speculative backend", "cache mode"
    setting: str  # the profile key that chooses one, for hints
    entries: dict[str, Entry[T]] = field(default_factory=dict)
    _alias: dict[str, str] = field(default_factory=dict)

    def add(self, obj: T, plugin: str) -> None:
        name = getattr(obj, "name", None)
        if not isinstance(name, str) or not name:
            raise PluginError(f"plugin {plugin!r} registered a {self.kind} without a name",
                              hint="set the `name` attribute of the object passed to register()")
        aliases = tuple(getattr(obj, "aliases", ()) or ())
        for key in (name, *aliases):
            owner = self._alias.get(key)
            if owner is not None:
                raise PluginError(
                    f"{self.kind} {key!r} is registered twice: by {self.entries[owner].plugin!r} "
                    f"and by {plugin!r}",
                    hint="uninstall one of the two plugins, or limit loading with HPC_LOAD_PLUGINS",
                )
        self.entries[name] = Entry(name, obj, plugin, aliases)
        for key in (name, *aliases):
            self._alias[key] = name

    def get(self, name: str) -> T:
        return self.entry(name).obj

    def entry(self, name: str) -> Entry[T]:
        key = self._alias.get(name)
        if key is None:
            known = ", ".join(f"{e.name} ({e.plugin})" for e in self.entries.values())
            raise PluginError(f"unknown {self.kind} {name!r}; registered: {known}",
                              hint=f"set {self.setting} to one of the registered names")
        return self.entries[key]

    def canonical(self, name: str) -> str:
        return self.entry(name).name

    def names(self) -> list[str]:
        return list(self.entries)

    def __iter__(self) -> Iterator[Entry[T]]:
        return iter(self.entries.values())

    def __contains__(self, name: str) -> bool:
        return name in self._alias


@dataclass
class Registries:
    kv_profiles: Registry
    spec_backends: Registry
    cache_modes: Registry
    shared_stores: Registry


def _fill(pm: pluggy.PluginManager, hook_name: str, registry: Registry) -> None:
    hook = getattr(pm.hook, hook_name)
    for impl in hook.get_hookimpls():
        impl.function(register=lambda obj, _p=impl.plugin_name: registry.add(obj, _p))


def registries() -> Registries:
    """The KV profiles, speculative backends and cache modes of every loaded plugin."""
    global _registries
    if _registries is None:
        pm = get_plugin_manager()
        regs = Registries(
            kv_profiles=Registry("KV profile", "kv.profile (HPC_KV__PROFILE)"),
            spec_backends=Registry("speculative backend", "speculative.backend (HPC_SPECULATIVE__BACKEND)"),
            cache_modes=Registry("cache mode", "cache.mode (HPC_CACHE__MODE)"),
            shared_stores=Registry("shared cache store", "the scheme of cache.shared_cache (HPC_CACHE__SHARED_CACHE)"),
        )
        _fill(pm, "hpc_register_kv_profiles", regs.kv_profiles)
        _fill(pm, "hpc_register_spec_backends", regs.spec_backends)
        _fill(pm, "hpc_register_cache_modes", regs.cache_modes)
        _fill(pm, "hpc_register_shared_stores", regs.shared_stores)
        _registries = regs
    return _registries


def kv_profile(name: str):
    return registries().kv_profiles.get(name)


def spec_backend(name: str):
    return registries().spec_backends.get(name)


def cache_mode(name: str):
    return registries().cache_modes.get(name)


def shared_store(scheme: str):
    """The shared store kind (``hpc_cli.shared_store.SharedStoreKind``) serving a URL scheme."""
    return registries().shared_stores.get(scheme)


def plugin_info() -> list[dict[str, Any]]:
    """One record per loaded plugin: name, version, the hooks it implements, what it registered."""
    pm = get_plugin_manager()
    regs = registries()
    out = []
    for name, plugin in pm.list_name_plugin():
        hooks = sorted(h.name for h in pm.get_hookcallers(plugin) or [])
        dist = _DISTS.get(name)
        version = __version__ if name in DEFAULT_PLUGINS else _dist_version(dist)
        registered = {
            "kv_profiles": [e.name for e in regs.kv_profiles if e.plugin == name],
            "spec_backends": [e.name for e in regs.spec_backends if e.plugin == name],
            "cache_modes": [e.name for e in regs.cache_modes if e.plugin == name],
            "shared_stores": [e.name for e in regs.shared_stores if e.plugin == name],
        }
        out.append({"name": name, "version": version, "builtin": name in DEFAULT_PLUGINS,
                    "distribution": "hpc-cli" if name in DEFAULT_PLUGINS else dist,
                    "hooks": hooks, "registers": {k: v for k, v in registered.items() if v}})
    return out


def _dist_version(dist: str | None) -> str | None:
    if not dist:
        return None
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def add_commands(cli: Callable) -> None:
    """Let plugins add click commands to the top-level group."""
    get_plugin_manager().hook.hpc_register_commands(cli=cli)
