"""What the two OpenAI routes (:mod:`.chat_completions`, :mod:`.completions`) share: the
sampling parameters a body asks for, the ``usage`` object, the ``finish_reason`` and the
streamed chunks' framing (:class:`OpenAIStreamWriter`).

``usage.prompt_tokens_details.cached_tokens`` is the engine's ``reuse_tokens`` (the frontier the
request resumed from, fixed at admission; spec §8.3), always present, never null.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, TypeVar

from fastapi import Request

from hpc_cli.engine.api import FinishEvent, FinishReason, SamplingParams
from hpc_cli.errors import RequestError
from hpc_cli.server.common import TextAssembler, openai_error_body
from hpc_cli.server.schemas import SamplingBody
from hpc_cli.server.streaming import DONE, StreamWriter, sse_data
from hpc_cli.server.validate import cache_salt

if TYPE_CHECKING:
    from hpc_cli.server.state import ServerState

Body = TypeVar("Body", bound=SamplingBody)


async def read_body(state: "ServerState", request: Request, model_cls: type[Body]) -> tuple[Body, str]:
    """The body read, the model it names (as served), the parameters this server refuses and the
    cache salt checked."""
    body = await state.read_body(request, model_cls)
    model = state.check_model(body.model)
    check_unsupported(body)
    cache_salt(body.cache_salt)
    return body, model


def stops(v: str | list[str] | None) -> tuple[str, ...]:
    """The body's ``stop`` as a tuple."""
    if v is None:
        return ()
    return (v,) if isinstance(v, str) else tuple(v)


def check_unsupported(body: SamplingBody) -> None:
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):
            raise RequestError(f"{name} is not supported by this server; leave it unset or 0", param=name,
                               code="unsupported_parameter")


def sampling_params(state: "ServerState", body: SamplingBody, max_tokens: int, logprobs: int | None,
                    prompt_logprobs: bool, seed_offset: int = 0) -> SamplingParams:
    """``top_p`` 0 samples greedily; ``top_k`` -1 is off; the n-th choice's seed is ``seed + n``."""
    temperature = 1.0 if body.temperature is None else float(body.temperature)
    top_p = 1.0 if body.top_p is None else float(body.top_p)
    if top_p == 0.0:
        temperature, top_p = 0.0, 1.0
    top_k = 0 if body.top_k in (None, -1) else int(body.top_k)
    seed = None if body.seed is None else body.seed + seed_offset
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                          stop_token_ids=() if body.ignore_eos else state.stop_token_ids(), stop=stops(body.stop),
                          logprobs=logprobs, prompt_logprobs=prompt_logprobs, ignore_eos=body.ignore_eos)


def openai_usage(prompt: int, completion: int, cached: int, reasoning: int = 0) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
            "completion_tokens_details": {"reasoning_tokens": reasoning}}


def finish_reason(fin: FinishEvent, asm: TextAssembler, tool_calls: bool = False) -> str:
    if tool_calls and fin.reason != FinishReason.LENGTH:
        return "tool_calls"
    if asm.stopped is not None:
        return "stop"
    if fin.reason in (FinishReason.STOP, FinishReason.LENGTH):
        return fin.reason.value
    return "stop"


class OpenAIStreamWriter(StreamWriter):
    """Chunks ``data: {...}`` over ``base`` (id, object, created, model), each with one choice
    (``usage: null`` in each when the client asked for usage), ending in ``data: [DONE]``; a
    failure is an ``{"error": ...}`` chunk and ``[DONE]``."""

    def __init__(self, base: dict[str, Any], include_usage: bool) -> None:
        self.base = base
        self.include_usage = include_usage
        self._frames: dict[str, tuple[str, str]] = {}

    def chunk(self, choice: dict[str, Any]) -> str:
        data = dict(self.base, choices=[choice])
        if self.include_usage:
            data["usage"] = None
        return sse_data(data)

    def framed_chunk(self, make_choice: Callable[[Any], dict[str, Any]], key: str, text: str) -> str:
        """``chunk(make_choice(text))`` for a choice whose only varying part is ``text`` (a content
        delta, a bare token), written as the rest of the chunk framed once per ``key`` around the
        text's JSON: the same bytes, without building and encoding the whole chunk a token."""
        frame = self._frames.get(key)
        if frame is None:
            marker = "\x00hpc-text\x00"
            head, sep, tail = self.chunk(make_choice(marker)).partition(json.dumps(marker, ensure_ascii=False))
            assert sep and marker not in tail, "the chunk's frame holds the text once"
            frame = self._frames[key] = (head, tail)
        head, tail = frame
        return head + json.dumps(text, ensure_ascii=False) + tail

    def closing(self, usage: Callable[[], dict]) -> Iterator[str]:
        """The usage chunk (when asked for) and ``[DONE]``."""
        if self.include_usage:
            yield sse_data(dict(self.base, choices=[], usage=usage()))
        yield DONE

    def error(self, status: int, message: str, code: str) -> Iterable[str]:
        return (sse_data(openai_error_body(status, message, code=code)), DONE)
