"""Request bodies of both APIs as pydantic models: OpenAI's ``/v1/chat/completions`` and
``/v1/completions`` (:class:`ChatRequest`, :class:`CompletionRequest`) and Anthropic's
``/v1/messages`` (:class:`MessagesRequest`).

Fields the APIs define and this server ignores are allowed (``extra="allow"``); what it cannot
honour is refused by the routes. ``cache_control`` has one shape in both APIs
(:class:`CacheControl`: type ``ephemeral``, ttl ``5m`` or ``1h``). Responses are built as dicts
by the routes (:mod:`.chat_completions`, :mod:`.completions`, :mod:`.messages`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator

from hpc_cli.server.timing import HpcOptions
from hpc_cli.server.validate import JSONValue

Number = float


class OpenBody(BaseModel):
    """A body part that keeps the fields it does not name (``model_extra``)."""

    model_config = ConfigDict(extra="allow")


class CacheControl(BaseModel):
    """A prompt-caching breakpoint (both APIs)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


# ---------------------------------------------------------------------------------------------
# OpenAI
# ---------------------------------------------------------------------------------------------

class StreamOptions(OpenBody):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class ContentPart(OpenBody):
    type: str
    text: str | None = None
    cache_control: CacheControl | None = None


class FunctionCallIn(OpenBody):
    name: str
    arguments: str | dict[str, JSONValue] = "{}"  # the API sends a JSON object as a string


class ToolCallIn(OpenBody):
    """An assistant message's tool call in the history (the API's shape)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(OpenBody):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    cache_control: CacheControl | None = None


class SamplingBody(OpenBody):
    """The fields both OpenAI routes take."""

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


class ChatRequest(SamplingBody):
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


class CompletionRequest(SamplingBody):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    # 0 only with echo: the prompt scored, nothing generated (legacy completions, as vLLM and the
    # evaluation harnesses that score prompts use it)
    max_tokens: StrictInt | None = Field(None, ge=0)
    echo: StrictBool = False
    logprobs: StrictInt | None = Field(None, ge=0, le=20)
    suffix: str | None = None
    best_of: StrictInt | None = None
    prompt_cache_key: str | None = None


# ---------------------------------------------------------------------------------------------
# Anthropic
# ---------------------------------------------------------------------------------------------

class Block(OpenBody):
    type: str
    text: str | None = None
    cache_control: CacheControl | None = None


class Message(OpenBody):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(OpenBody):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    cache_control: CacheControl | None = None


class Thinking(OpenBody):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: StrictInt | None = None


class MessagesRequest(OpenBody):
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
