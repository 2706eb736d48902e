"""What a new user meets through the official openai and anthropic clients (FakeEngine, a test
double, on 127.0.0.1): reasoning tokens are counted, /v1/completions errors name `prompt`,
max_tokens 0 is each API's 400, no control character reaches a text delta, and each request is
one log line."""

from __future__ import annotations

import logging

import httpx
import pytest

from hpc_cli.server.app import create_app
from hpc_cli.server.stop import StopController
from hpc_cli.settings import load_settings

anthropic = pytest.importorskip("anthropic")  # the test extra
openai = pytest.importorskip("openai")

from .fake_engine import FakeEngine  # noqa: E402

MODEL = "builtin:random"
USER = [{"role": "user", "content": "Hi!"}]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
CONTROLS = "a\x00b\x1b[31mc\x07\td\ne\x7f\x9b\x1bf "  # NUL, ESC, BEL, DEL, a C1 control; tab and newline stay
CLEAN = "ab[31mc\td\nef "


def start(serve, **engine_kw) -> str:
    engine = FakeEngine(**engine_kw).start()
    controller = StopController(engine, echo=lambda m: None)
    app = create_app(engine, load_settings(None, {}, environ={}), stop_controller=controller)
    controller.state = app.state.hpc
    return serve(app, controller)


def oai(url: str):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=20)


def ant(url: str):
    return anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=20)


def no_controls(text: str) -> bool:
    return not any((ord(c) < 32 and c not in "\n\t") or 0x7F <= ord(c) < 0xA0 for c in text)


# --------------------------------------------------------------------------------- reasoning tokens
def test_reasoning_tokens_are_counted(serve):
    url = start(serve, text="plan it</think>\n\nok ")  # 7 + 1 tokens of reasoning, then "\n\nok "
    client = oai(url)
    r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=12)
    assert r.choices[0].message.model_extra["reasoning_content"] == "plan it"
    assert r.choices[0].message.content == "ok"
    assert r.usage.completion_tokens == 12 and r.usage.completion_tokens_details.reasoning_tokens == 8
    chunks = list(client.chat.completions.create(model=MODEL, messages=USER, max_tokens=12, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 8


def test_all_reasoning_when_it_never_closes_and_none_without_thinking(serve):
    url = start(serve, text="hmm ")
    client = oai(url)
    r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=36)
    assert r.choices[0].message.model_extra["reasoning_content"] and not r.choices[0].message.content
    assert r.usage.completion_tokens_details.reasoning_tokens == 36
    r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=36, extra_body=NO_THINK)
    assert r.usage.completion_tokens_details.reasoning_tokens == 0


# --------------------------------------------------------------------------------- errors
def test_completions_context_error_names_prompt(serve):
    url = start(serve, max_model_len=64)
    with pytest.raises(openai.BadRequestError) as exc:
        oai(url).completions.create(model=MODEL, prompt="x" * 100, max_tokens=4)
    assert exc.value.status_code == 400
    assert exc.value.body["param"] == "prompt" and exc.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as exc:  # chat keeps naming messages
        oai(url).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x" * 100}])
    assert exc.value.body["param"] == "messages"


@pytest.mark.parametrize("route,field", [("chat", "max_tokens"), ("chat", "max_completion_tokens"),
                                         ("completions", "max_tokens")])
def test_openai_max_tokens_zero_is_400(serve, route, field):
    """The OpenAI API (and vLLM) answer max_tokens 0 with 400 invalid_request_error."""
    url = start(serve)
    client = oai(url)
    with pytest.raises(openai.BadRequestError) as exc:
        if route == "chat":
            client.chat.completions.create(model=MODEL, messages=USER, **{field: 0})
        else:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=0)
    assert exc.value.status_code == 400
    assert exc.value.body["type"] == "invalid_request_error" and exc.value.body["param"] == field
    r = client.completions.create(model=MODEL, prompt="hi", max_tokens=1)  # 1 is the least allowed
    assert r.usage.completion_tokens == 1


def test_anthropic_max_tokens_zero_is_400(serve):
    url = start(serve)
    with pytest.raises(anthropic.BadRequestError) as exc:
        ant(url).messages.create(model=MODEL, max_tokens=0, messages=USER)
    assert exc.value.status_code == 400 and exc.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in exc.value.body["error"]["message"]


# --------------------------------------------------------------------------------- control characters
def test_no_control_characters_in_any_text(serve):
    url = start(serve, text=CONTROLS)
    n = len(CONTROLS.encode())  # one byte token each: the whole text once
    client, aclient = oai(url), ant(url)
    chat = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=n, extra_body=NO_THINK)
    assert chat.choices[0].message.content == CLEAN
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=n, stream=True, extra_body=NO_THINK) if c.choices)
    assert streamed == CLEAN
    thinking = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=n)
    assert no_controls(thinking.choices[0].message.model_extra["reasoning_content"])
    comp = client.completions.create(model=MODEL, prompt="hi", max_tokens=n)
    assert comp.choices[0].text == CLEAN
    comp_stream = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="hi", max_tokens=n, stream=True))
    assert comp_stream == CLEAN
    msg = aclient.messages.create(model=MODEL, max_tokens=n, messages=USER)
    assert "".join(b.text for b in msg.content if b.type == "text") == CLEAN
    with aclient.messages.stream(model=MODEL, max_tokens=n, messages=USER) as s:
        assert "".join(s.text_stream) == CLEAN
    raw = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": USER, "max_tokens": n,
                                                         "stream": True, **NO_THINK}).text
    assert "\\u0000" not in raw and "\\u001b" not in raw and "\x1b" not in raw


# --------------------------------------------------------------------------------- the request log
def test_one_log_line_per_request(serve, caplog):
    url = start(serve)
    with caplog.at_level(logging.INFO, logger="hpc_cli.server.requests"):
        r = oai(url).chat.completions.create(model=MODEL, messages=USER, max_tokens=6)
        ant(url).messages.create(model=MODEL, max_tokens=3, messages=USER)
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "hpc_cli.server.requests"]
    assert len(lines) == 2, lines
    chat, messages = lines
    assert chat.startswith("POST /v1/chat/completions ok | ")
    assert f"prompt {r.usage.prompt_tokens} tok, cached 0" in chat and "ttft " in chat
    assert "output 6 tok, " in chat and " tok/s" in chat
    assert messages.startswith("POST /v1/messages ok | ") and "output 3 tok" in messages
