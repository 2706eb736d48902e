"""The live loop: poll a :class:`~hpc_cli.tui.collect.Collector`, draw :func:`~hpc_cli.tui.render.frame`
with rich.live at ``[tui] refresh_hz``. ``once`` prints one frame and returns."""

from __future__ import annotations

import threading
import time
from typing import Any

from rich.console import Console
from rich.live import Live

from hpc_cli.errors import UnavailableError
from hpc_cli.tui.collect import Collector, SourceGone, engine_source
from hpc_cli.tui.render import frame


def run_view(collector: Collector, *, refresh_hz: float = 4.0, once: bool = False,
             console: Console | None = None, stop: threading.Event | None = None,
             alive: Any = None) -> None:
    """Draw until ``stop`` is set, ``alive()`` turns false, or Ctrl-C. :class:`SourceGone`
    propagates (the caller prints one line)."""
    console = console or Console()
    if once:
        view = collector.poll()
        console.print(frame(view, console.width, console.height))
        return
    period = 1.0 / max(0.1, float(refresh_hz))
    stop = stop or threading.Event()
    try:
        with Live(console=console, auto_refresh=False, screen=console.is_terminal,
                  redirect_stdout=False, redirect_stderr=False) as live:
            while not stop.is_set():
                t0 = time.monotonic()
                view = collector.poll()
                live.update(frame(view, console.width, console.height), refresh=True)
                if alive is not None and not alive():
                    break
                stop.wait(max(0.0, period - (time.monotonic() - t0)))
    except KeyboardInterrupt:
        return


def run_tui(engine: Any, settings: Any, *, stop: threading.Event | None = None,
            console: Console | None = None, once: bool = False) -> None:
    """The view of an engine in this process (``hpc-cli serve --tui``): reads ``engine.stats()``
    (the snapshot the worker publishes a few times a second), never waits on the worker.
    Blocks until ``stop`` is set, the engine stops, or Ctrl-C. ``settings``: the ResolvedSettings."""
    s = getattr(settings, "settings", settings)
    hz = getattr(getattr(s, "tui", None), "refresh_hz", 4.0)
    collector = Collector(engine_source(engine, settings), source="in process")
    try:
        run_view(collector, refresh_hz=hz, once=once, console=console, stop=stop,
                 alive=lambda: bool(getattr(engine, "running", True)))
    except SourceGone as exc:  # pragma: no cover - engine sources do not raise it
        raise UnavailableError(str(exc)) from None


def start_tui_thread(engine: Any, settings: Any, console: Console | None = None) -> tuple[threading.Thread, threading.Event]:
    """:func:`run_tui` on a daemon thread; set the returned event to stop it."""
    stop = threading.Event()
    th = threading.Thread(target=run_tui, args=(engine, settings), kwargs={"stop": stop, "console": console},
                          name="hpc-tui", daemon=True)
    th.start()
    return th, stop
