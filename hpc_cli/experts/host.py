"""The expert tier's host copy: each MoE layer's routed experts in (pinned) host memory, packed
``[E, blob]`` (what slots are filled from) with typed views (what misses are computed from), taken
off the model so the host copy is the experts from then on."""

from __future__ import annotations

from typing import Any

import torch

from hpc_cli.errors import EngineError


class HostLayer:
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


def packed_of(ex: Any) -> torch.Tensor | None:
    """The packed host array ``ex``'s expert parameters are views of (``offload_experts``), or None."""
    packed = getattr(ex, "host_packed", None)
    if packed is None:
        return None
    base = packed.untyped_storage().data_ptr()
    if all(t.device.type == "cpu" and t.untyped_storage().data_ptr() == base
           for t in (ex.gate_up_proj, ex.down_proj)):
        return packed
    return None


def take_experts(model: Any, layers: list[int], pin: bool) -> dict[int, HostLayer]:
    """The host copies of ``layers``' routed experts; the model's references to them go.

    Built with ``offload_experts``: the host array the parameters are views of is adopted; else
    the device experts are copied to the host."""
    host = {}
    for i in layers:
        ex = model.layers[i].mlp.experts
        host[i] = HostLayer(ex.gate_up_proj.data, ex.down_proj.data, pin, packed=packed_of(ex))
        ex.gate_up_proj = None  # the model's references go: the host copy is the experts now
        ex.down_proj = None
        ex.host_packed = None
    return host
