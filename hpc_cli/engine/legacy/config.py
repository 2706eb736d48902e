"""The effective ``[cache.legacy]`` values of cache mode ``legacy`` and their derived defaults
(spec §14.1 names; the options model is in plugins/cache_modes.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hpc_cli.cache.catalog import CatalogLimits


@dataclass(frozen=True, slots=True)
class LegacyConfig:
    """The effective ``[cache.legacy]`` values (spec §14.1 names)."""

    device_state_slots: int
    host_state_slots: int
    host_kv_mib: int
    limits: CatalogLimits


def legacy_config(options: Any, *, lanes: int, prefill_chunk: int, host_mib: int) -> LegacyConfig:
    """Effective values of ``[cache.legacy]`` (unset ones derived, see plugins/cache_modes.py)."""
    d = legacy_defaults(lanes=lanes, prefill_chunk=prefill_chunk, host_mib=host_mib)
    v = {k: (getattr(options, k) if getattr(options, k, None) is not None else d[k]) for k in d}
    return LegacyConfig(device_state_slots=v["device_state_slots"], host_state_slots=v["host_state_slots"],
                        host_kv_mib=v["host_kv_mib"],
                        limits=CatalogLimits(v["max_private_continuations"], v["max_shared_prefixes"],
                                             v["max_long_anchors_per_continuation"], v["long_anchor_spacing"]))


def legacy_defaults(*, lanes: int, prefill_chunk: int, host_mib: int) -> dict[str, int]:
    """The derived defaults: one device state slot per lane and one more (C + 2 without a host
    tier), the host tier's KV from cache.host_cache_mib with 4 images per lane, 2C private
    continuations (at least 4), C shared prefixes (at least 2), 2 long anchors per continuation
    at the hybrid ladder's spacing, max(4096, 2 * prefill_chunk)."""
    host = host_mib > 0
    return {"device_state_slots": lanes + 1 if host else lanes + 2,
            "host_state_slots": 4 * lanes if host else 0,
            "host_kv_mib": host_mib,
            "max_private_continuations": max(4, 2 * lanes),
            "max_shared_prefixes": max(2, lanes),
            "max_long_anchors_per_continuation": 2,
            "long_anchor_spacing": max(4096, 2 * prefill_chunk)}

