"""Built-in KV profiles (spec §3.1): bf16, int8-g64, fp8-e4m3fn-row256, nvfp4-g16, k8v4."""

from __future__ import annotations

from typing import Sequence

import hpc_cli
from hpc_cli.kv_profile import KVProfile, PlaneSpec, RecordLayout


def _check_groups(name: str, head_dim: int, group: int) -> None:
    if head_dim % group:
        from hpc_cli.errors import ConfigError

        raise ConfigError(
            f"KV profile {name} needs a head_dim divisible by {group}, got {head_dim}",
            hint="choose kv.profile = 'bf16' for this model, or a profile whose groups divide head_dim",
        )


class BF16Profile(KVProfile):
    name = "bf16"
    aliases = ("bfloat16",)
    description = "bfloat16 K and V, no scales"

    def layout(self, head_dim: int) -> RecordLayout:
        return RecordLayout(head_dim, (PlaneSpec("k_data", "k", 2 * head_dim),
                                       PlaneSpec("v_data", "v", 2 * head_dim)))

    def quantize(self, x, side, global_scale=None):
        import torch

        n, h, d = x.shape
        return [x.to(torch.bfloat16).contiguous().view(torch.uint8).view(n, h, 2 * d)]

    def dequantize(self, planes: Sequence, side, dtype, global_scale=None):
        import torch

        (data,) = planes
        n, h, b = data.shape
        return data.contiguous().view(torch.bfloat16).view(n, h, b // 2).to(dtype)


class Int8G64Profile(KVProfile):
    name = "int8-g64"
    aliases = ("int8",)
    description = "int8 codes with one fp16 scale per 64 values, symmetric"

    def layout(self, head_dim: int) -> RecordLayout:
        _check_groups(self.name, head_dim, 64)
        g = head_dim // 64
        return RecordLayout(head_dim, (PlaneSpec("k_data", "k", head_dim), PlaneSpec("k_scale", "k", 2 * g),
                                       PlaneSpec("v_data", "v", head_dim), PlaneSpec("v_scale", "v", 2 * g)))


class FP8RowProfile(KVProfile):
    name = "fp8-e4m3fn-row256"
    aliases = ("fp8", "fp8-row256")
    description = "FP8 E4M3FN codes with one fp16 scale per 256-value row"

    def layout(self, head_dim: int) -> RecordLayout:
        _check_groups(self.name, head_dim, min(head_dim, 256))
        g = max(1, head_dim // 256)
        return RecordLayout(head_dim, (PlaneSpec("k_data", "k", head_dim), PlaneSpec("k_scale", "k", 2 * g),
                                       PlaneSpec("v_data", "v", head_dim), PlaneSpec("v_scale", "v", 2 * g)))


class NVFP4G16Profile(KVProfile):
    name = "nvfp4-g16"
    aliases = ("nvfp4", "fp4")
    description = "E2M1 nibbles with one UE4M3 scale per 16 values and a per-layer fp32 global scale"
    uses_global_scale = True

    def layout(self, head_dim: int) -> RecordLayout:
        _check_groups(self.name, head_dim, 16)
        return RecordLayout(head_dim, (PlaneSpec("k_data", "k", head_dim // 2), PlaneSpec("k_scale", "k", head_dim // 16),
                                       PlaneSpec("v_data", "v", head_dim // 2), PlaneSpec("v_scale", "v", head_dim // 16)))


class K8V4Profile(KVProfile):
    name = "k8v4"
    aliases = ("int8-nvfp4",)
    description = "K as int8 with one fp16 scale per 256 values, V as nvfp4-g16"
    uses_global_scale = True

    def layout(self, head_dim: int) -> RecordLayout:
        _check_groups(self.name, head_dim, 16)
        g = max(1, head_dim // 256)
        return RecordLayout(head_dim, (PlaneSpec("k_data", "k", head_dim), PlaneSpec("k_scale", "k", 2 * g),
                                       PlaneSpec("v_data", "v", head_dim // 2), PlaneSpec("v_scale", "v", head_dim // 16)))


BUILTIN_PROFILES = (BF16Profile, Int8G64Profile, FP8RowProfile, NVFP4G16Profile, K8V4Profile)


@hpc_cli.hookimpl
def hpc_register_kv_profiles(register):
    for cls in BUILTIN_PROFILES:
        register(cls())
