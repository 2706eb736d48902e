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

    def build_drafter(self, model, path=None, seed=None):
        """The checkpoint's own mtp.* head (builtin models carry a seeded one); ``path`` unused."""
        from hpc_cli.speculative.mtp import MTPDrafter

        return MTPDrafter(model)


def _drafter_layers(shape: HybridShape) -> int:
    return max(1, min(5, shape.num_layers // 8))


DRAFTER_SEED = 20250611


def _build_block_drafter(backend, kind: str, model, path, seed, **kw):
    from hpc_cli.errors import ConfigError
    from hpc_cli.speculative.dflash import DFlashDrafter, DFlashNet, default_config, load_drafter, seed_weights

    source = path
    if not path and str(model.config.name) == "builtin:tiny":
        from hpc_cli.model.builtin import TINY_DIR

        path = str(TINY_DIR / kind)  # the embedded model's trained drafters
        source = f"builtin:tiny/{kind}"
    if path:
        net = load_drafter(path, kind, model.device, model.dtype)
    elif str(model.config.name).startswith("builtin:"):
        net = DFlashNet(default_config(kind, model, _drafter_layers(model.shape()), **kw), device=model.device,
                        dtype=model.dtype)
        seed = DRAFTER_SEED if seed is None else seed
        seed_weights(net, seed)
        net.eval()
    else:
        raise ConfigError(f"speculative.backend {kind!r} needs a drafter checkpoint for {model.config.name}",
                          hint="set speculative.drafter to the drafter's directory")
    drafter = DFlashDrafter(model, net)  # its pool and rings are sized after it (DFlashDrafter.pool_spec)
    drafter.source = source if path else f"seeded:{seed}"
    return drafter


class DFlashBackend(SpecBackend):
    name = "dflash"
    description = "block-diffusion drafter over target hidden features, with its own BF16 KV pool"

    def backend_pool(self, shape: HybridShape) -> BackendPoolSpec:
        return BackendPoolSpec(layers=_drafter_layers(shape), kv_heads=shape.num_kv_heads,
                               head_dim=shape.head_dim)

    def build_drafter(self, model, path=None, seed=None):
        return _build_block_drafter(self, "dflash", model, path, seed)


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

    def state_extra_parts(self, model) -> dict:
        from hpc_cli.speculative.dflash import ring_parts  # lazily: listing plugins must not import torch

        return ring_parts(*self.ring_geometry(model.shape()))

    def build_drafter(self, model, path=None, seed=None):
        return _build_block_drafter(self, "dflash2", model, path, seed, window=self.ring_window)


@hpc_cli.hookimpl
def hpc_register_spec_backends(register):
    for cls in (NoSpeculation, MTPBackend, DFlashBackend, DFlash2Backend):
        register(cls())
