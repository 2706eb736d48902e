"""Built-in speculative backends: none, mtp, dflash, dflash2 (spec §3.1-3.2)."""

from __future__ import annotations

import hpc_cli
from hpc_cli.shapes import HybridShape
from hpc_cli.spec_backend import BackendPoolSpec, SpecBackend


class NoSpeculation(SpecBackend):
    name = "none"
    aliases = ("off",)
    description = "plain decoding, one token per round"


class MTPBackend(SpecBackend):
    name = "mtp"
    description = "the checkpoint's multi-token-prediction head drafts k tokens"
    frontier_lag = 1
    extra_main_kv_layers = 1


def _drafter_layers(shape: HybridShape) -> int:
    return max(1, min(5, shape.num_layers // 8))


class DFlashBackend(SpecBackend):
    name = "dflash"
    description = "block-diffusion drafter over target hidden features, with its own BF16 KV pool"

    def backend_pool(self, shape: HybridShape) -> BackendPoolSpec:
        return BackendPoolSpec(layers=_drafter_layers(shape), kv_heads=shape.num_kv_heads,
                               head_dim=shape.head_dim)


class DFlash2Backend(SpecBackend):
    name = "dflash2"
    description = "DFlash2 drafter: sliding-window layers whose local context rings live in the state image"
    ring_window = 2048

    def ring_geometry(self, shape: HybridShape) -> tuple[int, int, int, int]:
        """(layers, window, kv heads, head dim) of the local rings; 5 x 2048 x 8 x 128 for 27B (40 MiB)."""
        return _drafter_layers(shape), self.ring_window, 2 * shape.num_kv_heads, shape.head_dim // 2

    def state_image_extra_bytes(self, shape: HybridShape) -> int:
        layers, window, heads, dim = self.ring_geometry(shape)
        return layers * window * heads * dim * 2 * 2  # K and V, bf16


@hpc_cli.hookimpl
def hpc_register_spec_backends(register):
    for cls in (NoSpeculation, MTPBackend, DFlashBackend, DFlash2Backend):
        register(cls())
