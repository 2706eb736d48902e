"""OpenAI's ``/v1/chat/completions``: messages to a prompt (:mod:`.chat`, images by
:mod:`.vision_prompt`), ``n`` choices, reasoning split out as ``reasoning_content``, tool calls
parsed (:mod:`.tools`), token logprobs; the whole response or a stream of chunks
(:class:`ChatStreamWriter` over :func:`.streaming.stream_events`).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from hpc_cli.engine.api import GenerationRequest, TokenEvent, Usage
from hpc_cli.errors import RequestError
from hpc_cli.server.chat import Marker, PreparedChat, prepare_chat
from hpc_cli.server.common import ReasoningSplitter, TextAssembler, token_text
from hpc_cli.server.media import ImageSource, MediaLimits
from hpc_cli.server.openai_common import (OpenAIStreamWriter, finish_reason, openai_usage, read_body, sampling_params,
                                          stops)
from hpc_cli.server.schemas import ChatRequest, ContentPart, ToolCallIn
from hpc_cli.server.state import ServerState
from hpc_cli.server.streaming import collect, raise_for_finish, sse_response, stream_events
from hpc_cli.server.timing import ServerMarks, wants_timing, with_timing
from hpc_cli.server.tools import ToolParser, ToolStream, tools_enabled
from hpc_cli.server.tracking import tracked
from hpc_cli.server.validate import JSONValue, parse_json_object, template_kwargs
from hpc_cli.server.vision_prompt import (has_openai_images, media_limits, openai_parts, prepare_images,
                                          require_vision)


def register(app: FastAPI, state: ServerState) -> None:
    tok = state.tokenizer

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        marks = ServerMarks()
        body, model = await read_body(state, request, ChatRequest)
        if body.stream and body.n > 1:
            raise RequestError("n > 1 is not supported with stream", param="n")
        state.gate.check(body.n)
        if body.top_logprobs is not None and not body.logprobs:
            raise RequestError("top_logprobs requires logprobs: true", param="top_logprobs")
        messages, markers, images = chat_messages(body, media_limits(state))
        require_vision(state.engine, len(images), media_limits(state))
        kwargs = template_kwargs(body.chat_template_kwargs)
        if body.reasoning_effort in ("none", "minimal") and "enable_thinking" not in kwargs:
            kwargs["enable_thinking"] = False
        # linear in the messages: on the thread pool while other requests stream (ServerState.prepare)
        prepared = await state.prepare(request, prepare_chat, tok, messages, tools=body.tools, markers=markers,
                                       template_kwargs=kwargs)
        prepared, media = await prepare_images(state, prepared, images)  # docs/vision.md
        n = len(prepared.prompt_tokens)
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_tokens = state.resolve_max_tokens(n, requested)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        handles = state.submit_all([
            GenerationRequest(prompt_tokens=list(prepared.prompt_tokens),
                              sampling=sampling_params(state, body, max_tokens, logprobs, False, seed_offset=i),
                              tap_hints=list(prepared.tap_hints), message_boundaries=list(prepared.message_boundaries),
                              cache_salt=body.cache_salt, media=list(media))
            for i in range(body.n)])
        marks.submit(handles[0])
        rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                    "system_fingerprint": None}
            skip = set(state.stop_token_ids())
            asm = TextAssembler(state.tokenizer, stops(body.stop), skip)
            writer = ChatStreamWriter(state, body, prepared, asm, skip, base, include_usage)
            writer.marks = marks
            return sse_response(stream_events(state, request, handles[0], "chat", asm, writer))
        return await _chat_full(state, request, handles, body, prepared, rid, created, model, marks)


# ----------------------------------------------------------------------------------------------
# Messages to the template's
# ----------------------------------------------------------------------------------------------

def _content_text(content: str | list[ContentPart] | None) -> tuple[str, list[int]]:
    """Joined text of a message's content and, per part, the text length after it."""
    if content is None:
        return "", []
    if isinstance(content, str):
        return content, []
    texts, ends = [], []
    for i, part in enumerate(content):
        if part.type not in ("text", "input_text", "output_text"):
            raise RequestError(f"content part type {part.type!r} is not supported (text and image_url)",
                               param=f"messages.content.{i}.type", code="unsupported_content")
        if part.text is None:
            raise RequestError("a text content part needs 'text'", param=f"messages.content.{i}.text")
        texts.append(part.text)
        ends.append(len("\n".join(texts)))
    return "\n".join(texts), ends


def _history_call(call: ToolCallIn, where: str) -> dict[str, JSONValue]:
    """A tool call of the history as the template takes it: ``arguments`` a JSON object."""
    args = call.function.arguments
    if isinstance(args, str):
        try:
            args = parse_json_object(args.encode("utf-8")) if args.strip() else {}
        except RequestError as exc:
            raise RequestError(f"{where}.function.arguments must be a JSON object ({exc.message})",
                               param=f"{where}.function.arguments", code="invalid_value") from None
    return {**call.model_dump(), "function": {"name": call.function.name, "arguments": args}}


def chat_messages(body: ChatRequest, limits: MediaLimits | None = None
                  ) -> tuple[list[dict], list[Marker], list[ImageSource]]:
    """Template messages, breakpoint markers, and the images in order (a message with images
    keeps its parts for the template; a breakpoint on one of its parts marks the whole message)."""
    messages: list[dict] = []
    markers: list[Marker] = []
    images: list[ImageSource] = []
    for i, m in enumerate(body.messages):
        parts = None
        if has_openai_images(m.content):
            if m.role != "user":
                raise RequestError("images may only be sent in user messages", param=f"messages.{i}.content",
                                   code="unsupported_content")
            parts, found = openai_parts(m.content, f"messages.{i}", limits or MediaLimits())
            images += found
            text, ends = "", []
        else:
            text, ends = _content_text(m.content)
        role = {"developer": "system", "function": "tool"}.get(m.role, m.role)
        msg: dict[str, Any] = {"role": role, "content": text if parts is None else parts}
        if m.name:
            msg["name"] = m.name
        if m.tool_calls:
            msg["tool_calls"] = [_history_call(call, f"messages.{i}.tool_calls.{j}")
                                 for j, call in enumerate(m.tool_calls)]
        if m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
        if m.reasoning_content:
            msg["reasoning_content"] = m.reasoning_content
        if isinstance(m.content, list):
            for j, part in enumerate(m.content):
                if part.cache_control is not None:
                    markers.append(Marker(i, text[:ends[j]] if j < len(m.content) - 1 and parts is None else None))
        if m.cache_control is not None:
            markers.append(Marker(i, None))
        messages.append(msg)
    if len(markers) > 4:
        raise RequestError(f"A maximum of 4 cache breakpoints may be given. Found {len(markers)}.",
                           param="messages", code="too_many_cache_breakpoints")
    return messages, markers, images


# ----------------------------------------------------------------------------------------------
# The answer
# ----------------------------------------------------------------------------------------------

def _split_reasoning(text: str, active: bool) -> tuple[str | None, str]:
    sp = ReasoningSplitter(active)
    parts = sp.feed(text, final=True)
    reasoning = "".join(t for k, t in parts if k == "reasoning")
    content = "".join(t for k, t in parts if k == "content")
    return (reasoning if active else None), content


def _tool_parser(body: ChatRequest) -> ToolParser | None:
    return ToolParser(body.tools) if tools_enabled(body.tools, body.tool_choice) else None


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _logprob_entry(tokenizer, ev: TokenEvent, top: bool) -> dict:
    text, raw = token_text(tokenizer, ev.token_id)
    entry = {"token": text, "logprob": ev.logprob if ev.logprob is not None else 0.0, "bytes": raw,
             "top_logprobs": []}
    if top and ev.top_logprobs:
        for tid, lp in ev.top_logprobs:
            t, b = token_text(tokenizer, tid)
            entry["top_logprobs"].append({"token": t, "logprob": lp, "bytes": b})
    return entry


async def _chat_full(state: ServerState, request: Request, handles, body: ChatRequest, prepared: PreparedChat,
                     rid: str, created: int, model: str, marks: ServerMarks) -> JSONResponse:
    skip = set(state.stop_token_ids())
    parser = _tool_parser(body)
    choices = []
    usages: list[Usage] = []
    reasoning_tokens = 0
    with tracked(state, "chat", handles) as trackers:
        for i, (h, tr) in enumerate(zip(handles, trackers)):
            tokens, asm, fin = await collect(state, request, h, tr, stops(body.stop), skip)
            raise_for_finish(fin)
            tr.finish("ok", fin.usage, marks if i == 0 else None)
            usages.append(fin.usage)
            reasoning_tokens += asm.reasoning_tokens(prepared.opens_thinking)
            reasoning, content = _split_reasoning(asm.text, prepared.opens_thinking)
            calls = []
            if parser is not None:
                content, calls = parser.parse(content)
            msg: dict[str, Any] = {"role": "assistant", "content": None if calls and not content else content}
            if reasoning is not None:
                msg["reasoning_content"] = reasoning
            if calls:
                msg["tool_calls"] = [{"id": _call_id(), "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments_json()}} for c in calls]
            choice: dict[str, Any] = {"index": i, "message": msg, "logprobs": None,
                                      "finish_reason": finish_reason(fin, asm, bool(calls))}
            if body.logprobs:
                choice["logprobs"] = {"content": [_logprob_entry(state.tokenizer, ev, bool(body.top_logprobs))
                                                  for ev in tokens if ev.token_id not in skip]}
            choices.append(choice)
    first = usages[0]
    usage = with_timing(openai_usage(first.prompt_tokens or len(prepared.prompt_tokens),
                                     sum(u.completion_tokens for u in usages), first.reuse_tokens, reasoning_tokens),
                        first, wants_timing(state, body.hpc), marks)
    return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": model,
                         "choices": choices, "usage": usage, "system_fingerprint": None})


class ChatStreamWriter(OpenAIStreamWriter):
    """``chat.completion.chunk``s: the role first, then ``delta``s of ``reasoning_content``,
    ``content`` and ``tool_calls`` (each call whole: its name, then its arguments), token
    logprobs on the last delta of the token that released them, the ``finish_reason``, usage."""

    def __init__(self, state: ServerState, body: ChatRequest, prepared: PreparedChat, asm: TextAssembler,
                 skip: set[int], base: dict[str, Any], include_usage: bool) -> None:
        super().__init__(base, include_usage)
        self.state, self.body, self.prepared, self.asm, self.skip = state, body, prepared, asm, skip
        self.splitter = ReasoningSplitter(prepared.opens_thinking)
        self.tool_stream = ToolStream(_tool_parser(body))
        self.n_calls = 0
        self.pending_lp: list[dict] = []

    def delta(self, delta: dict, finish: str | None = None, logprobs=None) -> str:
        if finish is None and logprobs is None and len(delta) == 1:
            (key, text), = delta.items()
            if key in ("content", "reasoning_content") and isinstance(text, str):  # a token's text:
                return self.framed_chunk(lambda t: self._choice({key: t}), key, text)  # framed once
        return self.chunk(self._choice(delta, finish, logprobs))

    @staticmethod
    def _choice(delta: dict, finish: str | None = None, logprobs=None) -> dict:
        return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    def _content(self, pieces) -> list[dict]:
        out = []
        for k, v in pieces:
            if k == "text":
                out.append({"content": v})
                continue
            out.append({"tool_calls": [{"index": self.n_calls, "id": _call_id(), "type": "function",
                                        "function": {"name": v.name, "arguments": ""}}]})
            out.append({"tool_calls": [{"index": self.n_calls, "function": {"arguments": v.arguments_json()}}]})
            self.n_calls += 1
        return out

    def _deltas(self, parts, final: bool = False) -> list[dict]:
        out = []
        for kind, text in parts:
            if kind == "reasoning":
                out.append({"reasoning_content": text})
            else:
                out.extend(self._content(self.tool_stream.feed(text)))
        if final:
            out.extend(self._content(self.tool_stream.feed("", final=True)))
        return out

    def opening(self):
        yield self.delta({"role": "assistant", "content": ""})

    def token(self, ev, piece):
        logprobs = bool(self.body.logprobs)
        if logprobs and ev.token_id not in self.skip:
            self.pending_lp.append(_logprob_entry(self.state.tokenizer, ev, bool(self.body.top_logprobs)))
        ds = self._deltas(self.splitter.feed(piece)) if piece else []
        for k, d in enumerate(ds):
            lp = {"content": self.pending_lp} if (logprobs and k == len(ds) - 1) else None
            yield self.delta(d, logprobs=lp)
            if lp:
                self.pending_lp = []

    def finish(self, fin, tail):
        for d in self._deltas(self.splitter.feed(tail, final=True), final=True):
            yield self.delta(d)
        if self.pending_lp:
            yield self.delta({}, logprobs={"content": self.pending_lp})
        yield self.delta({}, finish=finish_reason(fin, self.asm, self.n_calls > 0))
        u, prepared = fin.usage, self.prepared
        yield from self.closing(lambda: with_timing(openai_usage(
            u.prompt_tokens or len(prepared.prompt_tokens), u.completion_tokens, u.reuse_tokens,
            self.asm.reasoning_tokens(prepared.opens_thinking)), u, wants_timing(self.state, self.body.hpc),
            self.marks))
