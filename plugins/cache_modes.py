"""Built-in cache modes: hybrid (spec §5-§10), legacy (the checkpoint catalog, spec §0, §1,
§14.1) and off (no reuse). Each builds its binding through :meth:`CacheMode.build`, exactly as a
third-party mode does (docs/plugins.md)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

import hpc_cli
from hpc_cli.cache_mode import CacheMode, reject_settings
from hpc_cli.errors import ConfigError

#: options of the hybrid mode that other modes reject (spec "Coexistence rules"); the shared
#: tier and the prefix cache file restore through the hybrid index
HYBRID_ONLY_SETTINGS = {
    "cache.shared_cache": "the shared cache tier restores through the hybrid index",
}


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


def _hybrid_defaults(lanes: int, chunk: int, host: bool) -> dict[str, Any]:
    return {
        "device_snapshot_slots": lanes + 1 if host else lanes + 2,
        "max_new_taps": 8 if host else 2,
        "tap_ladder_tokens": max(4096, 2 * chunk),
        "tap_min_gap_tokens": max(1024, chunk),
    }


class HybridMode(CacheMode):
    name = "hybrid"
    description = "content-addressed 64-token KV blocks and recurrent-state snapshots, device and host tiers"
    options_model = HybridOptions
    persistent = True

    def derive(self, settings, options: HybridOptions) -> dict[str, Any]:
        return _hybrid_defaults(settings.engine.max_concurrency, settings.engine.prefill_chunk,
                                settings.cache.host_cache_mib > 0)

    def snapshot_slots(self, options: HybridOptions, *, lanes: int, host: bool) -> int:
        if options.device_snapshot_slots is not None:
            return options.device_snapshot_slots
        return _hybrid_defaults(lanes, 0, host)["device_snapshot_slots"]

    def tap_slots(self, options: HybridOptions, *, model, speculative: bool) -> int:
        # a speculative backend's parts of the state image (DFlash2's rings) are not tapped
        # inside a pass: it splits there
        from hpc_cli.model.gdn_taps import tap_capacity

        return 0 if speculative else tap_capacity(model.device, model.config.linear_key_head_dim)

    def build(self, context):
        from hpc_cli.cache.taps import TapPlanner
        from hpc_cli.engine.hybrid import HybridBinding

        o: HybridOptions = context.options
        planner = TapPlanner(chunk=context.prefill_chunk, tap_ladder_tokens=o.tap_ladder_tokens,
                             tap_min_gap=o.tap_min_gap_tokens, max_new_taps=o.max_new_taps,
                             host_tier=context.host_bytes > 0)
        return HybridBinding(context.model, context.storage, context.states, lanes=context.lanes,
                             snapshot_slots=context.snapshot_slots, backend_storage=context.backend_storage,
                             frontier_lag=context.frontier_lag, host_bytes=context.host_bytes, reuse=True,
                             planner=planner, transfer_factory=context.transfer_factory,
                             coalesce=o.coalesce and context.concurrent_prefill,
                             coalesce_wait_limit=context.pending_timeout_s / 2.0,
                             tap_slots=context.tap_slots)


class LegacyOptions(BaseModel):
    """``[cache.legacy]``: the checkpoint catalog's capacities (spec §14.1 names); every value
    is derived when left unset."""

    model_config = ConfigDict(extra="forbid")

    device_state_slots: int | None = Field(None, ge=1, le=256, description=(
        "device state slots for checkpoints; default C+1 with a host tier, C+2 without"))
    host_state_slots: int | None = Field(None, ge=0, le=4096, description=(
        "checkpoint images the host tier holds; default 4*C with a host tier, else 0"))
    host_kv_mib: int | None = Field(None, ge=0, description=(
        "host KV of demoted checkpoints in MiB; default cache.host_cache_mib"))
    max_private_continuations: int | None = Field(None, ge=0, le=4096, description=(
        "sessions' continuations kept; default max(4, 2*C)"))
    max_shared_prefixes: int | None = Field(None, ge=0, le=4096, description=(
        "shared stable prefixes kept; default max(2, C)"))
    max_long_anchors_per_continuation: int | None = Field(None, ge=0, le=64, description=(
        "long anchors kept per continuation (the deepest); default 2"))
    long_anchor_spacing: int | None = Field(None, ge=64, description=(
        "tokens between long anchors; default max(4096, 2*prefill_chunk)"))


class LegacyMode(CacheMode):
    name = "legacy"
    description = "the checkpoint catalog: session endpoints, shared stable prefixes, long anchors (a baseline)"
    options_model = LegacyOptions

    def derive(self, settings, options: LegacyOptions) -> dict[str, Any]:
        from hpc_cli.engine.legacy import legacy_defaults

        return legacy_defaults(lanes=settings.engine.max_concurrency, prefill_chunk=settings.engine.prefill_chunk,
                               host_mib=settings.cache.host_cache_mib)

    def validate(self, settings, options: LegacyOptions) -> None:
        super().validate(settings, options)
        reject_settings(settings, self, HYBRID_ONLY_SETTINGS)
        from hpc_cli import plugins

        backend = plugins.spec_backend(settings.speculative.backend)
        if backend.drafts:
            raise ConfigError(f"cache mode 'legacy' runs without a speculative backend, but speculative.backend "
                              f"is {backend.name!r}", hint="set speculative.backend = 'none', or cache.mode = 'hybrid'")
        kv = options.host_kv_mib if options.host_kv_mib is not None else settings.cache.host_cache_mib
        if options.host_state_slots and not kv:
            raise ConfigError("cache.legacy.host_state_slots is set but the host tier holds no KV "
                              "(cache.legacy.host_kv_mib / cache.host_cache_mib is 0)",
                              hint="a checkpoint on the host needs its KV there too: set host_kv_mib, "
                                   "or leave host_state_slots unset")

    def snapshot_slots(self, options: LegacyOptions, *, lanes: int, host: bool) -> int:
        if options.device_state_slots is not None:
            return options.device_state_slots
        return lanes + 1 if host else lanes + 2

    def build(self, context):
        from hpc_cli.engine.legacy import LegacyBinding, legacy_config

        config = legacy_config(context.options, lanes=context.lanes, prefill_chunk=context.prefill_chunk,
                               host_mib=context.host_bytes >> 20)
        return LegacyBinding(context, config)


class OffMode(CacheMode):
    name = "off"
    aliases = ("none",)
    description = "no prefix reuse: every request prefills from the root"
    reuses = False

    def validate(self, settings, options) -> None:
        super().validate(settings, options)
        reject_settings(settings, self, HYBRID_ONLY_SETTINGS)

    def build(self, context):
        from hpc_cli.engine.off import OffBinding

        return OffBinding(context)


@hpc_cli.hookimpl
def hpc_register_cache_modes(register):
    register(HybridMode())
    register(LegacyMode())
    register(OffMode())
