"""Anthropic's ``/v1/messages``: the request converted (:mod:`.messages_prompt`), thinking,
text and ``tool_use`` content blocks, the whole message or a stream of named events
(:class:`MessagesStreamWriter` over :func:`.streaming.stream_events`).

Usage: ``cache_read_input_tokens`` = the engine's reuse tokens; ``cache_creation_input_tokens`` =
the tokens up to the last breakpoint beyond what was read; ``input_tokens`` = the rest of the
prompt.
"""

from __future__ import annotations

import uuid
from typing import Any, Iterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from hpc_cli.engine.api import FinishEvent, FinishReason, GenerationRequest, SamplingParams, Usage
from hpc_cli.errors import RequestError
from hpc_cli.server.chat import PreparedChat, prepare_chat
from hpc_cli.server.common import ReasoningSplitter, TextAssembler, anthropic_error_body
from hpc_cli.server.messages_prompt import convert, request_salt
from hpc_cli.server.schemas import MessagesRequest
from hpc_cli.server.state import ServerState
from hpc_cli.server.streaming import (StreamWriter, collect, raise_for_finish, sse_event, sse_response,
                                      stream_events)
from hpc_cli.server.timing import ServerMarks, wants_timing, with_timing
from hpc_cli.server.tools import ToolParser, ToolStream, tools_enabled
from hpc_cli.server.tracking import tracked
from hpc_cli.server.vision_prompt import anthropic_sources, media_limits, prepare_images, require_vision

STOP_REASONS = {FinishReason.STOP: "end_turn", FinishReason.LENGTH: "max_tokens"}


def register(app: FastAPI, state: ServerState) -> None:
    tok = state.tokenizer

    @app.post("/v1/messages")
    async def messages(request: Request):
        marks = ServerMarks()
        body = await state.read_body(request, MessagesRequest)
        salt = request_salt(body)
        model = state.check_model(body.model)
        msgs, tools, markers, ttls = convert(body)
        if not msgs:
            raise RequestError("messages: at least one message is required")
        images = anthropic_sources(body, media_limits(state))
        require_vision(state.engine, len(images), media_limits(state))
        thinking = body.thinking is not None and body.thinking.type != "disabled"
        continue_final = msgs[-1]["role"] == "assistant"
        prepared = await state.prepare(request, prepare_chat, tok, msgs, tools=tools, markers=markers,
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
        marks.submit(handle)
        reply = Reply(prepared, ttls, f"msg_{uuid.uuid4().hex[:24]}", model, prepared.opens_thinking and thinking,
                      ToolParser(tools) if tools_enabled(tools, body.tool_choice) else None,
                      wants_timing(state, body.hpc), marks)
        if body.stream:
            asm = TextAssembler(state.tokenizer, stop, set(state.stop_token_ids()))
            writer = MessagesStreamWriter(reply, asm)
            writer.marks = marks
            return sse_response(stream_events(state, request, handle, "messages", asm, writer))
        with tracked(state, "messages", [handle]) as (tracker,):
            _, asm, fin = await collect(state, request, handle, tracker, stop, set(state.stop_token_ids()))
            raise_for_finish(fin)
        tracker.finish("ok", fin.usage, marks)
        return JSONResponse(reply.message(asm, fin))


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


def _stop_reason(fin: FinishEvent, asm: TextAssembler, tool_use: bool) -> tuple[str, str | None]:
    if tool_use and fin.reason != FinishReason.LENGTH:
        return "tool_use", None
    if asm.stopped is not None:
        return "stop_sequence", asm.stopped
    return STOP_REASONS.get(fin.reason, "end_turn"), None


class Reply:
    """What the answer to one request is made with, streamed or not."""

    def __init__(self, prepared: PreparedChat, ttls: list[str], mid: str, model: str, thinking: bool,
                 parser: ToolParser | None, timing: bool, marks: ServerMarks | None = None) -> None:
        self.prepared, self.ttls, self.mid, self.model = prepared, ttls, mid, model
        self.thinking, self.parser, self.timing, self.marks = thinking, parser, timing, marks

    def usage(self, usage: Usage | None, reuse: int, output_tokens: int) -> dict:
        return anthropic_usage(self.prepared, usage, reuse, output_tokens, self.ttls)

    def final_usage(self, u: Usage) -> dict:
        return with_timing(self.usage(u, u.reuse_tokens, u.completion_tokens), u, self.timing, self.marks)

    def content_blocks(self, text: str) -> list[dict]:
        parts = ReasoningSplitter(self.thinking).feed(text, final=True)
        blocks = []
        reasoning = "".join(t for k, t in parts if k == "reasoning")
        content = "".join(t for k, t in parts if k == "content")
        if self.thinking and reasoning:
            blocks.append({"type": "thinking", "thinking": reasoning, "signature": ""})
        calls = []
        if self.parser is not None:
            content, calls = self.parser.parse(content)
        if content or not calls:
            blocks.append({"type": "text", "text": content})
        for c in calls:
            blocks.append({"type": "tool_use", "id": _tool_use_id(), "name": c.name, "input": c.arguments})
        return blocks

    def message(self, asm: TextAssembler, fin: FinishEvent) -> dict:
        """The whole ``message`` of a finished request."""
        blocks = self.content_blocks(asm.text)
        stop_reason, stop_sequence = _stop_reason(fin, asm, any(b["type"] == "tool_use" for b in blocks))
        return {"id": self.mid, "type": "message", "role": "assistant", "model": self.model,
                "content": blocks, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": self.final_usage(fin.usage)}


class MessagesStreamWriter(StreamWriter):
    """``message_start`` (at admission, with the reuse) and ``ping``; content blocks (thinking,
    text, each ``tool_use`` whole) as ``content_block_start``/``_delta``/``_stop``;
    ``message_delta`` with the stop reason and usage; ``message_stop``. A failure is an ``error``
    event."""

    sends_at_admission = True  # message_start, with the cached tokens, and a ping

    def __init__(self, reply: Reply, asm: TextAssembler) -> None:
        self.reply, self.asm = reply, asm
        self.splitter = ReasoningSplitter(reply.thinking)
        self.tool_stream = ToolStream(reply.parser)
        self.n_calls = 0
        self.started = False
        self.block_index = -1
        self.block_kind: str | None = None

    def _start(self, reuse: int) -> Iterator[str]:
        if self.started:
            return
        self.started = True
        r = self.reply
        yield sse_event("message_start", {"type": "message_start", "message": {
            "id": r.mid, "type": "message", "role": "assistant", "model": r.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": r.usage(None, reuse, 0)}})

    def _route(self, parts, final: bool = False) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        for kind, text in parts:
            if kind == "reasoning":
                out.append((kind, text))
            else:
                out.extend(("content" if k == "text" else "tool", v) for k, v in self.tool_stream.feed(text))
        if final:
            out.extend(("content" if k == "text" else "tool", v) for k, v in self.tool_stream.feed("", final=True))
        return out

    def _block(self, event: str, **fields: Any) -> str:
        return sse_event(event, {"type": event, "index": self.block_index, **fields})

    def _emit(self, parts) -> Iterator[str]:
        for kind, text in parts:
            if kind == "tool":
                yield from self._close()
                self.block_index += 1
                self.n_calls += 1
                yield self._block("content_block_start", content_block={
                    "type": "tool_use", "id": _tool_use_id(), "name": text.name, "input": {}})
                yield self._block("content_block_delta", delta={"type": "input_json_delta",
                                                                "partial_json": text.arguments_json()})
                yield self._block("content_block_stop")
                continue
            want = "thinking" if kind == "reasoning" else "text"
            if want != self.block_kind:
                yield from self._close()
                self.block_index += 1
                self.block_kind = want
                cb = {"type": "thinking", "thinking": "", "signature": ""} if want == "thinking" else \
                    {"type": "text", "text": ""}
                yield self._block("content_block_start", content_block=cb)
            delta = {"type": "thinking_delta", "thinking": text} if want == "thinking" else \
                {"type": "text_delta", "text": text}
            yield self._block("content_block_delta", delta=delta)

    def _close(self) -> Iterator[str]:
        if self.block_kind is not None:
            if self.block_kind == "thinking":
                yield self._block("content_block_delta", delta={"type": "signature_delta", "signature": ""})
            yield self._block("content_block_stop")
        self.block_kind = None

    def admitted(self, ev):
        if not self.started:
            yield from self._start(ev.reuse_tokens)
            yield sse_event("ping", {"type": "ping"})

    def token(self, ev, piece):
        yield from self._start(0)  # an engine that sends no AdmittedEvent: reuse comes with the finish
        if piece:
            yield from self._emit(self._route(self.splitter.feed(piece)))

    def finish(self, fin, tail):
        yield from self._start(fin.usage.reuse_tokens)
        yield from self._emit(self._route(self.splitter.feed(tail, final=True), final=True))
        if self.block_kind is None and self.block_index < 0:
            yield from self._emit([("content", "")])
        yield from self._close()
        stop_reason, stop_sequence = _stop_reason(fin, self.asm, self.n_calls > 0)
        yield sse_event("message_delta", {"type": "message_delta",
                                          "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                          "usage": self.reply.final_usage(fin.usage)})
        yield sse_event("message_stop", {"type": "message_stop"})

    def error(self, status, message, code):
        return (sse_event("error", anthropic_error_body(status, message)),)
