"""/metrics through prometheus_client (parsed with its own parsers; content negotiation; a
registry per app; the phase histograms after real requests) and usage.hpc_timing, which appears
only when a request or the server asks for it, with every phase non-negative and the phases
within the request's wall time. The real engine (builtin:random on CPU) behind a live server."""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families

from hpc_cli.engine.api import PHASES, PrefillPass, Usage
from hpc_cli.engine.engine import Engine
from hpc_cli.server.app import create_app
from hpc_cli.server.metrics import Metrics
from hpc_cli.settings import load_settings

anthropic = pytest.importorskip("anthropic")  # the test extra; absent on bare machines
openai = pytest.importorskip("openai")  # the test extra; absent on bare machines

from .fake_engine import FakeEngine

SYSTEM = "You are a careful assistant who answers briefly. " * 6
FLAGS = {"model.name": "builtin:random", "model.device": "cpu", "model.max_model_len": 2048,
         "engine.max_concurrency": 2, "engine.prefill_chunk": 128, "cache.host_cache_mib": 64}
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
TIMING = {"hpc": {"timing": True}}


@pytest.fixture(scope="module")
def live():
    from .conftest import live_server

    settings = load_settings(None, FLAGS, environ={})
    engine = Engine.from_settings(settings).start()
    with live_server(create_app(engine, settings)) as url:
        yield url
    engine.stop(timeout=30)


def oai(url: str) -> "openai.OpenAI":
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)


def ant(url: str) -> "anthropic.Anthropic":
    return anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=60)


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def check_timing(timing: dict, wall: float, prompt_tokens: int, cached_tokens: int, streamed: bool = False) -> None:
    assert set(PHASES) <= set(timing), timing
    assert all(timing[p] >= 0.0 for p in PHASES), timing
    assert sum(timing[p] for p in PHASES) <= wall, (timing, wall)
    passes = timing["prefill_passes"]
    assert passes and sum(p["tokens"] for p in passes) == prompt_tokens - cached_tokens
    assert sum(p["seconds"] for p in passes) == pytest.approx(timing["prefill"])
    assert isinstance(timing["taps"], int) and timing["taps"] >= 0
    # the engine's submit-to-first-token: after the admission, within the wall
    assert timing["admission"] <= timing["time_to_first_token"] <= wall, (timing, wall)
    # the server's own part: taking the request to the submit, and (streamed) the first token to its chunk
    assert ("server_first_send" in timing) == streamed, timing
    server = timing["server_prepare"] + timing.get("server_first_send", 0.0)
    assert timing["server_prepare"] >= 0.0 and server + timing["time_to_first_token"] <= wall, (timing, wall)


def chat(client, content: str, **kw):
    t0 = time.monotonic()
    r = client.chat.completions.create(model="builtin:random", max_tokens=6, temperature=0,
                                       messages=[{"role": "system", "content": SYSTEM},
                                                 {"role": "user", "content": content}], **kw)
    return r, time.monotonic() - t0


# --- usage.hpc_timing ---------------------------------------------------------------------------

def test_openai_timing_only_when_asked(live):
    client = oai(live)
    plain, _ = chat(client, "plain", extra_body=NO_THINK)
    assert "hpc_timing" not in plain.usage.model_dump()
    r, wall = chat(client, "timed", extra_body={**NO_THINK, **TIMING})
    u = r.usage
    check_timing(u.model_dump()["hpc_timing"], wall, u.prompt_tokens, u.prompt_tokens_details.cached_tokens)
    assert u.prompt_tokens_details.cached_tokens > 0  # the shared system block came from the cache
    off, _ = chat(client, "off", extra_body={**NO_THINK, "hpc": {"timing": False}})
    assert "hpc_timing" not in off.usage.model_dump()


def test_openai_streaming_and_completions_timing(live):
    client = oai(live)
    t0 = time.monotonic()
    chunks = list(client.chat.completions.create(
        model="builtin:random", max_tokens=5, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "stream"}], extra_body={**NO_THINK, **TIMING}))
    wall = time.monotonic() - t0
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].choices == []
    u = chunks[-1].usage
    check_timing(u.model_dump()["hpc_timing"], wall, u.prompt_tokens, u.prompt_tokens_details.cached_tokens,
                 streamed=True)
    t0 = time.monotonic()
    r = client.completions.create(model="builtin:random", prompt="hello there", max_tokens=3, extra_body=TIMING)
    wall = time.monotonic() - t0
    check_timing(r.usage.model_dump()["hpc_timing"], wall, r.usage.prompt_tokens,
                 r.usage.prompt_tokens_details.cached_tokens)


def test_anthropic_timing_only_when_asked(live):
    client = ant(live)
    msgs = [{"role": "user", "content": "hello"}]
    plain = client.messages.create(model="builtin:random", max_tokens=4, messages=msgs)
    assert "hpc_timing" not in plain.usage.model_dump()
    t0 = time.monotonic()
    r = client.messages.create(model="builtin:random", max_tokens=4, system=SYSTEM, messages=msgs, extra_body=TIMING)
    wall = time.monotonic() - t0
    u = r.usage
    check_timing(u.model_dump()["hpc_timing"], wall,
                 u.input_tokens + u.cache_read_input_tokens + u.cache_creation_input_tokens, u.cache_read_input_tokens)
    t0 = time.monotonic()
    with client.messages.stream(model="builtin:random", max_tokens=4, messages=msgs, extra_body=TIMING) as stream:
        deltas = [ev for ev in stream if ev.type == "message_delta"]
    wall = time.monotonic() - t0
    (delta,) = deltas
    timing = delta.usage.model_dump()["hpc_timing"]
    assert all(timing[p] >= 0.0 for p in PHASES) and sum(timing[p] for p in PHASES) <= wall
    assert timing["server_prepare"] + timing["time_to_first_token"] + timing["server_first_send"] <= wall, timing


def test_bad_timing_option_is_a_400(live):
    with pytest.raises(openai.BadRequestError):
        chat(oai(live), "x", extra_body={"hpc": {"timing": "yes"}})
    with pytest.raises(anthropic.BadRequestError):
        ant(live).messages.create(model="builtin:random", max_tokens=2, messages=[{"role": "user", "content": "x"}],
                                  extra_body={"hpc": {"timings": True}})


def test_debug_timing_setting_adds_it_to_every_response(serve):
    settings = load_settings(None, {"server.debug_timing": True}, environ={})
    url = serve(create_app(FakeEngine().start(), settings))
    r = oai(url).chat.completions.create(model="builtin:random", max_tokens=2, messages=[{"role": "user", "content": "x"}])
    timing = r.usage.model_dump()["hpc_timing"]
    assert all(timing[p] >= 0.0 for p in PHASES)
    r = oai(url).chat.completions.create(model="builtin:random", max_tokens=2, messages=[{"role": "user", "content": "x"}],
                                         extra_body={"hpc": {"timing": False}})
    assert "hpc_timing" not in r.usage.model_dump()
    m = ant(url).messages.create(model="builtin:random", max_tokens=2, messages=[{"role": "user", "content": "x"}])
    assert set(PHASES) <= set(m.usage.model_dump()["hpc_timing"])


# --- /metrics -------------------------------------------------------------------------------------

def test_phase_histograms_after_requests(live):
    chat(oai(live), "metrics please", extra_body=NO_THINK)
    r = httpx.get(live + "/metrics", timeout=10)
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    fam = families(r.text)
    phase = fam["hpc_request_phase_seconds"]
    assert phase.type == "histogram"
    counts = {s.labels["phase"]: s.value for s in phase.samples if s.name.endswith("_count")}
    assert set(counts) == set(PHASES) and all(c > 0 for c in counts.values()), counts
    for p in PHASES:
        buckets = [s for s in phase.samples if s.name.endswith("_bucket") and s.labels["phase"] == p]
        assert buckets[0].labels["le"] == "0.0005" and buckets[-1].labels["le"] == "+Inf"
        assert buckets[-1].value == counts[p]
    for name in ("hpc_prefill_pass_seconds", "hpc_prefill_pass_tokens"):
        count = next(s.value for s in fam[name].samples if s.name == name + "_count")
        assert count >= counts["prefill"], name  # at least one pass per request
    server = {s.labels["phase"]: s.value for s in fam["hpc_server_phase_seconds"].samples if s.name.endswith("_count")}
    assert server["prepare"] > 0 and "first_send" in server, server  # once per request (its first choice)
    tokens = next(s.value for s in fam["hpc_prefill_pass_tokens"].samples if s.name.endswith("_sum"))
    prefilled = next(s.value for s in fam["hpc_prefill_tokens"].samples if s.name == "hpc_prefill_tokens_total")
    assert tokens == prefilled > 0
    # the names that existed before prometheus_client, the engine gauges and the process metrics
    for name in ("hpc_requests", "hpc_requests_running", "hpc_prompt_tokens", "hpc_cached_tokens",
                 "hpc_prefill_tokens", "hpc_completion_tokens", "hpc_cache_hit_rate", "hpc_host_restores",
                 "hpc_host_restored_bytes", "hpc_time_to_first_token_seconds", "hpc_inter_token_latency_seconds",
                 "hpc_engine_cache_pool_free", "process_cpu_seconds", "python_info", "python_gc_collections"):
        assert name in fam, name
    ok = [s for s in fam["hpc_requests"].samples
          if s.name == "hpc_requests_total" and s.labels == {"endpoint": "chat", "outcome": "ok"}]
    assert ok and ok[0].value >= 1


def test_content_negotiation(live):
    r = httpx.get(live + "/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"}, timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/openmetrics-text")
    assert r.text.endswith("# EOF\n")
    names = {f.name for f in parse_openmetrics(r.text)}
    assert {"hpc_request_phase_seconds", "hpc_requests", "hpc_engine_cache_pool_free"} <= names
    r = httpx.get(live + "/metrics", headers={"Accept": "text/plain"}, timeout=10)
    assert r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert "# EOF" not in r.text


# --- Metrics units ----------------------------------------------------------------------------------

def test_registry_per_app_and_checked_labels():
    a, b = Metrics(), Metrics()
    a.request_done("chat", "ok")
    fa, fb = families(a.render()), families(b.render())
    value = {m: next(s.value for s in f["hpc_requests"].samples
                     if s.name == "hpc_requests_total" and s.labels == {"endpoint": "chat", "outcome": "ok"})
             for m, f in (("a", fa), ("b", fb))}
    assert value == {"a": 1.0, "b": 0.0}
    with pytest.raises(ValueError):
        a.request_done("chat", "exploded")
    with pytest.raises(ValueError):
        a.request_done("v2/whatever", "ok")


def test_usage_timing_observed():
    m = Metrics()
    u = Usage(prompt_tokens=300, prefill_tokens=300, completion_tokens=4)
    u.timing.admission, u.timing.finish = 0.002, 0.0007
    u.timing.passes += [PrefillPass(0.03, 256), PrefillPass(0.01, 44)]
    m.usage(u)
    fam = families(m.render())
    samples = {(s.name, s.labels.get("phase"), s.labels.get("le")): s.value
               for s in fam["hpc_request_phase_seconds"].samples}
    assert samples[("hpc_request_phase_seconds_count", "prefill", None)] == 1
    assert samples[("hpc_request_phase_seconds_sum", "prefill", None)] == pytest.approx(0.04)
    assert samples[("hpc_request_phase_seconds_bucket", "admission", "0.0025")] == 1
    assert samples[("hpc_request_phase_seconds_bucket", "admission", "0.001")] == 0
    tokens = {float(s.labels["le"]): s.value for s in fam["hpc_prefill_pass_tokens"].samples
              if s.name.endswith("_bucket")}
    assert tokens[64] == 1 and tokens[256] == 2


def test_kernel_compilations_counter_only_when_reported():
    m = Metrics()
    assert "hpc_kernel_compilations" not in families(m.render({"cache": {"pool": {"free": 3}}}))
    fam = families(m.render({"compilations": 7, "cache": {"pool": {"free": 3}}}))
    c = fam["hpc_kernel_compilations"]
    assert c.type == "counter" and next(s.value for s in c.samples if s.name.endswith("_total")) == 7
    assert fam["hpc_engine_cache_pool_free"].samples[0].value == 3
    assert "hpc_engine_cache_pool_free" not in families(m.render())  # the document is per exposition
