"""Recurrent-state slots (spec §5.4, ARCHITECTURE.md §5).

One slot-indexed layout per GDN layer: a conv window ``[slots, conv_dim, kernel-1]`` in the
model dtype and a recurrent state ``[slots, H_v, d_k, d_v]`` in fp32; plus the continuation
hidden ``[slots, hidden]`` and the speculative backend's parts (DFlash2's local rings), each
``[slots, ...]``. Slots ``0..C-1`` serve active lanes, the rest hold snapshots (the cache
binding keeps the lanes' free slots; the index hands out the snapshot slots).

The per-layer tensors are views of two stacked tensors (``conv_all [L, slots, ...]``,
``recurrent_all [L, slots, ...]``), so copying one whole image between slots (a tap) is one
strided copy per stacked tensor plus the hidden and backend parts: a handful of device copies
instead of one per layer. Each per-layer view is contiguous, as before.

A state image's *packed* form (what host slabs hold) is :meth:`image_parts` back to back: per
GDN layer conv then recurrent, then the hidden, then the backend parts.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from hpc_cli.memory.cudart import load_cudart


class StateSlots:
    def __init__(self, num_gdn_layers: int, conv_dim: int, conv_width: int, num_v_heads: int,
                 key_head_dim: int, value_head_dim: int, hidden_size: int, num_slots: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 extra_parts: Mapping[str, tuple[Sequence[int], torch.dtype]] | None = None) -> None:
        self.num_slots = num_slots
        self.num_gdn_layers = num_gdn_layers
        self.device = torch.device(device)
        self.dtype = dtype
        self.conv_all = torch.zeros(num_gdn_layers, num_slots, conv_dim, conv_width, dtype=dtype,
                                    device=self.device)
        self.recurrent_all = torch.zeros(num_gdn_layers, num_slots, num_v_heads, key_head_dim,
                                         value_head_dim, dtype=torch.float32, device=self.device)
        self.conv: list[torch.Tensor] = list(self.conv_all.unbind(0))
        self.recurrent: list[torch.Tensor] = list(self.recurrent_all.unbind(0))
        self.hidden = torch.zeros(num_slots, hidden_size, dtype=dtype, device=self.device)
        #: backend parts (e.g. DFlash2 rings), name -> [slots, *shape]
        self.extra: dict[str, torch.Tensor] = {
            name: torch.zeros(num_slots, *shape, dtype=dt, device=self.device)
            for name, (shape, dt) in (extra_parts or {}).items()}
        self._image_bytes: int | None = None
        #: how copy_slot moves an image when not told (None: decided at the first tap, see there)
        self.tap_method: str | None = None

    def parts(self) -> list[torch.Tensor]:
        """Every slot-indexed tensor in image order: conv, recurrent per layer, hidden, backend parts."""
        out: list[torch.Tensor] = []
        for conv, rec in zip(self.conv, self.recurrent):
            out += [conv, rec]
        out.append(self.hidden)
        out += list(self.extra.values())
        return out

    def image_parts(self) -> list[tuple[str, int | None, torch.Tensor]]:
        """``(name, gdn_layer or None, tensor)`` in packed image order; ``None`` marks the parts
        a restore copies in its prelude (hidden and backend parts)."""
        out: list[tuple[str, int | None, torch.Tensor]] = []
        for g, (conv, rec) in enumerate(zip(self.conv, self.recurrent)):
            out += [(f"conv{g}", g, conv), (f"recurrent{g}", g, rec)]
        out.append(("hidden", None, self.hidden))
        out += [(name, None, t) for name, t in self.extra.items()]
        return out

    @property
    def image_bytes(self) -> int:
        """Bytes of one packed image (computed once: the shapes are fixed)."""
        if self._image_bytes is None:
            self._image_bytes = sum(t[0].numel() * t.element_size() for t in self.parts())
        return self._image_bytes

    def slot_bytes(self, part: torch.Tensor, slot: int) -> torch.Tensor:
        """One slot of a part as flat bytes (a view)."""
        return part[slot].reshape(-1).view(torch.uint8)

    def reset(self, slot: int) -> None:
        self.conv_all[:, slot].zero_()
        self.recurrent_all[:, slot].zero_()
        self.hidden[slot].zero_()
        for t in self.extra.values():
            t[slot].zero_()

    def copy_slot(self, src: int, dst: int, method: str | None = None) -> None:
        """Copy one whole image (a tap, or a resume from a snapshot slot) on the current stream.

        ``method``: ``"kernel"`` (CUDA with Triton): one launch of the segment copy kernel
        (``hpc_kernels.seg_copy``) over a row table of every part's slot-0 bytes kept on the
        device, with the two slots as launch arguments; ``"torch"``: one strided torch copy per
        stacked tensor plus one per other part; ``"memcpy2d"`` (CUDA with cuda-python): a 2-D
        device memcpy per stacked tensor (rows = GDN layers); ``"per_layer"``: one contiguous copy
        per part. None: ``"kernel"`` on CUDA when the kernel's startup probe passes, unless
        ``HPC_TRANSFER_COPY=dma``, else ``"torch"`` (chosen once per pool, kept in ``tap_method``,
        which an owner may set first). On an H200 a 187 MiB image took 0.10 ms with the kernel,
        0.14 ms with torch, 0.21 ms with memcpy2d, 0.35 ms per layer."""
        if src == dst:
            return
        if method is None:
            method = self._default_tap_method()
        if method == "kernel":
            from hpc_kernels import seg_copy

            assert 0 <= src < self.num_slots and 0 <= dst < self.num_slots, \
                f"tap {src} -> {dst} outside slots 0..{self.num_slots - 1}"
            table, n_wide = self._tap_table()
            with torch.cuda.device(self.device):
                seg_copy.launch(table, n_wide, src, dst)
            return
        if method == "memcpy2d":
            rt = load_cudart()
            assert rt is not None and self.device.type == "cuda", "memcpy2d needs CUDA and cuda-python"
            stream = torch.cuda.current_stream(self.device).cuda_stream
            kind = rt.cudaMemcpyKind.cudaMemcpyDeviceToDevice
            for t in (self.conv_all, self.recurrent_all):
                if t.numel():
                    w = t[0, 0].numel() * t.element_size()
                    pitch = t.shape[1] * w
                    (err,) = rt.cudaMemcpy2DAsync(t.data_ptr() + dst * w, pitch, t.data_ptr() + src * w, pitch,
                                                  w, t.shape[0], kind, stream)
                    assert int(err) == 0, f"state tap copy failed: CUDA error {err}"
            for t in (self.hidden, *self.extra.values()):
                w = t[0].numel() * t.element_size()
                (err,) = rt.cudaMemcpyAsync(t.data_ptr() + dst * w, t.data_ptr() + src * w, w, kind, stream)
                assert int(err) == 0, f"state tap copy failed: CUDA error {err}"
        elif method == "per_layer":
            for t in self.parts():
                t[dst].copy_(t[src])
        else:
            for t in (self.conv_all, self.recurrent_all):
                if t.numel():
                    t[:, dst].copy_(t[:, src])
            self.hidden[dst].copy_(self.hidden[src])
            for t in self.extra.values():
                t[dst].copy_(t[src])

    def _default_tap_method(self) -> str:
        if self.tap_method is None:  # decided once per pool
            import os

            method = "torch"
            if self.device.type == "cuda" and os.environ.get("HPC_TRANSFER_COPY", "").strip().lower() != "dma":
                from hpc_kernels import seg_copy

                method = "kernel" if seg_copy.probe(self.device) is None else "torch"
            self.tap_method = method
        return self.tap_method

    def tap_segments(self) -> tuple[list[int], list[int]]:
        """``(slot-0 addresses, slot bytes)`` of every slot-indexed piece: one per GDN layer of
        each stacked tensor, one per other part; slot ``s`` of a piece starts at ``address + s *
        bytes`` (what a kernel tap copies)."""
        addrs, widths = [], []
        for t in (self.conv_all, self.recurrent_all):
            assert t.is_contiguous(), "stacked state tensors must be contiguous"
            w = t[0, 0].numel() * t.element_size() if t.shape[0] else 0
            for layer in range(t.shape[0]):
                addrs.append(t.data_ptr() + layer * self.num_slots * w)
                widths.append(w)
        for t in (self.hidden, *self.extra.values()):
            assert t.is_contiguous(), "state parts must be contiguous"
            addrs.append(t.data_ptr())
            widths.append(t[0].numel() * t.element_size())
        return addrs, widths

    def _tap_table(self) -> tuple[torch.Tensor, int]:
        """The tap's row table on the device, built once (one small blocking upload)."""
        rows = getattr(self, "_tap_rows", None)
        if rows is None:
            from hpc_kernels import seg_copy

            addrs, widths = self.tap_segments()
            table, n_wide = seg_copy.plan_rows(addrs, addrs, widths, stride=widths)
            rows = self._tap_rows = (torch.from_numpy(table).to(self.device), n_wide)
        return rows
