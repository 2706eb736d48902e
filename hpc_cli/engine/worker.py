"""The engine's worker thread: its loop (inbox, transfers, admission, one step, stats, sleep
when idle), the inbox of submissions, cancellations, calls and stats requests, and the step
itself: finished lanes leave, the oldest prefilling lane runs one pass
(:mod:`.prefill_step`), every decoding lane one column (:mod:`.decode_step`)."""

from __future__ import annotations

import logging
import sys
import time

import torch

from hpc_cli.engine.api import FinishReason
from hpc_cli.engine.core import EngineCore
from hpc_cli.engine.cpu_threads import release_thread_team
from hpc_cli.engine.lane import Lane
from hpc_cli.engine.sampling import make_generator
from hpc_cli.engine.stats import StatsRequest
from hpc_cli.errors import EngineError, HpcError

log = logging.getLogger("hpc_cli.engine")


class Worker(EngineCore):
    """The worker's loop and its step (mixed into the engine)."""

    # ------------------------------------------------------------------ the worker
    #: the published stats are refreshed at most this often while the engine works
    STATS_PERIOD_S = 0.2
    #: nothing to step but transfers in flight: how often they are polled
    TRANSFER_POLL_S = 0.001
    #: lanes or waiting requests but no step possible this round: when to look again
    RECHECK_S = 0.05

    def _run(self) -> None:
        last_stats = 0.0
        # Subnormal floats are handled in microcode on x86 CPUs, 10-100x slower than normal ones,
        # and a GDN state's decayed entries fall into that range: on the CPU a cold 2.4k-token
        # prefill took 4.8 s with them and 3.1 s flushed to zero (values below 1.2e-38). The flag
        # is per thread: the worker, which runs every pass, sets it for itself.
        if self.model.device.type == "cpu":
            torch.set_flush_denormal(True)
        try:
            while not self._stopping.is_set():
                self._drain_inbox()
                self.cache.poll()
                if self.cache.failed:
                    raise EngineError(self.cache.failed, hint="check the device; restart the server")
                self._admit()
                worked = self._step()
                busy = bool(self._lanes or self._waiting)
                self._serve_or_pin(busy)
                now = time.monotonic()
                if worked or busy or self.cache.transfers_pending:
                    if now - last_stats > self.STATS_PERIOD_S:
                        self._take_stats()
                        last_stats = now
                    if not worked:  # poll transfers only while some are pending
                        self._wake.wait(self.TRANSFER_POLL_S if self.cache.transfers_pending else self.RECHECK_S)
                        self._wake.clear()
                    continue
                # idle: publish the stats as they are, then sleep until submit, cancel, stop, a
                # stats request or a host chunk wakes the worker (no polling: an idle server
                # uses no CPU)
                self._take_stats()
                last_stats = now
                # and its OpenMP team (cpu_threads): another engine in the process, a benchmark's
                # other backend, then finds the cores free
                if self.model.device.type == "cpu":
                    release_thread_team()
                self._wake.wait()
                self._wake.clear()
            self._shutdown(FinishReason.UNAVAILABLE, "the server is stopping")
            self.cache.drain()
            self.cache.host.stop_growth()
            self._take_stats()
            for hook in self.on_stop:
                hook(self)
        except Exception as exc:  # a fatal error: fail everything, release everything, save nothing
            self.fatal = f"{type(exc).__name__}: {exc}" if not isinstance(exc, HpcError) else exc.message
            log.error("the engine stopped after an error: %s (every request fails from now on; the prefix "
                      "cache is not saved)", self.fatal, exc_info=exc)
            self._shutdown(FinishReason.ERROR, self.fatal, publish=False)
            try:  # land (or abandon) the transfers still queued so that their pins drop
                self.cache.drain()
            except Exception:  # pragma: no cover - a broken device may fail the wait too
                pass
            self.cache.host.stop_growth()
            self._take_stats()
        finally:
            self._stopping.set()
            pending = sys.exc_info()[1]  # a BaseException, or the error path itself failed
            if self.fatal is None and pending is not None:
                self.fatal = f"the worker stopped: {type(pending).__name__}: {pending}"
                log.error("the engine stopped after an error: %s", self.fatal)  # never silently
            if self.fatal is not None:
                self._run_fatal_hooks()

    def _drain_inbox(self) -> None:
        inbox = self._inbox
        while inbox:
            kind, item = inbox.popleft()
            if kind == "submit":
                handle, prepared = item
                self._count += 1
                req = handle.request
                lane = Lane(req, handle, prepared, self._count, tokens=list(req.prompt_tokens),
                            n_prompt=len(req.prompt_tokens))
                try:
                    lane.generator = make_generator(req.sampling, self._count, self.seed)
                except Exception as exc:  # this request's own parameters: it fails alone
                    self._fail_lane(lane, exc)
                    self._emit_finish(lane)
                    continue
                if self.tokenizer is not None and req.sampling.stop:
                    from hpc_cli.model.tokenizer import IncrementalDecoder

                    lane.decoder = IncrementalDecoder(self.tokenizer)
                self._by_id[req.request_id] = lane
                self._waiting.append(lane)
                self.counters["requests"] += 1
            elif kind == "call":
                fn, fut = item
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn())
                    except BaseException as exc:  # handed to the caller, not fatal to the worker
                        fut.set_exception(exc)
            elif kind == "cancel":
                lane = self._by_id.get(item)
                if lane is not None:
                    lane.finish_reason = lane.finish_reason or FinishReason.CANCELLED
            elif kind == "stats":
                self._answer_stats(item)

    def _answer_stats(self, req: "StatsRequest") -> None:
        """A client's detailed stats, made between steps; a failure answers None (the caller
        falls back to the published stats) and never stops the worker."""
        try:
            req.result = self._take_stats(detailed=True)
        except Exception:  # noqa: BLE001 - stats must never take the engine down
            log.exception("detailed stats failed")
        finally:
            req.done.set()

    def _serve_or_pin(self, busy: bool) -> None:
        """The host tier pins its next chunk only while nothing is served (a registration stalls
        every CUDA call of the process); tell it when that changes."""
        if busy != self._serving:
            self._serving = busy
            if busy:
                self.cache.host.may_pin.clear()
            else:
                self.cache.host.may_pin.set()
    def _step(self) -> bool:
        finishing = [l for l in self._lanes if l.finish_reason]
        worked = bool(finishing)
        prefilling = [l for l in self._lanes if l.prefilling and not l.finish_reason]
        if prefilling:
            self._send_held()  # a pass would keep the decoding lanes' tokens
            try:
                self._prefill(prefilling[0])
            except Exception as exc:  # this request's pass failed: it alone ends (a broken device
                self._fail_lane(prefilling[0], exc)  # fails the next decode round, which is fatal)
            worked = True
        decoding = [l for l in self._lanes if l.decoding]
        if decoding:
            self._decode(decoding, finishing)  # ends `finishing` while the device computes the step
            worked = True
        else:
            self._finish_lanes(finishing)
        self.commit_passes()  # a lane that finished at its first token (no decode step ran)
        return worked
    def _run_fatal_hooks(self) -> None:
        for hook in self.on_fatal:
            try:
                hook(self)
            except Exception:  # a hook's failure must not hide the engine's
                log.exception("an engine fatal-error hook failed")
