"""Anthropic-compatible route: /v1/messages (streaming and not).

``cache_control`` breakpoints are validated as the API does (type ``ephemeral``, ttl ``5m`` or
``1h``, at most four blocks, no 1h breakpoint after a 5m one, none on empty text or thinking
blocks) and become priority-1 tap hints; a top-level ``cache_control`` (automatic caching) marks
the end of the conversation as a structural, automatic hint. Usage:
``cache_read_input_tokens`` = the engine's reuse tokens; ``cache_creation_input_tokens`` = the
tokens up to the last breakpoint beyond what was read; ``input_tokens`` = the rest of the prompt.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt
from starlette.concurrency import run_in_threadpool

from hpc_cli.engine.api import AdmittedEvent, FinishEvent, GenerationRequest, SamplingParams, TokenEvent, Usage
from hpc_cli.errors import EngineError, RequestError
from hpc_cli.server.chat import Marker, PreparedChat, prepare_chat
from hpc_cli.server.common import (ClientDisconnected, ReasoningSplitter, TextAssembler, Unavailable,
                                   anthropic_error_body, iterate_events)
from hpc_cli.server.openai import _Tracker, _outcome
from hpc_cli.server.timing import HpcOptions, wants_timing, with_timing
from hpc_cli.server.tools import ToolParser, ToolStream, tools_enabled
from hpc_cli.server.validate import cache_salt as _cache_salt, read_model
from hpc_cli.server.vision_prompt import (IMAGE_PART, anthropic_sources, media_limits, prepare_images,
                                          require_vision)


class CacheControl(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class Block(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None
    cache_control: CacheControl | None = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    cache_control: CacheControl | None = None


class Thinking(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: StrictInt | None = None


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    max_tokens: StrictInt = Field(..., ge=1)
    messages: list[Message] = Field(..., min_length=1)
    system: str | list[Block] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: StrictInt | None = Field(None, ge=0)
    stop_sequences: list[str] | None = None
    stream: StrictBool = False
    metadata: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: Any = None
    thinking: Thinking | None = None
    cache_control: CacheControl | None = None
    hpc: HpcOptions | None = None  # this server's options: {"timing": true} adds usage.hpc_timing
    cache_salt: str | None = None  # the tenant's cache partition (or metadata.cache_salt; docs/security.md)


def request_salt(body: MessagesRequest) -> str | None:
    """The request's cache salt: top-level ``cache_salt`` or ``metadata.cache_salt`` (equal when both)."""
    top = _cache_salt(body.cache_salt, "cache_salt")
    meta = _cache_salt((body.metadata or {}).get("cache_salt"), "metadata.cache_salt")
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


STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}


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


def anthropic_usage(prepared: PreparedChat, usage: Usage | None, reuse: int, output_tokens: int,
                    ttls: list[str]) -> dict:
    n = (usage.prompt_tokens if usage is not None and usage.prompt_tokens else len(prepared.prompt_tokens))
    last_bp = max(prepared.marker_positions) if prepared.marker_positions else 0
    creation = max(0, last_bp - reuse)
    one_hour = bool(ttls) and ttls[-1] == "1h"
    return {"input_tokens": max(0, n - reuse - creation), "cache_creation_input_tokens": creation,
            "cache_read_input_tokens": reuse, "output_tokens": output_tokens,
            "cache_creation": {"ephemeral_5m_input_tokens": 0 if one_hour else creation,
                               "ephemeral_1h_input_tokens": creation if one_hour else 0}}


def _tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def _content_blocks(text: str, thinking: bool, parser: ToolParser | None = None) -> list[dict]:
    sp = ReasoningSplitter(thinking)
    parts = sp.feed(text, final=True)
    blocks = []
    reasoning = "".join(t for k, t in parts if k == "reasoning")
    content = "".join(t for k, t in parts if k == "content")
    if thinking and reasoning:
        blocks.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    calls = []
    if parser is not None:
        content, calls = parser.parse(content)
    if content or not calls:
        blocks.append({"type": "text", "text": content})
    for c in calls:
        blocks.append({"type": "tool_use", "id": _tool_use_id(), "name": c.name, "input": c.arguments})
    return blocks


def _stop_reason(fin: FinishEvent, asm: TextAssembler, tool_use: bool) -> tuple[str, str | None]:
    if tool_use and fin.reason != "length":
        return "tool_use", None
    if asm.stopped is not None:
        return "stop_sequence", asm.stopped
    return STOP_REASONS.get(fin.reason, "end_turn"), None


def _sse(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def register(app: FastAPI, state) -> None:
    tok = state.tokenizer

    @app.post("/v1/messages")
    async def messages(request: Request):
        state.authorize(request)
        body: MessagesRequest = await read_model(request, MessagesRequest)
        salt = request_salt(body)
        model = state.check_model(body.model)
        msgs, tools, markers, ttls = convert(body)
        if not msgs:
            raise RequestError("messages: at least one message is required")
        images = anthropic_sources(body, media_limits(state))
        require_vision(state.engine, len(images), media_limits(state))
        thinking = body.thinking is not None and body.thinking.type != "disabled"
        continue_final = msgs[-1]["role"] == "assistant"
        prepared = await run_in_threadpool(prepare_chat, tok, msgs, tools=tools, markers=markers,  # off the loop
                                           template_kwargs={"enable_thinking": thinking},
                                           continue_final=continue_final)
        prepared, media = await prepare_images(state, prepared, images)  # docs/vision.md
        n = len(prepared.prompt_tokens)
        max_tokens = state.resolve_max_tokens(n, body.max_tokens)
        stop = tuple(s for s in (body.stop_sequences or []) if s)
        temperature = 1.0 if body.temperature is None else float(body.temperature)
        top_p = 1.0 if not body.top_p else float(body.top_p)
        sampling = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                  top_k=body.top_k or 0, stop_token_ids=state.stop_token_ids(), stop=stop)
        req = GenerationRequest(prompt_tokens=list(prepared.prompt_tokens), sampling=sampling,
                                tap_hints=list(prepared.tap_hints),
                                message_boundaries=list(prepared.message_boundaries), cache_salt=salt,
                                media=list(media))
        handle = state.submit(req)
        mid = f"msg_{uuid.uuid4().hex[:24]}"
        opens = prepared.opens_thinking and thinking
        parser = ToolParser(tools) if tools_enabled(tools, body.tool_choice) else None
        timing = wants_timing(state, body.hpc)
        if body.stream:
            return StreamingResponse(_stream(state, request, handle, prepared, ttls, mid, model, stop, opens, parser,
                                             timing=timing),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await _full(state, request, handle, prepared, ttls, mid, model, stop, opens, parser, timing=timing)


async def _full(state, request, handle, prepared, ttls, mid, model, stop, thinking, parser=None, *,
                timing: bool = False):
    tracker = _Tracker(state, "messages")
    asm = TextAssembler(state.tokenizer, stop, set(state.stop_token_ids()))
    try:
        fin = None
        async for ev in iterate_events(handle, request.is_disconnected):
            if isinstance(ev, TokenEvent):
                tracker.token()
                if asm.stopped is None:
                    asm.push(ev.token_id)
                    if asm.stopped is not None:
                        handle.cancel()
            elif isinstance(ev, FinishEvent):
                fin = ev
        asm.finish()
        assert fin is not None, "event stream ended without a FinishEvent"
        if fin.reason == "unavailable":
            raise Unavailable(fin.error or "the server is stopping; the request was not completed")
        if fin.reason == "error":
            raise EngineError(fin.error or "the engine failed this request")  # a 500, no traceback
    except BaseException as exc:
        tracker.finish(_outcome(exc))
        raise
    tracker.finish("ok", fin.usage)
    blocks = _content_blocks(asm.text, thinking, parser)
    stop_reason, stop_sequence = _stop_reason(fin, asm, any(b["type"] == "tool_use" for b in blocks))
    return JSONResponse({
        "id": mid, "type": "message", "role": "assistant", "model": model,
        "content": blocks, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
        "usage": with_timing(anthropic_usage(prepared, fin.usage, fin.usage.reuse_tokens, fin.usage.completion_tokens,
                                             ttls), fin.usage, timing)})


async def _stream(state, request, handle, prepared, ttls, mid, model, stop, thinking, parser=None, *,
                  timing: bool = False):
    tracker = _Tracker(state, "messages")
    asm = TextAssembler(state.tokenizer, stop, set(state.stop_token_ids()))
    splitter = ReasoningSplitter(thinking)
    tool_stream = ToolStream(parser)
    n_calls = 0
    started = False
    block_index = -1
    block_kind: str | None = None
    outcome = "error"

    def start(reuse: int) -> str:
        return _sse("message_start", {"type": "message_start", "message": {
            "id": mid, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": anthropic_usage(prepared, None, reuse, 0, ttls)}})

    def route(parts, final: bool = False) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        for kind, text in parts:
            if kind == "reasoning":
                out.append((kind, text))
            else:
                out.extend(("content" if k == "text" else "tool", v) for k, v in tool_stream.feed(text))
        if final:
            out.extend(("content" if k == "text" else "tool", v) for k, v in tool_stream.feed("", final=True))
        return out

    def emit(parts) -> list[str]:
        nonlocal block_index, block_kind, n_calls
        out = []
        for kind, text in parts:
            if kind == "tool":
                out.extend(close())
                block_index += 1
                n_calls += 1
                out.append(_sse("content_block_start", {"type": "content_block_start", "index": block_index,
                                                        "content_block": {"type": "tool_use", "id": _tool_use_id(),
                                                                          "name": text.name, "input": {}}}))
                out.append(_sse("content_block_delta", {"type": "content_block_delta", "index": block_index,
                                                        "delta": {"type": "input_json_delta",
                                                                  "partial_json": text.arguments_json()}}))
                out.append(_sse("content_block_stop", {"type": "content_block_stop", "index": block_index}))
                continue
            want = "thinking" if kind == "reasoning" else "text"
            if want != block_kind:
                out.extend(close())
                block_index += 1
                block_kind = want
                cb = {"type": "thinking", "thinking": "", "signature": ""} if want == "thinking" else \
                    {"type": "text", "text": ""}
                out.append(_sse("content_block_start", {"type": "content_block_start", "index": block_index,
                                                        "content_block": cb}))
            delta = {"type": "thinking_delta", "thinking": text} if want == "thinking" else \
                {"type": "text_delta", "text": text}
            out.append(_sse("content_block_delta", {"type": "content_block_delta", "index": block_index,
                                                    "delta": delta}))
        return out

    def close() -> list[str]:
        nonlocal block_kind
        out = []
        if block_kind is not None:
            if block_kind == "thinking":
                out.append(_sse("content_block_delta", {"type": "content_block_delta", "index": block_index,
                                                        "delta": {"type": "signature_delta", "signature": ""}}))
            out.append(_sse("content_block_stop", {"type": "content_block_stop", "index": block_index}))
        block_kind = None
        return out

    try:
        async for ev in iterate_events(handle, request.is_disconnected):
            if isinstance(ev, AdmittedEvent):
                if not started:
                    started = True
                    yield start(ev.reuse_tokens)
                    yield _sse("ping", {"type": "ping"})
            elif isinstance(ev, TokenEvent):
                if not started:  # an engine that sends no AdmittedEvent: reuse comes with the finish
                    started = True
                    yield start(0)
                tracker.token()
                if asm.stopped is not None:
                    continue
                piece = asm.push(ev.token_id)
                if asm.stopped is not None:
                    handle.cancel()
                for s in emit(route(splitter.feed(piece))) if piece else ():
                    yield s
            elif isinstance(ev, FinishEvent):
                if ev.reason in ("unavailable", "error"):
                    outcome = ev.reason
                    tracker.finish(outcome, ev.usage)
                    status = 503 if ev.reason == "unavailable" else 500
                    yield _sse("error", anthropic_error_body(status, ev.error or (
                        "the server is stopping; the request was not completed" if status == 503
                        else "the engine failed this request")))
                    return
                if not started:
                    started = True
                    yield start(ev.usage.reuse_tokens)
                for s in emit(route(splitter.feed(asm.finish(), final=True), final=True)):
                    yield s
                if block_kind is None and block_index < 0:
                    for s in emit([("content", "")]):
                        yield s
                for s in close():
                    yield s
                stop_reason, stop_sequence = _stop_reason(ev, asm, n_calls > 0)
                u = ev.usage
                yield _sse("message_delta", {"type": "message_delta",
                                             "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                             "usage": with_timing(anthropic_usage(prepared, u, u.reuse_tokens,
                                                                                  u.completion_tokens, ttls),
                                                                  u, timing)})
                yield _sse("message_stop", {"type": "message_stop"})
                outcome = "ok"
                tracker.finish("ok", u)
                return
    except ClientDisconnected:
        outcome = "cancelled"  # the client went away
    except (asyncio.CancelledError, GeneratorExit):
        outcome = "cancelled"  # the stream was closed under it: the client went away
        raise
    finally:
        if handle.finished is None:
            handle.cancel()
        tracker.finish(outcome)
