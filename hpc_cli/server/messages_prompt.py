"""Anthropic's ``/v1/messages`` request as the chat template's input (:func:`convert`).

``cache_control`` breakpoints are validated as the API does (type ``ephemeral``, ttl ``5m`` or
``1h``, at most four blocks, no 1h breakpoint after a 5m one, none on empty text or thinking
blocks) and become markers (:class:`.chat.Marker`: priority-1 tap hints); a top-level
``cache_control`` (automatic caching) marks the end of the conversation as a structural,
automatic hint. History ``tool_use`` and ``tool_result`` blocks become the template's tool calls
and tool messages; ``image`` blocks become image parts (:mod:`.vision_prompt` reads them).
"""

from __future__ import annotations

from typing import Any

from hpc_cli.errors import RequestError
from hpc_cli.server.chat import Marker
from hpc_cli.server.schemas import Block, CacheControl, MessagesRequest
from hpc_cli.server.validate import cache_salt
from hpc_cli.server.vision_prompt import IMAGE_PART


def request_salt(body: MessagesRequest) -> str | None:
    """The request's cache salt: top-level ``cache_salt`` or ``metadata.cache_salt`` (equal when both)."""
    top = cache_salt(body.cache_salt, "cache_salt")
    meta = cache_salt((body.metadata or {}).get("cache_salt"), "metadata.cache_salt")
    if top is not None and meta is not None and top != meta:
        raise RequestError("cache_salt and metadata.cache_salt differ; send one of them")
    return top if top is not None else meta


def _tool_use(extra: dict[str, Any], where: str) -> dict[str, Any]:
    """A history ``tool_use`` block as the template's tool call (the API's shape checked)."""
    name, args, call_id = extra.get("name"), extra.get("input", {}), extra.get("id")
    if not isinstance(name, str) or not name:
        raise RequestError(f"{where}.name: Input should be a non-empty string")
    if not isinstance(args, dict):
        raise RequestError(f"{where}.input: Input should be an object")
    if call_id is not None and not isinstance(call_id, str):
        raise RequestError(f"{where}.id: Input should be a string")
    return {"type": "function", "id": call_id, "function": {"name": name, "arguments": args}}



def _block_text(block: Block, where: str) -> str:
    if block.text is None:
        raise RequestError(f"{where}.text: Field required")
    return block.text


def _tool_result_text(block: Block, where: str) -> str:
    content = (block.model_extra or {}).get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for k, c in enumerate(content):
            if not isinstance(c, dict) or c.get("type") != "text" or not isinstance(c.get("text"), str):
                raise RequestError(f"{where}.content.{k}: only text content is supported in tool results")
            parts.append(c["text"])
        return "\n".join(parts)
    raise RequestError(f"{where}.content: Input should be a string or a list of content blocks")


def convert(body: MessagesRequest) -> tuple[list[dict], list[dict] | None, list[Marker], list[str]]:
    """Anthropic request -> template messages, tools, breakpoint markers, and each breakpoint's ttl
    in prefix order (tools, system, messages). Raises RequestError for what the API rejects."""
    messages: list[dict] = []
    markers: list[Marker] = []
    ttls: list[str] = []

    def note(cc: CacheControl | None, where: str, empty: bool = False, kind: str = "text") -> bool:
        if cc is None:
            return False
        if kind in ("thinking", "redacted_thinking"):
            raise RequestError(f"{where}.cache_control: thinking blocks cannot be cached directly with "
                               "cache_control")
        if empty:
            raise RequestError(f"{where}: cache_control cannot be set for empty text blocks")
        ttls.append(cc.ttl or "5m")
        return True

    tools = None
    if body.tools:
        tools = []
        for i, t in enumerate(body.tools):
            tools.append({"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                           "parameters": t.input_schema or {}}})
            if note(t.cache_control, f"tools.{i}"):
                markers.append(Marker(-1, tools=True))

    if body.system is not None:
        if isinstance(body.system, str):
            if body.system:
                messages.append({"role": "system", "content": body.system})
        else:
            texts: list[str] = []
            sys_markers: list[int] = []
            for j, b in enumerate(body.system):
                where = f"system.{j}"
                if b.type != "text":
                    raise RequestError(f"{where}.type: system blocks must be text")
                text = _block_text(b, where)
                if not text:
                    raise RequestError(f"{where}: text content blocks must be non-empty")
                texts.append(text)
                if note(b.cache_control, where, empty=not text):
                    sys_markers.append(j)
            if texts:
                joined = "\n".join(texts)
                idx = len(messages)
                messages.append({"role": "system", "content": joined})
                for j in sys_markers:
                    markers.append(Marker(idx, "\n".join(texts[:j + 1]) if j < len(texts) - 1 else None))

    for i, m in enumerate(body.messages):
        where = f"messages.{i}"
        if isinstance(m.content, str):
            if not m.content and not (m.role == "assistant" and i == len(body.messages) - 1):
                raise RequestError(f"{where}: all messages must have non-empty content except for the optional "
                                   "final assistant message")
            messages.append({"role": m.role, "content": m.content})
            continue
        if not m.content and not (m.role == "assistant" and i == len(body.messages) - 1):
            raise RequestError(f"{where}: all messages must have non-empty content except for the optional "
                               "final assistant message")
        texts: list[str] = []
        parts: list[dict[str, str]] = []  # the template's parts when the message has images
        images = False
        text_markers: list[int] = []  # index into texts
        whole_marker = False
        reasoning: list[str] = []
        calls: list[dict] = []
        for j, b in enumerate(m.content):
            bw = f"{where}.content.{j}"
            extra = b.model_extra or {}
            if b.type == "text":
                text = _block_text(b, bw)
                if not text:
                    if b.cache_control is not None:
                        note(b.cache_control, bw, empty=True)
                    raise RequestError(f"{bw}: text content blocks must be non-empty")
                texts.append(text)
                parts.append({"type": "text", "text": text})
                if note(b.cache_control, bw):
                    text_markers.append(len(texts) - 1)
            elif b.type in ("thinking", "redacted_thinking"):
                note(b.cache_control, bw, kind=b.type)
                if m.role != "assistant":
                    raise RequestError(f"{bw}: thinking blocks are only allowed in assistant messages")
                if b.type == "thinking":
                    reasoning.append(str(extra.get("thinking", "")))
            elif b.type == "tool_use":
                if m.role != "assistant":
                    raise RequestError(f"{bw}: tool_use blocks are only allowed in assistant messages")
                calls.append(_tool_use(extra, bw))
                whole_marker |= note(b.cache_control, bw)
            elif b.type == "tool_result":
                if m.role != "user":
                    raise RequestError(f"{bw}: tool_result blocks are only allowed in user messages")
                if not isinstance(extra.get("tool_use_id", ""), str):
                    raise RequestError(f"{bw}.tool_use_id: Input should be a string")
                messages.append({"role": "tool", "content": _tool_result_text(b, bw),
                                 "tool_call_id": extra.get("tool_use_id")})
                if note(b.cache_control, bw):
                    markers.append(Marker(len(messages) - 1, None))
            elif b.type == "image":  # docs/vision.md; the sources are read by anthropic_sources
                if m.role != "user":
                    raise RequestError(f"{bw}: image blocks are only allowed in user messages")
                parts.append(dict(IMAGE_PART))
                images = True
                whole_marker |= note(b.cache_control, bw)
            elif b.type in ("document", "search_result", "container_upload"):
                raise RequestError(f"{bw}.type: {b.type!r} content is not supported (text and image blocks)")
            else:
                raise RequestError(f"{bw}.type: unknown content block type {b.type!r}")
        if texts or calls or reasoning or images or m.role == "assistant":
            idx = len(messages)
            msg: dict[str, Any] = {"role": m.role, "content": parts if images else "\n".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            if reasoning:
                msg["reasoning_content"] = "\n".join(reasoning)
            messages.append(msg)
            for k in text_markers:  # with images, a breakpoint marks the whole message
                markers.append(Marker(idx, "\n".join(texts[:k + 1])
                                      if (k < len(texts) - 1 or calls) and not images else None))
            if whole_marker:
                markers.append(Marker(idx, None))

    if body.cache_control is not None:
        ttls.append(body.cache_control.ttl or "5m")
        markers.append(Marker(len(messages) - 1, None, automatic=True))
    if len(ttls) > 4:
        raise RequestError(f"A maximum of 4 blocks with cache_control may be provided. Found {len(ttls)}.")
    seen_5m = False
    for ttl in ttls:
        if ttl == "5m":
            seen_5m = True
        elif seen_5m:
            raise RequestError("a ttl='1h' cache_control block must not come after a ttl='5m' cache_control "
                               "block. Note that blocks are processed in the following order: `tools`, "
                               "`system`, `messages`.")
    return messages, tools, markers, ttls
