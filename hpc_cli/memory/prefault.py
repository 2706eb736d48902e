"""Fault in the host tier's pages ahead of use, in the background (CPU hosts).

On CUDA the host tier is pinned, which commits every page when a chunk is registered. On the CPU
it is ordinary memory, and an untouched page is faulted in (zeroed by the kernel) by the first
write into it: a write-through of a 3 MiB snapshot image into fresh slabs took 0.82 ms against
0.23 ms into slabs written before, on the engine's thread, in the request's time. So a thread
faults the pages in before the index hands their slabs out: slabs are handed out lowest first,
so the pages below the highest slab handed out so far plus :data:`AHEAD_BYTES` are kept faulted
in. The thread runs at the lowest scheduling priority, so it takes the cores only when the
engine leaves them idle, and it commits only what use is about to reach (an idle server does
not grow to the tier's size).

Pages are faulted in with ``madvise(MADV_POPULATE_WRITE)`` (Linux 5.14 and later), which maps
them writable without touching their bytes, so it is safe on pages another thread is writing.
Where the call is missing the thread does nothing and the first write faults, as before.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading
import weakref
from typing import Callable, Sequence

log = logging.getLogger("hpc_cli.memory")

MiB = 1 << 20
#: how far the faulted pages run ahead of the highest slab handed out
AHEAD_BYTES = 256 * MiB
#: bytes one ``madvise`` call faults in (the thread checks for a stop between pieces)
PIECE_BYTES = 16 * MiB
MADV_POPULATE_WRITE = 23  # linux/mman.h
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _libc() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        lib.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        lib.madvise.restype = ctypes.c_int
        return lib
    except (OSError, AttributeError):
        return None


_LIBC = _libc()


def populate_write(address: int, nbytes: int) -> bool:
    """Fault in the pages of ``[address, address + nbytes)`` writable, bytes unchanged (the
    range widened to whole pages). False where the system cannot (no such ``madvise``)."""
    if _LIBC is None or nbytes <= 0:
        return False
    start = address - address % PAGE
    end = address + nbytes
    return _LIBC.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_POPULATE_WRITE) == 0


def supported() -> bool:
    """Whether this system faults pages in without writing them (probed on a small buffer)."""
    if _LIBC is None:
        return False
    buf = ctypes.create_string_buffer(2 * PAGE)
    return populate_write(ctypes.addressof(buf), len(buf))


class Prefaulter:
    """A thread that keeps slabs ``0 .. target - 1`` of a storage faulted in.

    ``ranges(first, last)`` gives the ``(address, nbytes)`` runs of slabs ``first .. last - 1``
    (within chunks that exist: the caller clamps to them); a bound method is held weakly, so the
    thread does not keep its storage alive (it ends when the storage goes). :meth:`want` raises the
    target (never lowers it), :meth:`stop` ends the thread. ``faulted`` is how many slabs from
    slab 0 are done.
    """

    def __init__(self, ranges: Callable[[int, int], Sequence[tuple[int, int]]], slab_bytes: int,
                 ahead_bytes: int = AHEAD_BYTES) -> None:
        self._ranges = weakref.WeakMethod(ranges) if hasattr(ranges, "__self__") else (lambda: ranges)
        self.slab_bytes = slab_bytes
        self.ahead_slabs = max(1, ahead_bytes // slab_bytes)
        self.faulted = 0
        self.failed = False
        self._target = 0
        self._stopped = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="hpc-host-prefault", daemon=True)
        self._thread.start()

    def want(self, high_water: int, limit: int) -> None:
        """Slabs up to ``high_water`` (the highest handed out, plus one) are in use: fault in
        those and :attr:`ahead_slabs` more, at most ``limit`` (the slabs that have memory)."""
        target = min(limit, high_water + self.ahead_slabs)
        if target > self._target:  # read without the lock: only this (the engine's) thread raises it
            with self._cond:
                self._target = target
                self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        try:  # the lowest priority: this thread runs only on cores the engine leaves idle (Linux:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # a thread is a task)
        except (AttributeError, OSError):
            pass
        piece = max(1, PIECE_BYTES // self.slab_bytes)
        while True:
            with self._cond:
                while not self._stopped and self.faulted >= self._target:
                    self._cond.wait()
                if self._stopped:
                    return
                last = min(self._target, self.faulted + piece)
            ranges = self._ranges()
            if ranges is None:  # the storage is gone
                return
            for address, nbytes in ranges(self.faulted, last):
                if not populate_write(address, nbytes):
                    self.failed = True
                    log.debug("host tier pages cannot be faulted in ahead of use on this system")
                    return
            del ranges
            self.faulted = last
