"""Orderly stop (spec §5.5).

SIGTERM, or a confirmed Ctrl+C (a second press within 5 s), starts the stop: admission closes
(new requests get 503 in the API's shape), the engine's ``stop()`` fails running and queued
requests as unavailable at the next unit boundary (their clients get that answer before anything
else happens), then, when a prefix cache file is configured, the engine's save runs; then the
HTTP server exits. One more Ctrl+C during the stop asks the save to abort, waits up to 2 s for
it, and exits at once.

When the engine's worker stops after an error (:meth:`StopController.engine_failed`, called from
it) the failure is logged, the prefix cache is not saved (the previous file stays: the failed
engine's cache may hold what the failure poisoned) and, with ``exit_on_fatal``, the same stop
runs at once; ``serve`` then exits with status 3 so that a supervisor restarts it.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import signal
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from hpc_cli.engine.api import Engine

log = logging.getLogger("hpc_cli.server")

CONFIRM_WINDOW_S = 5.0
FORCE_WAIT_S = 2.0


class StopController:
    def __init__(self, engine: "Engine", state: Any = None, server: Any = None, prefix_cache_file: Any = None,
                 engine_stop_timeout: float = 30.0, echo: Callable[[str], None] | None = None,
                 exit_fn: Callable[[int], None] = os._exit, clock: Callable[[], float] = time.monotonic,
                 exit_on_fatal: bool = False) -> None:
        self.engine = engine
        self.state = state  # ServerState: its ``accepting`` flag closes admission
        self.server = server  # uvicorn.Server: ``should_exit`` ends it
        self.prefix_cache_file = prefix_cache_file
        self.engine_stop_timeout = engine_stop_timeout
        self.echo = echo or (lambda msg: log.warning("%s", msg))
        self.exit_fn = exit_fn
        self.exit_on_fatal = exit_on_fatal
        self.clock = clock
        self.abort_save = threading.Event()
        self.done = threading.Event()
        self.stopping = False
        self.reason: str | None = None
        self.error: BaseException | None = None
        self._last_sigint: float | None = None
        # re-entrant: a signal handler runs in the main thread between any two bytecodes, also
        # while that thread holds the lock inside request_stop (Thread.start waits for the new
        # thread): a second SIGTERM there must find the stop started, not wait on its own lock
        self._lock = threading.RLock()
        self._thread: threading.Thread | None = None

    # --- signals -------------------------------------------------------------------------------
    def handle_sigint(self, signum=None, frame=None) -> None:
        now = self.clock()
        if self.stopping:
            self.force_exit()
            return
        if self._last_sigint is not None and now - self._last_sigint <= CONFIRM_WINDOW_S:
            self.request_stop("Ctrl+C")
            return
        self._last_sigint = now
        self.echo("press Ctrl+C again within 5 s to stop: running and queued requests fail as unavailable"
                  + (", then the prefix cache is saved" if self.prefix_cache_file else ""))

    def handle_sigterm(self, signum=None, frame=None) -> None:
        self.request_stop("SIGTERM")

    @contextlib.contextmanager
    def installed(self):
        """Install the SIGINT/SIGTERM handlers (main thread only) for the duration."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        old = {signal.SIGINT: signal.signal(signal.SIGINT, self.handle_sigint),
               signal.SIGTERM: signal.signal(signal.SIGTERM, self.handle_sigterm)}
        try:
            yield
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)

    # --- the stop ------------------------------------------------------------------------------
    def request_stop(self, reason: str = "request", wait: bool = False) -> bool:
        """Start the orderly stop (once); returns False when it had already started."""
        with self._lock:
            if self.stopping:
                if wait:
                    self.done.wait()
                return False
            self.stopping = True
            self.reason = reason
            if self.state is not None:
                self.state.accepting = False
            self._thread = threading.Thread(target=self._run, name="hpc-orderly-stop", daemon=True)
            self._thread.start()
        self.echo(f"stopping ({reason}): admission closed; failing running and queued requests as unavailable")
        if wait:
            self.done.wait()
        return True

    def _run(self) -> None:
        try:
            stop = getattr(self.engine, "stop", None)
            if stop is not None:
                stop(timeout=self.engine_stop_timeout)
            fatal = getattr(self.engine, "fatal", None)
            if self.prefix_cache_file and fatal:
                log.warning("prefix cache not saved to %s: the engine stopped after an error (%s); the previous "
                            "file stays", self.prefix_cache_file, fatal)
            elif self.prefix_cache_file and not self.abort_save.is_set():
                self._save()
        except BaseException as exc:  # report, then still let the server exit
            self.error = exc
            log.error("orderly stop failed: %s", exc)
        finally:
            self.done.set()
            if self.server is not None:
                self.server.should_exit = True

    def _save(self) -> None:
        save = getattr(self.engine, "save_prefix_cache", None)
        if save is None:
            return  # the engine saves inside stop(), or persistence is not built yet
        self.echo(f"saving the prefix cache to {self.prefix_cache_file} (Ctrl+C again to skip)")
        params = inspect.signature(save).parameters
        kwargs = {"abort": self.abort_save} if "abort" in params else {}
        if "path" in params or len(params) - len(kwargs) >= 1:
            save(self.prefix_cache_file, **kwargs)
        else:
            save(**kwargs)

    def engine_failed(self, reason: str) -> None:
        """The engine's worker stopped after an error (called from that thread): log it and, with
        ``exit_on_fatal``, stop the server (see the module doc)."""
        log.error("the engine failed (%s): /health answers 503 and every request fails; %s", reason,
                  "the server stops ([server] exit_on_fatal)" if self.exit_on_fatal else
                  "the server stays up until restarted ([server] exit_on_fatal is off)")
        if self.exit_on_fatal:
            self.request_stop("engine error")

    def force_exit(self) -> None:
        self.abort_save.set()  # first, so a save still running sees it at its next check
        self.echo("exiting now (the prefix cache is not saved)")
        self.done.wait(FORCE_WAIT_S)
        self.exit_fn(130)
