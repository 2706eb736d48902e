"""The hybrid binding's transfers: write-through jobs to the host tier, the host chunks that
finished pinning, and landing finished copies (spec §10.9: residency changes only here or at
commit), with the write-behind to the shared tier."""

from __future__ import annotations

from hpc_cli.engine.hybrid.parts import BindingParts


class Transfers(BindingParts):
    """Starts and lands the binding's copies (mixed into the binding)."""

    def _write(self, batch) -> None:
        if batch is None or not batch:
            return
        job = self.transfer.write_through(
            blocks=[(bt.pages[0], bt.slab) for bt in batch.blocks],
            images=[(self.snap_phys[st.slot], list(st.slabs)) for st in batch.snapshots],
            tails=[(st.tail_pages[0], st.tail_slab) for st in batch.snapshots if st.tail_pages is not None])
        self.jobs[job.job_id] = ("write", batch)

    def grow_host(self) -> int:
        """Hand the index the host slabs whose chunks finished pinning since the last call
        (O(1) when none did), and the storage the index's high-water mark (on the CPU its pages
        are faulted in ahead of it). Returns how many slabs were added."""
        self.host.fault_ahead(self.index.host.high_water)
        ready = self.host.ready_slabs
        if ready == self.index.host.ready_slabs:
            return 0
        return self.index.grow_host(ready)

    def wait_host(self, slabs: int, timeout: float | None = None) -> int:
        """Wait for ``slabs`` host slabs to be ready (or the allocation to stop short), hand them
        to the index and return how many are ready (the cache file load before start)."""
        ready = self.host.wait_ready(slabs, timeout)
        self.grow_host()
        return ready

    @property
    def transfers_pending(self) -> int:
        """Copies enqueued and not yet landed (the worker polls only while some are)."""
        return self.transfer.pending

    def poll(self, completions=None) -> None:
        """Land finished transfers (spec §10.9: residency changes only here or at commit); pick
        up host chunks that became ready."""
        self.grow_host()
        for c in (self.transfer.poll() if completions is None else completions):
            kind, batch = self.jobs.pop(c.job_id)
            if self._prefetch is not None and self._prefetch.job_id == c.job_id:
                self._prefetch = None
            if not c.ok:
                self.counters["transfer_failures"] += 1
                self.failed = f"{kind} transfer {c.job_id} failed: {c.error}"
            self._land(kind, batch)  # a failed one lands too: its pins drop, its copies are dropped
            if c.ok and kind != "restore" and self.shared is not None:
                self.shared.written(batch)  # write-behind to the shared tier, once per key

    def _land(self, kind: str, batch) -> None:
        """Land a finished (or failed) copy in the index and the device pool."""
        if kind == "restore":
            self.index.land_restore(batch)
            self.pool.land([bt.pages[0] for bt in batch.blocks])
            if batch.snapshot is not None and batch.snapshot.tail_pages is not None:
                self.pool.land([batch.snapshot.tail_pages[0]])
        else:
            self.index.land_write(batch)

    def drain(self) -> None:
        # TransferEngine.drain retires the jobs and returns their completions: land those
        # (a poll() after it finds nothing, which left pins and Filling host copies behind).
        self.poll(self.transfer.drain())
        self.poll()

    def _free_pages(self, bundles) -> None:
        pages = [b[0] for b in bundles]
        if pages:
            self.pool.free(pages, abandon_filling=True)
