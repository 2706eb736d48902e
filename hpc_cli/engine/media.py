"""Images in a request, on the engine's side: checks, cache identity, and what a lane's passes need.

A request's images (:class:`PromptImage`, preprocessed by the server) name the placeholder span
each fills. :func:`check_images` refuses what the model cannot serve; :func:`media_items` gives
the cache's identity of each image (spec §5.1: its content digest, grid and span enter the key of
every block that holds its tokens). On the worker, :class:`LaneVision` keeps a lane's mRoPE
positions and runs the vision tower once, at the lane's first pass, for the images the cache did
not serve (an image wholly before the resume point is never encoded), and
:func:`prefill_media` / :func:`decode_offsets` hand the model the pieces of each pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from hpc_cli.cache.keys import MediaItem
from hpc_cli.engine.api import PromptImage
from hpc_cli.errors import RequestError
from hpc_cli.model.mrope import VisionSpan, rope_positions
from hpc_cli.model.vision import IMAGE, PrefillMedia

if TYPE_CHECKING:
    from hpc_cli.engine.api import GenerationRequest
    from hpc_cli.engine.lane import Lane
    from hpc_cli.model.model import HybridModel


def media_items(images: Sequence[PromptImage]) -> list[MediaItem]:
    """The cache identity of each image (hpc_cli.cache.keys.media_key hashes these)."""
    return [MediaItem(im.digest, IMAGE, im.grid, im.begin, im.length) for im in images]


def check_images(model: "HybridModel", request: "GenerationRequest", *, speculative: bool = False) -> None:
    """Refuse images the model cannot serve, or whose spans do not fit the prompt (RequestError)."""
    images = request.media
    if not images:
        return
    if getattr(model, "vision", None) is None:
        raise RequestError("this model does not take images: it has no vision tower",
                           hint="send text only, or serve a multimodal Qwen3.5 checkpoint (config.json with "
                                "vision_config and model.visual.* weights)",
                           param="messages", code="unsupported_content")
    if speculative:
        raise RequestError("images are not supported with a speculative backend",
                           hint="serve with [speculative] backend = \"none\" to send images",
                           param="messages", code="unsupported_content")
    tower, mm = model.vision, model.multimodal
    tokens = request.prompt_tokens
    n = len(tokens)
    at = 0
    for i, im in enumerate(sorted(images, key=lambda im: im.begin)):
        tower.check_grid(im.grid, im.pixels.shape[0])
        assert im.pixels.ndim == 2 and im.pixels.shape[1] == tower.config.patch_dim, \
            f"image {i}: patches of {im.pixels.shape[1:]} values, the tower takes {tower.config.patch_dim}"
        assert im.length == tower.tokens_of(im.grid), f"image {i}: {im.length} placeholders for grid {im.grid}"
        assert len(im.digest) == 32, "an image digest is 32 bytes"
        if not (at <= im.begin and im.end <= n):
            raise RequestError(f"image {i}'s placeholder span [{im.begin}, {im.end}) overlaps another or leaves "
                               f"the {n}-token prompt", param="messages")
        at = im.end
    pad = mm.image_token_id
    spans = sum(im.length for im in images)
    placed = sum(1 for t in tokens if t == pad)
    inside = sum(1 for im in images for t in tokens[im.begin:im.end] if t == pad)
    if placed != spans or inside != spans:
        raise RequestError(f"the prompt has {placed} image placeholder tokens where its {len(images)} image(s) "
                           f"need {spans}", hint="do not write the image placeholder token in the text",
                           param="messages")


def vision_spans(model: "HybridModel", images: Sequence[PromptImage]) -> list[VisionSpan]:
    m = model.vision.config.spatial_merge_size
    return [VisionSpan(im.begin, (im.grid[0], im.grid[1] // m, im.grid[2] // m))
            for im in sorted(images, key=lambda im: im.begin)]


@dataclass(slots=True)
class LaneVision:
    """A Vision lane's positions and image embeddings (built at its first prefill pass)."""

    positions: torch.Tensor  # [3, n_prompt] (t, h, w)
    delta: int  # decode's rotary offset: position = index + delta
    images: list[PromptImage]
    embeds: dict[int, torch.Tensor] = field(default_factory=dict)  # image index -> [length, hidden]

    @classmethod
    def build(cls, model: "HybridModel", lane: "Lane") -> "LaneVision":
        images = sorted(lane.request.media, key=lambda im: im.begin)
        positions, delta = rope_positions(lane.n_prompt, vision_spans(model, images))
        vision = cls(positions, delta, images)
        vision.encode(model, lane.pos)
        return vision

    def encode(self, model: "HybridModel", start: int) -> None:
        """Run the tower once over every image not wholly before ``start`` (the resume point)."""
        todo = [i for i, im in enumerate(self.images) if im.end > start and i not in self.embeds]
        if not todo:
            return
        pixels = torch.from_numpy(np.concatenate([self.images[i].pixels for i in todo]))
        out = model.vision.encode(pixels, [self.images[i].grid for i in todo])
        self.embeds.update(zip(todo, out))

    def pass_media(self, start: int, end: int) -> PrefillMedia:
        """The pieces of the pass over ``[start, end)``; embeddings no later pass needs are dropped."""
        rows = []
        for i, im in enumerate(self.images):
            lo, hi = max(start, im.begin), min(end, im.end)
            if lo < hi:
                rows.append((lo - start, self.embeds[i][lo - im.begin:hi - im.begin]))
            if im.end <= end:
                self.embeds.pop(i, None)
        return PrefillMedia(self.positions[:, start:end], rows)


def prefill_media(model: "HybridModel", lane: "Lane", start: int, end: int) -> dict[str, PrefillMedia]:
    """``model.prefill``'s keyword for a pass of ``lane`` over ``[start, end)`` ({} without images)."""
    if not lane.request.media:
        return {}
    if lane.vision is None:
        lane.vision = LaneVision.build(model, lane)
    return {"media": lane.vision.pass_media(start, end)}


def decode_offsets(lanes: Sequence["Lane"]) -> dict[str, list[int]]:
    """``model.decode``'s keyword: each lane's rotary offset ({} when no lane has images, so a
    text-only round runs exactly as before)."""
    if not any(lane.vision is not None for lane in lanes):
        return {}
    return {"rope_offsets": [lane.vision.delta if lane.vision is not None else 0 for lane in lanes]}
