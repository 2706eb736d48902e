"""The cache binding: what the engine asks of its cache mode (ARCHITECTURE.md §3, spec
"Coexistence rules").

A cache mode (:class:`hpc_cli.cache_mode.CacheMode`) builds one :class:`CacheBinding` for an
engine from a :class:`BindingContext` (the model, the device pools and state slots, the lanes,
the host budget, the transfer engine's factory and the mode's own options). The engine keeps the
active-execution machinery (lanes, block tables, prefill, decode, speculative rounds) and asks
the binding only for what a mode decides: where a request resumes from (admission-source
selection), what is captured (where a prefill pass must split, what is kept after it), what is
retained at the end, and what goes under pressure. The calls, in a request's order:

    admit(lane, siblings)      pages, a state slot and a resume point for the FIFO head, or Blocked
    prefetch(lane)             the head stays blocked: start what makes its admission cheaper
    next_stop(lane, end)       where the next prefill pass must end (an exact capture point)
    pass_taps(lane, end)       the state images the pass takes inside itself (positions, slots)
    before_pass(lane, end)     before a prefill pass
    layer_ready(lane)          a per-layer wait for the lane's first pass (restores in flight), or None
    after_pass(lane, tapped)   after it: commit and capture what the pass reached (and its images)
    commit_blocks(lane)        after decode rounds (and speculative verify passes)
    finish(lane, publish=...)  terminal settlement: keep (publish) or drop what the lane built
    poll() / drain()           land finished transfers / all of them (at the stop)

and around them ``failed`` (a transfer fault: the worker stops), ``transfers_pending``,
``counters`` (``taps``: captures taken, read around passes for the timing), ``host`` (the host
tier's storage, possibly of no slabs: the worker pins it only while idle), :meth:`stats`,
:meth:`residency`, :meth:`check_invariants` and :meth:`leftovers` (what is still held: all zero
once the engine stopped). ``persistent`` says whether the prefix cache file applies
(:mod:`hpc_cli.engine.persistence` refuses a binding without it).

Every binding runs on the worker thread only (spec §10.9).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

from pydantic import BaseModel, ValidationError

from hpc_cli.cache.ids import StateSlot
from hpc_cli.cache.keys import BLOCK_TOKENS
from hpc_cli.engine.stats_types import CacheStats, Residency
from hpc_cli.errors import ConfigError, EngineError

if TYPE_CHECKING:
    from hpc_cli.model.model import TapImage
    from hpc_cli.cache_mode import CacheMode
    from hpc_cli.engine.lane import Lane
    from hpc_cli.memory.host_slabs import HostSlabStorage
    from hpc_cli.memory.kv_pool import PagedKVStorage
    from hpc_cli.memory.state_pool import StateSlots
    from hpc_cli.memory.transfer.engine import TransferEngine
    from hpc_cli.model.model import HybridModel

#: builds the transfer engine: ``factory(main_storage, host, state=..., layer_order=..., [backend=...])``
TransferFactory = Callable[..., "TransferEngine"]


@dataclass(slots=True)
class Admission:
    """What an admission reports to the request: tokens resumed (``usage.reuse_tokens``), the
    longest prefix the cache held (reusable or not) and the host bytes it restores."""

    reuse_tokens: int
    cached_prefix_tokens: int
    restored_host_bytes: int


class Blocked(Exception):
    """Admission must wait (TemporarilyBlocked): active entitlements hold the pages."""


@dataclass(frozen=True, slots=True)
class BindingContext:
    """What the engine gives a cache mode to build its binding from.

    ``states`` holds ``lanes + snapshot_slots + tap_slots`` state slots: slots ``0 .. lanes-1``
    are the lanes' own, the rest the mode's (as many as :meth:`CacheMode.snapshot_slots` and
    :meth:`CacheMode.tap_slots` asked for, in that order).
    ``options`` is the mode's options model (values the profile left unset may be ``None``: the
    mode fills them from this context, as its ``derive`` does from the settings)."""

    model: "HybridModel"
    storage: "PagedKVStorage"
    states: "StateSlots"
    lanes: int
    snapshot_slots: int
    host_bytes: int
    prefill_chunk: int
    options: BaseModel
    transfer_factory: TransferFactory
    backend_storage: "PagedKVStorage | None" = None
    frontier_lag: int = 0  # a speculative backend's committed frontier trails by this much (MTP: 1)
    speculative: bool = False  # a drafting speculative backend is active
    concurrent_prefill: bool = False
    pending_timeout_s: float = 600.0
    tap_slots: int = 0  # state slots a prefill pass writes its taps' images into (after snapshot_slots)

    def make_transfer(self, host: "HostSlabStorage") -> "TransferEngine":
        """The transfer engine between these pools and ``host`` (restores in forward order)."""
        from hpc_cli.memory.transfer.plan import layer_order_for_shape

        extra: dict[str, Any] = {"backend": self.backend_storage} if self.backend_storage is not None else {}
        return self.transfer_factory(self.storage, host, state=self.states,
                                     layer_order=layer_order_for_shape(self.model.shape()), **extra)


@runtime_checkable
class CacheBinding(Protocol):
    """The engine's cache, whatever the mode (see the module doc for the call order)."""

    #: the cache mode's name
    mode: str
    #: True when the prefix cache file (spec §5.5) applies to this binding
    persistent: bool
    #: True when it can reuse prefixes at all (False: the null object of cache mode ``off``)
    reuse: bool
    host: "HostSlabStorage"
    counters: dict[str, int]
    failed: str | None

    @property
    def transfers_pending(self) -> int: ...

    def admit(self, lane: "Lane", siblings: Sequence["Lane"] = ()) -> Admission: ...

    def prefetch(self, lane: "Lane") -> int: ...

    def next_stop(self, lane: "Lane", end: int) -> int: ...

    def pass_taps(self, lane: "Lane", end: int) -> Sequence["TapImage"]: ...

    def before_pass(self, lane: "Lane", end: int) -> None: ...

    def layer_ready(self, lane: "Lane") -> Callable[[int], None] | None: ...

    def after_pass(self, lane: "Lane", tapped: Sequence["TapImage"] = ()) -> None: ...

    def commit_blocks(self, lane: "Lane") -> None: ...

    def finish(self, lane: "Lane", *, publish: bool = True) -> None: ...

    def poll(self) -> None: ...

    def drain(self) -> None: ...

    def stats(self, *, detailed: bool = False) -> CacheStats: ...

    def residency(self) -> Residency: ...

    def check_invariants(self) -> None: ...

    def leftovers(self) -> dict[str, int]: ...


def entitlement(n_prompt: int, max_tokens: int) -> int:
    """Pages a request may grow to: its prompt and every output token, in 64-token pages."""
    return max(1, math.ceil((n_prompt + max_tokens) / BLOCK_TOKENS))


def admissible_pages(lane: "Lane", free_lanes: int, pool_pages: int) -> int:
    """The pages ``lane`` may grow to (:func:`entitlement`), checked the same in every mode:
    :class:`Blocked` while no lane is free, EngineError when the device pool could never hold them."""
    if not free_lanes:
        raise Blocked("no free lane")
    ent = entitlement(lane.n_prompt, lane.max_tokens)
    if ent > pool_pages:
        raise EngineError(f"the request needs {ent} KV pages ({lane.n_prompt} prompt + {lane.max_tokens} "
                          f"output tokens), the device pool holds {pool_pages}",
                          hint="lower max_tokens or the prompt, or raise engine.kv_capacity")
    return ent


def start_from_root(lane: "Lane", pages: list[int], slot: StateSlot, states: Any) -> None:
    """Start ``lane`` from the root: ``pages`` all its own, state ``slot`` reset, no taps (a
    plain admission in every mode)."""
    lane.pages = pages
    lane.owned = [True] * len(pages)
    lane.state_slot = slot
    states.reset(slot)
    lane.pos = 0
    lane.taps = []


# ---------------------------------------------------------------------------------------------
# Choosing the mode and its options for an engine built without a profile
# ---------------------------------------------------------------------------------------------

def mode_options(mode: "CacheMode", options: BaseModel | Mapping[str, object] | None,
                 overrides: Mapping[str, object] | None = None) -> BaseModel:
    """``mode``'s options model from ``options`` (a model or a mapping of its keys) with the
    ``overrides`` that are not None on top. An override the mode has no option for is a
    ConfigError that names the modes it belongs to."""
    if isinstance(options, BaseModel):
        if not isinstance(options, mode.options_model):
            raise ConfigError(f"cache mode {mode.name!r} takes {mode.options_model.__name__} options, "
                              f"not {type(options).__name__}",
                              hint=f"pass the [cache.{mode.name}] options of the mode selected")
        values = options.model_dump(exclude_unset=True)
    else:
        values = dict(options or {})
    fields = mode.options_model.model_fields
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        if key not in fields:
            raise ConfigError(f"{key} is not an option of cache mode {mode.name!r}",
                              hint=f"{key} belongs to {_owners(key)}; options of {mode.name!r}: "
                                   f"{', '.join(fields) or 'none'}")
        values[key] = value
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(f"{', '.join(unknown)}: not options of cache mode {mode.name!r}",
                          hint=f"options of {mode.name!r}: {', '.join(fields) or 'none'}")
    try:
        return mode.options_model(**values)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ConfigError(f"cache.{mode.name}.{where}: {first['msg']}",
                          hint=f"see the [cache.{mode.name}] options in docs/configuration.md") from None


def _owners(key: str) -> str:
    from hpc_cli import plugins

    names = [e.name for e in plugins.registries().cache_modes if key in e.obj.options_model.model_fields]
    return ("cache mode " + " and ".join(repr(n) for n in names)) if names else "no cache mode"


def effective_options(mode: "CacheMode", effective: Mapping[str, object]) -> dict[str, object]:
    """``mode``'s options from a resolved profile's effective values (``cache.<mode>.<key>``:
    derived values included)."""
    prefix = f"cache.{mode.name}."
    return {k: effective[prefix + k] for k in mode.options_model.model_fields if prefix + k in effective}
