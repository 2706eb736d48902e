"""The cache's id vocabulary: what the index records in place of memory (spec §5.2-5.4).

The index never holds a tensor; it holds ids the memory layer resolves. Each kind of id has
its own name so a seam says which one it takes (all are plain ``int`` at run time):

- :data:`PageId`: a device KV page (one block of :data:`~hpc_cli.cache.keys.BLOCK_TOKENS`
  tokens) in one device pool; a :data:`PageBundle` has one per pool, in pool order;
- :data:`SlabId`: a host slab of :class:`~hpc_cli.cache.host.HostSlabPool`;
- :data:`SnapshotSlot`: a device snapshot slot (one state image);
- :data:`StateSlot`: a slot of the memory layer's recurrent-state slots: a lane's own, or the one
  a snapshot slot's image lives in (the engine's bindings map one to the other).
"""

from __future__ import annotations

from typing import NewType

PageId = NewType("PageId", int)
SlabId = NewType("SlabId", int)
SnapshotSlot = NewType("SnapshotSlot", int)
StateSlot = NewType("StateSlot", int)

#: One page per device pool (Main, plus a backend pool for MTP or DFlash), in pool order.
PageBundle = tuple[PageId, ...]
