"""Chat prompts with images: template content parts, preprocessing, placeholder expansion.

A message with images reaches the chat template as a list of parts, ``{"type": "text", "text":
...}`` and ``{"type": "image"}`` in the client's order, so the checkpoint's own template writes
the vision placeholder (Qwen's ``<|vision_start|><|image_pad|><|vision_end|>``) where each image
stands; text-only messages keep their string content. After the one rendering and tokenization
(:func:`hpc_cli.server.chat.prepare_chat`), each image's single ``<|image_pad|>`` token is
expanded to the image's token count and every position after it (tap hints, boundaries) moves
with it (:func:`expand_images`). The images are decoded and preprocessed off the event loop
(:func:`load_images`); the result, :class:`hpc_cli.engine.api.PromptImage`, carries the
patches, the content digest the cache keys on, and the placeholder span.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Sequence

from hpc_cli.engine.api import PromptImage, TapHint
from hpc_cli.errors import RequestError
from hpc_cli.server.chat import PreparedChat
from hpc_cli.server.media import ImageSource, MediaError, MediaLimits, from_anthropic, from_url, load

if TYPE_CHECKING:
    from hpc_cli.engine.api import Engine
    from hpc_cli.model.image_processor import ImageProcessorConfig, ImagePatches
    from hpc_cli.server.schemas import ContentPart, MessagesRequest
    from hpc_cli.server.state import ServerState

IMAGE_PART: dict[str, str] = {"type": "image"}
OPENAI_IMAGE_TYPES = ("image_url", "input_image")


def require_vision(engine: "Engine", n_images: int, limits: MediaLimits, where: str = "messages") -> None:
    """A 400 before anything is fetched when the model takes no images or there are too many."""
    if not n_images:
        return
    if getattr(getattr(engine, "model", None), "vision", None) is None:
        raise RequestError("this model does not take images: it has no vision tower",
                           hint="send text only, or serve a multimodal Qwen3.5 checkpoint (config.json with "
                                "vision_config and model.visual.* weights)",
                           param=where, code="unsupported_content")
    if n_images > limits.max_images:
        raise MediaError(f"the request has {n_images} images; this server takes at most {limits.max_images}",
                         hint="send fewer images (or raise [server] max_images_per_request)", param=where,
                         code="too_many_images")


# ------------------------------------------------------------------ OpenAI content parts
def openai_image(part: "ContentPart", where: str, limits: MediaLimits) -> ImageSource:
    """``{"type": "image_url", "image_url": {"url": ...}}`` (or ``input_image`` with a URL string)."""
    extra = getattr(part, "model_extra", None) or {}
    ref = extra.get("image_url")
    url = ref.get("url") if isinstance(ref, dict) else ref
    return from_url(url, f"{where}.image_url.url" if isinstance(ref, dict) else f"{where}.image_url", limits)


def openai_parts(content: Sequence["ContentPart"], where: str, limits: MediaLimits
                 ) -> tuple[list[dict[str, str]], list[ImageSource]]:
    """A message's content parts as template parts, and its images in order."""
    parts: list[dict[str, str]] = []
    images: list[ImageSource] = []
    for i, part in enumerate(content):
        pw = f"{where}.content.{i}"
        if part.type in OPENAI_IMAGE_TYPES:
            images.append(openai_image(part, pw, limits))
            parts.append(dict(IMAGE_PART))
        elif part.type in ("text", "input_text", "output_text"):
            if part.text is None:
                raise RequestError("a text content part needs 'text'", param=f"{pw}.text")
            parts.append({"type": "text", "text": part.text})
        else:
            raise RequestError(f"content part type {part.type!r} is not supported (text and image_url)",
                               param=f"{pw}.type", code="unsupported_content")
    return parts, images


def has_openai_images(content: "str | list[ContentPart] | None") -> bool:
    return isinstance(content, list) and any(getattr(p, "type", None) in OPENAI_IMAGE_TYPES for p in content)


def anthropic_sources(body: "MessagesRequest", limits: MediaLimits) -> list[ImageSource]:
    """The ``image`` blocks of an Anthropic request's messages, in order (the order the template
    renders them: system blocks and tool results hold text only)."""
    out = []
    for i, m in enumerate(body.messages):
        if isinstance(m.content, str):
            continue
        for j, b in enumerate(m.content):
            if b.type == "image":
                out.append(from_anthropic((b.model_extra or {}).get("source"),
                                          f"messages.{i}.content.{j}.source", limits))
    return out


# ------------------------------------------------------------------ images
def load_images(sources: Sequence[ImageSource], limits: MediaLimits,
                processor: "ImageProcessorConfig") -> list["ImagePatches"]:
    """Decode (fetching remote ones) and preprocess every image: ImagePatches in order."""
    from hpc_cli.model.image_processor import ImageShapeError, preprocess

    out = []
    for src in sources:
        img = load(src, limits)
        try:
            out.append(preprocess(img, processor))
        except ImageShapeError as exc:
            raise MediaError(f"{src.where}: {exc}", hint="send a less elongated image", param=src.where) from None
    return out


def expand_images(prepared: PreparedChat, patches: Sequence["ImagePatches"], image_token_id: int, merge: int
                  ) -> tuple[PreparedChat, list["PromptImage"]]:
    """Expand each image's ``<|image_pad|>`` token to its token count; move every position after it."""
    if not patches:
        return prepared, []
    tokens = prepared.prompt_tokens
    at = [i for i, t in enumerate(tokens) if t == image_token_id]
    if len(at) != len(patches):
        raise RequestError(f"the chat template wrote {len(at)} image placeholders for {len(patches)} images",
                           hint="check that the checkpoint's chat template renders image content parts, and do "
                                "not write the image placeholder token in the text", param="messages",
                           code="unsupported_content")
    lengths = [p.grid[0] * p.grid[1] * p.grid[2] // (merge * merge) for p in patches]
    out: list[int] = []
    images: list["PromptImage"] = []
    prev = 0
    for q, n, p in zip(at, lengths, patches):
        out.extend(tokens[prev:q])
        images.append(PromptImage(p.pixels, p.grid, p.digest, len(out), n))
        out.extend([image_token_id] * n)
        prev = q + 1
    out.extend(tokens[prev:])

    def move(pos: int | None) -> int | None:
        if pos is None:
            return None
        return pos + sum(n - 1 for q, n in zip(at, lengths) if q < pos)

    hints = [TapHint(move(h.position), h.priority, h.automatic) for h in prepared.tap_hints]
    return dataclasses.replace(
        prepared, prompt_tokens=out, tap_hints=hints,
        message_boundaries=[move(b) for b in prepared.message_boundaries],
        opener_position=move(prepared.opener_position), system_end=move(prepared.system_end),
        tools_end=move(prepared.tools_end), marker_positions=[move(m) for m in prepared.marker_positions]), images


async def prepare_images(state: "ServerState", prepared: PreparedChat, sources: Sequence[ImageSource]
                         ) -> tuple[PreparedChat, list["PromptImage"]]:
    """The route's step after ``prepare_chat``: load the images off the loop, expand the prompt."""
    if not sources:
        return prepared, []
    from starlette.concurrency import run_in_threadpool

    model = state.engine.model
    limits = media_limits(state)
    patches = await run_in_threadpool(load_images, sources, limits, model.image_processor)
    return expand_images(prepared, patches, model.multimodal.image_token_id, model.vision.config.spatial_merge_size)


def media_limits(state: "ServerState") -> MediaLimits:
    return MediaLimits.from_settings(state.settings.server)
