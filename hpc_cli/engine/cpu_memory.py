"""Freed memory kept in the process on the CPU, so that passes do not fault their buffers in again.

glibc's malloc hands a block of 128 KiB or more (a threshold that grows up to 32 MiB as such
blocks are freed) straight to ``mmap`` and gives it back to the system when it is freed, and it
trims the heap's free top; the next block of that size is new memory, every page of it a fault.
A prefill pass on the CPU allocates and frees buffers of megabytes (the projections of a 512-token
pass, the gathered keys of its attention), so each new length or context faults its buffers in
again. Measured on the 2-core CPU machine (2026-12-07, the hidden-256 checkpoint, a cold 2,529-token
prompt in passes of 512 through a started engine, hybrid cache with an 8 GiB host tier, three
fresh processes each): the first request 3.10-3.48 s and the second 2.57-2.87 s with glibc's
defaults; 2.45-2.61 s and 2.49-2.69 s with freed memory kept.

:func:`keep_freed_memory` sets glibc's ``mallopt``: no block under 1 GiB goes to ``mmap``, the heap
is not trimmed, and it grows 256 MiB at a time. The process keeps its high-water mark of memory,
as a device's caching allocator keeps its own. Where the C library is not glibc (no ``mallopt``)
it does nothing; ``[engine] cpu_keep_memory = false`` turns it off."""

from __future__ import annotations

import ctypes
import functools
import logging

log = logging.getLogger(__name__)

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
#: blocks under this size come from the heap, never from their own mmap
MMAP_THRESHOLD = 1 << 30
#: the heap grows this much beyond a request at a time
TOP_PAD = 256 << 20
#: free memory at the heap's top kept before trimming (mallopt takes an int: the largest)
TRIM_THRESHOLD = (1 << 31) - 1


@functools.cache
def keep_freed_memory() -> bool:
    """Keep freed memory in the process (once a process); True where glibc took every setting."""
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): its allocator is left as it is
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    done = all(mallopt(param, value) == 1 for param, value in
               ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD)))
    if not done:
        log.debug("mallopt refused a setting: freed memory is kept only in part")
    return done
