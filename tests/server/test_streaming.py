"""The one SSE loop (hpc_cli.server.streaming.stream_events) and collect, without HTTP: what a
route's writer is asked to write, the outcome each way a request ends is counted with, and
which engine requests get cancelled."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from hpc_cli.engine.api import AdmittedEvent, FinishEvent, GenerationRequest, RequestHandle, TokenEvent, Usage
from hpc_cli.model.tokenizer import ByteTokenizer
from hpc_cli.server.common import TextAssembler
from hpc_cli.server.streaming import StreamWriter, collect, stream_events
from hpc_cli.server.tracking import RequestTracker


class Recorder:
    """ServerState's metrics, as calls."""

    def __init__(self) -> None:
        self.done: list[tuple[str, str]] = []
        self.running = 0

    def add_running(self, delta: int) -> None:
        self.running += delta

    def request_done(self, endpoint: str, outcome: str) -> None:
        self.done.append((endpoint, outcome))

    def inter_token(self, seconds: float) -> None:
        pass

    def usage(self, usage: Usage) -> None:
        pass


class Writer(StreamWriter):
    """Each event as one line (what the stream yields at once is several)."""

    def opening(self):
        return ["open\n"]

    def admitted(self, ev):
        return [f"admitted {ev.reuse_tokens}\n"]

    def token(self, ev, piece):
        return [f"token {piece!r}\n"]

    def finish(self, fin, tail):
        return [f"finish {fin.reason} {tail!r}\n"]

    def error(self, status, message, code):
        return [f"error {status} {message} {code}\n"]


class Request:
    def __init__(self, gone: bool = False) -> None:
        self.gone = gone

    async def is_disconnected(self) -> bool:
        return self.gone


def setup(events, stop=()):
    tok = ByteTokenizer()
    state = SimpleNamespace(metrics=Recorder(), tokenizer=tok)
    cancelled = []
    handle = RequestHandle(GenerationRequest(prompt_tokens=[1]), cancelled.append)
    for ev in events:
        handle.put(ev)
    return state, handle, cancelled, TextAssembler(tok, stop)


def tokens(text: str) -> list[TokenEvent]:
    return [TokenEvent(b) for b in text.encode()]


def writes(state, handle, asm, request=None) -> list[str]:
    """What the stream yields, write by write (each a connection write)."""
    async def main():
        return [s async for s in stream_events(state, request or Request(), handle, "chat", asm, Writer())]

    return asyncio.run(main())


def run(state, handle, asm, request=None) -> list[str]:
    """The events written, in order."""
    return "".join(writes(state, handle, asm, request)).splitlines()


def test_a_finished_stream_is_written_in_order_and_counted_ok():
    state, handle, cancelled, asm = setup([AdmittedEvent(4, 4), *tokens("ab"), FinishEvent("length", Usage())])
    assert run(state, handle, asm) == ["open", "admitted 4", "token 'a'", "token 'b'", "finish length ''"]
    assert state.metrics.done == [("chat", "ok")] and state.metrics.running == 0
    assert not cancelled


def test_the_events_put_before_the_loop_reads_them_go_out_in_one_write():
    # a speculative round's tokens are put together: one write of the loop, each its own event
    state, handle, cancelled, asm = setup([AdmittedEvent(4, 4), *tokens("ab"), FinishEvent("length", Usage())])
    assert writes(state, handle, asm) == ["open\n", "admitted 4\ntoken 'a'\ntoken 'b'\nfinish length ''\n"]


def test_events_put_while_the_stream_runs_are_each_written():
    """Events put one at a time from another thread (a decode step's token each) reach the stream
    as they come: none is lost or waits for the next, with one wake-up a put at most."""
    import threading
    import time

    state, handle, cancelled, asm = setup([])

    def engine():
        for ev in [*tokens("abc"), FinishEvent("length", Usage())]:
            time.sleep(0.02)
            handle.put(ev)

    async def main():
        t = threading.Thread(target=engine)
        t.start()
        out = []
        async for s in stream_events(state, Request(), handle, "chat", asm, Writer()):
            out.append((s, time.monotonic()))
        t.join()
        return out

    out = asyncio.run(main())
    assert "".join(s for s, _ in out).splitlines() == ["open", "token 'a'", "token 'b'", "token 'c'",
                                                       "finish length ''"]
    assert len(out) == 5, out  # each put came alone: a write each


def test_an_engine_failure_is_one_error_event_with_the_default_message():
    for reason, status, message in (("error", 500, "the engine failed this request"),
                                     ("unavailable", 503, "the server is stopping; the request was not completed")):
        state, handle, cancelled, asm = setup([*tokens("a"), FinishEvent(reason, Usage())])
        assert run(state, handle, asm) == ["open", "token 'a'", f"error {status} {message} {reason}"]
        assert state.metrics.done == [("chat", reason)]
    state, handle, cancelled, asm = setup([FinishEvent("error", Usage(), error="boom")])
    assert run(state, handle, asm)[-1] == "error 500 boom error"


def test_a_stop_string_cancels_the_engine_request_and_finishes_as_stop():
    state, handle, cancelled, asm = setup([*tokens("abcd"), FinishEvent("cancelled", Usage())], stop=("c",))
    assert run(state, handle, asm) == ["open", "token 'a'", "token 'b'", "token ''", "finish stop ''"]
    assert cancelled == [handle.request.request_id]
    assert state.metrics.done == [("chat", "ok")]


def test_a_client_gone_ends_the_stream_cancelled():
    state, handle, cancelled, asm = setup(tokens("ab"))  # no finish: only the client's going ends it
    assert run(state, handle, asm, Request(gone=True)) == ["open", "token 'a'", "token 'b'"]
    assert cancelled == [handle.request.request_id]
    assert state.metrics.done == [("chat", "cancelled")] and state.metrics.running == 0


def test_collect_reads_to_the_finish():
    state, handle, cancelled, _ = setup([*tokens("abcd"), FinishEvent("cancelled", Usage())])
    tracker = RequestTracker(state, "completions")
    toks, asm, fin = asyncio.run(collect(state, Request(), handle, tracker, ("c",), set()))
    assert [t.token_id for t in toks] == list(b"abc") and asm.text == "ab" and fin.reason == "stop"
    assert cancelled == [handle.request.request_id]


def test_a_tokens_chunk_framed_once_is_the_same_bytes_as_built_whole():
    """OpenAI chunks of a token's text are written as a frame made once around the text's JSON
    (``framed_chunk``): byte for byte what encoding the whole chunk gives, for any text, in both
    routes' shapes, with and without the usage field."""
    from hpc_cli.server.chat_completions import ChatStreamWriter
    from hpc_cli.server.completions import CompletionStreamWriter
    from hpc_cli.server.openai_common import OpenAIStreamWriter

    texts = ["", "a", ' "quoted" ', "back\\slash", "new\nline\ttab", "naïve — 東京 🙂", "\x00hpc-text\x00",
             "}]}"]
    for usage in (False, True):
        w = OpenAIStreamWriter({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7,
                                "model": "m", "system_fingerprint": None}, usage)
        for key in ("content", "reasoning_content"):
            def make(t, key=key):
                return ChatStreamWriter._choice({key: t})
            for t in texts:
                assert w.framed_chunk(make, key, t) == w.chunk(make(t)), (key, t)
        for t in texts:
            assert w.framed_chunk(CompletionStreamWriter._choice, "text", t) == \
                w.chunk(CompletionStreamWriter._choice(t)), t
