"""OpenAI-compatible routes: /v1/completions and /v1/chat/completions.

``usage.prompt_tokens_details.cached_tokens`` is the engine's ``reuse_tokens`` (the frontier the
request resumed from, fixed at admission; spec §8.3), always present, never null.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator
from starlette.concurrency import run_in_threadpool

from hpc_cli.engine.api import (AdmittedEvent, FinishEvent, GenerationRequest, SamplingParams, TokenEvent, Usage)
from hpc_cli.errors import EngineError, RequestError
from hpc_cli.server.chat import Marker, prepare_chat
from hpc_cli.server.common import (ClientDisconnected, ReasoningSplitter, TextAssembler, Unavailable,
                                   iterate_events, openai_error_body, token_text)
from hpc_cli.server.media import ImageSource, MediaLimits
from hpc_cli.server.reqlog import log_request
from hpc_cli.server.timing import HpcOptions, wants_timing, with_timing
from hpc_cli.server.tools import ToolParser, ToolStream, tools_enabled
from hpc_cli.server.validate import JSONValue, parse_json_object, read_model, template_kwargs
from hpc_cli.server.validate import cache_salt as _cache_salt
from hpc_cli.server.vision_prompt import (has_openai_images, media_limits, openai_parts, prepare_images,
                                          require_vision)

Number = float


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Body):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class CacheControl(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class ContentPart(_Body):
    type: str
    text: str | None = None
    cache_control: CacheControl | None = None


class FunctionCallIn(_Body):
    name: str
    arguments: str | dict[str, JSONValue] = "{}"  # the API sends a JSON object as a string


class ToolCallIn(_Body):
    """An assistant message's tool call in the history (the API's shape)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    cache_control: CacheControl | None = None


class _Sampling(_Body):
    model: str
    max_tokens: StrictInt | None = Field(None, ge=1)  # the OpenAI API (and vLLM) reject 0 with a 400
    temperature: Number | None = Field(None, ge=0, le=2)
    top_p: Number | None = Field(None, ge=0, le=1)
    top_k: StrictInt | None = Field(None, ge=-1)
    n: StrictInt = Field(1, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: StrictInt | None = Field(None, ge=-(1 << 63), le=(1 << 63) - 1)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Number | None = Field(None, ge=-2, le=2)
    frequency_penalty: Number | None = Field(None, ge=-2, le=2)
    ignore_eos: StrictBool = False
    user: str | None = None
    hpc: HpcOptions | None = None  # this server's options: {"timing": true} adds usage.hpc_timing
    cache_salt: str | None = None  # extra_body: the tenant's cache partition (docs/security.md)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences")
        return v


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    # 0 only with echo: the prompt scored, nothing generated (legacy completions, as vLLM and the
    # evaluation harnesses that score prompts use it)
    max_tokens: StrictInt | None = Field(None, ge=0)
    echo: StrictBool = False
    logprobs: StrictInt | None = Field(None, ge=0, le=20)
    suffix: str | None = None
    best_of: StrictInt | None = None
    prompt_cache_key: str | None = None


def _stops(v: str | list[str] | None) -> tuple[str, ...]:
    if v is None:
        return ()
    return (v,) if isinstance(v, str) else tuple(v)


def _check_unsupported(body: _Sampling) -> None:
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):
            raise RequestError(f"{name} is not supported by this server; leave it unset or 0", param=name,
                               code="unsupported_parameter")


def _sampling(state, body: _Sampling, max_tokens: int, logprobs: int | None, prompt_logprobs: bool,
              seed_offset: int = 0) -> SamplingParams:
    temperature = 1.0 if body.temperature is None else float(body.temperature)
    top_p = 1.0 if body.top_p is None else float(body.top_p)
    if top_p == 0.0:
        temperature, top_p = 0.0, 1.0
    top_k = 0 if body.top_k in (None, -1) else int(body.top_k)
    seed = None if body.seed is None else body.seed + seed_offset
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                          stop_token_ids=() if body.ignore_eos else state.stop_token_ids(), stop=_stops(body.stop),
                          logprobs=logprobs, prompt_logprobs=prompt_logprobs, ignore_eos=body.ignore_eos)


def openai_usage(prompt: int, completion: int, cached: int, reasoning: int = 0) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
            "completion_tokens_details": {"reasoning_tokens": reasoning}}


def _finish_reason(fin: FinishEvent, asm: TextAssembler, tool_calls: bool = False) -> str:
    if tool_calls and fin.reason != "length":
        return "tool_calls"
    if asm.stopped is not None:
        return "stop"
    if fin.reason in ("stop", "length"):
        return fin.reason
    return "stop"


def _tool_parser(body: "ChatRequest") -> ToolParser | None:
    return ToolParser(body.tools) if tools_enabled(body.tools, body.tool_choice) else None


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _raise_for_finish(fin: FinishEvent) -> None:
    if fin.reason == "unavailable":
        raise Unavailable(fin.error or "the server is stopping; the request was not completed")
    if fin.reason == "error":
        raise EngineError(fin.error or "the engine failed this request")  # a 500, no traceback


def _logprob_entry(tokenizer, ev: TokenEvent, top: bool) -> dict:
    text, raw = token_text(tokenizer, ev.token_id)
    entry = {"token": text, "logprob": ev.logprob if ev.logprob is not None else 0.0, "bytes": raw,
             "top_logprobs": []}
    if top and ev.top_logprobs:
        for tid, lp in ev.top_logprobs:
            t, b = token_text(tokenizer, tid)
            entry["top_logprobs"].append({"token": t, "logprob": lp, "bytes": b})
    return entry


def _sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


class _Tracker:
    """Per-request metrics: inter-token gaps and the final usage."""

    def __init__(self, state, endpoint: str) -> None:
        self.state, self.endpoint, self.last = state, endpoint, None
        state.metrics.add_running(1)
        self.done = False
        self.started = time.monotonic()

    def token(self) -> None:
        now = time.monotonic()
        if self.last is not None:
            self.state.metrics.inter_token(now - self.last)
        self.last = now

    def finish(self, outcome: str, usage: Usage | None = None) -> None:
        if self.done:
            return
        self.done = True
        self.state.metrics.add_running(-1)
        if usage is not None:
            self.state.metrics.usage(usage)
        self.state.metrics.request_done(self.endpoint, outcome)
        log_request(self.endpoint, outcome, usage, time.monotonic() - self.started)


def _outcome(exc: BaseException) -> str:
    if isinstance(exc, (ClientDisconnected, asyncio.CancelledError, GeneratorExit)):
        return "cancelled"  # the client went away
    if isinstance(exc, Unavailable):
        return "unavailable"
    return "error"


def register(app: FastAPI, state) -> None:
    tok = state.tokenizer

    # ------------------------------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        state.authorize(request)
        body: ChatRequest = await read_model(request, ChatRequest)
        model = state.check_model(body.model)
        _check_unsupported(body)
        _cache_salt(body.cache_salt)
        if body.stream and body.n > 1:
            raise RequestError("n > 1 is not supported with stream", param="n")
        state.gate.check(body.n)
        if body.top_logprobs is not None and not body.logprobs:
            raise RequestError("top_logprobs requires logprobs: true", param="top_logprobs")
        messages, markers, images = _chat_messages(body, media_limits(state))
        require_vision(state.engine, len(images), media_limits(state))
        kwargs = template_kwargs(body.chat_template_kwargs)
        if body.reasoning_effort in ("none", "minimal") and "enable_thinking" not in kwargs:
            kwargs["enable_thinking"] = False
        # linear in the messages, but a long chat still takes a while: off the event loop
        prepared = await run_in_threadpool(prepare_chat, tok, messages, tools=body.tools, markers=markers,
                                           template_kwargs=kwargs)
        prepared, media = await prepare_images(state, prepared, images)  # docs/vision.md
        n = len(prepared.prompt_tokens)
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_tokens = state.resolve_max_tokens(n, requested)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        handles = []
        for i in range(body.n):
            req = GenerationRequest(prompt_tokens=list(prepared.prompt_tokens),
                                    sampling=_sampling(state, body, max_tokens, logprobs, False, seed_offset=i),
                                    tap_hints=list(prepared.tap_hints),
                                    message_boundaries=list(prepared.message_boundaries),
                                    cache_salt=body.cache_salt, media=list(media))
            try:
                handles.append(state.submit(req))
            except BaseException:
                for h in handles:
                    h.cancel()
                raise
        rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_chat_stream(state, request, handles[0], body, prepared, rid, created, model,
                                                  include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await _chat_full(state, request, handles, body, prepared, rid, created, model)

    # ------------------------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(request: Request):
        state.authorize(request)
        body: CompletionRequest = await read_model(request, CompletionRequest)
        model = state.check_model(body.model)
        _check_unsupported(body)
        _cache_salt(body.cache_salt)
        state.gate.check(_prompt_count(body.prompt) * body.n, param="prompt")
        if body.suffix:
            raise RequestError("suffix is not supported", param="suffix", code="unsupported_parameter")
        if body.max_tokens == 0 and not body.echo:
            raise RequestError("max_tokens: Input should be greater than or equal to 1 (0 only with echo)",
                               param="max_tokens")
        if body.best_of not in (None, body.n):
            raise RequestError("best_of must equal n (or be unset)", param="best_of")
        prompts = await run_in_threadpool(_completion_prompts, state, body.prompt)
        if body.stream and (len(prompts) > 1 or body.n > 1):
            raise RequestError("stream supports a single prompt with n = 1", param="stream")
        want_prompt_lp = body.echo and body.logprobs is not None
        handles = []
        plan = []
        for pi, (ids, text) in enumerate(prompts):
            max_tokens = state.resolve_max_tokens(len(ids), body.max_tokens, default=16, prompt_param="prompt")
            for j in range(body.n):
                req = GenerationRequest(prompt_tokens=list(ids),
                                        sampling=_sampling(state, body, max_tokens, body.logprobs, want_prompt_lp,
                                                           seed_offset=j),
                                        cache_salt=body.cache_salt)
                try:
                    handles.append(state.submit(req))
                except BaseException:
                    for h in handles:
                        h.cancel()
                    raise
                plan.append((pi, ids, text))
        rid = f"cmpl-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_completion_stream(state, request, handles[0], body, prompts[0], rid, created,
                                                        model, include_usage),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await _completion_full(state, request, handles, plan, body, rid, created, model)


# ----------------------------------------------------------------------------------------------
# Chat
# ----------------------------------------------------------------------------------------------

def _content_text(content) -> tuple[str, list[int]]:
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


def _prompt_count(prompt: str | list) -> int:
    """How many prompts a completions ``prompt`` holds (a string or one token list: 1)."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return 1
    return len(prompt)


def _chat_messages(body: ChatRequest, limits: MediaLimits | None = None
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


def _split_reasoning(text: str, active: bool) -> tuple[str | None, str]:
    sp = ReasoningSplitter(active)
    parts = sp.feed(text, final=True)
    reasoning = "".join(t for k, t in parts if k == "reasoning")
    content = "".join(t for k, t in parts if k == "content")
    return (reasoning if active else None), content


async def _collect(state, request: Request, handle, tracker: _Tracker, stop: tuple[str, ...], skip: set[int]):
    asm = TextAssembler(state.tokenizer, stop, skip)
    tokens: list[TokenEvent] = []
    async for ev in iterate_events(handle, request.is_disconnected):
        if isinstance(ev, TokenEvent):
            tracker.token()
            if asm.stopped is None:
                tokens.append(ev)
                asm.push(ev.token_id)
                if asm.stopped is not None:
                    handle.cancel()  # the engine stops at the same token; this only makes sure
        elif isinstance(ev, FinishEvent):
            if ev.reason == "cancelled" and asm.stopped is not None:
                ev.reason = "stop"
            asm.finish()
            return tokens, asm, ev
    raise RuntimeError("event stream ended without a FinishEvent")


async def _chat_full(state, request, handles, body: ChatRequest, prepared, rid, created, model):
    trackers = [_Tracker(state, "chat") for _ in handles]
    skip = set(state.stop_token_ids())
    parser = _tool_parser(body)
    choices = []
    usages: list[Usage] = []
    reasoning_tokens = 0
    try:
        for i, (h, tr) in enumerate(zip(handles, trackers)):
            tokens, asm, fin = await _collect(state, request, h, tr, _stops(body.stop), skip)
            _raise_for_finish(fin)
            tr.finish("ok", fin.usage)
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
                                      "finish_reason": _finish_reason(fin, asm, bool(calls))}
            if body.logprobs:
                choice["logprobs"] = {"content": [_logprob_entry(state.tokenizer, ev, bool(body.top_logprobs))
                                                  for ev in tokens if ev.token_id not in skip]}
            choices.append(choice)
    except BaseException as exc:
        for h, tr in zip(handles, trackers):
            h.cancel()
            tr.finish(_outcome(exc))
        raise
    first = usages[0]
    usage = with_timing(openai_usage(first.prompt_tokens or len(prepared.prompt_tokens),
                                     sum(u.completion_tokens for u in usages), first.reuse_tokens, reasoning_tokens),
                        first, wants_timing(state, body.hpc))
    return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": model,
                         "choices": choices, "usage": usage, "system_fingerprint": None})


async def _chat_stream(state, request, handle, body: ChatRequest, prepared, rid, created, model, include_usage):
    tracker = _Tracker(state, "chat")
    skip = set(state.stop_token_ids())
    asm = TextAssembler(state.tokenizer, _stops(body.stop), skip)
    splitter = ReasoningSplitter(prepared.opens_thinking)
    tool_stream = ToolStream(_tool_parser(body))
    base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "system_fingerprint": None}

    def chunk(delta: dict, finish: str | None = None, logprobs=None) -> str:
        data = dict(base, choices=[{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}])
        if include_usage:
            data["usage"] = None
        return _sse(data)

    n_calls = 0

    def content(pieces) -> list[dict]:
        nonlocal n_calls
        out = []
        for k, v in pieces:
            if k == "text":
                out.append({"content": v})
                continue
            out.append({"tool_calls": [{"index": n_calls, "id": _call_id(), "type": "function",
                                        "function": {"name": v.name, "arguments": ""}}]})
            out.append({"tool_calls": [{"index": n_calls, "function": {"arguments": v.arguments_json()}}]})
            n_calls += 1
        return out

    def deltas(parts, final: bool = False) -> list[dict]:
        out = []
        for kind, text in parts:
            if kind == "reasoning":
                out.append({"reasoning_content": text})
            else:
                out.extend(content(tool_stream.feed(text)))
        if final:
            out.extend(content(tool_stream.feed("", final=True)))
        return out

    outcome = "error"
    try:
        yield chunk({"role": "assistant", "content": ""})
        pending_lp: list[dict] = []
        async for ev in iterate_events(handle, request.is_disconnected):
            if isinstance(ev, TokenEvent):
                tracker.token()
                if asm.stopped is not None:
                    continue
                if body.logprobs and ev.token_id not in skip:
                    pending_lp.append(_logprob_entry(state.tokenizer, ev, bool(body.top_logprobs)))
                piece = asm.push(ev.token_id)
                if asm.stopped is not None:
                    handle.cancel()
                ds = deltas(splitter.feed(piece)) if piece else []
                for k, d in enumerate(ds):
                    lp = {"content": pending_lp} if (body.logprobs and k == len(ds) - 1) else None
                    yield chunk(d, logprobs=lp)
                    if lp:
                        pending_lp = []
            elif isinstance(ev, FinishEvent):
                if ev.reason == "unavailable" or ev.reason == "error":
                    outcome = "unavailable" if ev.reason == "unavailable" else "error"
                    tracker.finish(outcome, ev.usage)
                    status = 503 if ev.reason == "unavailable" else 500
                    yield _sse(openai_error_body(status, ev.error or (
                        "the server is stopping; the request was not completed" if status == 503
                        else "the engine failed this request"), code=ev.reason))
                    yield "data: [DONE]\n\n"
                    return
                tail = asm.finish()
                for d in deltas(splitter.feed(tail, final=True), final=True):
                    yield chunk(d)
                if pending_lp:
                    yield chunk({}, logprobs={"content": pending_lp})
                if ev.reason == "cancelled" and asm.stopped is not None:
                    ev.reason = "stop"
                yield chunk({}, finish=_finish_reason(ev, asm, n_calls > 0))
                u = ev.usage
                if include_usage:
                    yield _sse(dict(base, choices=[], usage=with_timing(openai_usage(
                        u.prompt_tokens or len(prepared.prompt_tokens), u.completion_tokens, u.reuse_tokens,
                        asm.reasoning_tokens(prepared.opens_thinking)),
                        u, wants_timing(state, body.hpc))))
                yield "data: [DONE]\n\n"
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


# ----------------------------------------------------------------------------------------------
# Completions
# ----------------------------------------------------------------------------------------------

def _completion_prompts(state, prompt) -> list[tuple[list[int], str]]:
    tok = state.tokenizer
    vocab = getattr(tok, "vocab_size", None)
    if isinstance(prompt, str):
        items: list = [prompt]
    elif prompt and all(isinstance(x, int) for x in prompt):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise RequestError("prompt must not be empty", param="prompt")
    out = []
    for item in items:
        if isinstance(item, str):
            ids = tok.encode(item)
            text = item
        else:
            ids = [int(i) for i in item]
            if vocab is not None and any(not (0 <= i < vocab) for i in ids):
                raise RequestError(f"prompt token ids must be in [0, {vocab})", param="prompt")
            text = tok.decode(ids)
        if not ids:
            raise RequestError("prompt must not be empty", param="prompt")
        out.append((ids, text))
    return out


def _completion_logprobs(tok, prompt_ids: list[int] | None, fin: FinishEvent | None, tokens: list[TokenEvent],
                         top: int, skip: set[int]) -> dict:
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = 0

    def add(tid: int, lp: float | None, tops: list[tuple[int, float]] | None) -> None:
        nonlocal offset
        text, _ = token_text(tok, tid)
        out["tokens"].append(text)
        out["token_logprobs"].append(lp)
        if lp is None:
            out["top_logprobs"].append(None)
        else:
            d = {text: lp}
            for t2, lp2 in (tops or [])[:max(top, 0)]:
                d.setdefault(token_text(tok, t2)[0], lp2)
            out["top_logprobs"].append(d)
        out["text_offset"].append(offset)
        offset += len(text)

    if prompt_ids is not None:
        plps = (fin.prompt_logprobs if fin is not None else None) or []
        ptops = getattr(fin, "prompt_top_logprobs", None) or []
        for k, tid in enumerate(prompt_ids):
            lp = plps[k] if k < len(plps) else None
            if k == 0:
                lp = None
            add(tid, lp, ptops[k] if k < len(ptops) else None)
    for ev in tokens:
        if ev.token_id in skip:
            continue
        add(ev.token_id, ev.logprob if ev.logprob is not None else 0.0, ev.top_logprobs)
    return out


async def _completion_full(state, request, handles, plan, body: CompletionRequest, rid, created, model):
    trackers = [_Tracker(state, "completions") for _ in handles]
    skip = set() if body.ignore_eos else set(state.stop_token_ids())
    choices = []
    prompt_total = completion_total = cached_total = 0
    seen_prompts: set[int] = set()
    first: Usage | None = None
    try:
        for i, (h, tr, (pi, ids, text)) in enumerate(zip(handles, trackers, plan)):
            tokens, asm, fin = await _collect(state, request, h, tr, _stops(body.stop), skip)
            _raise_for_finish(fin)
            tr.finish("ok", fin.usage)
            if first is None:
                first = fin.usage
            if pi not in seen_prompts:
                seen_prompts.add(pi)
                prompt_total += fin.usage.prompt_tokens or len(ids)
                cached_total += fin.usage.reuse_tokens
            completion_total += fin.usage.completion_tokens
            out_text = (text if body.echo else "") + asm.text
            lp = None
            if body.logprobs is not None:
                lp = _completion_logprobs(state.tokenizer, ids if body.echo else None, fin, tokens, body.logprobs,
                                          skip)
            choices.append({"index": i, "text": out_text, "logprobs": lp, "finish_reason": _finish_reason(fin, asm)})
    except BaseException as exc:
        for h, tr in zip(handles, trackers):
            h.cancel()
            tr.finish(_outcome(exc))
        raise
    return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": model,
                         "choices": choices,
                         "usage": with_timing(openai_usage(prompt_total, completion_total, cached_total), first,
                                              wants_timing(state, body.hpc)),
                         "system_fingerprint": None})


async def _completion_stream(state, request, handle, body: CompletionRequest, prompt, rid, created, model,
                             include_usage):
    tracker = _Tracker(state, "completions")
    skip = set() if body.ignore_eos else set(state.stop_token_ids())
    asm = TextAssembler(state.tokenizer, _stops(body.stop), skip)
    ids, ptext = prompt
    base = {"id": rid, "object": "text_completion", "created": created, "model": model}

    def chunk(text: str, finish: str | None = None, logprobs=None) -> str:
        data = dict(base, choices=[{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}])
        if include_usage:
            data["usage"] = None
        return _sse(data)

    outcome = "error"
    try:
        if body.echo:
            yield chunk(ptext)
        async for ev in iterate_events(handle, request.is_disconnected):
            if isinstance(ev, TokenEvent):
                tracker.token()
                if asm.stopped is not None:
                    continue
                piece = asm.push(ev.token_id)
                if asm.stopped is not None:
                    handle.cancel()
                lp = None
                if body.logprobs is not None and ev.token_id not in skip:
                    lp = _completion_logprobs(state.tokenizer, None, None, [ev], body.logprobs, skip)
                if piece or lp:
                    yield chunk(piece, logprobs=lp)
            elif isinstance(ev, FinishEvent):
                if ev.reason in ("unavailable", "error"):
                    outcome = ev.reason
                    tracker.finish(outcome, ev.usage)
                    status = 503 if ev.reason == "unavailable" else 500
                    yield _sse(openai_error_body(status, ev.error or "the request was not completed", code=ev.reason))
                    yield "data: [DONE]\n\n"
                    return
                tail = asm.finish()
                if ev.reason == "cancelled" and asm.stopped is not None:
                    ev.reason = "stop"
                yield chunk(tail, finish=_finish_reason(ev, asm))
                u = ev.usage
                if include_usage:
                    yield _sse(dict(base, choices=[], usage=with_timing(
                        openai_usage(u.prompt_tokens or len(ids), u.completion_tokens, u.reuse_tokens),
                        u, wants_timing(state, body.hpc))))
                yield "data: [DONE]\n\n"
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
