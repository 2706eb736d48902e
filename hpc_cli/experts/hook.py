"""The model hook: which layers of a model are MoE layers, and the two attributes through which
a :class:`~hpc_cli.model.moe.SparseMoE` layer routes its experts to the tier
(``mlp.expert_tier.routed(mlp.layer_index, ...)``; ``model.expert_tier`` for the engine's stats).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hpc_cli.experts.tier import ExpertTier, ExpertTierStats


def moe_layers(model: Any) -> list[int]:
    """Indices of ``model``'s layers whose MLP is a sparse MoE."""
    from hpc_cli.model.moe import SparseMoE

    return [i for i, layer in enumerate(model.layers) if isinstance(layer.mlp, SparseMoE)]


def hook_model(model: Any, tier: "ExpertTier") -> None:
    """Route the routed experts of ``tier.layers`` through ``tier``."""
    for i in tier.layers:
        mlp = model.layers[i].mlp
        mlp.expert_tier, mlp.layer_index = tier, i
    model.expert_tier = tier


def expert_stats(model: Any) -> ExpertTierStats | None:
    """The expert tier's stats for the engine's snapshot (None when no tier is attached)."""
    tier = getattr(model, "expert_tier", None)
    return tier.stats() if tier is not None else None
