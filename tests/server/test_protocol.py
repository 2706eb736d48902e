"""HTTP shapes against FakeEngine (a test double), driven by the official openai and anthropic
clients and httpx, all on 127.0.0.1: usage reporting, streaming, logprobs, cache_control
validation, every bad input, the API key, metrics, and the orderly stop."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from hpc_cli.server.app import create_app
from hpc_cli.server.stop import StopController
from hpc_cli.settings import load_settings

anthropic = pytest.importorskip("anthropic")  # the test extra; absent on bare machines
openai = pytest.importorskip("openai")  # the test extra; absent on bare machines

from .fake_engine import FakeEngine

SYSTEM = "You are a careful assistant. " * 6  # 174 bytes: the system block ends past 128


def make(serve, api_key=None, **engine_kw):
    flags = {"server.api_key": api_key} if api_key else {}
    settings = load_settings(None, flags, environ={})
    engine = FakeEngine(**engine_kw).start()
    controller = StopController(engine, echo=lambda m: None)
    app = create_app(engine, settings, stop_controller=controller)
    controller.state = app.state.hpc
    url = serve(app, controller)
    return engine, controller, url


@pytest.fixture
def server(serve):
    return make(serve)


def oai(url, key="none"):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=20)


def ant(url, key="none"):
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=20)


# ---------------------------------------------------------------------------------------------

def test_models_health_and_stats(server):
    engine, _, url = server
    assert [m.id for m in oai(url).models.list().data] == ["builtin:random"]
    assert httpx.get(url + "/health").json()["status"] == "ok"
    assert httpx.get(url + "/v1/cache/stats").json() == engine.stats().to_json()


def test_three_turn_chat_reports_reuse(server):
    engine, _, url = server
    client = oai(url)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "first question"}]
    cached = []
    for turn in range(3):
        r = client.chat.completions.create(model="builtin:random", messages=messages, max_tokens=8, temperature=0)
        reuse = engine.submitted[-1].finished.usage.reuse_tokens
        assert r.usage.prompt_tokens_details.cached_tokens == reuse
        cached.append(reuse)
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8
        assert r.choices[0].message.content or r.choices[0].message.model_extra.get("reasoning_content")
        messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": f"question {turn + 2}"}]
    assert cached[0] == 0 and cached[1] >= 128 and cached[2] > cached[1]


def test_cached_tokens_zero_is_reported_not_null(server):
    _, _, url = server
    raw = httpx.post(url + "/v1/chat/completions", json={
        "model": "builtin:random", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).json()
    assert raw["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_chat_stream_with_usage_and_logprobs(server):
    _, _, url = server
    stream = oai(url).chat.completions.create(
        model="builtin:random", messages=[{"role": "user", "content": "hi"}], max_tokens=6, stream=True,
        stream_options={"include_usage": True}, logprobs=True, top_logprobs=2,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "hello "
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 0
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    lps = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(lps) == 6 and len(lps[0].top_logprobs) == 2 and lps[0].token == "h"


def test_chat_stop_seed_and_max_completion_tokens(server):
    engine, _, url = server
    r = oai(url).chat.completions.create(
        model="builtin:random", messages=[{"role": "user", "content": "hi"}], max_completion_tokens=20, stop=["wor"],
        seed=7, temperature=0.5, top_p=0.9, prompt_cache_key="k1",
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.content == "hello " and r.choices[0].finish_reason == "stop"
    sp = engine.submitted[-1].request.sampling
    assert (sp.seed, sp.max_tokens, sp.stop, sp.temperature, sp.top_p) == (7, 20, ("wor",), 0.5, 0.9)


def test_chat_reasoning_split(serve):
    engine, _, url = make(serve, text="plan</think>\n\nanswer ")
    r = oai(url).chat.completions.create(model="builtin:random", messages=[{"role": "user", "content": "q"}],
                                         max_tokens=14)
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == "plan" and msg.content == "answer "


def test_tap_hints_reach_the_engine(server):
    engine, _, url = server
    oai(url).chat.completions.create(model="builtin:random", max_tokens=1, messages=[
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": [{"type": "text", "text": "doc " * 40, "cache_control": {"type": "ephemeral"}},
                                     {"type": "text", "text": "question"}]}])
    req = engine.submitted[-1].request
    prio = {h.priority for h in req.tap_hints}
    assert prio == {1, 2, 3}
    text = engine.tokenizer.decode(req.prompt_tokens)
    by = {h.priority: engine.tokenizer.decode(req.prompt_tokens[:h.position]) for h in req.tap_hints}
    assert by[3].endswith(SYSTEM + "<|im_end|>\n")
    assert by[1].endswith("doc " * 40)
    assert text[len(by[2]):].startswith("<|im_start|>assistant")
    assert req.message_boundaries == sorted(req.message_boundaries)


def test_completions_text_tokens_echo_logprobs(server):
    engine, _, url = server
    client = oai(url)
    r = client.completions.create(model="builtin:random", prompt="abc", max_tokens=3, temperature=0)
    assert r.choices[0].text == "hel" and r.usage.prompt_tokens_details.cached_tokens == 0
    # lm-evaluation-harness loglikelihood: token ids, echo, logprobs, one generated token
    r = client.completions.create(model="builtin:random", prompt=[[97, 98, 99, 100]], max_tokens=1, echo=True,
                                  logprobs=1, temperature=0)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == "abcdh"
    assert lp.tokens == ["a", "b", "c", "d", "h"]
    assert lp.token_logprobs[0] is None and lp.token_logprobs[1:4] == [-1.5] * 3
    assert lp.top_logprobs[0] is None and all(isinstance(t, dict) for t in lp.top_logprobs[1:])
    assert lp.text_offset == [0, 1, 2, 3, 4]
    assert engine.submitted[-1].request.sampling.prompt_logprobs is True
    r = client.completions.create(model="builtin:random", prompt=["ab", "cd"], max_tokens=0, echo=True)
    assert [c.text for c in r.choices] == ["ab", "cd"] and r.usage.prompt_tokens == 4


def test_completions_stream(server):
    _, _, url = server
    chunks = list(oai(url).completions.create(model="builtin:random", prompt="x", max_tokens=5, stream=True,
                                              stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "hello"
    assert chunks[-1].usage.completion_tokens == 5


def test_eos_is_not_in_text(serve):
    _, _, url = make(serve, eos_after=3)
    r = oai(url).completions.create(model="builtin:random", prompt="x", max_tokens=10)
    assert r.choices[0].text == "hel" and r.choices[0].finish_reason == "stop"


# --- Anthropic --------------------------------------------------------------------------------

def test_anthropic_cache_control_and_usage(server):
    engine, _, url = server
    client = ant(url)
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    msgs = [{"role": "user", "content": [{"type": "text", "text": "long document " * 10,
                                          "cache_control": {"type": "ephemeral", "ttl": "5m"}}]}]
    r1 = client.messages.create(model="builtin:random", max_tokens=4, system=system, messages=msgs)
    req = engine.submitted[-1].request
    explicit = [h.position for h in req.tap_hints if h.priority == 1]
    assert len(explicit) == 2
    assert r1.usage.cache_read_input_tokens == 0
    assert r1.usage.cache_creation_input_tokens == max(explicit)
    assert r1.usage.input_tokens == len(req.prompt_tokens) - max(explicit)
    assert r1.content[0].type == "text" and r1.content[0].text == "hell" and r1.stop_reason == "max_tokens"
    msgs2 = msgs + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "next"}]
    r2 = client.messages.create(model="builtin:random", max_tokens=4, system=system, messages=msgs2)
    reuse = engine.submitted[-1].finished.usage.reuse_tokens
    assert r2.usage.cache_read_input_tokens == reuse >= max(explicit)
    assert r2.usage.cache_creation_input_tokens == 0


def test_anthropic_stream(server):
    engine, _, url = server
    client = ant(url)
    msgs = [{"role": "user", "content": "hello there"}]
    client.messages.create(model="builtin:random", max_tokens=2, messages=msgs, system=SYSTEM)
    with client.messages.stream(model="builtin:random", max_tokens=5, messages=msgs, system=SYSTEM,
                                stop_sequences=["lo"]) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert events[0] == "message_start" and "message_stop" in events
    assert final.content[0].text == "hel" and final.stop_reason == "stop_sequence" and final.stop_sequence == "lo"
    assert final.usage.cache_read_input_tokens == engine.submitted[-1].finished.usage.reuse_tokens > 0


def test_anthropic_thinking_blocks(serve):
    _, _, url = make(serve, text="plan</think>\n\nanswer ")
    r = ant(url).messages.create(model="builtin:random", max_tokens=14, messages=[{"role": "user", "content": "q"}],
                                 thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in r.content] == ["thinking", "text"]
    assert r.content[0].thinking == "plan" and r.content[1].text == "answer "


# --- bad input ----------------------------------------------------------------------------------

OPENAI_BAD = [
    ("/v1/chat/completions", b"{not json", 400),
    ("/v1/chat/completions", b"[1, 2]", 400),
    ("/v1/chat/completions", {"model": "builtin:random", "messages": []}, 400),
    ("/v1/chat/completions", {"model": "builtin:random", "messages": "hi"}, 400),
    ("/v1/chat/completions", {"model": "builtin:random", "messages": [{"role": "user", "content": 5}]}, 400),
    ("/v1/chat/completions", {"model": "builtin:random", "messages": [{"role": "wizard", "content": "x"}]}, 400),
    ("/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, 400),
    ("/v1/chat/completions", {"model": "builtin:random", "messages": [{"role": "user", "content": "x"}],
                              "max_tokens": -1}, 400),
    ("/v1/chat/completions", {"model": "builtin:random", "messages": [{"role": "user", "content": "x"}],
                              "max_tokens": "ten"}, 400),
    ("/v1/chat/completions", {"model": "builtin:random", "messages": [{"role": "user", "content": "x"}],
                              "temperature": 3}, 400),
    ("/v1/chat/completions", {"model": "builtin:random", "messages": [{"role": "user", "content": "x" * 5000}]}, 400),
    ("/v1/chat/completions", {"model": "builtin:random", "messages": [{"role": "user", "content": "x"}],
                              "max_tokens": 5000}, 400),
    ("/v1/chat/completions", {"model": "builtin:random", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "x", "cache_control": {"type": "persistent"}}]}]}, 400),
    ("/v1/chat/completions", {"model": "builtin:random", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400),
    ("/v1/completions", {"model": "builtin:random", "prompt": ""}, 400),
    ("/v1/completions", {"model": "builtin:random", "prompt": [1, 99999]}, 400),
    ("/v1/completions", {"model": "builtin:random", "prompt": "x", "max_tokens": -5}, 400),
    ("/v1/completions", {"model": "builtin:random", "prompt": 12}, 400),
    ("/v1/nothing", {}, 404),
]


@pytest.mark.parametrize("path,body,status", OPENAI_BAD)
def test_openai_bad_input(server, path, body, status):
    _, _, url = server
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(url + path, content=content, headers={"content-type": "application/json"}, timeout=10)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]


def _amsg(**kw):
    body = {"model": "builtin:random", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    body.update(kw)
    return body


def _cc_blocks(k, ttl="5m"):
    return [{"type": "text", "text": f"block {i}", "cache_control": {"type": "ephemeral", "ttl": ttl}}
            for i in range(k)]


ANTHROPIC_BAD = [
    (b"{", 400), (_amsg(messages=[]), 400), (_amsg(max_tokens=-1), 400), (_amsg(max_tokens=None), 400),
    (_amsg(model="claude-x"), 404), (_amsg(messages=[{"role": "system", "content": "x"}]), 400),
    (_amsg(messages=[{"role": "user", "content": ""}]), 400),
    (_amsg(messages=[{"role": "user", "content": [{"type": "text", "text": "x" * 5000}]}]), 400),
    (_amsg(system=_cc_blocks(5)), 400),
    (_amsg(system=_cc_blocks(3), cache_control={"type": "ephemeral"}, tools=[
        {"name": "t", "input_schema": {}, "cache_control": {"type": "ephemeral"}}]), 400),
    (_amsg(system=[{"type": "text", "text": "x", "cache_control": {"type": "forever"}}]), 400),
    (_amsg(system=[{"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "2h"}}]), 400),
    (_amsg(system=_cc_blocks(1, "5m") + _cc_blocks(1, "1h")), 400),
    (_amsg(messages=[{"role": "user", "content": [{"type": "text", "text": "",
                                                   "cache_control": {"type": "ephemeral"}}]}]), 400),
    (_amsg(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]), 400),
    (_amsg(temperature="hot"), 400),
]


@pytest.mark.parametrize("body,status", ANTHROPIC_BAD)
def test_anthropic_bad_input(server, body, status):
    _, _, url = server
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(url + "/v1/messages", content=content, headers={"content-type": "application/json"}, timeout=10)
    assert r.status_code == status, r.text
    data = r.json()
    assert data["type"] == "error" and set(data["error"]) == {"type", "message"} and data["error"]["message"]


def test_anthropic_four_breakpoints_and_1h_before_5m_are_fine(server):
    _, _, url = server
    r = httpx.post(url + "/v1/messages", json=_amsg(system=_cc_blocks(1, "1h") + _cc_blocks(3)), timeout=10)
    assert r.status_code == 200, r.text


def test_clients_raise_typed_errors(server):
    _, _, url = server
    with pytest.raises(openai.NotFoundError):
        oai(url).chat.completions.create(model="gpt-x", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError) as exc:
        oai(url).chat.completions.create(model="builtin:random", messages=[{"role": "user", "content": "x" * 5000}])
    assert exc.value.code == "context_length_exceeded"
    with pytest.raises(anthropic.BadRequestError):
        ant(url).messages.create(model="builtin:random", max_tokens=4, messages=[{"role": "user", "content": "x"}],
                                 system=_cc_blocks(5))


# --- api key, metrics, disconnect, stop ---------------------------------------------------------

def test_api_key(serve):
    _, _, url = make(serve, api_key="s3cret")
    with pytest.raises(openai.AuthenticationError):
        oai(url, "wrong").models.list()
    r = httpx.post(url + "/v1/chat/completions", json={"model": "builtin:random", "messages": []})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        ant(url, "wrong").messages.create(model="builtin:random", max_tokens=2, messages=[{"role": "user", "content": "x"}])
    r = httpx.post(url + "/v1/messages", json=_amsg())
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert oai(url, "s3cret").models.list().data[0].id == "builtin:random"
    assert ant(url, "s3cret").messages.create(model="builtin:random", max_tokens=2,
                                              messages=[{"role": "user", "content": "x"}]).usage.output_tokens == 2
    assert httpx.get(url + "/health").status_code == 200


def test_metrics(server):
    _, _, url = server
    oai(url).chat.completions.create(model="builtin:random", messages=[{"role": "user", "content": "x"}], max_tokens=3)
    text = httpx.get(url + "/metrics").text
    assert 'hpc_requests_total{endpoint="chat",outcome="ok"} 1' in text
    assert "hpc_completion_tokens_total 3" in text
    assert "hpc_time_to_first_token_seconds_count 1" in text
    assert "hpc_inter_token_latency_seconds_count 2" in text
    assert "hpc_engine_cache_device_blocks 3" in text and "hpc_cache_hit_rate" in text


def test_client_disconnect_cancels(serve):
    engine, _, url = make(serve, token_delay=0.01)
    with httpx.Client(timeout=10) as client:
        with client.stream("POST", url + "/v1/chat/completions", json={
                "model": "builtin:random", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3000,
                "stream": True}) as r:
            for i, line in enumerate(r.iter_lines()):
                if i >= 8:  # a few chunks in, the client goes away
                    break
    rid = engine.submitted[-1].request.request_id
    deadline = time.monotonic() + 10
    while rid not in engine.cancelled and time.monotonic() < deadline:
        time.sleep(0.02)
    assert rid in engine.cancelled


def test_orderly_stop(serve):
    engine, controller, url = make(serve, token_delay=0.01)
    client = oai(url)
    results = {}

    def running():
        try:
            client.chat.completions.create(model="builtin:random", messages=[{"role": "user", "content": "x"}],
                                           max_tokens=3000)
        except openai.APIStatusError as exc:
            results["status"] = exc.status_code

    t = threading.Thread(target=running)
    t.start()
    deadline = time.monotonic() + 10
    while not engine.submitted and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    controller.prefix_cache_file = "/tmp/never-written.bin"
    assert controller.request_stop("test", wait=True)
    t.join(10)
    assert results.get("status") == 503
    assert engine.stopped and engine.saved == ["/tmp/never-written.bin"]
    assert not controller.request_stop("again")


def test_stop_refuses_new_requests(serve):
    engine, controller, url = make(serve)
    controller.state.accepting = False
    r = httpx.post(url + "/v1/chat/completions", json={"model": "builtin:random", "messages": [
        {"role": "user", "content": "x"}]})
    assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable"
    r = httpx.post(url + "/v1/messages", json=_amsg())
    assert r.status_code == 503 and r.json()["type"] == "error"
    assert httpx.get(url + "/health").status_code == 503


def test_sigint_needs_confirmation():
    engine = FakeEngine().start()
    clock = [0.0]
    exits = []
    c = StopController(engine, echo=lambda m: None, clock=lambda: clock[0], exit_fn=exits.append)
    c.handle_sigint()
    assert not c.stopping
    clock[0] = 6.0
    c.handle_sigint()  # too late: asks again
    assert not c.stopping
    clock[0] = 9.0
    c.handle_sigint()
    assert c.stopping and c.done.wait(5) and engine.stopped
    c.handle_sigint()
    assert exits == [130] and c.abort_save.is_set()


def test_a_second_sigterm_during_the_stops_start_does_not_hang_the_server(monkeypatch):
    """A signal handler runs in the main thread between bytecodes: a second SIGTERM (a supervisor
    retrying, ``timeout`` then ``kill``) can arrive while the first one's handler holds the
    controller's lock, waiting for the stop thread to start. It must return at once (the stop runs
    once), not wait on that lock: the event loop, and so the server, would hang for good."""
    import hpc_cli.server.stop as stop_mod

    engine = FakeEngine().start()
    c = StopController(engine, echo=lambda m: None)
    started = []

    class SignalledDuringStart(threading.Thread):
        def start(self):
            started.append(self.name)
            c.handle_sigterm()  # the second SIGTERM, delivered while request_stop holds the lock
            super().start()

    first = threading.Thread(target=c.handle_sigterm, daemon=True)  # the first SIGTERM's handler
    monkeypatch.setattr(stop_mod.threading, "Thread", SignalledDuringStart)  # the threads it starts
    first.start()
    first.join(5)
    assert not first.is_alive(), "the nested SIGTERM waited on the controller's own lock"
    assert c.done.wait(5) and engine.stopped
    assert started == ["hpc-orderly-stop"] and c.reason == "SIGTERM"
