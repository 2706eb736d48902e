"""What the hybrid binding's parts share: the attributes :class:`HybridBinding` sets up (its
:mod:`.binding`) and its parts (:mod:`.restore`, :mod:`.commit`, :mod:`.publish`,
:mod:`.transfers`) read. The engine's worker is their only caller (spec §10.9)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hpc_cli.cache.index import PrefixIndex
from hpc_cli.cache.taps import TapPlanner
from hpc_cli.cache.ids import StateSlot
from hpc_cli.memory.bundle import BundleLayout
from hpc_cli.memory.host_slabs import HostSlabStorage
from hpc_cli.memory.pools import DeviceKVPool
from hpc_cli.memory.transfer.engine import TransferEngine
from hpc_cli.memory.transfer.records import RestoreTicket

if TYPE_CHECKING:
    from hpc_cli.engine.shared import SharedTier


class BindingParts:
    """The hybrid binding's state, as its parts see it (set by ``HybridBinding.__init__``)."""

    model: Any
    storage: Any  # the main PagedKVStorage
    backend_storage: Any  # a speculative backend's own pool, or None
    states: Any  # the StateSlots
    reuse: bool
    planner: TapPlanner
    coalesce: bool
    coalesce_wait_limit: float
    frontier_lag: int
    tap_scratch: list[StateSlot]
    C: int
    D: int
    layout: BundleLayout
    host: HostSlabStorage
    index: PrefixIndex
    pool: DeviceKVPool
    transfer: TransferEngine
    free_active: list[StateSlot]  # the lanes' own state slots not in use
    snap_phys: list[StateSlot]  # index snapshot slot -> the state slot holding its image
    jobs: dict[int, tuple[str, Any]]
    failed: str | None
    counters: dict[str, int]
    shared: "SharedTier | None"
    _prefetch: RestoreTicket | None
    _prefetch_last: tuple[str, int] | None
