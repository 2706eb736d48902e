"""What the legacy binding's parts share: the per-lane plan and the attributes
:class:`~hpc_cli.engine.legacy.binding.LegacyBinding` sets up and its parts (:mod:`.admission`,
:mod:`.owners`) read."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hpc_cli.cache.catalog import Checkpoint, CheckpointCatalog, CheckpointKind, Owner
from hpc_cli.cache.ids import StateSlot
from hpc_cli.engine.binding import BindingContext
from hpc_cli.engine.legacy.config import LegacyConfig
from hpc_cli.memory.host_slabs import HostSlabStorage
from hpc_cli.memory.pools import DeviceKVPool
from hpc_cli.memory.transfer.engine import TransferEngine
from hpc_cli.memory.transfer.records import RestoreTicket

if TYPE_CHECKING:
    from hpc_cli.engine.lane import Lane


@dataclass(eq=False, slots=True)
class LanePlan:
    """What the binding knows of one admitted lane."""

    cached: bool  # False: served like cache mode off
    source: Owner | None = None
    resumed: int = 0
    captures: list[tuple[int, CheckpointKind]] = field(default_factory=list)  # ahead, ascending
    anchors: list[Checkpoint] = field(default_factory=list)  # taken, in device slots
    ticket: RestoreTicket | None = None


class LegacyParts:
    """The legacy binding's state, as its parts see it (set by ``LegacyBinding.__init__``)."""

    context: BindingContext
    config: LegacyConfig
    storage: Any  # the PagedKVStorage
    states: Any  # the StateSlots
    C: int
    catalog: CheckpointCatalog
    pool: DeviceKVPool
    refs: list[int]
    free_active: list[StateSlot]  # the lanes' own state slots not in use
    free_slots: list[StateSlot]  # the mode's checkpoint slots not in use
    image_slabs: int
    kv_slabs: int
    host_images: int
    host: HostSlabStorage
    free_slabs: list[int]
    host_high: int  # one more than the highest host slab handed out (CPU: pages faulted in ahead of it)
    kv_slabs_used: int
    images_used: int
    transfer: TransferEngine
    jobs: dict[int, tuple[str, Owner | None]]
    plans: dict["Lane", LanePlan]
    zombies: list[Owner]
    failed: str | None
    counters: dict[str, int]

