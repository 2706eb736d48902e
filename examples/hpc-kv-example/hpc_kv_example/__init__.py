"""An example third-party hpc-cli plugin.

It registers one KV profile, ``fp16`` (IEEE half precision K and V, no scales), and one command,
``hpc-cli fp16-info``. Install it with ``pip install -e examples/hpc-kv-example``; then
``hpc-cli plugins`` lists it and ``kv.profile = "fp16"`` selects the profile.
"""

from __future__ import annotations

import click
import torch

import hpc_cli
from hpc_cli.kv_profile import KVProfile, PlaneSpec, RecordLayout


class FP16Profile(KVProfile):
    name = "fp16"
    aliases = ("half",)
    description = "float16 K and V, no scales (example plugin)"

    def layout(self, head_dim: int) -> RecordLayout:
        # One plane per side: head_dim float16 values = 2 * head_dim bytes per token per KV head.
        return RecordLayout(head_dim, (PlaneSpec("k_data", "k", 2 * head_dim),
                                       PlaneSpec("v_data", "v", 2 * head_dim)))

    def quantize(self, x, side, global_scale=None):
        if not torch.isfinite(x).all():
            raise ValueError("fp16 KV profile: non-finite K/V input")
        n, h, d = x.shape
        # Values beyond the float16 range saturate rather than becoming inf.
        half = x.clamp(-65504.0, 65504.0).to(torch.float16).contiguous()
        return [half.view(torch.uint8).view(n, h, 2 * d)]

    def dequantize(self, planes, side, dtype, global_scale=None):
        (data,) = planes
        n, h, b = data.shape
        return data.contiguous().view(torch.float16).view(n, h, b // 2).to(dtype)


@hpc_cli.hookimpl
def hpc_register_kv_profiles(register):
    register(FP16Profile())


@hpc_cli.hookimpl
def hpc_register_commands(cli):
    @cli.command("fp16-info")
    @click.option("--head-dim", default=256, show_default=True)
    def fp16_info(head_dim: int) -> None:
        """Print the fp16 profile's record layout (from the hpc-kv-example plugin)."""
        layout = FP16Profile().layout(head_dim)
        click.echo(f"fp16: {layout.bytes_per_token_head} B per token per KV head "
                   f"(K {layout.k_bytes} B, V {layout.v_bytes} B)")
