"""Recurrent-state slots (spec §5.4, ARCHITECTURE.md §5).

One slot-indexed layout per GDN layer: a conv window ``[slots, conv_dim, kernel-1]`` in the
model dtype and a recurrent state ``[slots, H_v, d_k, d_v]`` in fp32; plus the continuation
hidden ``[slots, hidden]``. Slots ``0..C-1`` serve active lanes, the rest hold snapshots.
"""

from __future__ import annotations

import torch


class StateSlots:
    def __init__(self, num_gdn_layers: int, conv_dim: int, conv_width: int, num_v_heads: int,
                 key_head_dim: int, value_head_dim: int, hidden_size: int, num_slots: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        self.num_slots = num_slots
        self.device = torch.device(device)
        self.dtype = dtype
        self.conv = [torch.zeros(num_slots, conv_dim, conv_width, dtype=dtype, device=self.device)
                     for _ in range(num_gdn_layers)]
        self.recurrent = [torch.zeros(num_slots, num_v_heads, key_head_dim, value_head_dim,
                                      dtype=torch.float32, device=self.device)
                          for _ in range(num_gdn_layers)]
        self.hidden = torch.zeros(num_slots, hidden_size, dtype=dtype, device=self.device)

    def parts(self) -> list[torch.Tensor]:
        """Every slot-indexed tensor, in forward order (conv, recurrent per layer), hidden last."""
        out: list[torch.Tensor] = []
        for conv, rec in zip(self.conv, self.recurrent):
            out += [conv, rec]
        out.append(self.hidden)
        return out

    @property
    def image_bytes(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.parts())

    def reset(self, slot: int) -> None:
        for t in self.parts():
            t[slot].zero_()

    def copy_slot(self, src: int, dst: int) -> None:
        """Copy one whole image (a tap, or a resume from a snapshot slot)."""
        for t in self.parts():
            t[dst].copy_(t[src])
