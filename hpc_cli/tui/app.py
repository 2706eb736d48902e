"""The live loop: poll a :class:`~hpc_cli.tui.collect.Collector`, draw :func:`~hpc_cli.tui.render.frame`
with rich.live at ``[tui] refresh_hz``. ``once`` prints one frame and returns.

On a terminal the view redraws in the alternate screen. When the output is not a terminal (a
pipe, a log file: rich.live would print nothing until the end) it prints a whole frame when the
first stats arrive, then one every :data:`PLAIN_PERIOD_S` seconds, then the last one."""

from __future__ import annotations

import threading
import time
from typing import Any

from rich.console import Console
from rich.live import Live

from hpc_cli.errors import UnavailableError
from hpc_cli.tui.collect import Collector, SourceGone, engine_source
from hpc_cli.tui.render import frame

PLAIN_PERIOD_S = 10.0  # seconds between frames when the output is not a terminal


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
    if not console.is_terminal:
        _run_plain(collector, console, stop, alive, period)
        return
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


def _run_plain(collector: Collector, console: Console, stop: threading.Event, alive: Any, period: float) -> None:
    """Frames printed one after another (no cursor movement) for a pipe or a file: the source is
    read at the refresh rate (a server that goes away is noticed as soon as on a terminal), a
    frame is printed every :data:`PLAIN_PERIOD_S` seconds and when the view stops."""
    printed_at = None
    view = None
    try:
        while True:
            t0 = time.monotonic()
            view = collector.poll()
            if printed_at is None or t0 - printed_at >= PLAIN_PERIOD_S:
                console.print(frame(view, console.width, console.height))
                printed_at, view = t0, None
            if alive is not None and not alive():
                break
            if stop.wait(max(0.0, period - (time.monotonic() - t0))):
                break
        if view is not None:  # the last frame, as the view stops
            console.print(frame(view, console.width, console.height))
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


def _run_tui_guarded(engine: Any, settings: Any, stop: threading.Event, console: Console | None) -> None:
    """:func:`run_tui` for the server's thread: whatever goes wrong in the view ends the view with
    one line on stderr; the server and the engine go on."""
    try:
        run_tui(engine, settings, stop=stop, console=console)
    except Exception as exc:  # noqa: BLE001 - the view must never take the server down
        import sys

        try:
            print(f"hpc-cli: the live view stopped ({type(exc).__name__}: {exc}); the server goes on",
                  file=sys.stderr, flush=True)
        except Exception:  # pragma: no cover - stderr closed
            pass


def start_tui_thread(engine: Any, settings: Any, console: Console | None = None) -> tuple[threading.Thread, threading.Event]:
    """:func:`run_tui` on a daemon thread; set the returned event to stop it."""
    stop = threading.Event()
    th = threading.Thread(target=_run_tui_guarded, args=(engine, settings, stop, console),
                          name="hpc-tui", daemon=True)
    th.start()
    return th, stop
