"""The server's event loop (`[server] event_loop`): uvloop where it is installed, asyncio's own
on request, and on either loop the same server: a streamed chat answered through the openai
client, keep-alive requests without the delayed-ACK wait, a stalled request head closed."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from hpc_cli.errors import ConfigError
from hpc_cli.server.limits import event_loop
from tests.server.hostile import NO_THINK, MODEL, chat_body, client, raw_connect, read_until_closed, served, \
    settings, start_engine

openai = pytest.importorskip("openai")  # the test extra
uvloop = pytest.importorskip("uvloop")  # a dependency where the platform has it


def test_auto_takes_uvloop_where_it_imports_and_asyncio_is_asyncio():
    assert event_loop("auto") == "uvloop"
    assert event_loop("uvloop") == "uvloop"
    assert event_loop("asyncio") == "asyncio"


def test_without_uvloop_auto_falls_back_and_naming_it_is_an_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "uvloop", None)  # `import uvloop` raises ImportError
    assert event_loop("auto") == "asyncio"
    assert event_loop("asyncio") == "asyncio"
    with pytest.raises(ConfigError) as info:
        event_loop("uvloop")
    assert "uvloop is not installed" in info.value.message and "event_loop" in info.value.hint


def test_the_setting_is_validated():
    with pytest.raises(Exception) as info:
        settings(**{"server.event_loop": "trio"})
    assert "event_loop" in str(info.value)


@pytest.fixture(scope="module")
def engine():
    e, _ = start_engine()
    yield e
    e.stop(timeout=30)


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_the_server_answers_the_same_on_either_loop(engine, loop):
    resolved = settings(**{"server.event_loop": loop, "server.header_timeout_s": 1.0})
    with served(engine, resolved) as srv:
        running = type(srv.server.servers[0]).__module__  # uvicorn's listening server object
        assert running.startswith("uvloop") == (loop == "uvloop"), running
        oc = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
        messages = [{"role": "user", "content": "Say something."}]
        whole = oc.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                           extra_body={"chat_template_kwargs": NO_THINK})
        text, usage = "", None
        with oc.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0, stream=True,
                                        stream_options={"include_usage": True},
                                        extra_body={"chat_template_kwargs": NO_THINK}) as stream:
            for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                if chunk.usage is not None:
                    usage = chunk.usage
        assert text == whole.choices[0].message.content and usage.completion_tokens == whole.usage.completion_tokens
        # keep-alive: later requests on one connection are not held by a delayed ACK (~40 ms each)
        with client(srv.url) as c:
            c.get("/health")
            t0 = time.monotonic()
            for _ in range(10):
                assert c.get("/health").status_code == 200
            assert (time.monotonic() - t0) / 10 < 0.030
            assert c.post("/v1/chat/completions", json=chat_body()).status_code == 200
        # the request-head deadline holds on this loop's timers too
        s = raw_connect(srv.url)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and never the rest
        data, seconds = read_until_closed(s, 10)
        s.close()
        assert data == b"" and seconds < 5


def test_serve_refuses_a_missing_uvloop_before_the_model_loads(tmp_path):
    fake = tmp_path / "uvloop"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('not here')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HPC_")}
    env.update(PYTHONPATH=os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")]), HPC_SERVER__EVENT_LOOP="uvloop")
    r = subprocess.run([sys.executable, "-m", "hpc_cli", "serve", "--model", "builtin:random", "--device", "cpu",
                        "--port", "0"], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 2, r.stderr
    first, hint = r.stderr.splitlines()[:2]
    assert first == "error: server.event_loop is 'uvloop' but uvloop is not installed"
    assert hint.startswith("hint: ") and "Traceback" not in r.stderr and "building" not in r.stderr
