"""The real engine (builtin:random on CPU) behind a live server on 127.0.0.1, driven by the official
openai and anthropic clients: reuse reported as cached_tokens, streaming usage, Anthropic
cache_control reuse, the orderly stop."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

try:
    from hpc_cli.engine.engine import Engine
except ImportError as exc:  # pragma: no cover - until the engine lands
    pytest.skip(f"hpc_cli.engine.engine does not import yet: {exc}", allow_module_level=True)

from hpc_cli.server.app import create_app
from hpc_cli.server.stop import StopController
from hpc_cli.settings import load_settings

anthropic = pytest.importorskip("anthropic")  # the test extra; absent on bare machines
openai = pytest.importorskip("openai")  # the test extra; absent on bare machines

SYSTEM = "You are a careful assistant who answers briefly. " * 4  # ~200 byte tokens
FLAGS = {"model.name": "builtin:random", "model.device": "cpu", "model.max_model_len": 2048,
         "engine.max_concurrency": 2, "engine.prefill_chunk": 256, "cache.host_cache_mib": 64}
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}


def start(serve):
    settings = load_settings(None, FLAGS, environ={})
    engine = Engine.from_settings(settings).start()
    controller = StopController(engine, echo=lambda m: None)
    app = create_app(engine, settings, stop_controller=controller)
    controller.state = app.state.hpc
    handles = []
    submit = engine.submit

    def recording_submit(request):
        h = submit(request)
        handles.append(h)
        return h

    engine.submit = recording_submit  # to compare the reported numbers with the engine's own
    return engine, controller, serve(app, controller), handles


@pytest.fixture(scope="module")
def live():
    from .conftest import live_server

    settings = load_settings(None, FLAGS, environ={})
    engine = Engine.from_settings(settings).start()
    app = create_app(engine, settings)
    handles = []
    submit = engine.submit

    def recording_submit(request):
        h = submit(request)
        handles.append(h)
        return h

    engine.submit = recording_submit
    with live_server(app) as url:
        yield engine, url, handles
    engine.stop(timeout=30)


def _reuse(handles) -> int:
    deadline = time.monotonic() + 10
    while handles[-1].finished is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return handles[-1].finished.usage.reuse_tokens


def test_three_turn_chat_cached_tokens(live):
    engine, url, handles = live
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a prefix cache?"}]
    reported, openers = [], []
    for turn in range(3):
        r = client.chat.completions.create(model="builtin:random", messages=messages, max_tokens=8, temperature=0,
                                           extra_body=NO_THINK)
        req = handles[-1].request
        openers.append(next(h.position for h in req.tap_hints if h.priority == 2))
        assert r.usage.prompt_tokens == len(req.prompt_tokens)
        assert r.usage.prompt_tokens_details.cached_tokens == _reuse(handles)
        reported.append(r.usage.prompt_tokens_details.cached_tokens)
        messages += [{"role": "assistant", "content": r.choices[0].message.content or "ok"},
                     {"role": "user", "content": f"And question {turn + 2}?"}]
    # turns 2 and 3 resume at least from the last 64-token block boundary before the previous opener
    assert reported[1] >= openers[0] // 64 * 64 >= 64
    assert reported[2] >= openers[1] // 64 * 64 and reported[2] > reported[1]


def test_streaming_usage(live):
    engine, url, handles = live
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "stream please"}]
    client.chat.completions.create(model="builtin:random", messages=messages, max_tokens=2, extra_body=NO_THINK)
    chunks = list(client.chat.completions.create(model="builtin:random", messages=messages, max_tokens=6,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body=NO_THINK))
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == handles[-1].finished.usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens == handles[-1].finished.usage.reuse_tokens > 0


def test_completions_echo_logprobs(live):
    engine, url, handles = live
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    r = client.completions.create(model="builtin:random", prompt=[list(b"hello world")], max_tokens=1, echo=True,
                                  logprobs=1, temperature=0)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 12 and lp.token_logprobs[0] is None
    assert all(isinstance(x, float) and x <= 0 for x in lp.token_logprobs[1:])


def test_anthropic_cache_control_reuse(live):
    engine, url, handles = live
    client = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=60)
    system = [{"type": "text", "text": "Reference manual. " * 20, "cache_control": {"type": "ephemeral"}}]
    first = [{"role": "user", "content": "Summarise section one."}]
    r1 = client.messages.create(model="builtin:random", max_tokens=4, system=system, messages=first)
    bp = next(h.position for h in handles[-1].request.tap_hints if h.priority == 1)
    assert r1.usage.cache_creation_input_tokens == bp - r1.usage.cache_read_input_tokens
    r2 = client.messages.create(model="builtin:random", max_tokens=4, system=system,
                                messages=[{"role": "user", "content": "Now section two, different question."}])
    assert r2.usage.cache_read_input_tokens == _reuse(handles) >= bp // 64 * 64 > 0


def test_bad_input_real_engine(live):
    engine, url, handles = live
    r = httpx.post(url + "/v1/chat/completions", json={"model": "builtin:random", "messages": [
        {"role": "user", "content": "x" * 3000}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = httpx.post(url + "/v1/messages", json={"model": "builtin:random", "max_tokens": -1, "messages": [
        {"role": "user", "content": "x"}]})
    assert r.status_code == 400 and r.json()["type"] == "error"


def test_orderly_stop_real_engine(serve):
    engine, controller, url, handles = start(serve)
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    result = {}

    def long_request():
        try:
            client.chat.completions.create(model="builtin:random", messages=[{"role": "user", "content": "go"}],
                                           max_tokens=1500, extra_body={"ignore_eos": True})
            result["status"] = 200
        except openai.APIStatusError as exc:
            result["status"] = exc.status_code

    t = threading.Thread(target=long_request)
    t.start()
    deadline = time.monotonic() + 20
    while not handles and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)
    controller.request_stop("test", wait=True)
    t.join(30)
    assert result.get("status") == 503
    # After the stop the server either still answers (503 unavailable) or is exiting: a refused or a reset
    # connection (the listener closed while this request was in flight) both say it is gone.
    try:
        r = httpx.post(url + "/v1/chat/completions", json={"model": "builtin:random", "messages": [
            {"role": "user", "content": "x"}]})
    except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
        return
    assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable"
