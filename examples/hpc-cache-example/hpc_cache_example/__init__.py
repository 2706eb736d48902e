"""The cache mode ``system-prompt``: keep the state and KV at the end of the last request's
leading system (and tools) block; a request that starts with the same block resumes there (an
example plugin for docs/plugins.md)."""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field

import hpc_cli
from hpc_cli.cache_mode import CacheMode
from hpc_cli.engine.binding import Admission, BindingContext, Residency, entitlement
from hpc_cli.engine.off import OffBinding
from hpc_cli.memory.pools import PageState

STRUCTURAL = 3  # TapHint.priority of the end of the leading system block or of the tools


class SystemPromptOptions(BaseModel):
    """``[cache.system-prompt]``."""

    model_config = ConfigDict(extra="forbid")

    min_tokens: int = Field(64, ge=1, description="keep only system blocks of at least this many tokens")


class SystemPromptBinding(OffBinding):
    """Cache mode off (private pages, a reset state) plus one kept system block: its tokens, a
    copy of its KV in pages the binding holds, and its state in the state slot after the lanes'."""

    mode = "system-prompt"
    reuse = True

    def __init__(self, context: BindingContext) -> None:
        super().__init__(context)
        self.min_tokens = context.options.min_tokens
        self.slot = context.lanes  # the one slot snapshot_slots() asked for
        self.kept: list[int] = []
        self.kept_pages: list[int] = []
        self.counters.update(resumed=0, kept=0)

    def _block_end(self, lane) -> int:
        """Where the request's leading system block ends (0: it has none worth keeping)."""
        ends = [h.position for h in lane.request.tap_hints if h.priority == STRUCTURAL]
        end = max(ends, default=0)
        plain = lane.request.cache_enabled and not lane.prepared.media and not lane.prepared.salt
        return end if plain and self.min_tokens <= end < lane.n_prompt else 0

    def admit(self, lane, siblings=()) -> Admission:
        n = len(self.kept)
        ent = entitlement(lane.n_prompt, lane.max_tokens)
        if not (n and self._block_end(lane) == n and lane.tokens[:n] == self.kept and self.pool.num_free >= ent):
            return self.admit_plain(lane)  # (make_room forgets the kept block when pages run short)
        self.admit_plain(lane)
        for b, page in enumerate(self.kept_pages):  # the lane's own copy of the kept KV and state
            self.storage.copy_page(page, lane.pages[b], min(64, n - 64 * b))
        self.states.copy_slot(self.slot, lane.state_slot)
        lane.pos = n
        self.counters["resumed"] += 1
        return Admission(reuse_tokens=n, cached_prefix_tokens=n, restored_host_bytes=0)

    def next_stop(self, lane, end: int) -> int:
        p = self._block_end(lane)  # split the prefill where the system block ends
        return p if lane.pos < p < end else end

    def after_pass(self, lane) -> None:
        p = self._block_end(lane)
        if not p or lane.pos != p or lane.tokens[:p] == self.kept:
            return
        self.forget()
        pages = self.pool.try_alloc(math.ceil(p / 64), PageState.CACHED)
        if pages is None:
            return
        for b, page in enumerate(pages):
            self.storage.copy_page(lane.pages[b], page, min(64, p - 64 * b))
        self.states.copy_slot(lane.state_slot, self.slot)
        self.kept, self.kept_pages = list(lane.tokens[:p]), pages
        self.counters["taps"] += 1
        self.counters["kept"] += 1

    def make_room(self, pages: int) -> None:
        if self.pool.num_free < pages:
            self.forget()

    def forget(self) -> None:
        if self.kept_pages:
            self.pool.free(self.kept_pages)
        self.kept, self.kept_pages = [], []

    def residency(self) -> Residency:
        return Residency(device_kv_bytes=len(self.kept_pages) * self.storage.page_bytes,
                         device_state_bytes=self.states.image_bytes if self.kept else 0, entries=int(bool(self.kept)))


class SystemPromptMode(CacheMode):
    name = "system-prompt"
    description = "one system block's state and KV, resumed by requests that start with it (example plugin)"
    options_model = SystemPromptOptions

    def snapshot_slots(self, options, *, lanes: int, host: bool) -> int:
        return 1

    def build(self, context: BindingContext) -> SystemPromptBinding:
        return SystemPromptBinding(context)


@hpc_cli.hookimpl
def hpc_register_cache_modes(register):
    register(SystemPromptMode())
