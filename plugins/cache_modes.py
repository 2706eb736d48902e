"""Built-in cache modes: hybrid (spec §5-§10) and off."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

import hpc_cli
from hpc_cli.cache_mode import CacheMode


class HybridOptions(BaseModel):
    """``[cache.hybrid]``: every value is derived when left unset (spec §14.2)."""

    model_config = ConfigDict(extra="forbid")

    device_snapshot_slots: int | None = Field(None, ge=1, le=256, description=(
        "device snapshot slots D; default C+1 with a host tier, C+2 without"))
    max_new_taps: int | None = Field(None, ge=0, le=64, description=(
        "taps kept per request; default 8 with a host tier, 2 without"))
    tap_ladder_tokens: int | None = Field(None, ge=64, description=(
        "G, the geometric ladder's base spacing; default max(4096, 2*prefill_chunk)"))
    tap_min_gap_tokens: int | None = Field(None, ge=64, description=(
        "minimum gap around ladder taps; default max(1024, prefill_chunk)"))
    coalesce: bool = Field(True, description=(
        "in-flight prefix coalescing (spec §12.2); needs engine.concurrent_prefill"))


class HybridMode(CacheMode):
    name = "hybrid"
    description = "content-addressed 64-token KV blocks and recurrent-state snapshots, device and host tiers"
    options_model = HybridOptions

    def derive(self, settings, options: HybridOptions) -> dict[str, Any]:
        c = settings.engine.max_concurrency
        chunk = settings.engine.prefill_chunk
        host = settings.cache.host_cache_mib > 0
        return {
            "device_snapshot_slots": c + 1 if host else c + 2,
            "max_new_taps": 8 if host else 2,
            "tap_ladder_tokens": max(4096, 2 * chunk),
            "tap_min_gap_tokens": max(1024, chunk),
        }


class OffMode(CacheMode):
    name = "off"
    aliases = ("none",)
    description = "no prefix reuse: every request prefills from the root"
    reuses = False


@hpc_cli.hookimpl
def hpc_register_cache_modes(register):
    register(HybridMode())
    register(OffMode())
