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


def special_values(n=64, h=4, d=HEAD_DIM, seed=21):
    """fp32 data with NaN, +-inf, -0, huge, tiny, subnormal, all-zero and -0 rows, exact 0.5s
    and integers (test_gpu.py's special set plus fp32 edge values)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, d, generator=g)
    x[0, 0, :6] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e30])
    x[0, 1, :4] = torch.tensor([3e38, -torch.finfo(torch.float32).max, 1e-40, -1e-45])
    x[0, 2, 16:32] = float("nan")  # a whole NVFP4 block
    x[1] = 0.0
    x[2] = -0.0
    x[3] *= 1e-6  # underflowing scales
    x[4] *= 1e4
    x[5, :, ::2] = 0.5  # exact ties for many scales
    x[6] = torch.randint(-127, 128, (h, d), generator=g).float()  # int8 scale exactly 1
    x[7] *= 1e-39  # subnormal fp32 inputs
    x[8, :, 1::3] = float("inf")
    return x


#: Midpoints between consecutive non-negative grid values, in grid units of the format's code.
def grid_midpoints(kind: str) -> torch.Tensor:
    from hpc_kernels import kv_quant_ref as ref

    if kind == "int8":
        grid = torch.arange(128, dtype=torch.float32)
    elif kind == "fp8":
        grid = ref.e4m3_decode(torch.arange(127, dtype=torch.uint8))  # 0 .. 448
    else:
        grid = torch.tensor(ref.E2M1_VALUES)
    return (grid[:-1] + grid[1:]) / 2  # exact: one more bit


def group_scales(fmt, x, global_scale=None) -> torch.Tensor:
    """The reference's per-group scale (fp32) of ``x`` ``[N, H, D]``: ``[N, H, D / group, 1]``."""
    from hpc_kernels import kv_quant_ref as ref

    n, h, _ = x.shape
    planes = ref.quantize(fmt, x, global_scale)
    if fmt.kind == "nvfp4":
        gs = torch.tensor(1.0 if global_scale is None else global_scale, dtype=torch.float32)
        return (ref.e4m3_decode(planes[1]) * gs).reshape(n, h, -1, 1)
    return planes[1].contiguous().view(torch.float16).float().reshape(n, h, -1, 1)


def tie_data(fmt, global_scale=None, n=32, h=4, d=HEAD_DIM, seed=3, nudge=False) -> torch.Tensor:
    """fp32 data whose quotients x / s are exact midpoints of the code grid (ties for the
    half-to-even rounding): each group's first value fixes its scale (a random magnitude with
    random mantissa bits), the others are random midpoints times that scale, exact in fp32.
    ``nudge``: move every midpoint value one ulp up or down (``nextafter``), the closest a value
    can come to a tie without being one."""
    group = 16 if fmt.kind == "nvfp4" else fmt.group
    g = torch.Generator().manual_seed(seed)
    top = {"int8": 127.0, "fp8": 448.0, "nvfp4": 6.0}[fmt.kind]
    unit = top * (1.0 if global_scale is None else float(global_scale))  # amax of a scale-1 group
    amax = unit * torch.exp2(torch.empty(n, h, d // group, 1).uniform_(-4, 4, generator=g))
    amax = amax * (1 + torch.rand(n, h, d // group, 1, generator=g))
    x = torch.zeros(n, h, d // group, group)
    x[..., :1] = amax * torch.where(torch.rand(amax.shape, generator=g) < 0.5, -1.0, 1.0)
    s = group_scales(fmt, x.reshape(n, h, d), global_scale)
    mids = grid_midpoints(fmt.kind)
    pick = mids[torch.randint(len(mids), (n, h, d // group, group - 1), generator=g)]
    sign = torch.where(torch.rand(pick.shape, generator=g) < 0.5, -1.0, 1.0)
    x[..., 1:] = sign * pick * s
    if nudge:
        up = torch.rand(pick.shape, generator=g) < 0.5
        body = x[..., 1:]
        x[..., 1:] = torch.nextafter(body, torch.where(up, float("inf"), -float("inf")))
    x = x.reshape(n, h, d)
    assert torch.equal(group_scales(fmt, x, global_scale), s), "tie data changed a group's scale"
    return x
