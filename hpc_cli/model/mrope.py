"""Multimodal rotary positions (Qwen3.5's interleaved mRoPE) for prompts with images.

Every token has three positions (t, h, w). A text token has all three equal; the tokens of an
image of ``t' x h' x w'`` merged tokens (grid after the merger) starting at running position
``c`` get ``(c + t_idx, c + row, c + col)`` in raster order, and the text after it continues at
``c + max(h', w')`` (Qwen3.5 advances by the larger side, not by the token count). So positions
lag the token index after an image; ``delta = max(position) + 1 - n`` is what decode adds to a
token's index (all three axes equal again).

The rotary frequencies are shared out over the axes *interleaved*: frequency ``j`` turns with
``h`` when ``j % 3 == 1`` and ``j < 3 * section[1]``, with ``w`` when ``j % 3 == 2`` and
``j < 3 * section[2]``, else with ``t``. With the three positions equal this is exactly the 1-D
rotary of :class:`hpc_cli.model.layers.Rotary`, so text-only passes keep that path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from hpc_cli.model.layers import Rotary


@dataclass(frozen=True, slots=True)
class VisionSpan:
    """An image's placeholder tokens in a prompt: ``begin`` (first token), ``grid`` the merged
    grid (t', h', w') whose raster order the tokens follow."""

    begin: int
    grid: tuple[int, int, int]

    @property
    def length(self) -> int:
        t, h, w = self.grid
        return t * h * w

    @property
    def end(self) -> int:
        return self.begin + self.length

    @property
    def advance(self) -> int:
        """How far the running position moves over the image."""
        return max(self.grid[1], self.grid[2])


def rope_positions(n: int, spans: Sequence[VisionSpan]) -> tuple[torch.Tensor, int]:
    """The ``[3, n]`` (t, h, w) positions of a prompt of ``n`` tokens whose images are ``spans``
    (sorted, disjoint, inside the prompt), and its ``delta`` (decode's offset)."""
    pos = torch.empty(3, n, dtype=torch.long)
    at = 0  # token index
    cur = 0  # running position
    for s in sorted(spans, key=lambda s: s.begin):
        assert at <= s.begin and s.end <= n, f"span [{s.begin}, {s.end}) overlaps another or leaves the prompt"
        gap = s.begin - at
        pos[:, at:s.begin] = torch.arange(cur, cur + gap)
        cur += gap
        t, h, w = s.grid
        tt = torch.arange(t)[:, None, None].expand(t, h, w).reshape(-1)
        hh = torch.arange(h)[None, :, None].expand(t, h, w).reshape(-1)
        ww = torch.arange(w)[None, None, :].expand(t, h, w).reshape(-1)
        pos[:, s.begin:s.end] = torch.stack([tt, hh, ww]) + cur
        cur += s.advance
        at = s.end
    pos[:, at:n] = torch.arange(cur, cur + n - at)
    cur += n - at
    return pos, cur - n


def frequency_axes(n_freq: int, section: Sequence[int]) -> torch.Tensor:
    """Which axis (0 t, 1 h, 2 w) each of the ``n_freq`` rotary frequencies turns with."""
    axes = torch.zeros(n_freq, dtype=torch.long)
    for j in range(n_freq):
        if j % 3 == 1 and j < 3 * section[1]:
            axes[j] = 1
        elif j % 3 == 2 and j < 3 * section[2]:
            axes[j] = 2
    return axes


def mrope_cos_sin(rotary: Rotary, positions: torch.Tensor, section: Sequence[int],
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` ``[N, rotary_dim]`` for ``[3, N]`` positions: each frequency takes its axis's
    position (for equal axes, bit-identical to ``rotary.cos_sin`` of one of them)."""
    inv = rotary.inv_freq.to(positions.device)
    axes = frequency_axes(inv.shape[0], section).to(positions.device)
    chosen = positions.index_select(0, axes)  # [n_freq, N]: the position each frequency reads
    freqs = chosen.t().float() * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)
