"""The MoE expert tier: experts in host memory, the most-routed of them resident in device slots.

A Qwen3.5-MoE checkpoint of the 35B-A3B class often does not fit a GPU with room for KV. With
``[experts] offload = true`` the routed experts move to (pinned) host memory and an
:class:`ExpertCache` of ``slots`` device slots holds a copy of some of them; each MoE layer then
splits every token's routed experts into *resident* ones (computed on the device from their
slots) and *misses* (computed on the host from the host copy), and adds the two. Router and
shared expert stay on the device. A layer whose experts are all resident never reads from the
device: the picks' slots come from a device residency tensor and their weights are gathered from
the slot arena into batched matmuls (:meth:`ExpertTier.routed`). The design is
``shared/spec/expert-cache.hpp`` (R4):

* slot storage of uniform or per-slot sizes, checked against the device's free memory;
* the residency table ``(layer, expert) -> slot`` or :data:`NOT_RESIDENT`, bounds-checked;
* admission never evicts: ``profile`` (the top pairs of an STRP file, filled and optionally
  verified at startup), ``first-routed`` (the first distinct pairs routed, one counter for all
  layers) and ``per-layer-first-routed`` (R4.2g: layer ``l`` owns slots ``[l*q, (l+1)*q)``,
  the last layer the remainder);
* ``fill_slot`` copies asynchronously on a side stream, ``fill_slot_blocking`` at startup;
  ``verify_slot`` reads a slot back and compares it byte for byte with the host copy.

The engine attaches the tier with :func:`attach_expert_tier` and reports :func:`expert_stats`.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from hpc_cli.errors import CapacityError, ConfigError, EngineError

NOT_RESIDENT = -1
SLOT_ALIGN = 256
MiB = 1 << 20
POLICIES = ("profile", "first-routed", "per-layer-first-routed")


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


def _align(n: int, a: int = SLOT_ALIGN) -> int:
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
        strides = np.array([_align(int(s)) for s in sizes], dtype=np.int64)
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


class _HostLayer:
    """One MoE layer's experts in host memory: a packed ``[E, blob]`` byte array (what slots are
    filled from) and typed views of it (what misses are computed from).

    ``packed`` given (a model built with ``offload_experts``, whose expert parameters are views
    of it): that array is adopted as it is, nothing is copied; else the experts are copied from
    ``gate_up``/``down`` (wherever they are) into a new one."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, pin: bool,
                 packed: torch.Tensor | None = None) -> None:
        e, two_i, h = gate_up.shape
        self.dtype = gate_up.dtype
        self.shape_gu, self.shape_dn = (two_i, h), tuple(down.shape[1:])
        elem = gate_up.element_size()
        self.gu_bytes = two_i * h * elem
        self.blob = self.gu_bytes + down[0].numel() * elem
        self.adopted = packed is not None
        if packed is None:
            packed = torch.empty(e, self.blob, dtype=torch.uint8, pin_memory=pin)
        elif tuple(packed.shape) != (e, self.blob) or packed.dtype != torch.uint8 or packed.device.type != "cpu":
            raise EngineError(f"host experts of shape {tuple(packed.shape)} ({packed.dtype}, {packed.device}) "
                              f"are not the packed [{e}, {self.blob}] uint8 host array the tier expects")
        elif pin and not packed.is_pinned():
            packed = packed.pin_memory()  # one pinned copy; the unpinned one goes with the model's views
        self.gate_up = packed[:, :self.gu_bytes].view(self.dtype).view(e, *self.shape_gu)
        self.down = packed[:, self.gu_bytes:].view(self.dtype).view(e, *self.shape_dn)
        if not self.adopted:
            self.gate_up.copy_(gate_up)
            self.down.copy_(down)
        self.packed = packed


def _packed_of(ex: Any) -> torch.Tensor | None:
    """The packed host array ``ex``'s expert parameters are views of (``offload_experts``), or None."""
    packed = getattr(ex, "host_packed", None)
    if packed is None:
        return None
    base = packed.untyped_storage().data_ptr()
    if all(t.device.type == "cpu" and t.untyped_storage().data_ptr() == base
           for t in (ex.gate_up_proj, ex.down_proj)):
        return packed
    return None


class _Recorder:
    """Collects one forward's routing per layer and writes it as trace records."""

    def __init__(self, path: Path, layers: list[int], n_expert: int, top_k: int) -> None:
        from hpc_cli.model.expert_profile import TraceWriter

        self.writer = TraceWriter(path, len(layers), n_expert, top_k)
        self.pos = {layer: i for i, layer in enumerate(layers)}
        self.buf: list[np.ndarray | None] = [None] * len(layers)
        self.lock = threading.Lock()

    def add(self, layer: int, index: np.ndarray) -> None:
        i = self.pos[layer]
        self.buf[i] = index
        if i == len(self.buf) - 1:
            parts = self.buf
            self.buf = [None] * len(parts)
            if any(p is None or p.shape != index.shape for p in parts):
                return  # a partial forward (a layer skipped): not a token record
            with self.lock:
                self.writer.write(np.stack(parts, axis=1))
                self.writer.flush()

    def close(self) -> None:
        with self.lock:
            self.writer.close()


class ExpertTier:
    """The split MoE: host experts, device slots, admission, stats (and routing traces)."""

    def __init__(self, model: Any, *, slots: int = 0, admission: str = "profile", profile: Any = None,
                 offload: bool = True, verify: bool = False, trace_file: str | os.PathLike | None = None,
                 free_bytes: int | None = None, pin: bool | None = None) -> None:
        from hpc_cli.model.moe import SparseMoE

        if admission not in POLICIES:
            raise ConfigError(f"unknown expert admission policy {admission!r}", hint=f"choose one of: {', '.join(POLICIES)}")
        cfg = model.config
        self.model = model
        self.device = torch.device(model.device)
        self.layers = [i for i, layer in enumerate(model.layers) if isinstance(layer.mlp, SparseMoE)]
        if not self.layers:
            raise ConfigError(f"model {cfg.name!r} has no MoE layers", hint="the expert tier needs a qwen3_5_moe model")
        self.n_layers, self.n_expert, self.top_k = cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok
        self.admission, self.offload = admission, offload
        self.hits = np.zeros(self.n_layers, dtype=np.int64)
        self.misses = np.zeros(self.n_layers, dtype=np.int64)
        self.host_bytes = 0
        self.tokens = 0
        self.calls = 0
        #: device->host reads the split made (each one a wait for the device); none on a layer
        #: whose experts are all resident and whose batch takes the gather path
        self.syncs = 0
        #: layer calls that computed misses from the host copy
        self.miss_calls = 0
        #: a layer call of more than this many picks (``tokens x top_k``) takes the per-expert loop
        #: (prefill-sized batches, where reading each routed expert once beats gathering it per
        #: pick; one read per layer, as the plain MoE's loop makes); fewer: the device-only gather
        self.gather_max_picks = 4 * self.n_expert
        #: the gather copies each pick's expert: it runs over the tokens in chunks whose copies
        #: stay under this many bytes
        self.gather_max_bytes = 256 * MiB
        self.cache: ExpertCache | None = None
        self.host: dict[int, _HostLayer] = {}
        self._views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._layer_rows: dict[int, tuple[torch.Tensor, int] | None] = {}
        self._pending: dict[int, tuple[Any, int, int]] = {}  # slot -> (fill event, layer, expert)
        self._stream = None
        #: the residency the split computes with: ``(layer, expert)`` -> slot or NOT_RESIDENT, on
        #: the device (``residency``) and its host mirror (``_live``). A pair enters both once its
        #: slot holds the expert (a blocking fill, or an asynchronous fill whose event completed);
        #: the device entry is written on the compute stream, so every kernel queued after it
        #: sees the filled slot, and the two never disagree for a kernel the host reasons about.
        self.residency: torch.Tensor | None = None
        self._live = np.zeros((0, 0), dtype=np.int32)
        self._live_count = np.zeros(self.n_layers, dtype=np.int64)
        self.recorder: _Recorder | None = None
        if trace_file is not None:
            self.recorder = _Recorder(Path(trace_file), self.layers, self.n_expert, self.top_k)
        if offload:
            pin = (self.device.type == "cuda") if pin is None else pin
            for i in self.layers:
                ex = model.layers[i].mlp.experts
                # built with offload_experts: adopt the host array the parameters are views of;
                # else copy the device experts to the host
                self.host[i] = _HostLayer(ex.gate_up_proj.data, ex.down_proj.data, pin, packed=_packed_of(ex))
                ex.gate_up_proj = None  # the model's references go: the host copy is the experts now
                ex.down_proj = None
                ex.host_packed = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            blob = {self.host[i].blob for i in self.layers}
            self.cache = ExpertCache(self.device)
            if len(blob) == 1:
                self.cache.open(slots, self.n_layers, self.n_expert, blob.pop(), free_bytes=free_bytes)
            else:  # layers of different expert sizes: per-layer sized slots in per-layer ranges
                q, sizes = slots // self.n_layers, []
                for layer in range(self.n_layers):
                    n = q if layer < self.n_layers - 1 else slots - q * (self.n_layers - 1)
                    sizes += [self.host[layer].blob if layer in self.host else max(b for b in blob)] * n
                self.cache.open_sized(sizes, self.n_layers, self.n_expert, free_bytes=free_bytes)
                admission = admission if admission != "first-routed" else "per-layer-first-routed"
            self.cache.set_per_layer_admission(admission == "per-layer-first-routed" or len(blob) > 1)
            self._live = np.full((self.n_layers, self.n_expert), NOT_RESIDENT, dtype=np.int32)
            self.residency = torch.full((self.n_layers, self.n_expert), NOT_RESIDENT, dtype=torch.int32,
                                        device=self.device)
            if self.device.type == "cuda":
                self._stream = torch.cuda.Stream(self.device)
            if admission == "profile":
                if profile is None:
                    raise ConfigError("expert admission 'profile' needs a profile",
                                      hint="set experts.profile_file (hpc-cli expert profile builds one)")
                self._fill_from_profile(profile, verify)
            elif verify:
                self.verify_all()
        for i in self.layers:
            mlp = model.layers[i].mlp
            mlp.expert_tier, mlp.layer_index = self, i
        model.expert_tier = self

    # -- startup ---------------------------------------------------------------------------
    def _fill_from_profile(self, profile: Any, verify: bool) -> None:
        if (profile.n_layers, profile.n_expert) != (self.n_layers, self.n_expert):
            raise ConfigError(f"the expert profile is for {profile.n_layers} layers x {profile.n_expert} experts; "
                              f"the model has {self.n_layers} x {self.n_expert}",
                              hint="build a profile from this model's routing traces")
        for layer, expert in profile.ranked:
            layer, expert = int(layer), int(expert)
            if layer not in self.host:
                continue
            slot = self.cache.admit(layer, expert, self.host[layer].blob)
            if slot == NOT_RESIDENT:
                if not self.cache.per_layer:
                    break
                continue
            self.cache.fill_slot_blocking(slot, self.host[layer].packed[expert], self.host[layer].blob)
        # every fill has finished: publish the whole table at once
        self._live[:] = self.cache.table
        self._live_count[:] = (self._live != NOT_RESIDENT).sum(axis=1)
        self.residency.copy_(torch.from_numpy(self._live))
        if verify:
            self.verify_all()

    def admit_blocking(self, layer: int, expert: int) -> int:
        """Admit ``(layer, expert)``, fill its slot (blocking) and publish it: its slot, or
        :data:`NOT_RESIDENT` when there is no room."""
        if int(self.cache.table[layer, expert]) != NOT_RESIDENT:
            self.sync()
            return int(self.cache.table[layer, expert])
        h = self.host[layer]
        slot = self.cache.admit(layer, expert, h.blob)
        if slot != NOT_RESIDENT:
            self.cache.fill_slot_blocking(slot, h.packed[expert], h.blob)
            self._publish(layer, expert, slot)
        return slot

    def verify_all(self) -> None:
        """Verify every claimed slot against the host copy; a mismatch refuses to start."""
        self.sync()
        for slot, owner in enumerate(self.cache.owner):
            if owner is None:
                continue
            layer, expert = owner
            err = self.cache.verify_slot(slot, self.host[layer].packed[expert], self.host[layer].blob)
            if err:
                raise EngineError(f"expert slot verification failed: {err}",
                                  hint="the device copy is wrong: check the device; restart without the tier")

    def sync(self) -> None:
        """Wait for the asynchronous fills and publish their slots."""
        if self._pending and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._poll(wait=True)

    def close(self) -> None:
        if self.recorder is not None:
            self.recorder.close()
            self.recorder = None

    # -- the split -------------------------------------------------------------------------
    def _publish(self, layer: int, expert: int, slot: int) -> None:
        """``(layer, expert)``'s slot holds the expert now: the split may compute from it."""
        if self._live[layer, expert] == NOT_RESIDENT:
            self._live_count[layer] += 1
        self._live[layer, expert] = slot
        self.residency[layer, expert] = slot  # a fill kernel on the current stream, no wait

    def _poll(self, wait: bool = False) -> None:
        """Publish the asynchronous fills that have finished (``ev.query()`` does not wait)."""
        for slot, (ev, layer, expert) in list(self._pending.items()):
            if wait or ev is None or ev.query():
                del self._pending[slot]
                self._publish(layer, expert, slot)

    def _slot_views(self, slot: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        v = self._views.get(slot)
        if v is None:
            h = self.host[layer]
            raw = self.cache.device_slot(slot)
            gu = raw[:h.gu_bytes].view(h.dtype).view(*h.shape_gu)
            dn = raw[h.gu_bytes:h.blob].view(h.dtype).view(*h.shape_dn)
            v = self._views[slot] = (gu, dn)
        return v

    def _rows(self, layer: int) -> tuple[torch.Tensor, int] | None:
        """The slots ``layer`` can occupy as one typed ``[n, stride]`` view of the arena (each row a
        slot: the gate_up then the down elements, then padding), and the first of those slots.
        Uniform slots: the whole arena. Per-layer sized slots: the layer's own range, whose slots
        all have the layer's size. None when the layer has no slot."""
        if layer in self._layer_rows:
            return self._layer_rows[layer]
        c, h = self.cache, self.host[layer]
        lo, hi = (0, c.slots) if c.uniform else c.layer_slot_range(layer)
        rows = None
        if hi > lo:
            strides = np.diff(c.off[lo:hi + 1])
            stride = int(strides[0])
            elem = torch.empty(0, dtype=h.dtype).element_size()
            if (strides != stride).any() or stride % elem or int(c.off[lo]) % elem or c.slot_bytes[lo] < h.blob:
                raise ExpertCacheError(f"layer {layer}'s slots {lo}..{hi - 1} are not of one size that holds "
                                       f"its {h.blob}-byte experts")
            typed = c.base.view(h.dtype)
            rows = (typed.as_strided((hi - lo, stride // elem), (stride // elem, 1), int(c.off[lo]) // elem), lo)
        self._layer_rows[layer] = rows
        return rows

    def _gather(self, layer: int, x: torch.Tensor, slot: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The routed sum for ``x`` ``[N, hidden]`` from the slots ``slot`` ``[N, top_k]`` (each a
        valid slot of the layer), weighted by ``weights``: the slots' weights gathered by index
        and two batched matmuls, all on the device, no host read, no loop over experts."""
        rows, lo = self._rows(layer)
        n, k = slot.shape
        chunk = max(1, self.gather_max_bytes // (k * rows.shape[1] * rows.element_size()))
        if n > chunk:  # bound the copies: a few token chunks (not a loop over experts)
            return torch.cat([self._gather(layer, x[i:i + chunk], slot[i:i + chunk], weights[i:i + chunk])
                              for i in range(0, n, chunk)])
        h = self.host[layer]
        local = slot.reshape(-1)
        if lo:
            local = local - lo
        blobs = rows.index_select(0, local)  # [N*k, stride]: each pick's expert, one copy
        gu_n, dn_n = h.shape_gu[0] * h.shape_gu[1], h.shape_dn[0] * h.shape_dn[1]
        gu = blobs[:, :gu_n].view(n * k, *h.shape_gu)  # [P, 2I, hidden]
        dn = blobs[:, gu_n:gu_n + dn_n].view(n * k, *h.shape_dn)  # [P, hidden, I]
        xr = x.unsqueeze(1).expand(n, k, x.shape[-1]).reshape(n * k, x.shape[-1], 1)
        gate, up = torch.bmm(gu, xr).squeeze(-1).chunk(2, dim=-1)
        y = torch.bmm(dn, (F.silu(gate) * up).unsqueeze(-1)).squeeze(-1)  # [P, hidden]
        y = y * weights.reshape(-1, 1)
        return y.view(n, k, -1).sum(dim=1).to(x.dtype)

    def _read(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """``tensors`` on the host after one wait for the device (counted in ``syncs``)."""
        self.syncs += 1
        if self.device.type != "cuda":
            return list(tensors)
        out = [t.to("cpu", non_blocking=True) for t in tensors]
        torch.cuda.current_stream(self.device).synchronize()
        return out

    def routed(self, layer: int, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
               experts: Any) -> torch.Tensor:
        """The routed experts' sum for ``x`` ``[N, hidden]`` (``index``/``weights`` ``[N, top_k]``).

        Every pick whose expert is resident is computed on the device from its slot; with all of
        the layer's experts resident (known on the host) that is all the layer does: no read from
        the device, routing never leaves it. Otherwise the device marks the picks that miss, one
        read brings those marks (and ``x``, ``weights``) to the host, the hits are queued on the
        device and the misses computed from the host copy meanwhile, and the two are added."""
        if self.recorder is not None:
            self.recorder.add(layer, index.cpu().numpy().astype(np.int16))
        n, k = index.shape
        if layer == self.layers[0]:
            self.tokens += n
            self.calls += 1
        if not self.offload:
            return experts(x, index, weights)
        if n == 0:
            return torch.zeros_like(x)
        if self._pending:
            self._poll()
        live = int(self._live_count[layer])
        if n * k > self.gather_max_picks:
            return self._routed_loop(layer, x, index, weights, live)
        if live == self.n_expert:  # every pick a hit: no read, stats from the shapes
            self.hits[layer] += n * k
            return self._gather(layer, x, self.residency[layer][index], weights)
        slot = self.residency[layer][index]  # [N, k] int32, NOT_RESIDENT for a miss
        hit = slot >= 0
        code = torch.where(hit, slot.to(index.dtype), -1 - index)  # a slot, or -1 - the missed expert
        code_h, xh, wh = self._read(code, x, weights)
        code_h = code_h.numpy()
        n_hit = int((code_h >= 0).sum())
        self.hits[layer] += n_hit
        self.misses[layer] += n * k - n_hit
        out = None
        if n_hit:  # queued before the host work, so the device computes the hits meanwhile
            safe = torch.where(hit, slot, self._rows(layer)[1])
            out = self._gather(layer, x, safe, torch.where(hit, weights, torch.zeros_like(weights)))
        if n_hit == n * k:
            return out
        acc = self._host_misses(layer, code_h, xh, wh, k)
        acc = acc.to(x.device, x.dtype)
        return acc if out is None else out + acc

    def _routed_loop(self, layer: int, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                     live: int) -> torch.Tensor:
        """A large batch (prefill): one read of every pick's slot, then one device computation per
        resident expert routed (as the plain MoE loops over its experts) and the misses on the host."""
        slot = self.residency[layer][index]
        code = torch.where(slot >= 0, slot.to(index.dtype), -1 - index)
        if live == self.n_expert:
            (code_h,), xh, wh = self._read(code), None, None
        else:
            code_h, xh, wh = self._read(code, x, weights)
        code_h = code_h.numpy()
        n, k = code_h.shape
        flat = code_h.reshape(-1)
        order = np.argsort(flat, kind="stable")
        sorted_code = flat[order]
        first_hit = int(np.searchsorted(sorted_code, 0))  # misses (negative codes) sort first
        n_hit = flat.size - first_hit
        self.hits[layer] += n_hit
        self.misses[layer] += flat.size - n_hit
        out = torch.zeros_like(x)
        if n_hit:
            hit_order = order[first_hit:]
            dev_order = torch.from_numpy(hit_order).to(x.device, non_blocking=True)
            dev_tok = dev_order // k
            w_sorted = weights.reshape(-1)[dev_order]
            slots, starts, counts = np.unique(sorted_code[first_hit:], return_index=True, return_counts=True)
            for s, start, c in zip(slots.tolist(), starts.tolist(), counts.tolist()):
                gu, dn = self._slot_views(s, layer)
                tok = dev_tok[start:start + c]
                gate, up = F.linear(x[tok], gu).chunk(2, dim=-1)
                y = F.linear(F.silu(gate) * up, dn) * w_sorted[start:start + c, None]
                out.index_add_(0, tok, y.to(out.dtype))
        if n_hit < flat.size:
            out = out + self._host_misses(layer, code_h, xh, wh, k).to(x.device, x.dtype)
        return out

    def _host_misses(self, layer: int, code: np.ndarray, xh: torch.Tensor, wh: torch.Tensor,
                     k: int) -> torch.Tensor:
        """The missed picks (negative ``code``: ``-1 - expert``) computed from the host copy, each
        missed expert read once for all its tokens; counts the bytes, admits under first-routed."""
        host = self.host[layer]
        flat = code.reshape(-1)
        pos = np.flatnonzero(flat < 0)
        miss_expert = -1 - flat[pos]
        order = np.argsort(miss_expert, kind="stable")
        pos, miss_expert = pos[order], miss_expert[order]
        experts, starts, counts = np.unique(miss_expert, return_index=True, return_counts=True)
        xh = xh.to("cpu", host.dtype)
        w = wh.reshape(-1).to("cpu")[torch.from_numpy(pos)]
        tok_all = torch.from_numpy(pos // k)
        acc = torch.zeros(xh.shape, dtype=host.dtype)
        for e, start, c in zip(experts.tolist(), starts.tolist(), counts.tolist()):
            tok = tok_all[start:start + c]
            gate, up = F.linear(xh[tok], host.gate_up[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, host.down[e]) * w[start:start + c, None]
            acc.index_add_(0, tok, y.to(acc.dtype))
        self.miss_calls += 1
        self.host_bytes += len(experts) * host.blob
        if self.admission != "profile":
            self._admit_misses(layer, experts.tolist())
        return acc

    def _admit_misses(self, layer: int, experts: list[int]) -> None:
        host = self.host[layer]
        for e in experts:
            if int(self.cache.table[layer, e]) != NOT_RESIDENT:
                continue
            slot = self.cache.admit(layer, e, host.blob)
            if slot == NOT_RESIDENT:
                if not self.cache.per_layer:
                    return
                break
            ev = self.cache.fill_slot(slot, host.packed[e], self._stream, host.blob)
            if ev is None:  # the copy is done (CPU)
                self._publish(layer, e, slot)
            else:  # published by _poll once the event has completed
                self._pending[slot] = (ev, layer, e)

    # -- stats -----------------------------------------------------------------------------
    def blob_bytes(self) -> int:
        return max((h.blob for h in self.host.values()), default=0)

    def stats(self) -> dict[str, Any]:
        picks = self.hits + self.misses
        per_layer = [float(h / p) if p else None for h, p in zip(self.hits.tolist(), picks.tolist())]
        total = int(picks.sum())
        c = self.cache
        return {
            "offload": self.offload, "admission": self.admission,
            "slots": c.slots if c else 0, "resident": c.resident if c else 0,
            "slot_bytes": c.bytes if c else 0, "fills": c.fills if c else 0,
            "expert_bytes": self.blob_bytes(),
            "hit_rate": (int(self.hits.sum()) / total) if total else None,
            "hit_rate_per_layer": per_layer,
            "tokens": self.tokens, "host_bytes": self.host_bytes,
            "host_bytes_per_token": (self.host_bytes / self.tokens) if self.tokens else None,
            "recording": self.recorder is not None,
            "syncs": self.syncs, "miss_calls": self.miss_calls,
        }

    def reset_stats(self) -> None:
        self.hits[:] = 0
        self.misses[:] = 0
        self.host_bytes = self.tokens = self.calls = 0
        self.syncs = self.miss_calls = 0


def expert_stats(model: Any) -> dict[str, Any] | None:
    """The expert tier's stats for the engine's snapshot (None when no tier is attached)."""
    tier = getattr(model, "expert_tier", None)
    return tier.stats() if tier is not None else None


def resolve_slots(model: Any, experts: Any, profile: Any = None) -> int:
    """Slots from ``budget_slots``, else ``budget_mib`` over the expert size, else the profile's."""
    cfg = model.config
    elem = torch.finfo(model.dtype).bits // 8
    blob = 3 * cfg.hidden_size * cfg.moe_intermediate_size * elem
    most = cfg.num_hidden_layers * cfg.num_experts
    if experts.budget_slots is not None:
        return min(int(experts.budget_slots), most)
    if experts.budget_mib is not None:
        return min(int(experts.budget_mib) * MiB // _align(blob), most)
    if profile is not None:
        return min(int(profile.slots), most)
    raise ConfigError("experts.offload needs a budget: set experts.budget_slots or experts.budget_mib",
                      hint="or use admission 'profile' with a profile file, whose slot count is the default")


def attach_expert_tier(model: Any, settings: Any, *, free_bytes: int | None = None) -> ExpertTier | None:
    """Attach the tier ``settings`` (an ``HpcSettings`` or its ``[experts]`` section) asks for.

    Called by the engine after its KV pools are sized, so the slot budget is checked against
    the device memory that is actually free then. Returns None when neither offload nor trace
    recording is on."""
    experts = getattr(settings, "experts", settings)
    if not (experts.offload or experts.trace_file is not None):
        return None
    if not model.config.is_moe:
        raise ConfigError(f"[experts] is set but {model.config.name!r} is a dense model",
                          hint="the expert tier and routing traces need a qwen3_5_moe checkpoint")
    profile = None
    if experts.offload and experts.admission == "profile":
        from hpc_cli.model.expert_profile import read_profile

        if experts.profile_file is None:
            raise ConfigError("experts.admission = 'profile' needs experts.profile_file",
                              hint="build one with `hpc-cli expert profile TRACES --slots N -o profile.bin`, "
                                   "or choose admission 'per-layer-first-routed'")
        profile = read_profile(experts.profile_file, model.config.num_hidden_layers, model.config.num_experts)
    slots = resolve_slots(model, experts, profile) if experts.offload else 0
    return ExpertTier(model, slots=slots, admission=experts.admission, profile=profile, offload=experts.offload,
                      verify=experts.verify, trace_file=experts.trace_file, free_bytes=free_bytes)
