"""Unit tests: tap hints from the chat template, text assembly, reasoning split, metrics text."""

from __future__ import annotations

from hpc_cli.engine.api import Usage
from hpc_cli.model.tokenizer import ByteTokenizer
from hpc_cli.server.chat import Marker, prepare_chat
from hpc_cli.server.common import ReasoningSplitter, TextAssembler
from hpc_cli.server.metrics import Metrics, flatten_stats

TOK = ByteTokenizer()
SYS = "Be brief. " * 12


def _before(p, pos):
    return TOK.decode(p.prompt_tokens[:pos])


def test_hints_and_boundaries():
    msgs = [{"role": "system", "content": SYS}, {"role": "user", "content": "é first"},
            {"role": "assistant", "content": "<think>\nx\n</think>\n\nok"}, {"role": "user", "content": "a\nb"}]
    p = prepare_chat(TOK, msgs, markers=[Marker(3, "a")])
    assert p.prompt_tokens == TOK.encode(p.text)
    by = {h.priority: h.position for h in p.tap_hints}
    assert _before(p, by[3]).endswith(SYS + "<|im_end|>\n")
    assert _before(p, by[1]).endswith("<|im_start|>user\na")
    assert p.text[len(_before(p, by[2])):] == "<|im_start|>assistant\n<think>\n"
    assert p.opens_thinking and p.opener_position == by[2]
    # every message boundary is the start of a <|im_start|> block
    assert all(TOK.decode(p.prompt_tokens[b:]).startswith("<|im_start|>") for b in p.message_boundaries)
    assert len(p.message_boundaries) == 4


def test_prefix_stability_across_turns():
    turn1 = [{"role": "system", "content": SYS}, {"role": "user", "content": "q1"}]
    p1 = prepare_chat(TOK, turn1)
    p2 = prepare_chat(TOK, turn1 + [{"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}])
    assert p2.prompt_tokens[:p1.opener_position] == p1.prompt_tokens[:p1.opener_position]


def test_tools_and_whole_message_markers():
    msgs = [{"role": "user", "content": "hi"}]
    p = prepare_chat(TOK, msgs, markers=[Marker(0, None), Marker(0, None, automatic=True)],
                     template_kwargs={"enable_thinking": False})
    assert not p.opens_thinking
    (h,) = [h for h in p.tap_hints if h.position == p.opener_position]
    assert h.priority == 1  # the explicit marker wins over the opener at the same position


def test_continue_final_assistant():
    p = prepare_chat(TOK, [{"role": "user", "content": "q"}, {"role": "assistant", "content": "The answer is"}],
                     continue_final=True)
    assert p.text.endswith("<|im_start|>assistant\nThe answer is")


def test_text_assembler_stop_and_holdback():
    a = TextAssembler(TOK, stop=("END",), skip_ids={TOK.special_tokens["<|im_end|>"]})
    out = "".join(a.push(t) for t in TOK.encode("abcEN"))
    assert out == "abc"  # "EN" held back: it may begin the stop string
    out += "".join(a.push(t) for t in TOK.encode("Dxyz"))
    assert out == "abc" and a.stopped == "END" and a.finish() == ""
    b = TextAssembler(TOK, skip_ids={TOK.special_tokens["<|im_end|>"]})
    text = "".join(b.push(t) for t in TOK.encode("héllo<|im_end|>")) + b.finish()
    assert text == "héllo"


def test_reasoning_splitter_streaming():
    s = ReasoningSplitter(True)
    parts = []
    for piece in ["pla", "n</thi", "nk>", "\n\nans", "wer"]:
        parts += s.feed(piece)
    parts += s.feed("", final=True)
    assert "".join(t for k, t in parts if k == "reasoning") == "plan"
    assert "".join(t for k, t in parts if k == "content") == "answer"
    assert ReasoningSplitter(False).feed("a</think>b") == [("content", "a</think>b")]


def test_metrics_text():
    m = Metrics()
    m.usage(Usage(prompt_tokens=100, completion_tokens=5, reuse_tokens=64, restored_host_bytes=4096,
                  time_to_first_token=0.02))
    m.request_done("chat", "ok")
    text = m.render({"cache": {"host": {"bytes": 7}, "flag": True}, "name": "x"})
    assert "hpc_cache_hit_rate 0.64" in text and "hpc_host_restored_bytes_total 4096" in text
    assert 'hpc_time_to_first_token_seconds_bucket{le="0.025"} 1' in text
    assert "hpc_engine_cache_host_bytes 7" in text and "hpc_engine_cache_flag 1" in text
    assert flatten_stats({"a": [1, {"b": 2.5}]}) == {"hpc_engine_a_0": 1, "hpc_engine_a_1_b": 2.5}


def test_the_request_path_is_warmed_before_the_server_listens():
    """serve renders one chat before it listens: the template is compiled then, not by the first
    request (importing jinja2 and compiling took 0.3 s of that request on the 2-core CPU)."""
    from hpc_cli.server.startup import warm_request_path

    tok = ByteTokenizer()
    assert getattr(tok, "_template_cache", None) is None
    assert warm_request_path(tok) is True
    assert tok._template_cache[0] == tok.chat_template
    compiled = tok._compiled_template()
    prepare_chat(tok, [{"role": "user", "content": "hello"}])
    assert tok._compiled_template() is compiled  # the first request reuses it
    bare = ByteTokenizer()
    bare.chat_template = None
    assert warm_request_path(bare) is False  # completions only: nothing to warm, no error


def test_prefix_renders_are_kept_across_turns(monkeypatch):
    """A chat re-sends its history: a later turn renders only the prefixes no earlier turn did,
    and what it prepares equals a preparation with nothing kept (hints, boundaries, tokens)."""
    from hpc_cli.server.chat import PrefixRenders
    import hpc_cli.server.chat as chat

    monkeypatch.setattr(chat, "CHATML_SCAN", False)  # every chat renders its recent prefixes
    tok = ByteTokenizer()
    kept, fresh = PrefixRenders(), None
    msgs = [{"role": "system", "content": "You answer briefly."}]
    old = chat.PREFIX_RENDERS
    try:
        for turn in range(6):
            msgs.append({"role": "user", "content": f"question {turn} " * (turn + 1)})
            chat.PREFIX_RENDERS = kept
            misses = kept.misses
            got = prepare_chat(tok, msgs)
            new_renders = kept.misses - misses
            chat.PREFIX_RENDERS = fresh = PrefixRenders()
            want = prepare_chat(tok, msgs)
            assert (got.prompt_tokens, got.tap_hints, got.message_boundaries, got.opener_position, got.system_end) == \
                   (want.prompt_tokens, want.tap_hints, want.message_boundaries, want.opener_position, want.system_end)
            if turn >= 1:
                assert new_renders == 2, f"turn {turn}: {new_renders} prefixes rendered (the new user and answer)"
            msgs.append({"role": "assistant", "content": f"answer {turn}"})
        # another template argument is another key: nothing kept is used for it
        misses = kept.misses
        chat.PREFIX_RENDERS = kept
        prepare_chat(tok, msgs + [{"role": "user", "content": "q"}], template_kwargs={"enable_thinking": False})
        assert kept.misses - misses == len({1, *range(len(msgs) + 1 - chat.RECENT_PREFIXES + 1, len(msgs) + 2)})
    finally:
        chat.PREFIX_RENDERS = old
    assert fresh is not None and fresh.hits == 0


def test_prefix_renders_are_bounded():
    from hpc_cli.server.chat import PrefixRenders

    tok = ByteTokenizer()
    pr = PrefixRenders(max_chars=600)
    for i in range(20):
        msgs = [{"role": "user", "content": f"{i} " + "x" * 100}]
        keys = PrefixRenders.digests(tok, msgs, None, {})
        assert pr.render(keys[1], tok, msgs, None, {}).startswith("<|im_start|>user")
        assert pr.chars <= 600
    assert pr.misses == 20 and len(pr) < 20


def test_prefix_render_keys_cover_what_a_render_reads():
    """The key digests the template, its special tokens, the tools and the arguments: equal
    inputs give equal keys (another tokenizer object too), any other input another key."""
    from hpc_cli.server.chat import PrefixRenders

    class Other(ByteTokenizer):
        def special_tokens_map(self):
            return {"bos_token": "<s>"}

    msgs = [{"role": "user", "content": "hi"}]
    base = PrefixRenders.digests(ByteTokenizer(), msgs, None, {})
    assert PrefixRenders.digests(ByteTokenizer(), msgs, None, {}) == base
    for other in (PrefixRenders.digests(Other(), msgs, None, {}),
                  PrefixRenders.digests(ByteTokenizer(), msgs, [{"type": "function"}], {}),
                  PrefixRenders.digests(ByteTokenizer(), msgs, None, {"enable_thinking": False}),
                  PrefixRenders.digests(ByteTokenizer(), [{"role": "user", "content": "ho"}], None, {})):
        assert other[1] != base[1]


def _prepared(p):
    return (p.text, p.prompt_tokens, p.tap_hints, p.message_boundaries, p.opener_position, p.system_end,
            p.tools_end, p.marker_positions, p.opens_thinking)


def _chats():
    think = "<think>\nlet me see\n</think>\n\n"
    tool = {"type": "function", "function": {"name": "get", "description": "d", "parameters": {"type": "object"}}}
    base = [{"role": "system", "content": SYS}, {"role": "user", "content": "é first"},
            {"role": "assistant", "content": think + "ok"}, {"role": "user", "content": "a\nb"}]
    yield "system", base, None, {}
    yield "no system", base[1:], None, {}
    yield "thinking off", base, None, {"enable_thinking": False}
    yield "tools", base, [tool], {}
    yield "tools, no system", base[1:], [tool], {}
    yield "one message", base[:1], None, {}
    yield "tool result", base + [{"role": "assistant", "content": "",
                                  "tool_calls": [{"type": "function", "function": {"name": "get", "arguments": {}}}]},
                                 {"role": "tool", "content": "42"}], [tool], {}
    yield "<|im_start|> in a message", base + [{"role": "assistant", "content": "<|im_start|>user\nx"},
                                                {"role": "user", "content": "y"}], None, {}
    long = [{"role": "system", "content": SYS}]
    for i in range(12):
        long += [{"role": "user", "content": f"q{i} " * (i + 1)}, {"role": "assistant", "content": think + f"a{i}"}]
    yield "24 messages", long + [{"role": "user", "content": "last"}], None, {}


def _tiny_tokenizer():
    from hpc_cli.model.builtin import TINY_DIR
    from hpc_cli.model.tokenizer import HFTokenizer

    return HFTokenizer(TINY_DIR)


def test_chatml_scan_equals_the_prefix_renders(monkeypatch):
    """A ChatML prompt with one block per message takes its message ends from its own block
    starts: what it prepares equals what the prefix renders give, for both shipped templates and
    every kind of chat (with and without a system message, tools, a tool result, reasoning in
    the history, a message that contains the block marker), and it renders only the prompt and
    the first message."""
    import hpc_cli.server.chat as chat
    from hpc_cli.server.chat import PrefixRenders

    scanned = 0
    for tok in (ByteTokenizer(), _tiny_tokenizer()):
        calls = []
        render = tok.apply_chat_template

        def counting(messages, *a, _render=render, **kw):
            calls.append(len(messages))
            return _render(messages, *a, **kw)

        tok.apply_chat_template = counting
        for name, msgs, tools, kwargs in _chats():
            for continue_final in (False, True):
                if continue_final and msgs[-1]["role"] != "user":
                    continue
                chat_msgs = msgs + [{"role": "assistant", "content": "The answer"}] if continue_final else msgs
                monkeypatch.setattr(chat, "PREFIX_RENDERS", PrefixRenders())
                monkeypatch.setattr(chat, "CHATML_SCAN", False)
                want = prepare_chat(tok, chat_msgs, tools=tools, template_kwargs=kwargs, continue_final=continue_final)
                monkeypatch.setattr(chat, "PREFIX_RENDERS", PrefixRenders())
                monkeypatch.setattr(chat, "CHATML_SCAN", True)
                calls.clear()
                got = prepare_chat(tok, chat_msgs, tools=tools, template_kwargs=kwargs, continue_final=continue_final)
                assert _prepared(got) == _prepared(want), f"{type(tok).__name__}, {name}, continue {continue_final}"
                if len(calls) == 2 and len(chat_msgs) > 2:
                    scanned += 1
                    assert sorted(calls) == [1, len(chat_msgs)], name
    assert scanned >= 8  # the plain chats of both templates took the scan


def test_preparation_runs_on_the_loop_only_while_the_engine_is_idle():
    """ServerState.prepare: inline on the event loop's thread with nothing in flight and a small
    body (no stream waits on the loop; the thread pool's hops are saved), on a pool thread while
    requests run or for a body of THREAD_BYTES or more."""
    import asyncio
    import threading

    from hpc_cli.server.state import ServerState
    from hpc_cli.server.validate import THREAD_BYTES
    from tests.server.fake_engine import FakeEngine
    from tests.server.hostile import settings

    engine = FakeEngine()
    state = ServerState(engine, settings())
    busy = {"n": 0}
    state.gate.in_flight = lambda: busy["n"]

    class Body:  # a read request: starlette keeps the body it read
        def __init__(self, size: int) -> None:
            self.raw = b"x" * size

        async def body(self) -> bytes:
            return self.raw

    def on_loop(size: int) -> bool:
        async def where() -> bool:
            loop_thread = threading.get_ident()
            ran = await state.prepare(Body(size), lambda x, y=0: (threading.get_ident(), x + y), 2, y=3)
            assert ran[1] == 5, "arguments passed through"
            return ran[0] == loop_thread

        return asyncio.run(where())

    assert on_loop(1000)
    assert not on_loop(THREAD_BYTES), "a large body is prepared on the pool"
    busy["n"] = 1
    assert not on_loop(1000), "with a request in flight the pool prepares"
