"""Images a request sends: where their bytes come from, and decoding them within limits.

An image arrives as a ``data:`` URL with base64 (OpenAI ``image_url`` parts), a base64 source
(Anthropic ``image`` blocks), or an ``http(s)`` URL, fetched only when ``[server]
allow_remote_media`` is on, with a byte limit and a time limit. Pillow decodes it; only the
formats in :data:`FORMATS` are taken, and an image whose pixel count exceeds
``[server] max_image_pixels`` is refused before its pixels are decoded (no decompression bombs).
Every failure is a :class:`MediaError`: a 400 in the API's own error shape, naming the part.
"""

from __future__ import annotations

import base64
import binascii
import io
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from hpc_cli.errors import RequestError

if TYPE_CHECKING:
    from PIL import Image

    from hpc_cli.settings import ServerSettings

#: Pillow format names taken, and the media types that name them
FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif", "BMP": "image/bmp"}
MEDIA_TYPES = {v: k for k, v in FORMATS.items()} | {"image/jpg": "JPEG"}


class MediaError(RequestError):
    """An image the server cannot take (400)."""

    def __init__(self, message: str, hint: str | None = None, *, param: str | None = None,
                 code: str = "invalid_image") -> None:
        super().__init__(message, hint, param=param, code=code)


@dataclass(frozen=True, slots=True)
class MediaLimits:
    """``[server]`` media options: remote URLs, byte and pixel limits, the fetch time limit."""

    allow_remote: bool = False
    max_bytes: int = 20 << 20
    max_pixels: int = 40_000_000
    fetch_timeout_s: float = 10.0
    max_images: int = 16

    @classmethod
    def from_settings(cls, server: "ServerSettings") -> "MediaLimits":
        d = cls()
        return cls(allow_remote=bool(getattr(server, "allow_remote_media", d.allow_remote)),
                   max_bytes=int(getattr(server, "max_image_bytes", d.max_bytes)),
                   max_pixels=int(getattr(server, "max_image_pixels", d.max_pixels)),
                   fetch_timeout_s=float(getattr(server, "media_fetch_timeout_s", d.fetch_timeout_s)),
                   max_images=int(getattr(server, "max_images_per_request", d.max_images)))


@dataclass(frozen=True, slots=True)
class ImageSource:
    """Where one image's bytes are: ``data`` (already decoded from base64) or a remote ``url``.
    ``where`` names the request field (error messages); ``media_type`` is what the client said."""

    where: str
    data: bytes | None = None
    url: str | None = None
    media_type: str | None = None


def _b64(text: str, where: str, limits: MediaLimits) -> bytes:
    if len(text) > 4 * (limits.max_bytes // 3 + 4):
        raise MediaError(f"{where}: the image is larger than {limits.max_bytes} bytes",
                         hint="send a smaller image (or raise [server] max_image_bytes)", param=where,
                         code="image_too_large")
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise MediaError(f"{where}: the image data is not valid base64", param=where) from None


def from_url(url: object, where: str, limits: MediaLimits) -> ImageSource:
    """An OpenAI ``image_url``: a ``data:image/...;base64,`` URL or an http(s) URL."""
    if not isinstance(url, str) or not url:
        raise MediaError(f"{where}: an image URL must be a non-empty string", param=where)
    if url.startswith("data:"):
        head, sep, payload = url[5:].partition(",")
        if not sep or not head.endswith(";base64"):
            raise MediaError(f"{where}: a data URL must be 'data:<media type>;base64,<data>'", param=where)
        media_type = head[:-len(";base64")].strip().lower() or None
        return ImageSource(where, data=_b64(payload, where, limits), media_type=media_type)
    scheme = urlsplit(url).scheme.lower()
    if scheme in ("http", "https"):
        if not limits.allow_remote:
            raise MediaError(f"{where}: remote image URLs are off on this server",
                             hint="send the image inline as a data: URL (base64), or start the server with "
                                  "[server] allow_remote_media = true", param=where, code="remote_media_disabled")
        return ImageSource(where, url=url)
    raise MediaError(f"{where}: unsupported image URL scheme {scheme or url[:16]!r}",
                     hint="use a data:image/...;base64 URL" + (" or http(s)" if limits.allow_remote else ""),
                     param=where)


def from_anthropic(source: object, where: str, limits: MediaLimits) -> ImageSource:
    """An Anthropic image block's ``source``: ``base64`` (``media_type``, ``data``) or ``url``."""
    if not isinstance(source, dict):
        raise MediaError(f"{where}: Field required", param=where)
    kind = source.get("type")
    if kind == "base64":
        data, media_type = source.get("data"), source.get("media_type")
        if not isinstance(data, str) or not isinstance(media_type, str):
            raise MediaError(f"{where}: a base64 source needs 'media_type' and 'data' strings", param=where)
        if media_type.lower() not in MEDIA_TYPES:
            raise MediaError(f"{where}.media_type: {media_type!r} is not one of {', '.join(FORMATS.values())}",
                             param=where, code="unsupported_image_format")
        return ImageSource(where, data=_b64(data, where, limits), media_type=media_type.lower())
    if kind == "url":
        return from_url(source.get("url"), where, limits)
    raise MediaError(f"{where}.type: image source type {kind!r} is not supported (base64 or url)", param=where)


def fetch(src: ImageSource, limits: MediaLimits) -> bytes:
    """Download a remote image: at most ``max_bytes``, within ``fetch_timeout_s`` in all."""
    import httpx

    deadline = time.monotonic() + limits.fetch_timeout_s
    where = src.where
    try:
        with httpx.Client(timeout=limits.fetch_timeout_s, follow_redirects=True, max_redirects=3) as client:
            with client.stream("GET", src.url) as resp:
                if resp.status_code != 200:
                    raise MediaError(f"{where}: fetching the image gave HTTP {resp.status_code}", param=where,
                                     code="image_fetch_failed")
                declared = resp.headers.get("content-length")
                if declared and declared.isdigit() and int(declared) > limits.max_bytes:
                    raise _too_large(where, limits)
                buf = bytearray()
                for chunk in resp.iter_bytes():
                    buf += chunk
                    if len(buf) > limits.max_bytes:
                        raise _too_large(where, limits)
                    if time.monotonic() > deadline:
                        raise httpx.ReadTimeout("deadline")
                return bytes(buf)
    except httpx.TimeoutException:
        raise MediaError(f"{where}: fetching the image took longer than {limits.fetch_timeout_s:g} s", param=where,
                         code="image_fetch_failed") from None
    except httpx.HTTPError as exc:
        raise MediaError(f"{where}: cannot fetch the image: {type(exc).__name__}", param=where,
                         code="image_fetch_failed") from None


def _too_large(where: str, limits: MediaLimits) -> MediaError:
    return MediaError(f"{where}: the image is larger than {limits.max_bytes} bytes",
                      hint="send a smaller image (or raise [server] max_image_bytes)", param=where,
                      code="image_too_large")


def decode(data: bytes, where: str, limits: MediaLimits) -> "Image.Image":
    """Open and fully decode an image (its first frame), within the limits."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > limits.max_bytes:
        raise _too_large(where, limits)
    if not data:
        raise MediaError(f"{where}: the image is empty", param=where)
    try:
        img = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise MediaError(f"{where}: the data is not an image this server can decode",
                         hint=f"send one of {', '.join(FORMATS)}", param=where) from None
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise MediaError(f"{where}: the image cannot be decoded ({exc})", param=where) from None
    if img.format not in FORMATS:
        raise MediaError(f"{where}: image format {img.format} is not supported",
                         hint=f"send one of {', '.join(FORMATS)}", param=where, code="unsupported_image_format")
    w, h = img.size
    if w < 1 or h < 1:
        raise MediaError(f"{where}: the image has no pixels", param=where)
    if w * h > limits.max_pixels:
        raise MediaError(f"{where}: the image has {w}x{h} = {w * h} pixels, more than {limits.max_pixels}",
                         hint="send a smaller image (or raise [server] max_image_pixels)", param=where,
                         code="image_too_large")
    try:
        img.load()
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise MediaError(f"{where}: the image data is damaged ({exc})", param=where) from None
    return img


def load(src: ImageSource, limits: MediaLimits) -> "Image.Image":
    data = src.data if src.data is not None else fetch(src, limits)
    return decode(data, src.where, limits)
