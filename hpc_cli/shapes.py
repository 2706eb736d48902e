"""Cache-relevant shapes of a hybrid model: what sizes pages, slabs and state images (spec §3).

The runtime's model config produces a :class:`HybridShape`; the presets carry the released
Qwen3.5 widths so `hpc-cli kv table` and the byte accounting can be checked against spec §3.
"""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class HybridShape:
    name: str
    num_layers: int
    full_attention_interval: int
    num_kv_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    hidden_size: int
    state_dtype_bytes: int = 2  # conv window and continuation hidden in the model dtype (bf16)

    @property
    def attention_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if (i + 1) % self.full_attention_interval == 0]

    @property
    def gdn_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if (i + 1) % self.full_attention_interval != 0]

    @property
    def num_attention_layers(self) -> int:
        return len(self.attention_layers)

    @property
    def num_gdn_layers(self) -> int:
        return len(self.gdn_layers)

    @property
    def conv_dim(self) -> int:
        return (2 * self.linear_num_key_heads * self.linear_key_head_dim
                + self.linear_num_value_heads * self.linear_value_head_dim)

    @property
    def recurrent_bytes_per_layer(self) -> int:
        return self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim * 4

    @property
    def conv_bytes_per_layer(self) -> int:
        return self.conv_dim * (self.linear_conv_kernel_dim - 1) * self.state_dtype_bytes

    @property
    def hidden_bytes(self) -> int:
        return self.hidden_size * self.state_dtype_bytes

    def state_image_bytes(self, extra_bytes: int = 0) -> int:
        """Bytes of one sequence's state image: GDN recurrent + conv windows + hidden (+ backend parts)."""
        per_layer = self.recurrent_bytes_per_layer + self.conv_bytes_per_layer
        return per_layer * self.num_gdn_layers + self.hidden_bytes + extra_bytes


PRESETS: dict[str, HybridShape] = {
    "qwen3.5-27b": HybridShape(
        name="qwen3.5-27b", num_layers=64, full_attention_interval=4, num_kv_heads=4, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, hidden_size=5120),
    "qwen3.5-35b-a3b": HybridShape(
        name="qwen3.5-35b-a3b", num_layers=40, full_attention_interval=4, num_kv_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, hidden_size=2048),
}


def preset(name: str) -> HybridShape:
    from hpc_cli.errors import ConfigError

    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown model shape {name!r}",
                          hint=f"choose one of: {', '.join(PRESETS)}") from None
