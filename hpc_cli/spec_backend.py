"""The speculative backend contract (spec §3.1-3.2, §7.3 items 4-5, §7.4, §7.6-7.7).

A backend names itself and declares what it adds to the cache: more layers of pages in the
main block bundle (MTP), a pool of its own (DFlash's BF16 KV), parts of the state image
(DFlash2's local rings), and how far its committed frontier lags the text frontier.
The behaviour half (a drafter per model, see the comment above :class:`SpecBackend`) is driven by
the engine's :class:`hpc_cli.speculative.SpecRuntime`, which verifies, accepts and rolls back.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpc_cli.shapes import HybridShape


@dataclass(frozen=True, slots=True)
class BackendPoolSpec:
    """A backend's own paged KV pool (always BF16): its layers, KV heads and head dim."""

    layers: int
    kv_heads: int
    head_dim: int

    def bytes_per_token(self) -> int:
        return self.layers * self.kv_heads * self.head_dim * 2 * 2  # K and V, bf16


# Behaviour (docs/speculative.md). A backend builds a *drafter* for a model; the engine's
# :class:`hpc_cli.speculative.SpecRuntime` drives it. A drafter has:
#
#   name: str
#   capture: tuple[int, ...]       model layers whose residual stream the main passes return
#                                  (DFlash features); () for none
#   needs_hidden: bool              whether main passes return every position's final hidden (MTP)
#   bind(storage, backend_storage, states)     the engine's pools (main, own pool or None, slots)
#   admitted(lane)                  set lane.backend_frontier after admission (a resume: the bridge)
#   observe(lane, start, n, hidden, features, pre_hidden, *, extend)
#                                   the main model processed and committed [start, start+n): keep
#                                   the backend's own state (MTP K/V, DFlash K/V, DFlash2 rings) up to
#                                   date; pre_hidden is the slot's hidden before the pass (h[start-1])
#   propose(lanes, k, states) -> list[list[int]]   k drafts per lane following lane.next_token
#   propose_device(lanes, k, states) -> Tensor   optional: the drafts [B, k] left on the device
#                                   (the verify pass reads them there; the host reads them with
#                                   its verdicts, one wait a round)
#   catches_up_columns: bool, catch_up_columns(out, accepted), columns_behind: int   optional:
#                                   the catch-up of a round's committed positions on the device,
#                                   from the verify pass's outputs and index, capturable (captured
#                                   with the round's commit: hpc_cli/speculative/round_tail.py);
#                                   after it the lane's backend_frontier is its committed length
#                                   less columns_behind (MTP 1, DFlash 0)
#   warm(batches, widths, k, states, num_pages, max_model_len) -> int   optional: compile and
#                                   capture the drafter's own shapes at the engine's warm-up (MTP's
#                                   k steps, DFlash's block forward, in a CUDA graph per lanes x
#                                   table width x k); returns the shapes warmed
#   pool_spec() -> BackendPoolSpec | None, state_parts() -> dict   optional: the drafter's own pool
#                                   and state image parts, sized after its checkpoint (a DFlash
#                                   drafter of any depth); without them SpecRuntime.pool_spec and
#                                   state_parts take the backend's backend_pool(shape) and
#                                   state_extra_parts(model), which also size the memory plans
#                                   before a drafter is built
#
# Verification, acceptance and the rollback of the GDN state are the runtime's (the same for
# every backend): hpc_cli/speculative/runtime.py and ops.py.
class SpecBackend:
    name: str = ""
    aliases: tuple[str, ...] = ()
    description: str = ""
    #: tokens by which the backend's committed frontier trails the text frontier (MTP: 1)
    frontier_lag: int = 0
    #: attention layers of pages the backend adds to the main pool's bundle (MTP: 1)
    extra_main_kv_layers: int = 0

    def backend_pool(self, shape: HybridShape) -> BackendPoolSpec | None:
        """The backend's own pool, or None."""
        return None

    def state_image_extra_bytes(self, shape: HybridShape) -> int:
        """Bytes the backend adds to every state image (snapshots carry them)."""
        return 0

    def cache_summary(self, shape: HybridShape) -> str:
        parts = []
        if self.extra_main_kv_layers:
            parts.append(f"+{self.extra_main_kv_layers} layer(s) of pages in the main bundle")
        if self.frontier_lag:
            parts.append(f"committed frontier {self.frontier_lag} token(s) behind")
        pool = self.backend_pool(shape)
        if pool:
            parts.append(f"own BF16 pool ({pool.layers} layers x {pool.kv_heads} KV heads x {pool.head_dim})")
        extra = self.state_image_extra_bytes(shape)
        if extra:
            parts.append(f"+{extra / (1 << 20):.1f} MiB in the state image")
        return "; ".join(parts) or "adds nothing to the cache"

    # -- behaviour (docs/speculative.md) -----------------------------------------------------
    @property
    def drafts(self) -> bool:
        """Whether decode rounds propose and verify drafts (``none`` does not)."""
        return self.name != "none"

    def state_extra_parts(self, model) -> dict:
        """StateSlots ``extra_parts`` (name -> (shape, dtype)) this backend adds to every image."""
        return {}

    def build_drafter(self, model, path: str | None = None, seed: int | None = None):
        """The drafter for ``model``: from ``path`` (``speculative.drafter``), or seeded for builtins."""
        raise NotImplementedError(f"speculative backend {self.name!r} does not draft")

    def __repr__(self) -> str:
        return f"<SpecBackend {self.name}>"

