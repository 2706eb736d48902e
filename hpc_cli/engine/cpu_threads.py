"""The CPU thread team of the thread that starts the engine, handed back before the worker runs.

torch's CPU build runs its parallel ops on OpenMP (libgomp on Linux). Each thread that runs a
parallel op gets a team of its own, and the team's threads stay after the op. Once the threads of
all teams outnumber the cores, libgomp throttles how long a team's threads spin before they sleep,
so every parallel op of the engine's worker waits for its team to wake. The thread that loads the
model and builds the pools (the server's main thread) has such a team; the worker is a second
thread. Measured on the 2-core CPU machine (2026-12-04): a decode-sized ``F.linear`` of 256 ->
10,240 took 184 us on the main thread and 282 us on another thread after the main thread had run
parallel ops (187 us when it had not); a decode step of ``builtin:tiny`` 5.9 ms against 11-12.5 ms,
of the hidden-256 checkpoint 15 ms against 26 ms.

:func:`release_thread_team` ends the calling thread's team (OpenMP 5.0's
``omp_pause_resource_all``); the thread gets a new one if it runs a parallel op again. The engine
calls it twice: on the thread that starts it, and on its worker each time the worker goes idle.
The second matters where two engines live in one process (``benchmarks/spec_decode.py`` runs one
per backend): their two idle-but-alive teams throttled each other, and a decode step of
``builtin:tiny`` took 10.2-10.4 ms in either engine against 5.8-6.0 ms (2026-12-04, 2-core CPU);
handing the team back when idle costs nothing measurable (time to first token 10.9-11.1 ms both
ways)."""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

log = logging.getLogger(__name__)
#: the OpenMP runtimes torch's CPU builds load
RUNTIMES = ("libgomp", "libiomp5", "libomp")
OMP_PAUSE_SOFT = 1


@functools.cache
def _runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime this process has loaded (the very copy torch uses), or None."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:  # not Linux: nothing to hand back
        return None
    paths = sorted({line.split()[-1] for line in maps.splitlines()
                    if any(Path(line.split()[-1]).name.startswith(r) for r in RUNTIMES) and "/" in line})
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
            lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
            lib.omp_pause_resource_all.restype = ctypes.c_int
            return lib
        except (OSError, AttributeError):
            continue
    return None


def release_thread_team() -> bool:
    """End the calling thread's OpenMP team (its idle threads), so that the engine's worker is
    the only thread with one. True when a runtime took the request."""
    lib = _runtime()
    if lib is None:
        return False
    ok = lib.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0
    if not ok:
        log.debug("the OpenMP runtime refused to end this thread's team")
    return ok
