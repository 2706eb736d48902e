"""DMA planning of the transfer engine's jobs (spec §6.4-6.5, §7.4, §7.6-7.7): the ``(page,
slab)`` pairs of a batch are grouped by :func:`~hpc_cli.memory.slab_runs.plan_runs` and every
run moves as ONE copy per (layer, plane); image parts move as one copy per part piece (pieces
split only where the image crosses into a non-adjacent slab).

A restore is planned in the order a forward pass reads it, as *stages*:

* stage 0, the prelude: the snapshot tail bundle (every main layer and the backend page), every
  restored block's backend page and main layers that are not model layers (MTP's extra layer),
  and the image's continuation hidden and backend parts;
* stage ``i + 1`` for model layer ``i`` of ``layer_order``: an attention layer's KV planes of every
  restored block, or a GDN layer's conv and recurrent state;

with a :class:`~hpc_cli.memory.transfer.records.Mark` after each stage that copied something. A
write-through is one stage: blocks and tails in runs, then images.
"""

from __future__ import annotations

from typing import Sequence

import torch

from hpc_cli.memory.bundle import BundleLayout
from hpc_cli.memory.host_slabs import HostSlabStorage
from hpc_cli.memory.slab_runs import DEFAULT_MAX_PITCH, Run, plan_runs
from hpc_cli.memory.kv_pool import PagedKVStorage
from hpc_cli.memory.state_pool import StateSlots
from hpc_cli.memory.transfer.records import BlockRef, CopyOp, ImageRef, Mark, RestoreBatch


def layer_order_for_shape(shape) -> list[tuple[str, int]]:
    """Model layers in forward order as ``("attn", a)`` / ``("gdn", g)`` with per-kind indices."""
    out, a, g = [], 0, 0
    for i in range(shape.num_layers):
        if (i + 1) % shape.full_attention_interval == 0:
            out.append(("attn", a))
            a += 1
        else:
            out.append(("gdn", g))
            g += 1
    return out


class TransferPlanner:
    """The DMA plan of restores and write-through between device pools/state slots and host slabs.

    ``main``: the main KV pool's storage; ``backend``: a backend's own pool (DFlash) or None;
    ``state``: the state slots (images) or None; ``layer_order``: model layers in forward order
    (:func:`layer_order_for_shape`), default all attention layers then all GDN layers; main KV
    layers not named there (MTP's extra layer) are copied in the prelude.
    """

    def __init__(self, main: PagedKVStorage, host: HostSlabStorage, *, state: StateSlots | None = None,
                 backend: PagedKVStorage | None = None,
                 layer_order: Sequence[tuple[str, int]] | None = None) -> None:
        self.main = main
        self.backend = backend
        self.state = state
        self.host = host
        self.layout = BundleLayout.for_storage(main, backend)
        assert self.layout.slab_bytes <= host.slab_bytes, \
            f"bundle of {self.layout.slab_bytes} B does not fit a {host.slab_bytes} B slab"
        n_gdn = state.num_gdn_layers if state is not None else 0
        if layer_order is None:
            layer_order = [("attn", a) for a in range(main.num_layers)] + [("gdn", g) for g in range(n_gdn)]
        self.layer_order = list(layer_order)
        for kind, idx in self.layer_order:
            assert (kind == "attn" and 0 <= idx < main.num_layers) or (kind == "gdn" and 0 <= idx < n_gdn), \
                f"layer_order names {kind} {idx}, which this engine does not hold"
        named = {idx for kind, idx in self.layer_order if kind == "attn"}
        self.prelude_main_layers = [a for a in range(main.num_layers) if a not in named]
        self.device = main.device
        # flat byte views the copies address: per layer per plane, per image part
        self._main_bases = [[p.view(-1) for p in layer] for layer in main.planes]
        self._back_bases = [[p.view(-1) for p in layer] for layer in backend.planes] if backend else []
        self._image_groups: dict[int | None, list[tuple[str, torch.Tensor, int, int]]] = {}
        if state is not None:
            off = 0
            for name, g, part in state.image_parts():
                assert part.is_contiguous(), f"state part {name} must be contiguous"
                slot_bytes = part[0].numel() * part.element_size()
                base = part.reshape(-1).view(torch.uint8)
                self._image_groups.setdefault(g, []).append((name, base, slot_bytes, off))
                off += slot_bytes
            assert off == state.image_bytes, f"image parts sum to {off} B, image_bytes is {state.image_bytes}"
        self._image_slabs = -(-state.image_bytes // host.slab_bytes) if state is not None else 0
        #: the longest pitch one 2D copy takes (the engine reads the device's limit)
        self.max_pitch = DEFAULT_MAX_PITCH

    def _runs(self, pairs: list[tuple[int, int]], pool: PagedKVStorage) -> list[Run]:
        return plan_runs(pairs, slab_bytes=self.host.slab_bytes, slabs_per_chunk=self.host.slabs_per_chunk,
                         page_bytes=max(pool.plane_page_bytes), max_pitch=self.max_pitch)

    def _kv_ops(self, runs: list[Run], pool: PagedKVStorage, backend: bool, layer: int, stage: int,
                to_host: bool, out: list) -> None:
        ppbs = pool.plane_page_bytes
        bases = (self._back_bases if backend else self._main_bases)[layer]
        host = self.host
        sb, spc = host.slab_bytes, host.slabs_per_chunk
        for r in runs:
            last_page = r.page0 + (r.count - 1) * r.page_stride
            last_slab = r.slab0 + (r.count - 1) * r.slab_stride
            assert 0 <= r.page0 and last_page < pool.num_pages, \
                f"pool {pool.name}: pages {r.page0}..{last_page} outside 0..{pool.num_pages - 1}"
            assert 0 <= r.slab0 and last_slab < host.num_slabs, \
                f"slabs {r.slab0}..{last_slab} outside 0..{host.num_slabs - 1}"
            c = r.slab0 // spc
            assert last_slab // spc == c, f"run of slabs {r.slab0}..{last_slab} crosses a chunk"
            chunk = host.chunks[c]
            hoff0 = (r.slab0 % spc) * sb
            hpitch = r.slab_stride * sb
            for j, dev in enumerate(bases):
                ppb = ppbs[j]
                hoff = hoff0 + (self.layout.backend_plane_offset(layer, j) if backend
                                else self.layout.main_offset(layer, j))
                what = ("backend" if backend else "main", f"L{layer}", pool.layout.planes[j].name,
                        f"p{r.page0}x{r.count}")
                doff, dpitch = r.page0 * ppb, r.page_stride * ppb
                if to_host:
                    out.append(CopyOp(chunk, hoff, hpitch, dev, doff, dpitch, ppb, r.count, stage, what))
                else:
                    out.append(CopyOp(dev, doff, dpitch, chunk, hoff, hpitch, ppb, r.count, stage, what))

    def _image_ops(self, slot: int, slabs: Sequence[int], gdn: int | None, stage: int, to_host: bool,
                   out: list) -> None:
        assert self.state is not None, "this engine holds no state slots"
        assert 0 <= slot < self.state.num_slots, f"state slot {slot} outside 0..{self.state.num_slots - 1}"
        need = self._image_slabs
        assert len(slabs) >= need, f"image of {self.state.image_bytes} B needs {need} slabs, got {len(slabs)}"
        chunks = self.host.chunks
        for name, base, slot_bytes, off in self._image_groups.get(gdn, ()):
            dbase = slot * slot_bytes
            for c, hoff, n, o in self.host.image_extents(slabs, off, slot_bytes):
                doff = dbase + o - off
                what = ("image", name, f"slot{slot}", f"@{o}")
                if to_host:
                    out.append(CopyOp(chunks[c], hoff, n, base, doff, n, n, 1, stage, what))
                else:
                    out.append(CopyOp(base, doff, n, chunks[c], hoff, n, n, 1, stage, what))

    def _split(self, blocks: Sequence[BlockRef]) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        main = [(b[0], b[1]) for b in blocks]
        back = [(b[2] if len(b) > 2 else b[0], b[1]) for b in blocks]
        return main, back

    def plan_restore(self, batch: RestoreBatch) -> list[CopyOp | Mark]:
        """The copies and marks of a restore batch, in forward-pass order (see module doc)."""
        items: list[CopyOp | Mark] = []
        main_pairs, back_pairs = self._split(batch.blocks)
        main_runs = self._runs(main_pairs, self.main) if main_pairs else []
        # stage 0: the prelude
        if batch.tail is not None:
            (tm, tb) = self._split([batch.tail])
            truns = self._runs(tm, self.main)
            for layer in range(self.main.num_layers):
                self._kv_ops(truns, self.main, False, layer, 0, False, items)
            if self.backend is not None:
                bruns = self._runs(tb, self.backend)
                for layer in range(self.backend.num_layers):
                    self._kv_ops(bruns, self.backend, True, layer, 0, False, items)
        if self.backend is not None and back_pairs:
            bruns = self._runs(back_pairs, self.backend)
            for layer in range(self.backend.num_layers):
                self._kv_ops(bruns, self.backend, True, layer, 0, False, items)
        for layer in self.prelude_main_layers:
            self._kv_ops(main_runs, self.main, False, layer, 0, False, items)
        if batch.image is not None:
            self._image_ops(batch.image[0], batch.image[1], None, 0, False, items)
        if items:
            items.append(Mark(0))
        # stages 1..: one per model layer
        for i, (kind, idx) in enumerate(self.layer_order):
            n = len(items)
            if kind == "attn":
                self._kv_ops(main_runs, self.main, False, idx, i + 1, False, items)
            elif batch.image is not None:
                self._image_ops(batch.image[0], batch.image[1], idx, i + 1, False, items)
            if len(items) > n:
                items.append(Mark(i + 1))
        return items

    def plan_write(self, blocks: Sequence[BlockRef] = (), images: Sequence[ImageRef] = (),
                   tails: Sequence[BlockRef] = ()) -> list[CopyOp | Mark]:
        """The copies of a write-through batch (blocks and tails in runs, then images)."""
        items: list[CopyOp | Mark] = []
        main_pairs, back_pairs = self._split([*blocks, *tails])
        if main_pairs:
            runs = self._runs(main_pairs, self.main)
            for layer in range(self.main.num_layers):
                self._kv_ops(runs, self.main, False, layer, 0, True, items)
            if self.backend is not None:
                bruns = self._runs(back_pairs, self.backend)
                for layer in range(self.backend.num_layers):
                    self._kv_ops(bruns, self.backend, True, layer, 0, True, items)
        for slot, slabs in images:
            self._image_ops(slot, slabs, None, 0, True, items)
            for g in range(self.state.num_gdn_layers if self.state is not None else 0):
                self._image_ops(slot, slabs, g, 0, True, items)
        items.append(Mark(0))
        return items
