"""The shared cache tier (L3) of one engine: write-behind to a shared store and lookups before
admission (docs/shared-cache.md; keys and records in :mod:`hpc_cli.cache.shared`).
One module an idea: :mod:`.tier` the tier and its attachment, :mod:`.writer` the write-behind,
:mod:`.lookup` the lookups on the worker, :mod:`.find` the store query, :mod:`.health` the
store's outages.

    tier = attach_shared_cache(engine, "redis://127.0.0.1:6379/0")   # before engine.start()

Writes: every block and snapshot whose write-through to the host tier lands
(:meth:`SharedTier.written`, called by the binding's ``poll``) is handed once (by key) to a writer
thread through a queue bounded in bytes, as the host slabs that hold it and their generations;
the thread copies the bytes out of the slabs (dropping the entry if a slab was freed meanwhile:
its bytes may be another owner's), encodes, checksums and stores it (``SET NX``; a snapshot also joins its anchor's set), so
other replicas can use it at once. A full queue or a store that is down drops the entry (the
host tier still has it).

Lookups: when an admission's own tiers leave at least a block of the prompt to prefill
(:meth:`SharedTier.before_admit`), a lookup thread reads the anchor sets of the prompt's blocks
(one round trip), picks the deepest snapshot whose tail matches the prompt and reads it with the
path blocks the index lacks (a second round trip). Every value is checked against the prompt
(namespace, size, checksum, tokens, path digest); for what passes the worker reserves host slabs,
the lookup thread copies the bytes into them (the worker copies nothing), and the worker adopts
them host-only once copied (or gives them back if the prompt's path changed meanwhile); the
ordinary quote and restore then bring it to the device. The head
waits (``Blocked``) for at most ``timeout_s``; a miss, a damaged value, a timeout or a store that
is down is a prefill from the engine's own tiers, never a failed request. After a store failure
the tier stops asking for a while (0.5 s, doubling to 10 s) and logs one warning per outage.
"""

from __future__ import annotations

from hpc_cli.engine.shared.health import Health
from hpc_cli.engine.shared.lookup import Hit
from hpc_cli.engine.shared.tier import SharedTier, SharedTierConfig, attach_shared_cache, open_store

__all__ = ["Health", "Hit", "SharedTier", "SharedTierConfig", "attach_shared_cache", "open_store"]
