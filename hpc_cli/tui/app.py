"""The live loop: poll a :class:`~hpc_cli.tui.collect.Collector`, draw :func:`~hpc_cli.tui.render.frame`
with rich.live at ``[tui] refresh_hz``. ``once`` prints one frame and returns.

On a terminal the view redraws in the alternate screen. When the output is not a terminal (a
pipe, a log file: rich.live would print nothing until the end) it prints a whole frame when the
first stats arrive, then one every :data:`PLAIN_PERIOD_S` seconds, then the last one.

:class:`Chrome` is what the live view shows beside the stats: ``hpc-cli serve --tui`` puts the
server's address and stop keys there and its notices (what a first Ctrl+C means); ``hpc-cli top``
its keys (``q`` quits, read from the terminal in cbreak mode)."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, TextIO

from rich.console import Console
from rich.live import Live

from hpc_cli.errors import UnavailableError
from hpc_cli.tui.collect import Collector, SourceGone, engine_source
from hpc_cli.tui.render import frame

PLAIN_PERIOD_S = 10.0  # seconds between frames when the output is not a terminal
NOTICE_S = 8.0  # seconds a notice stays in the view


class Notices:
    """Messages for the live view (the first Ctrl+C's "press again"); the newest shows for
    :data:`NOTICE_S` seconds. Thread-safe: the signal handler posts, the view reads."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._items: list[tuple[float, str]] = []
        self._lock = threading.Lock()

    def post(self, text: str) -> None:
        with self._lock:
            self._items.append((self.clock(), text))

    def current(self) -> str | None:
        with self._lock:
            if self._items and self.clock() - self._items[-1][0] <= NOTICE_S:
                return self._items[-1][1]
        return None

    def all(self) -> list[str]:
        with self._lock:
            return [text for _, text in self._items]


@dataclass
class Chrome:
    """What the live view shows beside the stats, and the keys that end it."""

    banner: list[str] = field(default_factory=list)
    keys: str | None = None
    notices: Notices | None = None
    quit_keys: str = ""  # characters read from the terminal that end the view ("q" for hpc-cli top)

    def dress(self, view: Any) -> Any:
        view.banner = list(self.banner)
        view.keys = self.keys
        view.notice = self.notices.current() if self.notices is not None else None
        return view


@contextlib.contextmanager
def quit_on_keys(keys: str, stop: threading.Event, stream: TextIO | None = None) -> Iterator[None]:
    """While the view runs: a key of ``keys`` typed on the terminal sets ``stop``. The terminal is
    in cbreak mode meanwhile (keys are not echoed; Ctrl+C still interrupts) and restored after.
    Nothing happens when ``keys`` is empty or the input is not a terminal."""
    stream = stream if stream is not None else sys.stdin
    try:
        fd = stream.fileno()
        interactive = bool(keys) and os.isatty(fd)
    except (AttributeError, ValueError, OSError):
        interactive = False
    if not interactive:
        yield
        return
    import select
    import termios
    import tty

    saved = termios.tcgetattr(fd)
    done = threading.Event()

    def read() -> None:
        while not done.is_set() and not stop.is_set():
            ready, _, _ = select.select([fd], [], [], 0.1)
            if ready and os.read(fd, 1).decode(errors="ignore") in keys:
                stop.set()

    tty.setcbreak(fd)
    reader = threading.Thread(target=read, name="hpc-tui-keys", daemon=True)
    reader.start()
    try:
        yield
    finally:
        done.set()
        reader.join(1.0)
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def run_view(collector: Collector, *, refresh_hz: float = 4.0, once: bool = False,
             console: Console | None = None, stop: threading.Event | None = None,
             alive: Any = None, chrome: Chrome | None = None) -> None:
    """Draw until ``stop`` is set, ``alive()`` turns false, a quit key of ``chrome``, or Ctrl-C.
    :class:`SourceGone` propagates (the caller prints one line)."""
    console = console or Console()
    if once:
        view = collector.poll()
        console.print(frame(view, console.width, console.height))
        return
    period = 1.0 / max(0.1, float(refresh_hz))
    stop = stop or threading.Event()
    chrome = chrome or Chrome()
    if not console.is_terminal:
        _run_plain(collector, console, stop, alive, period, Chrome(banner=chrome.banner))
        return
    try:
        with quit_on_keys(chrome.quit_keys, stop), \
                Live(console=console, auto_refresh=False, screen=console.is_terminal,
                     redirect_stdout=False, redirect_stderr=False) as live:
            while not stop.is_set():
                t0 = time.monotonic()
                view = chrome.dress(collector.poll())
                live.update(frame(view, console.width, console.height), refresh=True)
                if alive is not None and not alive():
                    break
                stop.wait(max(0.0, period - (time.monotonic() - t0)))
    except KeyboardInterrupt:
        return


def _run_plain(collector: Collector, console: Console, stop: threading.Event, alive: Any, period: float,
               chrome: Chrome) -> None:
    """Frames printed one after another (no cursor movement) for a pipe or a file: the source is
    read at the refresh rate (a server that goes away is noticed as soon as on a terminal), a
    frame is printed every :data:`PLAIN_PERIOD_S` seconds and when the view stops."""
    printed_at = None
    view = None
    try:
        while True:
            t0 = time.monotonic()
            view = chrome.dress(collector.poll())
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
            console: Console | None = None, once: bool = False, chrome: Chrome | None = None,
            source: str = "in process") -> None:
    """The view of an engine in this process (``hpc-cli serve --tui``): reads
    ``engine.detailed_stats()`` (made by the worker between two steps, waited for a quarter of a
    second at most, else the snapshot it publishes; :func:`~hpc_cli.tui.collect.engine_source`).
    Blocks until ``stop`` is set, the engine stops, or Ctrl-C. ``settings``: the ResolvedSettings."""
    s = getattr(settings, "settings", settings)
    hz = getattr(getattr(s, "tui", None), "refresh_hz", 4.0)
    collector = Collector(engine_source(engine, settings), source=source)
    try:
        run_view(collector, refresh_hz=hz, once=once, console=console, stop=stop,
                 alive=lambda: bool(getattr(engine, "running", True)), chrome=chrome)
    except SourceGone as exc:  # pragma: no cover - engine sources do not raise it
        raise UnavailableError(str(exc)) from None


def _run_tui_guarded(engine: Any, settings: Any, stop: threading.Event, console: Console | None,
                     chrome: Chrome | None, source: str, ready: Callable[[], bool] | None) -> None:
    """:func:`run_tui` for the server's thread, once ``ready()`` (the server listens): whatever
    goes wrong in the view ends the view with one line on stderr; the server and the engine go on."""
    try:
        while ready is not None and not ready():
            if stop.wait(0.05):
                return
        run_tui(engine, settings, stop=stop, console=console, chrome=chrome, source=source)
    except Exception as exc:  # noqa: BLE001 - the view must never take the server down
        import sys

        try:
            print(f"hpc-cli: the live view stopped ({type(exc).__name__}: {exc}); the server goes on",
                  file=sys.stderr, flush=True)
        except Exception:  # pragma: no cover - stderr closed
            pass


def start_tui_thread(engine: Any, settings: Any, console: Console | None = None, *, chrome: Chrome | None = None,
                     source: str = "in process",
                     ready: Callable[[], bool] | None = None) -> tuple[threading.Thread, threading.Event]:
    """:func:`run_tui` on a daemon thread, from when ``ready()`` is true; set the returned event
    to stop it."""
    stop = threading.Event()
    th = threading.Thread(target=_run_tui_guarded, args=(engine, settings, stop, console, chrome, source, ready),
                          name="hpc-tui", daemon=True)
    th.start()
    return th, stop
