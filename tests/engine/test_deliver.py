"""The worker's hand-off to the server (hpc_cli.engine.finish.Finish._deliver and
RequestHandle's acknowledgement): after first or last tokens the worker waits, without the
interpreter, until the server has sent them, at most DELIVER_MAX_S, and not at all for a consumer
that does not acknowledge."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

from hpc_cli.engine.api import (FinishEvent, FinishReason, GenerationRequest, RequestHandle, SamplingParams,
                                 TokenEvent, Usage)
from hpc_cli.engine.finish import Finish
from hpc_cli.server.common import iterate_events


def _handle() -> RequestHandle:
    return RequestHandle(GenerationRequest([1, 2, 3], SamplingParams(max_tokens=4)), lambda rid: None)


def _worker(max_s: float) -> SimpleNamespace:
    return SimpleNamespace(DELIVER_MAX_S=max_s, _send_held=lambda: None)


def _token(t: int) -> TokenEvent:
    return TokenEvent(token_id=t, logprob=None, top_logprobs=None)


def test_no_wait_for_a_consumer_that_does_not_acknowledge():
    h = _handle()
    h.put(_token(5))
    t0 = time.monotonic()
    Finish._deliver(_worker(0.5), [SimpleNamespace(handle=h)])
    assert time.monotonic() - t0 < 0.05, "result() readers must not hold the worker up"
    assert h.wait_sent(0.5) is False


def test_waits_until_sent_and_no_longer():
    h = _handle()
    h.acknowledges = True
    h.put(_token(5))

    def consumer():
        time.sleep(0.05)
        h.get(timeout=1)
        h.acknowledge()

    threading.Thread(target=consumer).start()
    t0 = time.monotonic()
    Finish._deliver(_worker(2.0), [SimpleNamespace(handle=h)])
    waited = time.monotonic() - t0
    assert 0.04 <= waited < 1.0, f"the worker waited {waited:.3f} s for a send that took 0.05 s"


def test_wait_is_capped_for_all_lanes_together():
    hs = [_handle() for _ in range(3)]
    for h in hs:
        h.acknowledges = True
        h.put(_token(5))  # nobody takes them
    t0 = time.monotonic()
    Finish._deliver(_worker(0.1), [SimpleNamespace(handle=h) for h in hs])
    waited = time.monotonic() - t0
    assert 0.09 <= waited < 0.25, f"three silent consumers held the worker {waited:.3f} s (cap 0.1 s)"


def test_an_event_put_after_the_acknowledgement_keeps_the_wait():
    h = _handle()
    h.acknowledges = True
    h.put(_token(5))
    h.get(timeout=1)
    h.acknowledge()
    assert h.wait_sent(0)
    h.put(_token(6))
    assert not h.wait_sent(0.01), "a new event is not sent yet"
    h.acknowledge()  # its consumer has not taken it: still not sent
    assert not h.wait_sent(0.01)
    h.get(timeout=1)
    h.acknowledge()
    assert h.wait_sent(0)


def test_the_server_acknowledges_each_event_it_was_asked_past():
    h = _handle()

    async def consume() -> list[bool]:
        seen = []
        async for ev in iterate_events(h):
            seen.append(h.wait_sent(0))  # this event is being handled: not acknowledged yet
        return seen

    h.put(_token(5))
    h.put(FinishEvent(FinishReason.LENGTH, Usage()))
    seen = asyncio.run(consume())
    assert h.acknowledges
    assert seen == [False, False]
    assert h.wait_sent(0), "the finish event was acknowledged when the stream ended"


def test_the_admission_wakes_only_a_stream_that_sends_at_admission():
    """iterate_events(wake_on_admission=False): the admission is read with the next event (the
    loop stays off the interpreter while the worker goes on to launch the pass)."""
    from hpc_cli.engine.api import AdmittedEvent

    def arrival(wake: bool) -> float:
        h = _handle()

        async def consume() -> float:
            t0 = time.monotonic()

            def engine() -> None:
                time.sleep(0.05)  # the consumer waits by now
                h.put(AdmittedEvent(0, 0))
                time.sleep(0.2)
                h.put(FinishEvent(FinishReason.LENGTH, Usage()))

            threading.Thread(target=engine).start()
            async for ev in iterate_events(h, poll=5.0, wake_on_admission=wake):
                if isinstance(ev, AdmittedEvent):
                    return time.monotonic() - t0
            raise AssertionError("no admission event")

        return asyncio.run(consume())

    assert arrival(True) < 0.2, "a stream that sends at admission reads it at once"
    assert arrival(False) >= 0.24, "the admission alone does not wake the loop"
