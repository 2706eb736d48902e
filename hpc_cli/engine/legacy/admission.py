"""Admission in cache mode ``legacy``: resume at the deepest owned checkpoint whose owner's
path is a prefix of the prompt (shared pages below it, a copied partial page, the checkpoint's
state copied, or a host-resident owner restored layer by layer); plan the lane's captures."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from hpc_cli.cache.catalog import CheckpointKind, Owner, Residency
from hpc_cli.cache.keys import BLOCK_TOKENS
from hpc_cli.engine.binding import Admission, Blocked, admissible_pages, start_from_root
from hpc_cli.engine.legacy.parts import LanePlan, LegacyParts
from hpc_cli.memory.pools import PageState
from hpc_cli.memory.transfer.records import RestoreBatch

if TYPE_CHECKING:
    from hpc_cli.engine.lane import Lane


class LegacyAdmission(LegacyParts):
    """Admits lanes (mixed into the binding)."""

    def admit(self, lane: "Lane", siblings: Sequence["Lane"] = ()) -> Admission:
        self.poll()
        ent = admissible_pages(lane, len(self.free_active), self.pool.num_pages)
        req = lane.request
        if not req.cache_enabled or req.sampling.prompt_logprobs or lane.prepared.media:
            return self._admit_plain(lane, ent, LanePlan(cached=False))
        prompt = tuple(lane.tokens[:lane.n_prompt])
        salt = lane.prepared.salt
        m = self.catalog.match(prompt, salt, lane.n_prompt - 1)
        owner, cp = m.owner, m.checkpoint
        if owner is not None and owner.residency is Residency.DEVICE:
            d = cp.frontier // BLOCK_TOKENS
            if not self._make_room(ent - d, exclude=[owner]):
                return self._blocked_or_plain(lane, ent, prompt, salt, m.cached_prefix_tokens)
            plan = self._plan(prompt, salt, lane, owner, cp.frontier)
            shared = owner.pages[:d]
            self._incref(shared)
            own = self.pool.alloc(ent - d, PageState.ACTIVE)
            self._incref(own)
            lane.pages, lane.owned = shared + own, [False] * d + [True] * (ent - d)
            lane.state_slot = self.free_active.pop()
            self.states.copy_slot(cp.slot, lane.state_slot)
            if cp.frontier % BLOCK_TOKENS:
                self.storage.copy_page(owner.pages[d], lane.pages[d], cp.frontier % BLOCK_TOKENS)
            restored = 0
        elif owner is not None:  # on the host: restore its blocks and the checkpoint's image
            if not self._make_room(ent):
                return self._blocked_or_plain(lane, ent, prompt, salt, m.cached_prefix_tokens)
            plan = self._plan(prompt, salt, lane, owner, cp.frontier)
            lane.pages = self.pool.alloc(ent, PageState.ACTIVE)
            self._incref(lane.pages)
            lane.owned = [True] * ent
            lane.state_slot = self.free_active.pop()
            nb = -(-cp.frontier // BLOCK_TOKENS)
            ticket = self.transfer.restore(RestoreBatch(blocks=list(zip(lane.pages[:nb], owner.slabs[:nb])),
                                                        image=(lane.state_slot, list(cp.image_slabs))))
            ticket.wait_prelude()
            owner.readers += 1
            self.jobs[ticket.job_id] = ("restore", owner)
            plan.ticket = lane.ticket = ticket
            restored = ticket.nbytes
            self.counters["restored_host_bytes"] += restored
            lane.usage.restored_host_bytes = restored
        else:
            return self._admit_plain(lane, ent, self._plan(prompt, salt, lane, None, 0), m.cached_prefix_tokens)
        cp.hits += 1
        self.catalog.touch(owner)
        lane.pos = cp.frontier
        lane.taps = []
        self.plans[lane] = plan
        return Admission(cp.frontier, max(cp.frontier, m.cached_prefix_tokens), restored)

    def _plan(self, prompt: tuple[int, ...], salt: int, lane: "Lane", source: Owner | None, resumed: int) -> LanePlan:
        captures = {p: CheckpointKind.LONG_ANCHOR for p in self.catalog.anchor_positions(lane.n_prompt, resumed)}
        s = self.catalog.shared_frontier(prompt, salt, lane.n_prompt - 1, resumed, source)
        if s:
            captures[s] = CheckpointKind.SHARED_PREFIX
        return LanePlan(cached=True, source=source, resumed=resumed, captures=sorted(captures.items()))

    def _blocked_or_plain(self, lane: "Lane", ent: int, prompt, salt: int, cached: int) -> Admission:
        if len(self.free_active) < self.C:
            self.counters["blocked"] += 1
            raise Blocked("pages held by active lanes")
        return self._admit_plain(lane, ent, self._plan(prompt, salt, lane, None, 0), cached)

    def _admit_plain(self, lane: "Lane", ent: int, plan: LanePlan, cached: int = 0) -> Admission:
        if not self._make_room(ent):
            self.counters["blocked"] += 1
            raise Blocked("pages held by active lanes")
        pages = self.pool.alloc(ent, PageState.ACTIVE)
        self._incref(pages)
        start_from_root(lane, pages, self.free_active.pop(), self.states)
        self.plans[lane] = plan
        return Admission(0, cached, 0)

    def prefetch(self, lane: "Lane") -> int:
        return 0
