"""Host slab storage: the bytes of the host tier (spec §5.4, §11.2, ARCHITECTURE.md §5).

One host allocation of ``num_slabs * slab_bytes`` bytes, made as chunks of at most
``chunk_bytes`` (4 GiB) of *whole* slabs, so a slab never crosses a chunk. On CUDA each chunk is
pinned (page-locked with ``cudaHostRegister``, portable and mapped, exact size, no power-of-two
rounding) and ``device_ptrs`` holds the address kernels use for it (the host address under
unified addressing); on CPU it is ordinary memory. A failed allocation is a
:class:`~hpc_cli.errors.CapacityError` naming the size.

With ``background=True`` the chunks are allocated and pinned by a thread, first chunk first,
and the storage is usable at once: ``ready_slabs`` (slabs ``0 .. ready_slabs-1``) grows as each
chunk is ready, ``on_ready`` is called after each, and :meth:`HostSlabStorage.wait_ready` waits
for a number of slabs. Pinning registers a chunk with the driver (~0.4-0.6 s per GiB on an
H200), and while it does, every other CUDA call of the process waits (measured: a 4 GiB
registration held a concurrent matmul loop for 1.3 s), so between chunks the thread waits for
``may_pin`` (set while the engine is idle, at most ``defer_s`` seconds). A copy may not span two
registrations (the driver refuses it), so one chunk is one registration. A failed chunk ends
the growth: the tier keeps the chunks it has, ``error`` says why and a warning is logged.
On the CPU (unpinned, in the background) a thread faults pages in ahead of the slabs in use
(:mod:`~hpc_cli.memory.prefault`, driven by :meth:`HostSlabStorage.fault_ahead`), so a
write-through does not zero fresh pages in the request's time.

A slab holds one *block bundle* (:class:`~hpc_cli.memory.bundle.BundleLayout`); a state image
takes ``ceil(image_bytes / slab_bytes)`` slabs wherever they are free, and the image's packed
byte ``o`` lives in its ``o // slab_bytes``-th slab at offset ``o % slab_bytes``. Copy runs
between device pages and slabs are planned by :func:`~hpc_cli.memory.slab_runs.plan_runs`.

Which slab ids are free or owned is accounted by ``hpc_cli.cache.host.HostSlabPool``; this module
holds the bytes and plans copies given ids. Its chunk geometry (``slabs_per_chunk =
chunk_bytes // slab_bytes``) is the same as the index's.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from enum import StrEnum
from typing import Callable, Sequence

import torch

from hpc_cli.errors import CapacityError
from hpc_cli.memory.bundle import SLAB_ALIGN, image_slab_count
from hpc_cli.memory.cudart import mapped_device_pointer
from hpc_cli.memory.prefault import Prefaulter

log = logging.getLogger("hpc_cli.memory")

MiB = 1 << 20
GiB = 1 << 30
CHUNK_BYTES = 4 * GiB


# -- storage -----------------------------------------------------------------------------------
def _cudart():
    """torch's bundled cudart bindings (cudaHostRegister/Unregister)."""
    return torch.cuda.cudart()


#: cudaHostRegisterPortable | cudaHostRegisterMapped: every context sees the chunk, and kernels
#: (the batched segment copy) can read and write it at its device address
HOST_REGISTER_FLAGS = 0x01 | 0x02


class HostTierState(StrEnum):
    """Where the host tier's allocation stands (a ``str``: it compares and formats as its value)."""

    PINNING = "pinning"  # chunks are still being allocated and pinned
    READY = "ready"  # every slab is ready
    FAILED = "failed"  # a chunk failed: the tier keeps the chunks it has (``error`` says why)
    STOPPED = "stopped"  # growth ended early (the engine stopped)
    CLOSED = "closed"  # the memory is released


@dataclass(frozen=True, slots=True)
class PinProgress:
    """How far the host tier's allocation (and pinning) has come."""

    ready_slabs: int
    total_slabs: int
    ready_chunks: int
    total_chunks: int
    slab_bytes: int
    state: HostTierState
    seconds: float  # since the allocation began (until it ended, once it has)
    error: str | None = None

    @property
    def ready_bytes(self) -> int:
        return self.ready_slabs * self.slab_bytes

    @property
    def total_bytes(self) -> int:
        return self.total_slabs * self.slab_bytes

    def as_dict(self) -> dict:
        return {"state": self.state.value, "ready_bytes": self.ready_bytes, "total_bytes": self.total_bytes,
                "ready_slabs": self.ready_slabs, "ready_chunks": self.ready_chunks,
                "chunks": self.total_chunks, "seconds": round(self.seconds, 3), "error": self.error}


class HostSlabStorage:
    """The host tier's bytes: ``num_slabs`` slabs of ``slab_bytes`` in chunks of whole slabs.

    ``pin=None`` pins when CUDA is available. ``chunk_bytes`` bounds one chunk (4 GiB);
    ``slabs_per_chunk = max(1, chunk_bytes // slab_bytes)`` as in the index's HostSlabPool.
    ``background``: allocate and pin the chunks on a thread (see the module doc); ``on_ready``
    is then called with ``ready_slabs`` after every chunk (from that thread); ``defer_s``
    bounds how long one chunk waits for ``may_pin``.
    """

    #: longest wait of one chunk for an idle engine before it is pinned anyway
    DEFER_S = 5.0

    def __init__(self, slab_bytes: int, num_slabs: int, pin: bool | None = None,
                 chunk_bytes: int = CHUNK_BYTES, *, background: bool = False,
                 on_ready: Callable[[int], None] | None = None, defer_s: float | None = None) -> None:
        if slab_bytes <= 0 or slab_bytes % SLAB_ALIGN:
            raise CapacityError(f"slab size must be a positive multiple of {SLAB_ALIGN} B, got {slab_bytes}")
        if num_slabs < 0:
            raise CapacityError(f"slab count must not be negative, got {num_slabs}")
        if chunk_bytes < slab_bytes:
            raise CapacityError(f"a host chunk of {chunk_bytes} B cannot hold one {slab_bytes} B slab",
                                hint="raise the chunk size or lower the bundle size")
        self.slab_bytes = slab_bytes
        self.num_slabs = num_slabs
        self.slabs_per_chunk = max(1, chunk_bytes // slab_bytes)
        self.pinned = bool(torch.cuda.is_available()) if pin is None else bool(pin)
        self.chunks: list[torch.Tensor] = []
        #: per chunk, the address a kernel reads and writes it at (pinned chunks), else None
        self.device_ptrs: list[int | None] = []
        self._registered: list[int] = []
        #: slabs ``0 .. ready_slabs-1`` have memory (their chunks are allocated and pinned)
        self.ready_slabs = 0
        #: why the background allocation stopped short (None while it goes well)
        self.error: str | None = None
        self.on_ready = on_ready
        #: set while the engine is idle: a chunk is pinned only then (or after ``defer_s``)
        self.may_pin = threading.Event()
        self.may_pin.set()
        self.defer_s = self.DEFER_S if defer_s is None else defer_s
        self._cond = threading.Condition()
        self._stop_growth = False  # the thread allocates no further chunk
        self._closed = False
        self._t0 = time.monotonic()
        self._t_end: float | None = None
        self._thread: threading.Thread | None = None
        #: on the CPU, in the background: faults pages in ahead of the slabs in use
        self._prefault: Prefaulter | None = None
        if background and num_slabs and not self.pinned:
            self._prefault = Prefaulter(self._slab_ranges, slab_bytes)
        if background and num_slabs:
            self._thread = threading.Thread(target=self._allocate_all, name="hpc-host-tier", daemon=True)
            self._thread.start()
            return
        try:
            for nbytes in self.chunk_sizes():
                self._add_chunk(self._alloc_chunk(nbytes))
        except CapacityError:
            self.close()
            raise
        self._t_end = time.monotonic()

    @classmethod
    def for_budget(cls, host_bytes: int, slab_bytes: int, image_bytes: int, pin: bool | None = None,
                   chunk_bytes: int = CHUNK_BYTES) -> "HostSlabStorage":
        """The storage for a host budget (``--host-cache-mib`` in bytes): ``host_bytes //
        slab_bytes`` slabs; a nonzero budget smaller than one image plus one block is refused."""
        num = host_bytes // slab_bytes
        need = image_slab_count(image_bytes, slab_bytes) + 1
        if host_bytes > 0 and num < need:
            mib = -(-need * slab_bytes // MiB)
            raise CapacityError(
                f"host cache of {host_bytes} B holds {num} slabs, fewer than one snapshot plus one "
                f"block ({need} slabs of {slab_bytes} B)",
                hint=f"set --host-cache-mib to at least {mib}, or 0 to run without a host tier")
        return cls(slab_bytes, num, pin=pin, chunk_bytes=chunk_bytes)

    # -- allocation -------------------------------------------------------------------------
    def chunk_sizes(self) -> list[int]:
        """Bytes of each chunk (whole slabs; the last may be smaller), first chunk first."""
        full, rest = divmod(self.num_slabs, self.slabs_per_chunk)
        return [self.slabs_per_chunk * self.slab_bytes] * full + ([rest * self.slab_bytes] if rest else [])

    def _add_chunk(self, t: torch.Tensor) -> None:
        """Publish one more ready chunk: its slabs join ``ready_slabs`` (after its tensor and
        device address are in place, so a reader that sees the count finds the chunk)."""
        assert t.numel() % self.slab_bytes == 0, f"chunk of {t.numel()} B is not whole slabs"
        self.chunks.append(t)
        with self._cond:
            self.ready_slabs = min(self.num_slabs, self.ready_slabs + t.numel() // self.slab_bytes)
            self._cond.notify_all()

    def _allocate_all(self) -> None:
        """The background thread: every chunk in order, each after ``may_pin`` (bounded)."""
        try:
            for nbytes in self.chunk_sizes():
                self.may_pin.wait(self.defer_s)
                if self._stop_growth:
                    return
                chunk = self._alloc_chunk(nbytes)
                if self._stop_growth:  # stopped meanwhile: this chunk is not handed out
                    self._release_last()
                    return
                self._add_chunk(chunk)
                self._notify()
        except Exception as exc:  # the tier stops growing; it keeps the chunks it has
            self.error = exc.message if isinstance(exc, CapacityError) else f"{type(exc).__name__}: {exc}"
            log.warning("host cache tier stopped growing at %.2f of %.2f GiB: %s",
                        self.ready_slabs * self.slab_bytes / GiB, self.total_bytes / GiB, self.error)
            self._notify()
        finally:
            with self._cond:
                self._t_end = time.monotonic()
                self._cond.notify_all()

    def _notify(self) -> None:
        cb = self.on_ready
        if cb is not None:
            try:
                cb(self.ready_slabs)
            except Exception:  # a listener's failure is not the tier's
                log.exception("host tier readiness callback failed")

    def _release_last(self) -> None:
        """Unpin the chunk allocated last but never published (a close() raced it)."""
        if self._registered and len(self._registered) > len(self.chunks):
            try:
                _cudart().cudaHostUnregister(self._registered.pop())
            except Exception:  # pragma: no cover - the process is going away
                pass
        del self.device_ptrs[len(self.chunks):]

    def wait_ready(self, slabs: int, timeout: float | None = None) -> int:
        """Wait until ``slabs`` slabs (at most all of them) are ready, the allocation stopped
        short, or ``timeout`` passed; returns ``ready_slabs``."""
        want = min(slabs, self.num_slabs)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self.ready_slabs < want and self._t_end is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._cond.wait(left)
            return self.ready_slabs

    def progress(self) -> PinProgress:
        """Ready and total slabs and chunks, the state and the seconds it took (any thread)."""
        end = self._t_end
        state = (HostTierState.CLOSED if self._closed else HostTierState.FAILED if self.error is not None
                 else HostTierState.READY if self.ready_slabs == self.num_slabs
                 else HostTierState.STOPPED if self._stop_growth else HostTierState.PINNING)
        return PinProgress(self.ready_slabs, self.num_slabs, len(self.chunks), len(self.chunk_sizes()),
                           self.slab_bytes, state, (end if end is not None else time.monotonic()) - self._t0,
                           self.error)

    def _alloc_chunk(self, nbytes: int) -> torch.Tensor:
        total = self.num_slabs * self.slab_bytes
        try:
            t = torch.empty(nbytes, dtype=torch.uint8)
        except RuntimeError as exc:
            raise CapacityError(
                f"cannot allocate the host cache: a chunk of {nbytes} B ({nbytes / GiB:.2f} GiB) of "
                f"{total} B ({total / GiB:.2f} GiB) in all failed: {exc}",
                hint="lower --host-cache-mib (host_cache_mib), or free host memory") from exc
        if self.pinned:
            err = _cudart().cudaHostRegister(t.data_ptr(), nbytes, HOST_REGISTER_FLAGS)
            if int(err) != 0:
                raise CapacityError(
                    f"cannot pin the host cache: pinning a chunk of {nbytes} B ({nbytes / GiB:.2f} GiB) "
                    f"of {total} B ({total / GiB:.2f} GiB) failed with CUDA error {int(err)}",
                    hint="lower --host-cache-mib (host_cache_mib); pinned memory is limited by the OS")
            self._registered.append(t.data_ptr())
            dev = mapped_device_pointer(t.data_ptr())
            if self._thread is not None and dev != t.data_ptr():
                # the transfer engine addresses chunks that arrive after it was built at their host
                # address (unified addressing); a chunk mapped elsewhere cannot join
                _cudart().cudaHostUnregister(self._registered.pop())
                raise CapacityError(f"pinned host chunk {len(self.chunks)} is mapped at device address "
                                    f"{dev!r}, not at its host address {t.data_ptr():#x}")
            self.device_ptrs.append(dev)
        else:
            self.device_ptrs.append(None)
        return t

    def fault_ahead(self, high_water: int) -> None:
        """Slabs below ``high_water`` have been handed out: keep the pages of those and of the
        next :data:`~hpc_cli.memory.prefault.AHEAD_BYTES` faulted in (CPU; a no-op when pinned).
        O(1): the engine calls it as it polls."""
        if self._prefault is not None:
            self._prefault.want(high_water, self.ready_slabs)

    def _slab_ranges(self, first: int, last: int) -> list[tuple[int, int]]:
        """``(address, nbytes)`` of slabs ``first .. last - 1``, one run per chunk."""
        out = []
        while first < last:
            c, off = self.location(first)
            end = min(last, (c + 1) * self.slabs_per_chunk)
            out.append((self.chunks[c].data_ptr() + off, (end - first) * self.slab_bytes))
            first = end
        return out

    def stop_growth(self) -> None:
        """Allocate no further chunk and fault no more pages in (the engine stopped); the ready
        chunks stay."""
        if self._prefault is not None:
            self._prefault.stop()
            self._prefault = None
        self._stop_growth = True
        self.may_pin.set()

    def close(self) -> None:
        """Stop the background allocation, unpin every chunk and drop the memory (idempotent)."""
        self.stop_growth()  # the prefault thread first: before the chunks go
        self._closed = True
        th = self._thread
        if th is not None and th is not threading.current_thread():
            th.join()
        for ptr in self._registered:
            try:
                _cudart().cudaHostUnregister(ptr)
            except Exception:  # interpreter shutdown: the process is going away anyway
                pass
        self._registered = []
        self.chunks = []
        self.device_ptrs = []

    def __del__(self) -> None:
        if (getattr(self, "_registered", None) or getattr(self, "_thread", None) is not None
                or getattr(self, "_prefault", None) is not None):
            self.close()

    # -- geometry -------------------------------------------------------------------------
    @property
    def total_bytes(self) -> int:
        return self.num_slabs * self.slab_bytes

    def location(self, slab: int) -> tuple[int, int]:
        """``(chunk index, byte offset in the chunk)`` of a slab."""
        assert 0 <= slab < self.num_slabs, f"slab {slab} out of range 0..{self.num_slabs - 1}"
        c, i = divmod(slab, self.slabs_per_chunk)
        return c, i * self.slab_bytes

    def slab_view(self, slab_id: int) -> torch.Tensor:
        """The ``slab_bytes`` bytes of one slab (a view; writes land in the slab)."""
        c, off = self.location(slab_id)
        return self.chunks[c][off:off + self.slab_bytes]

    def run_view(self, slab0: int, count: int, slab_stride: int, offset: int, width: int) -> torch.Tensor:
        """``[count, width]`` bytes at ``offset`` of slabs ``slab0 + i * slab_stride``: a strided
        view inside one chunk (torch refuses a view past the chunk's end)."""
        c, off = self.location(slab0)
        assert count == 1 or (slab0 + (count - 1) * slab_stride) // self.slabs_per_chunk == c, \
            f"run of slabs {slab0}+{slab_stride}*{count} crosses a chunk"
        assert 0 <= offset and offset + width <= self.slab_bytes, f"[{offset}, +{width}) outside a slab"
        base = self.chunks[c]
        return base.as_strided((count, width), (slab_stride * self.slab_bytes, 1),
                               base.storage_offset() + off + offset)

    def image_extents(self, slabs: Sequence[int], offset: int, nbytes: int) -> list[tuple[int, int, int, int]]:
        """Where image bytes ``[offset, offset + nbytes)`` of an image kept in ``slabs`` (packed
        byte ``o`` in ``slabs[o // slab_bytes]``) live: ``(chunk, chunk offset, bytes, image
        offset)`` extents in image order; extents in consecutive slabs of one chunk are merged."""
        out: list[tuple[int, int, int, int]] = []
        o, end = offset, offset + nbytes
        sb, spc = self.slab_bytes, self.slabs_per_chunk
        while o < end:
            k, within = divmod(o, sb)
            assert k < len(slabs), f"image byte {o} needs slab #{k}, only {len(slabs)} given"
            first = slabs[k]
            assert 0 <= first < self.num_slabs, f"slab {first} out of range 0..{self.num_slabs - 1}"
            n = min(end - o, sb - within)
            while (o + n < end and k + 1 < len(slabs) and slabs[k + 1] == slabs[k] + 1
                   and slabs[k + 1] // spc == first // spc):
                k += 1
                n = min(end - o, n + sb)
            out.append((first // spc, (first % spc) * sb + within, n, o))
            o += n
        return out

    def image_pieces(self, slabs: Sequence[int], offset: int, nbytes: int) -> list[tuple[torch.Tensor, int]]:
        """:meth:`image_extents` as ``(host view, image offset)`` pieces."""
        return [(self.chunks[c][off:off + n], o) for c, off, n, o in self.image_extents(slabs, offset, nbytes)]
