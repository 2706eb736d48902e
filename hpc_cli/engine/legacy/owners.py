"""The owners of cache mode ``legacy``: a finished lane publishes its private continuation
(anchors, inherited anchors, the session endpoint); under pressure the least recently used
owner is demoted to the host (copy before release) or dropped."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hpc_cli.cache.catalog import Checkpoint, CheckpointKind, Owner, Residency
from hpc_cli.cache.ids import StateSlot
from hpc_cli.cache.keys import BLOCK_TOKENS
from hpc_cli.engine.legacy.parts import LanePlan, LegacyParts

if TYPE_CHECKING:
    from hpc_cli.engine.lane import Lane


class Owners(LegacyParts):
    """Settles finished lanes and moves owners out (mixed into the binding)."""

    def finish(self, lane: "Lane", *, publish: bool = True) -> None:
        if lane.ticket is not None:
            lane.ticket.wait_all()
            lane.ticket = None
        plan = self.plans.pop(lane, None)
        if plan is not None and plan.cached and publish and self.failed is None and lane.pos > 0:
            self._publish(lane, plan)
        elif plan is not None:
            self._free_slots(c.slot for c in plan.anchors)
        self._decref(lane.pages)
        lane.pages, lane.owned = [], []
        if lane.state_slot >= 0:
            self.free_active.append(lane.state_slot)
            lane.state_slot = StateSlot(-1)

    def _publish(self, lane: "Lane", plan: LanePlan) -> None:
        """The lane's new private continuation: its anchors, the anchors it inherits from the
        continuation it resumed (those on its path) and the session endpoint at ``lane.pos``."""
        source = plan.source if plan.source is not None and not plan.source.shared else None
        cps = list(plan.anchors)
        if source is not None and source.id in self.catalog.owners and source.residency is Residency.DEVICE:
            inherited = [c for c in source.checkpoints
                         if c.kind is CheckpointKind.LONG_ANCHOR and c.frontier <= plan.resumed]
            source.checkpoints = [c for c in source.checkpoints if c not in inherited]
            cps += inherited
        if source is not None and source.id in self.catalog.owners:  # first: its slots serve the endpoint
            self._drop(source)  # (the lane still holds the pages it shares)
            self.catalog.counters["replaced"] += 1
        f = lane.pos
        if f > max((c.frontier for c in cps), default=0):
            slot = self._slot()
            if slot is not None:
                self.states.copy_slot(lane.state_slot, slot)
                cps.append(Checkpoint(CheckpointKind.SESSION_ENDPOINT, f, slot=slot))
                self.counters["endpoints"] += 1
        kept, dropped = self.catalog.trim_anchors(cps)
        self._free_slots(c.slot for c in dropped)
        if not kept:
            return
        deepest = kept[-1].frontier
        pages = lane.pages[:-(-deepest // BLOCK_TOKENS)]
        self._adopt(lane, pages)
        self.catalog.new_owner(shared=False, salt=lane.prepared.salt, tokens=lane.tokens[:deepest],
                               checkpoints=kept, pages=pages)
        self._enforce_limits()

    def _free_slots(self, slots) -> None:
        for s in slots:
            if s is not None:
                self.free_slots.append(s)

    # ------------------------------------------------------------------ owners leave
    def _enforce_limits(self) -> None:
        for owner in self.catalog.over_limit():
            self._drop(owner)

    def _drop(self, owner: Owner) -> None:
        """Remove ``owner``: its pages lose a holder, its slots and host copies are freed (host
        copies a restore still reads once it lands)."""
        self.catalog.remove(owner)
        self.catalog.counters["evicted"] += 1
        self._decref(owner.pages)
        owner.pages = []
        self._free_slots(c.slot for c in owner.checkpoints)
        for c in owner.checkpoints:
            c.slot = None
        if owner.readers:
            self.zombies.append(owner)
        else:
            self._free_host(owner)

    def _free_host(self, owner: Owner) -> None:
        self.free_slabs += owner.slabs
        self.kv_slabs_used -= len(owner.slabs)
        owner.slabs = []
        for c in owner.checkpoints:
            if c.image_slabs:
                self.free_slabs += c.image_slabs
                self.images_used -= 1
                c.image_slabs = ()

    def _evict(self, owner: Owner) -> None:
        """Device pressure: demote ``owner`` to the host if it fits there, else drop it."""
        if not self._host_room(owner.blocks, len(owner.checkpoints), keep=owner):
            self._drop(owner)
            return
        slabs = [self.free_slabs.pop() for _ in range(owner.blocks)]
        images = [(c, tuple(self.free_slabs.pop() for _ in range(self.image_slabs))) for c in owner.checkpoints]
        self.host_high = max(self.host_high, max([*slabs, *(x for _, s in images for x in s)], default=-1) + 1)
        job = self.transfer.write_through(blocks=list(zip(owner.pages, slabs)),
                                          images=[(c.slot, list(s)) for c, s in images])
        self.jobs[job.job_id] = ("demote", owner)
        self.kv_slabs_used += len(slabs)
        self.images_used += len(images)
        owner.slabs = slabs
        for c, s in images:
            c.image_slabs = s
        self._land(self.transfer.drain())  # copy before release: the pages and slots are reused next
        if owner.id not in self.catalog.owners:  # the copy failed (_land dropped it)
            return
        self._decref(owner.pages)
        owner.pages = []
        self._free_slots(c.slot for c in owner.checkpoints)
        for c in owner.checkpoints:
            c.slot = None
        owner.residency = Residency.HOST
        self.catalog.counters["demoted"] += 1
        self.counters["demoted_bytes"] += job.nbytes

    def _host_room(self, blocks: int, images: int, keep: Owner) -> bool:
        """Make room on the host for ``blocks`` KV slabs and ``images`` images, dropping the
        least recently used host owners; False when it cannot fit at all."""
        if blocks > self.kv_slabs or images > self.host_images:
            return False
        need_slabs = blocks + images * self.image_slabs
        older = self.catalog.lru(Residency.HOST, exclude=[keep])
        while (self.kv_slabs_used + blocks > self.kv_slabs or self.images_used + images > self.host_images
               or len(self.free_slabs) < need_slabs):
            victim = next(older, None)
            if victim is None:
                return False
            self._drop(victim)
        return True
