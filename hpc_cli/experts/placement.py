"""How many device slots the tier gets and under which admission, from the ``[experts]``
settings: :func:`attach_expert_tier`, which the engine calls once its KV pools are sized."""

from __future__ import annotations

from typing import Any

import torch

from hpc_cli.errors import ConfigError
from hpc_cli.experts.cache import MiB, align
from hpc_cli.experts.tier import ExpertTier


def resolve_slots(model: Any, experts: Any, profile: Any = None) -> int:
    """Slots from ``budget_slots``, else ``budget_mib`` over the expert size, else the profile's."""
    cfg = model.config
    elem = torch.finfo(model.dtype).bits // 8
    blob = 3 * cfg.hidden_size * cfg.moe_intermediate_size * elem
    most = cfg.num_hidden_layers * cfg.num_experts
    if experts.budget_slots is not None:
        return min(int(experts.budget_slots), most)
    if experts.budget_mib is not None:
        return min(int(experts.budget_mib) * MiB // align(blob), most)
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
