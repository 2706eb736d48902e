"""OpenAI's legacy ``/v1/completions``: one or more prompts (text or token ids), ``n`` choices
each, ``echo`` (with ``max_tokens`` 0 the prompt is only scored), legacy logprobs (prompt
logprobs with ``echo``); the whole response or, for one prompt and one choice, a stream of
``text_completion`` chunks (:class:`CompletionStreamWriter` over
:func:`.streaming.stream_events`).
"""

from __future__ import annotations

import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from hpc_cli.engine.api import FinishEvent, GenerationRequest, TokenEvent, Usage
from hpc_cli.errors import RequestError
from hpc_cli.server.common import TextAssembler, token_text
from hpc_cli.server.openai_common import (OpenAIStreamWriter, finish_reason, openai_usage, read_body, sampling_params,
                                          stops)
from hpc_cli.server.schemas import CompletionRequest
from hpc_cli.server.state import ServerState
from hpc_cli.server.streaming import collect, raise_for_finish, sse_response, stream_events
from hpc_cli.server.timing import ServerMarks, wants_timing, with_timing
from hpc_cli.server.tracking import tracked


def register(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request):
        marks = ServerMarks()
        body, model = await read_body(state, request, CompletionRequest)
        state.gate.check(prompt_count(body.prompt) * body.n, param="prompt")
        if body.suffix:
            raise RequestError("suffix is not supported", param="suffix", code="unsupported_parameter")
        if body.max_tokens == 0 and not body.echo:
            raise RequestError("max_tokens: Input should be greater than or equal to 1 (0 only with echo)",
                               param="max_tokens")
        if body.best_of not in (None, body.n):
            raise RequestError("best_of must equal n (or be unset)", param="best_of")
        prompts = await state.prepare(request, completion_prompts, state, body.prompt)
        if body.stream and (len(prompts) > 1 or body.n > 1):
            raise RequestError("stream supports a single prompt with n = 1", param="stream")
        want_prompt_lp = body.echo and body.logprobs is not None
        requests = []
        plan = []
        for pi, (ids, text) in enumerate(prompts):
            max_tokens = state.resolve_max_tokens(len(ids), body.max_tokens, default=16, prompt_param="prompt")
            for j in range(body.n):
                requests.append(GenerationRequest(
                    prompt_tokens=list(ids), cache_salt=body.cache_salt,
                    sampling=sampling_params(state, body, max_tokens, body.logprobs, want_prompt_lp, seed_offset=j)))
                plan.append((pi, ids, text))
        handles = state.submit_all(requests)
        marks.submit(handles[0])
        rid = f"cmpl-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            base = {"id": rid, "object": "text_completion", "created": created, "model": model}
            skip = set() if body.ignore_eos else set(state.stop_token_ids())
            asm = TextAssembler(state.tokenizer, stops(body.stop), skip)
            writer = CompletionStreamWriter(state, body, prompts[0], asm, skip, base, include_usage)
            writer.marks = marks
            return sse_response(stream_events(state, request, handles[0], "completions", asm, writer))
        return await _completion_full(state, request, handles, plan, body, rid, created, model, marks)


def prompt_count(prompt: str | list) -> int:
    """How many prompts a completions ``prompt`` holds (a string or one token list: 1)."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return 1
    return len(prompt)


def completion_prompts(state: ServerState, prompt) -> list[tuple[list[int], str]]:
    """Each prompt as (token ids, text): text is encoded, token ids checked against the vocabulary."""
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


def completion_logprobs(tok, prompt_ids: list[int] | None, fin: FinishEvent | None, tokens: list[TokenEvent],
                        top: int, skip: set[int]) -> dict:
    """The legacy ``logprobs`` object: the prompt's (with ``echo``; the first token's is null)
    and the generated tokens'."""
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


async def _completion_full(state: ServerState, request: Request, handles, plan, body: CompletionRequest, rid: str,
                           created: int, model: str, marks: ServerMarks) -> JSONResponse:
    skip = set() if body.ignore_eos else set(state.stop_token_ids())
    choices = []
    prompt_total = completion_total = cached_total = 0
    seen_prompts: set[int] = set()
    first: Usage | None = None
    with tracked(state, "completions", handles) as trackers:
        for i, (h, tr, (pi, ids, text)) in enumerate(zip(handles, trackers, plan)):
            tokens, asm, fin = await collect(state, request, h, tr, stops(body.stop), skip)
            raise_for_finish(fin)
            tr.finish("ok", fin.usage, marks if i == 0 else None)
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
                lp = completion_logprobs(state.tokenizer, ids if body.echo else None, fin, tokens, body.logprobs,
                                         skip)
            choices.append({"index": i, "text": out_text, "logprobs": lp, "finish_reason": finish_reason(fin, asm)})
    return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": model,
                         "choices": choices,
                         "usage": with_timing(openai_usage(prompt_total, completion_total, cached_total), first,
                                              wants_timing(state, body.hpc), marks),
                         "system_fingerprint": None})


class CompletionStreamWriter(OpenAIStreamWriter):
    """``text_completion`` chunks: the prompt first with ``echo``, then each token's text (and its
    logprobs), the held-back tail with the ``finish_reason``, usage."""

    def __init__(self, state: ServerState, body: CompletionRequest, prompt: tuple[list[int], str],
                 asm: TextAssembler, skip: set[int], base: dict, include_usage: bool) -> None:
        super().__init__(base, include_usage)
        self.state, self.body, self.asm, self.skip = state, body, asm, skip
        self.ids, self.text = prompt

    def text_chunk(self, text: str, finish: str | None = None, logprobs=None) -> str:
        if finish is None and logprobs is None:  # a token's text: the chunk framed once
            return self.framed_chunk(self._choice, "text", text)
        return self.chunk(self._choice(text, finish, logprobs))

    @staticmethod
    def _choice(text: str, finish: str | None = None, logprobs=None) -> dict:
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def opening(self):
        return (self.text_chunk(self.text),) if self.body.echo else ()

    def token(self, ev, piece):
        lp = None
        if self.body.logprobs is not None and ev.token_id not in self.skip:
            lp = completion_logprobs(self.state.tokenizer, None, None, [ev], self.body.logprobs, self.skip)
        return (self.text_chunk(piece, logprobs=lp),) if piece or lp else ()

    def finish(self, fin, tail):
        yield self.text_chunk(tail, finish=finish_reason(fin, self.asm))
        u = fin.usage
        yield from self.closing(lambda: with_timing(
            openai_usage(u.prompt_tokens or len(self.ids), u.completion_tokens, u.reuse_tokens),
            u, wants_timing(self.state, self.body.hpc), self.marks))
