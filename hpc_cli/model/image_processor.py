"""Image preprocessing as a Qwen3.5 checkpoint's preprocessor config says (Qwen2-VL image processor).

An RGB image (transparency composited on white) is resized with Pillow (bicubic by default) to
the nearest size whose sides are multiples of ``patch_size * merge_size`` and whose pixel count
lies in ``[min_pixels, max_pixels]`` (aspect ratio kept as closely as possible), rescaled to
``[0, 1]``, normalised per channel, and cut into patches: one row per patch of
``C * temporal_patch_size * p * p`` values (a still image is repeated over the temporal patch),
the rows in merge-block order (the ``merge x merge`` patches of one language-model token are
consecutive), which is what :class:`hpc_cli.model.vision.VisionTower` reads.

The config comes from ``preprocessor_config.json`` or the ``image_processor`` entry of
``processor_config.json``; missing keys take the Qwen2-VL defaults, and the patch sizes must
agree with the checkpoint's ``vision_config``.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from hpc_cli.errors import ModelError

if TYPE_CHECKING:
    from PIL import Image

    from hpc_cli.model.vision import VisionConfig

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
#: the most extreme aspect ratio the resize accepts (as Qwen2-VL's)
MAX_ASPECT = 200


class ImageShapeError(ValueError):
    """The image cannot be fitted to the patch grid (an extreme aspect ratio)."""


@dataclass(frozen=True, slots=True)
class ImageProcessorConfig:
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, float, float] = CLIP_MEAN
    image_std: tuple[float, float, float] = CLIP_STD
    rescale_factor: float = 1 / 255
    resample: int = 3  # PIL's BICUBIC

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def from_dict(cls, raw: dict[str, Any], vision: "VisionConfig | None" = None) -> "ImageProcessorConfig":
        size = raw.get("size") if isinstance(raw.get("size"), dict) else {}
        d = cls()
        patch = int(raw.get("patch_size", vision.patch_size if vision else d.patch_size))
        cfg = cls(patch_size=patch,
                  temporal_patch_size=int(raw.get("temporal_patch_size",
                                                  vision.temporal_patch_size if vision else d.temporal_patch_size)),
                  merge_size=int(raw.get("merge_size", vision.spatial_merge_size if vision else d.merge_size)),
                  min_pixels=int(raw.get("min_pixels", size.get("shortest_edge", size.get("min_pixels", d.min_pixels)))),
                  max_pixels=int(raw.get("max_pixels", size.get("longest_edge", size.get("max_pixels", d.max_pixels)))),
                  image_mean=tuple(float(x) for x in raw.get("image_mean", d.image_mean)),  # type: ignore[arg-type]
                  image_std=tuple(float(x) for x in raw.get("image_std", d.image_std)),  # type: ignore[arg-type]
                  rescale_factor=float(raw.get("rescale_factor", d.rescale_factor)),
                  resample=int(raw.get("resample", d.resample)))
        if vision is not None and (cfg.patch_size, cfg.temporal_patch_size, cfg.merge_size) != (
                vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size):
            raise ModelError(f"the preprocessor's patch sizes {(cfg.patch_size, cfg.temporal_patch_size, cfg.merge_size)} "
                             "differ from vision_config's "
                             f"{(vision.patch_size, vision.temporal_patch_size, vision.spatial_merge_size)}",
                             hint="fix preprocessor_config.json or config.json")
        if not 0 < cfg.min_pixels <= cfg.max_pixels:
            raise ModelError(f"the preprocessor's pixel bounds [{cfg.min_pixels}, {cfg.max_pixels}] are empty",
                             hint="fix preprocessor_config.json")
        return cfg

    @classmethod
    def from_dir(cls, path: str | Path, vision: "VisionConfig | None" = None) -> "ImageProcessorConfig":
        """From ``preprocessor_config.json`` or ``processor_config.json``; defaults when neither exists."""
        path = Path(path)
        for name, key in (("preprocessor_config.json", None), ("processor_config.json", "image_processor")):
            f = path / name
            if not f.is_file():
                continue
            try:
                raw = json.loads(f.read_text())
            except (OSError, json.JSONDecodeError) as exc:
                raise ModelError(f"{f}: cannot read JSON: {exc}", hint="fix or replace it") from exc
            if key is not None:
                raw = raw.get(key) if isinstance(raw, dict) else None
                if raw is None:
                    continue
            if not isinstance(raw, dict):
                raise ModelError(f"{f}: not a JSON object", hint="fix or replace it")
            return cls.from_dict(raw, vision)
        return cls.from_dict({}, vision)


@dataclass(frozen=True, slots=True)
class ImagePatches:
    """One preprocessed image: ``pixels`` ``[t*h*w, patch_dim]`` float32 in merge-block order,
    ``grid`` (t, h, w) in patches, ``digest`` the sha256 of the patch values and grid (what the
    tower sees, so two encodings of the same picture share cache entries)."""

    pixels: np.ndarray
    grid: tuple[int, int, int]
    digest: bytes
    size: tuple[int, int]  # (width, height) after the resize


def fit_size(height: int, width: int, cfg: ImageProcessorConfig) -> tuple[int, int]:
    """The resized (height, width): multiples of ``factor``, pixels within the bounds."""
    factor = cfg.factor
    if max(height, width) / max(1, min(height, width)) > MAX_ASPECT:
        raise ImageShapeError(f"the aspect ratio {max(height, width) / min(height, width):.0f}:1 exceeds "
                              f"{MAX_ASPECT}:1")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > cfg.max_pixels:
        beta = math.sqrt(height * width / cfg.max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < cfg.min_pixels:
        beta = math.sqrt(cfg.min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def to_rgb(image: "Image.Image") -> "Image.Image":
    """RGB, with any transparency composited onto white."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def preprocess(image: "Image.Image", cfg: ImageProcessorConfig) -> ImagePatches:
    rgb = to_rgb(image)
    width, height = rgb.size
    h, w = fit_size(height, width, cfg)
    if (w, h) != rgb.size:
        rgb = rgb.resize((w, h), resample=cfg.resample)
    arr = np.asarray(rgb, dtype=np.uint8)  # [h, w, 3]
    x = (arr.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
    x = (x - np.asarray(cfg.image_mean, dtype=np.float32)) / np.asarray(cfg.image_std, dtype=np.float32)
    x = np.ascontiguousarray(x.transpose(2, 0, 1))  # [C, h, w]
    p, m, tp = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    gh, gw = h // p, w // p
    c = x.shape[0]
    blocks = x.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)  # gh/m gw/m m m C p p
    blocks = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], tp, p, p))
    pixels = np.ascontiguousarray(blocks.reshape(gh * gw, c * tp * p * p), dtype=np.float32)
    grid = (1, gh, gw)
    digest = hashlib.sha256(np.asarray(grid, dtype="<i8").tobytes() + pixels.tobytes()).digest()
    return ImagePatches(pixels, grid, digest, (w, h))
