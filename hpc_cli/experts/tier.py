"""The expert tier (``shared/spec/expert-cache.hpp``, R4): a Qwen3.5-MoE model's routed experts in
(pinned) host memory and an :class:`~hpc_cli.experts.cache.ExpertCache` of device slots holding
some of them, filled at startup from a profile or as experts are first routed; its stats.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hpc_cli.errors import ConfigError, EngineError
from hpc_cli.experts.cache import NOT_RESIDENT, ExpertCache, MiB
from hpc_cli.experts.hook import hook_model, moe_layers
from hpc_cli.experts.host import HostLayer, take_experts
from hpc_cli.experts.split import ExpertSplit
from hpc_cli.experts.trace import Recorder

#: admission policies: ``profile`` (the top pairs of an STRP file, filled and optionally verified
#: at startup), ``first-routed`` (the first distinct pairs routed, one counter for all layers)
#: and ``per-layer-first-routed`` (each layer its own range of slots)
POLICIES = ("profile", "first-routed", "per-layer-first-routed")


@dataclass(frozen=True, slots=True)
class ExpertTierStats:
    """The tier's figures (:meth:`ExpertTier.stats`); its JSON is ``experts`` of the engine's
    stats."""

    offload: bool
    admission: str
    slots: int
    resident: int  # slots holding an expert
    slot_bytes: int
    fills: int
    expert_bytes: int  # one expert's bytes (the largest layer's)
    hit_rate: float | None  # routed picks served from a device slot (None: no pick yet)
    hit_rate_per_layer: list[float | None]
    tokens: int
    host_bytes: int  # bytes the misses read on the host
    host_bytes_per_token: float | None
    recording: bool  # a routing trace is being written
    syncs: int
    miss_calls: int


class ExpertTier(ExpertSplit):
    """The split MoE: host experts, device slots, admission, stats (and routing traces).

    Built on a model, it takes the routed experts of every MoE layer to the host (``offload``),
    fills slots by the admission policy and hooks the layers (:func:`~hpc_cli.experts.hook.hook_model`)
    so their routed experts run through :meth:`~hpc_cli.experts.split.ExpertSplit.routed`."""

    def __init__(self, model: Any, *, slots: int = 0, admission: str = "profile", profile: Any = None,
                 offload: bool = True, verify: bool = False, trace_file: str | os.PathLike | None = None,
                 free_bytes: int | None = None, pin: bool | None = None) -> None:
        if admission not in POLICIES:
            raise ConfigError(f"unknown expert admission policy {admission!r}",
                              hint=f"choose one of: {', '.join(POLICIES)}")
        cfg = model.config
        self.model = model
        self.device = torch.device(model.device)
        self.layers = moe_layers(model)
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
        self.host: dict[int, HostLayer] = {}
        self._views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._layer_rows: dict[int, tuple[torch.Tensor, int] | None] = {}
        self._pending: dict[int, tuple[Any, int, int]] = {}  # slot -> (fill event, layer, expert)
        self._stream = None
        #: the residency the split computes with (see :class:`ExpertSplit`)
        self.residency: torch.Tensor | None = None
        self._live = np.zeros((0, 0), dtype=np.int32)
        self._live_count = np.zeros(self.n_layers, dtype=np.int64)
        self.recorder: Recorder | None = None
        if trace_file is not None:
            self.recorder = Recorder(Path(trace_file), self.layers, self.n_expert, self.top_k)
        if offload:
            pin = (self.device.type == "cuda") if pin is None else pin
            self.host = take_experts(model, self.layers, pin)
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
        hook_model(model, self)

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

    # -- stats -----------------------------------------------------------------------------
    def blob_bytes(self) -> int:
        return max((h.blob for h in self.host.values()), default=0)

    def stats(self) -> ExpertTierStats:
        picks = self.hits + self.misses
        per_layer = [float(h / p) if p else None for h, p in zip(self.hits.tolist(), picks.tolist())]
        total = int(picks.sum())
        c = self.cache
        return ExpertTierStats(
            offload=self.offload, admission=self.admission,
            slots=c.slots if c else 0, resident=c.resident if c else 0,
            slot_bytes=c.bytes if c else 0, fills=c.fills if c else 0,
            expert_bytes=self.blob_bytes(),
            hit_rate=(int(self.hits.sum()) / total) if total else None,
            hit_rate_per_layer=per_layer,
            tokens=self.tokens, host_bytes=self.host_bytes,
            host_bytes_per_token=(self.host_bytes / self.tokens) if self.tokens else None,
            recording=self.recorder is not None,
            syncs=self.syncs, miss_calls=self.miss_calls)

    def reset_stats(self) -> None:
        self.hits[:] = 0
        self.misses[:] = 0
        self.host_bytes = self.tokens = self.calls = 0
        self.syncs = self.miss_calls = 0
