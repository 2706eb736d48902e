"""One profile for every mode of a bench run: each mode keeps only its own ``[cache.<mode>]``
table, and what would make the runs differ besides the mode (the prefix cache file, the shared
tier) is left out."""

from __future__ import annotations

import os
from typing import Any, Mapping

from hpc_cli.settings import ResolvedSettings, load_settings, read_profile, resolve_profile_path

#: keys a bench run never takes from the profile: every mode starts from an empty cache
LEFT_OUT = ("cache.prefix_cache_file", "cache.shared_cache")


def _flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, Mapping) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def mode_settings(profile: str | None, mode: str, overrides: Mapping[str, object]) -> ResolvedSettings:
    """The resolved settings of ``mode``: the profile (its other modes' tables dropped), then
    ``overrides`` (dotted keys), then ``cache.mode``."""
    from hpc_cli import plugins

    modes = plugins.registries().cache_modes
    canonical = modes.canonical(mode)
    layer: dict[str, Any] = {}
    if profile is not None:
        doc = read_profile(resolve_profile_path(profile))
        cache = doc.get("cache")
        if isinstance(cache, dict):
            doc["cache"] = {k: v for k, v in cache.items()
                            if not (k in modes and modes.canonical(k) != canonical)}
        layer = {k: v for k, v in _flatten(doc).items() if k not in LEFT_OUT}
    layer.update(overrides)
    layer["cache.mode"] = canonical
    return load_settings(None, layer, os.environ)
