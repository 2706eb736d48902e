"""A bounded HTTP fuzzer (issue 21): hypothesis generates requests for every endpoint, with and
without an API key, and sends them to the real app and engine (builtin:random on CPU) behind
live loopback servers with serve's connection limits. Every answer must be below 500, in the
API's own error shape when it is an error, within the client timeout; afterwards the engine is
alive, holds nothing, and a greedy canary gives the same answer as before the run.

The run is derandomized (the same requests every time); ``HPC_FUZZ_EXAMPLES`` sets how many
(default 1,000; the ``slow`` variant runs 10,000 fresh ones)."""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .hostile import MODEL, NO_THINK, leaks, served, start_engine, wait_idle
from .hostile import settings as hpc_settings

KEY = "fuzz-key"
EXAMPLES = int(os.environ.get("HPC_FUZZ_EXAMPLES", "1000"))
BUDGET_S = 150.0  # per 1,000 requests: the run fails past it (it takes ~30-60 s on 2 cores)

POSTS = ("/v1/chat/completions", "/v1/completions", "/v1/messages")
GETS = ("/health", "/metrics", "/v1/models", "/v1/cache/stats")
OTHERS = ("/", "/v1", "/v1/messages/count_tokens", "/v1/chat/completions/", "/v2/completions", "/docs",
          "/v1/embeddings", "/%ff%fe", "/v1/models/builtin:random")

# --------------------------------------------------------------------------------------------
# strategies
# --------------------------------------------------------------------------------------------

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False),
                         st.text(max_size=20))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                                 st.dictionaries(st.text(max_size=8), inner,
                                                                                 max_size=4)),
                           max_leaves=12)
text = st.one_of(st.text(max_size=40), st.sampled_from(["", " ", "<|im_end|>", "<think>", "</think>", "<tool_call>",
                                                        "\x00\x01\x1b[31m", "é😀中", "\u2028", "a" * 300]))
small_tokens = st.one_of(st.integers(0, 3), st.none())
junk = st.one_of(json_values, st.integers(min_value=2 ** 63), st.integers(max_value=-1),
                 st.sampled_from([1e-300, 1e-40, -0.0, 1e308, 2 ** 64, -(2 ** 64), "", "NaN", [], {}]))


def body_strategies(dirty: bool) -> dict[str, st.SearchStrategy[dict]]:
    """Request bodies per endpoint. Clean: the required fields, valid values, a random subset
    of the optional ones (most reach the engine). Dirty: any field may be junk or missing, and
    unknown fields appear."""

    def maybe(strategy):
        return st.one_of(strategy, strategy, strategy, junk) if dirty else strategy

    def fields(required: tuple[str, ...] = (), **named) -> st.SearchStrategy[dict]:
        @st.composite
        def build(draw):
            out = {}
            for k, strategy in named.items():
                if (k in required and not dirty) or draw(st.integers(0, 3)) == 0:
                    out[k] = draw(maybe(strategy))
            if dirty and draw(st.integers(0, 9)) == 0:
                out[draw(st.text(min_size=1, max_size=10))] = draw(json_values)
            return out

        return build()

    roles = ["system", "developer", "user", "assistant", "tool", "function"] + (["bot"] if dirty else [])
    parts = st.lists(fields(("type", "text"), type=st.sampled_from(["text", "input_text"] + (["image_url", "x"]
                                                                                              if dirty else [])),
                            text=text, cache_control=st.sampled_from([{"type": "ephemeral"}] + (
                                [{"type": "other"}] if dirty else []))), min_size=1, max_size=3)
    call = fields(("function",), id=st.text(max_size=8), type=st.just("function"),
                  function=st.one_of(fields(("name", "arguments"), name=st.text(min_size=1, max_size=8),
                                            arguments=st.sampled_from(['{"a": 1}', "{}", ""])),
                                     *([text] if dirty else [])))
    oai_message = fields(("role", "content"), role=st.sampled_from(roles), content=st.one_of(text, parts),
                         name=st.text(min_size=1, max_size=8), tool_calls=st.lists(call, max_size=2),
                         tool_call_id=st.text(max_size=8), reasoning_content=text)
    tools = st.lists(fields(("type", "function"), type=st.just("function"),
                            function=fields(("name",), name=st.text(min_size=1, max_size=8),
                                            parameters=st.just({"type": "object", "properties": {
                                                "x": {"type": "integer"}}}))), max_size=2)
    common = dict(model=st.just(MODEL) if not dirty else st.one_of(st.just(MODEL), st.text(max_size=12)),
                  max_tokens=small_tokens, temperature=st.one_of(st.floats(0, 2), st.just(1e-300)),
                  top_p=st.floats(0.01, 1), top_k=st.integers(-1, 50), seed=st.integers(-(2 ** 63), 2 ** 63 - 20),
                  stop=st.one_of(text, st.lists(text, max_size=4)), stream=st.booleans(),
                  ignore_eos=st.booleans(), user=st.text(max_size=8), cache_salt=st.text(min_size=1, max_size=8),
                  hpc=fields(timing=st.booleans()))
    if dirty:
        common["seed"] = st.integers(-(2 ** 64), 2 ** 65)
        common["top_p"] = st.floats(0, 1)
    chat = fields(("model", "messages", "max_tokens"),
                  messages=st.lists(oai_message, min_size=0 if dirty else 1, max_size=4),
                  n=st.integers(0, 3) if dirty else st.integers(1, 2), max_completion_tokens=small_tokens, logprobs=st.booleans(),
                  top_logprobs=st.integers(-1 if dirty else 0, 21 if dirty else 5), tools=tools,
                  tool_choice=st.sampled_from(["auto", "none", "required", {"type": "none"}]),
                  stream_options=fields(include_usage=st.booleans()),
                  chat_template_kwargs=st.one_of(st.just(NO_THINK), fields(enable_thinking=st.booleans()),
                                                 *([fields(tools=st.just([]), messages=st.just([]))]
                                                   if dirty else [])),
                  reasoning_effort=st.sampled_from(["none", "low", "high"]), **common)
    prompt = st.one_of(text.filter(bool) if not dirty else text, st.lists(st.text(min_size=1, max_size=20), min_size=1,
                                                                             max_size=2),
                       st.lists(st.integers(0 if not dirty else -5, 263 if not dirty else 300), min_size=1,
                                max_size=20),
                       st.lists(st.lists(st.integers(0, 263), min_size=1, max_size=8), min_size=1, max_size=2))
    completion = fields(("model", "prompt", "max_tokens"), prompt=prompt,
                        n=st.integers(0, 3) if dirty else st.integers(1, 2), echo=st.booleans(),
                        logprobs=st.integers(-1 if dirty else 0, 21 if dirty else 5),
                        suffix=text if dirty else st.just(""), best_of=st.integers(0, 3) if dirty else st.none(),
                        **common)
    kinds = ["text", "thinking", "tool_use", "tool_result"] + (["image", "x"] if dirty else [])
    block = fields(("type", "text", "name", "input") if not dirty else (),
                   type=st.sampled_from(kinds), text=text.filter(bool) if not dirty else text, thinking=text,
                   id=st.text(max_size=6), name=st.text(min_size=1, max_size=6) if not dirty else st.none(),
                   input=st.just({"x": 1}) if not dirty else text, tool_use_id=st.text(max_size=6), content=text,
                   cache_control=st.sampled_from([{"type": "ephemeral"}, {"type": "ephemeral", "ttl": "1h"}]))
    ant_message = fields(("role", "content"), role=st.sampled_from(["user", "assistant"] + (["system"] if dirty
                                                                                            else [])),
                         content=st.one_of(text.filter(bool) if not dirty else text, st.lists(block, max_size=3)))
    messages = fields(("model", "messages", "max_tokens"),
                      messages=st.lists(ant_message, min_size=0 if dirty else 1, max_size=4),
                      system=st.one_of(text, st.lists(block, max_size=2)), stop_sequences=st.lists(text, max_size=3),
                      metadata=fields(user_id=st.text(max_size=6), cache_salt=st.text(min_size=1, max_size=6)),
                      tools=st.lists(fields(("name",), name=st.text(min_size=1, max_size=6),
                                            input_schema=st.just({"type": "object"})), max_size=2),
                      thinking=fields(("type",), type=st.sampled_from(["enabled", "disabled"]),
                                      budget_tokens=st.integers(0, 9)),
                      cache_control=st.sampled_from([{"type": "ephemeral"}]),
                      **{**common, "max_tokens": st.integers(1, 4) if not dirty else small_tokens,
                         "temperature": st.floats(0, 1), "top_k": st.integers(0, 50)})
    return {"/v1/chat/completions": chat, "/v1/completions": completion, "/v1/messages": messages}


CLEAN, DIRTY = body_strategies(False), body_strategies(True)

hostile_raw = st.sampled_from([
    b"", b"null", b"[]", b"\"x\"", b"{", b"\xff\xfe", b"{\"model\": NaN}", b"{\"a\": Infinity}",
    b"{\"messages\": " + b"[" * 1500 + b"]" * 1500 + b"}", b"{\"max_tokens\": " + b"1" * 5000 + b"}",
    b"{\"model\": \"builtin:random\", \"prompt\": \"\\ud800\"}", b"{\"model\": \"\\udfff\"}",
    b"{\"model\": \"builtin:random\", \"messages\": [{\"role\": \"user\", \"content\": \"\\ud83d\\ude00\"}]}",
])


@st.composite
def requests(draw):
    keyed = draw(st.booleans())
    kind = draw(st.integers(0, 9))
    if kind <= 6:
        method, path = "POST", draw(st.sampled_from(POSTS))
        body = draw((CLEAN if draw(st.booleans()) else DIRTY)[path])
        raw = json.dumps(body, allow_nan=True).encode()
        if draw(st.integers(0, 14)) == 0:
            raw = draw(hostile_raw)
        elif draw(st.integers(0, 14)) == 0:
            raw = draw(st.binary(max_size=64))
    elif kind <= 8:
        method, path, raw = "GET", draw(st.sampled_from(GETS)), b""
    else:
        method = draw(st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]))
        path, raw = draw(st.sampled_from(OTHERS + POSTS + GETS)), draw(st.binary(max_size=32))
    auth = draw(st.sampled_from(["none", "bearer", "x-api-key", "both", "wrong", "garbage"]))
    headers = {"content-type": draw(st.sampled_from(["application/json", "text/plain", "application/json"]))}
    if auth == "bearer":
        headers["authorization"] = f"Bearer {KEY}"
    elif auth == "x-api-key":
        headers["x-api-key"] = KEY
    elif auth == "both":
        headers.update({"authorization": "Bearer nope", "x-api-key": KEY})
    elif auth == "wrong":
        headers["authorization"] = f"Bearer {KEY}x"
    elif auth == "garbage":
        headers["authorization"] = draw(st.sampled_from(["Bearer", "Basic abc", "bearer x y", "Token " + KEY]))
    return keyed, method, path, raw, headers


# --------------------------------------------------------------------------------------------
# checks
# --------------------------------------------------------------------------------------------

def check_error_shape(path: str, response: httpx.Response) -> None:
    body = response.json()
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and isinstance(body["error"]["message"], str), body
        assert isinstance(body["error"]["type"], str)
    else:
        assert isinstance(body["error"]["message"], str) and isinstance(body["error"]["type"], str), body


def check_stream(path: str, text: str) -> None:
    assert "server_error" not in text and "api_error" not in text and "engine_error" not in text, text[-500:]
    if path == "/v1/messages":
        assert "event: message_stop" in text, text[-500:]
    else:
        assert text.rstrip().endswith("data: [DONE]"), text[-500:]


CANARY = {"model": MODEL, "max_tokens": 6, "temperature": 0, "chat_template_kwargs": NO_THINK,
          "messages": [{"role": "system", "content": "Canary system prompt. " * 8},
                       {"role": "user", "content": "What does the canary say?"}]}


def canary(url: str) -> str:
    r = httpx.post(url + "/v1/chat/completions", json=CANARY, headers={"authorization": f"Bearer {KEY}"},
                   timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def run_fuzz(examples: int, derandomize: bool) -> None:
    engine, open_settings = start_engine(**{"model.max_model_len": 256})
    keyed_settings = hpc_settings(**{"model.max_model_len": 256, "server.api_key": KEY})
    sent = {"n": 0, "ok": 0, "statuses": {}}
    started = time.monotonic()
    budget = BUDGET_S * max(1.0, examples / 1000)
    try:
        with served(engine, open_settings) as srv, served(engine, keyed_settings) as keyed_srv, \
                httpx.Client(timeout=30, trust_env=False) as c:
            before = canary(srv.url), canary(keyed_srv.url)

            @settings(max_examples=examples, derandomize=derandomize, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck), print_blob=True)
            @given(requests())
            def one(req) -> None:
                keyed, method, path, raw, headers = req
                assert time.monotonic() - started < budget, "the fuzz run is over its time budget"
                url = (keyed_srv if keyed else srv).url
                response = c.request(method, url + path, content=raw or None, headers=headers)
                sent["n"] += 1
                status = response.status_code
                sent["statuses"][status] = sent["statuses"].get(status, 0) + 1
                assert status < 500, (status, method, path, raw[:300], response.text[:500])
                if method == "HEAD":
                    return
                if status == 401:
                    assert keyed and (path.startswith("/v1") or path == "/metrics")
                if status >= 400 and response.headers.get("content-type", "").startswith("application/json"):
                    check_error_shape(path, response)
                elif status == 200 and method == "POST" and path in POSTS:
                    sent["ok"] += 1
                    if response.headers.get("content-type", "").startswith("text/event-stream"):
                        check_stream(path, response.text)
                    else:
                        assert response.json()["usage"], response.text[:300]

            one()
            wait_idle(engine)
            assert engine.running and engine.fatal is None
            assert httpx.get(srv.url + "/health").status_code == 200
            assert leaks(engine) == []
            assert (canary(srv.url), canary(keyed_srv.url)) == before
    finally:
        engine.stop(timeout=30)
    assert sent["n"] >= examples, sent
    assert sent["ok"] >= examples // 50, sent  # the generator reaches the engine, not only the validators
    print(f"fuzz: {sent['n']} requests, {sent['ok']} generations, statuses {sorted(sent['statuses'].items())}, "
          f"{time.monotonic() - started:.1f} s")


def test_http_fuzz():
    run_fuzz(EXAMPLES, derandomize=True)


@pytest.mark.slow
def test_http_fuzz_long():
    run_fuzz(10 * EXAMPLES, derandomize=False)
