"""The expert tier's device slots and residency table (``shared/spec/expert-cache.hpp``'s
``ExpertCache``, R4): slot storage of uniform or per-slot sizes, checked against the device's free
memory; the table ``(layer, expert) -> slot`` or :data:`NOT_RESIDENT`, bounds-checked; admission
that never evicts (one counter for all layers, or per-layer ranges: R4.2g, layer ``l`` owns slots
``[l*q, (l+1)*q)``, the last layer the remainder); ``fill_slot`` copies asynchronously on a side
stream, ``fill_slot_blocking`` at startup; ``verify_slot`` reads a slot back and compares it byte
for byte with the host copy.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np
import torch

from hpc_cli.errors import CapacityError, EngineError

NOT_RESIDENT = -1
SLOT_ALIGN = 256
MiB = 1 << 20


class ExpertCacheError(EngineError):
    """A bad slot, layer or expert index, or a slot that does not hold what it claims to."""


def device_free_bytes(device: torch.device | str) -> int:
    """Free memory of ``device`` now: the CUDA allocator's view, or available host RAM on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError):  # pragma: no cover - non-POSIX
        return 1 << 62


def align(n: int, a: int = SLOT_ALIGN) -> int:
    """``n`` rounded up to a multiple of ``a`` (a slot's stride)."""
    return (n + a - 1) // a * a


class ExpertCache:
    """Device slots and the residency table (``expert-cache.hpp``'s ``ExpertCache``)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.base: torch.Tensor | None = None
        self.table = np.zeros((0, 0), dtype=np.int32)  # [n_layers, n_expert] -> slot or NOT_RESIDENT
        self.owner: list[tuple[int, int] | None] = []  # slot -> (layer, expert)
        self.off = np.zeros(1, dtype=np.int64)  # slot byte offsets, slots + 1 entries
        self.slot_bytes = np.zeros(0, dtype=np.int64)  # usable bytes of each slot
        self.uniform = True
        self.n_layers = self.n_expert = 0
        self.next_free = 0
        self.admitted = 0
        self.fills = 0
        self.per_layer = False
        self.layer_next: list[int] = []

    # -- allocation ------------------------------------------------------------------------
    def open(self, n_slots: int, n_layers: int, n_expert: int, blob_bytes: int, *,
             free_bytes: int | None = None) -> None:
        """``n_slots`` slots of ``blob_bytes`` each (rounded up to 256 B)."""
        self._open([blob_bytes] * n_slots, n_layers, n_expert, free_bytes, uniform=True)

    def open_sized(self, slot_bytes: Sequence[int], n_layers: int, n_expert: int, *,
                   free_bytes: int | None = None) -> None:
        """Slots of the given sizes, back to back (each keeps its size: an expert is never moved
        to another layer's slot)."""
        self._open(list(slot_bytes), n_layers, n_expert, free_bytes, uniform=False)

    def _open(self, sizes: list[int], n_layers: int, n_expert: int, free_bytes: int | None, uniform: bool) -> None:
        if n_layers <= 0 or n_expert <= 0:
            raise ExpertCacheError(f"an expert cache needs layers and experts, got {n_layers} x {n_expert}")
        if any(s <= 0 for s in sizes):
            raise ExpertCacheError("every expert slot needs a positive size")
        self.close()
        strides = np.array([align(int(s)) for s in sizes], dtype=np.int64)
        off = np.zeros(len(sizes) + 1, dtype=np.int64)
        np.cumsum(strides, out=off[1:])
        total = int(off[-1])
        free = device_free_bytes(self.device) if free_bytes is None else int(free_bytes)
        if total > free:
            raise CapacityError(
                f"the expert tier needs {total / MiB:,.1f} MiB for {len(sizes)} slots but the device has "
                f"{free / MiB:,.1f} MiB free (measured after the KV pools were sized)",
                hint="lower experts.budget_slots or experts.budget_mib, or leave room: lower "
                     "engine.device_memory_fraction or set engine.kv_capacity")
        try:
            self.base = torch.empty(max(total, 1), dtype=torch.uint8, device=self.device)
        except torch.OutOfMemoryError:
            raise CapacityError(f"allocating {total / MiB:,.1f} MiB of expert slots failed on {self.device}",
                                hint="lower experts.budget_slots or experts.budget_mib") from None
        self.off, self.slot_bytes, self.uniform = off, np.array(sizes, dtype=np.int64), uniform
        self.n_layers, self.n_expert = n_layers, n_expert
        self.table = np.full((n_layers, n_expert), NOT_RESIDENT, dtype=np.int32)
        self.owner = [None] * len(sizes)
        self.layer_next = [self.layer_slot_range(layer)[0] for layer in range(n_layers)]

    def close(self) -> None:
        self.base = None
        self.table = np.zeros((0, 0), dtype=np.int32)
        self.owner = []
        self.next_free = self.admitted = self.fills = 0

    # -- geometry --------------------------------------------------------------------------
    @property
    def valid(self) -> bool:
        return self.base is not None

    @property
    def slots(self) -> int:
        return len(self.owner)

    @property
    def resident(self) -> int:
        """Slots claimed (not ``slots``: nothing evicts, so a run that routes fewer distinct
        experts than there are slots leaves the rest empty)."""
        return self.admitted

    @property
    def bytes(self) -> int:
        return int(self.off[-1])

    @property
    def gib(self) -> float:
        return self.bytes / (1 << 30)

    def slot_offsets(self) -> np.ndarray | None:
        return None if self.uniform else self.off

    def _check_pair(self, layer: int, expert: int) -> None:
        if not self.valid:
            raise ExpertCacheError("the expert cache is not open")
        if not (0 <= layer < self.n_layers):
            raise ExpertCacheError(f"layer {layer} is outside the expert cache's {self.n_layers} layers")
        if not (0 <= expert < self.n_expert):
            raise ExpertCacheError(f"expert {expert} is outside layer {layer}'s {self.n_expert} experts")

    def _check_slot(self, slot: int) -> None:
        if not self.valid:
            raise ExpertCacheError("the expert cache is not open")
        if not (0 <= slot < self.slots):
            raise ExpertCacheError(f"slot {slot} is outside the expert cache's {self.slots} slots")

    # -- residency -------------------------------------------------------------------------
    def slot_of(self, layer: int, expert: int) -> int:
        """``(layer, expert)`` -> slot, or :data:`NOT_RESIDENT`; a bad index raises."""
        self._check_pair(layer, expert)
        return int(self.table[layer, expert])

    def set_per_layer_admission(self, on: bool) -> None:
        self.per_layer = bool(on)

    def layer_slot_range(self, layer: int) -> tuple[int, int]:
        """Slots ``[lo, hi)`` layer ``layer`` may admit into under per-layer admission:
        ``q = slots // n_layers`` each, the last layer taking the remainder."""
        if not (0 <= layer < self.n_layers):
            raise ExpertCacheError(f"layer {layer} is outside the expert cache's {self.n_layers} layers")
        q = self.slots // self.n_layers
        lo = layer * q
        hi = self.slots if layer == self.n_layers - 1 else lo + q
        return lo, hi

    def admit(self, layer: int, expert: int, blob_bytes: int = 0) -> int:
        """Claim the next free slot for ``(layer, expert)``: its slot, or :data:`NOT_RESIDENT` when
        the cache (or, per layer, the layer's range) is full. Never evicts. Already resident: its slot."""
        self._check_pair(layer, expert)
        have = int(self.table[layer, expert])
        if have != NOT_RESIDENT:
            return have
        if self.per_layer:
            _, hi = self.layer_slot_range(layer)
            slot = self.layer_next[layer]
            if slot >= hi:
                return NOT_RESIDENT
            self.layer_next[layer] = slot + 1
        else:
            if self.next_free >= self.slots:
                return NOT_RESIDENT
            slot = self.next_free
            self.next_free += 1
        if blob_bytes > self.slot_bytes[slot]:
            raise ExpertCacheError(f"layer {layer}'s experts are {blob_bytes} bytes; slot {slot} holds "
                                   f"{int(self.slot_bytes[slot])}")
        self.table[layer, expert] = slot
        self.owner[slot] = (layer, expert)
        self.admitted += 1
        return slot

    # -- bytes -----------------------------------------------------------------------------
    def device_slot(self, slot: int) -> torch.Tensor:
        """The slot's bytes on the device (a view of the arena)."""
        self._check_slot(slot)
        lo = int(self.off[slot])
        return self.base[lo:lo + int(self.slot_bytes[slot])]

    def _src(self, slot: int, host_blob: torch.Tensor, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_slot(slot)
        n = int(nbytes) or int(self.slot_bytes[slot])
        if n > self.slot_bytes[slot]:
            raise ExpertCacheError(f"{n} bytes do not fit slot {slot} ({int(self.slot_bytes[slot])} bytes)")
        src = host_blob.reshape(-1)
        if src.dtype != torch.uint8 or src.numel() < n:
            raise ExpertCacheError(f"the host blob for slot {slot} must be at least {n} bytes of uint8")
        return self.device_slot(slot)[:n], src[:n]

    def fill_slot(self, slot: int, host_blob: torch.Tensor, stream: Any = None, nbytes: int = 0) -> Any:
        """Copy ``host_blob`` into ``slot`` on ``stream``, asynchronously; returns a CUDA event the
        caller orders on (None on CPU, where the copy is done on return)."""
        dst, src = self._src(slot, host_blob, nbytes)
        self.fills += 1
        if self.device.type != "cuda":
            dst.copy_(src)
            return None
        stream = stream or torch.cuda.current_stream(self.device)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(stream)
        return ev

    def fill_slot_blocking(self, slot: int, host_blob: torch.Tensor, nbytes: int = 0) -> None:
        """The same copy, finished on return (startup: verify_slot reads the slot right after)."""
        dst, src = self._src(slot, host_blob, nbytes)
        dst.copy_(src)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.fills += 1

    def verify_slot(self, slot: int, host_blob: torch.Tensor, nbytes: int = 0) -> str | None:
        """Read ``slot`` back and compare it with ``host_blob`` byte for byte: None when equal,
        else what differs."""
        dst, src = self._src(slot, host_blob, nbytes)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        got = dst.cpu()
        if torch.equal(got, src):
            return None
        at = int((got != src).nonzero()[0, 0])
        owner = self.owner[slot]
        who = f" (layer {owner[0]}, expert {owner[1]})" if owner else ""
        return (f"slot {slot}{who} differs from the host copy at byte {at}: "
                f"{int(got[at]):#04x} in the slot, {int(src[at]):#04x} on the host")
