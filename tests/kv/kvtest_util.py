"""Shared data and helpers for the KV profile tests."""

from __future__ import annotations

import torch

from hpc_plugins.kv_profiles import BUILTIN_PROFILES

PROFILES = {cls.name: cls() for cls in BUILTIN_PROFILES}
HEAD_DIM = 256


def gs_for(profile, side):
    return profile.default_global_scale(side) if profile.uses_global_scale else None


def gaussian(n=512, h=4, d=HEAD_DIM, seed=1, scale=1.0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, h, d, generator=g) * scale).to(dtype)


def outlier_channels(n=512, h=4, d=HEAD_DIM, seed=2, channels=6, factor=30.0, dtype=torch.bfloat16):
    """Gaussian data with a few channels (the same in every token) ``factor`` times larger."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, d, generator=g)
    ch = torch.randperm(d, generator=g)[:channels]
    x[:, :, ch] *= factor
    return x.to(dtype), ch


def rel_err(y, x):
    x = x.float()
    return float((y.float() - x).norm() / x.norm())
