"""Tool calls in the model's output: the parser (Qwen3.5 XML and Qwen2.5/Qwen3 JSON bodies, type
conversion, malformed blocks, streaming), and the server's OpenAI and Anthropic shapes through the
official clients against FakeEngine scripted to emit a tool call, plus the history round trip
through a template that renders tool calls the way the Qwen3.5 chat template does."""

from __future__ import annotations

import json

import httpx
import pytest

from hpc_cli.model.tokenizer import ByteTokenizer
from hpc_cli.server.app import create_app
from hpc_cli.server.tools import ToolCall, ToolParser, ToolStream, convert_value, tools_enabled
from hpc_cli.settings import load_settings

anthropic = pytest.importorskip("anthropic")  # the test extra; absent on bare machines
openai = pytest.importorskip("openai")  # the test extra; absent on bare machines

from .conftest import live_server
from .fake_engine import FakeEngine

# A template with the Qwen3.5 chat template's tool rendering: tools in the system block, calls
# as <tool_call><function=...><parameter=...> after the content ("\n\n" before the first call
# when there is content, "\n" between calls), results as <tool_response> in a user turn, and a
# <think> block on assistant turns after the last user query. ``json_calls`` renders the
# Qwen2.5/Qwen3 JSON body instead.
QWEN35_LIKE = r"""
{%- if tools -%}
  {{- '<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>' -}}
  {%- for t in tools -%}{{- '\n' + (t | tojson) -}}{%- endfor -%}
  {{- '\n</tools>\n\nIf you choose to call a function ONLY reply in the following format:\n\n' -}}
  {{- '<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n' -}}
  {{- '</parameter>\n</function>\n</tool_call>' -}}
  {%- if messages[0].role == 'system' and messages[0].content -%}{{- '\n\n' + messages[0].content -}}{%- endif -%}
  {{- '<|im_end|>\n' -}}
{%- elif messages and messages[0].role == 'system' -%}
  {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' -}}
{%- endif -%}
{%- set ns = namespace(last_query=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_query = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- for m in messages -%}
  {%- set content = (m.content or '') | trim -%}
  {%- if m.role == 'user' -%}
    {{- '<|im_start|>user\n' + content + '<|im_end|>\n' -}}
  {%- elif m.role == 'system' and not loop.first -%}
    {{- '<|im_start|>system\n' + content + '<|im_end|>\n' -}}
  {%- elif m.role == 'assistant' -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if loop.index0 > ns.last_query -%}
      {{- '<think>\n' + ((m.reasoning_content or '') | trim) + '\n</think>\n\n' -}}
    {%- endif -%}
    {{- content -}}
    {%- for tc in (m.tool_calls or []) -%}
      {%- set f = tc.function if tc.function is defined else tc -%}
      {{- ('\n\n' if content else '') if loop.first else '\n' -}}
      {%- if json_calls is defined and json_calls -%}
        {{- '<tool_call>\n{"name": ' + (f.name | tojson) + ', "arguments": ' + (f.arguments | tojson) -}}
        {{- '}\n</tool_call>' -}}
      {%- else -%}
        {{- '<tool_call>\n<function=' + f.name + '>\n' -}}
        {%- for k, v in f.arguments.items() -%}
          {{- '<parameter=' + k + '>\n' -}}
          {{- (v | tojson) if (v is mapping or (v is sequence and v is not string)) else (v | string) -}}
          {{- '\n</parameter>\n' -}}
        {%- endfor -%}
        {{- '</function>\n</tool_call>' -}}
      {%- endif -%}
    {%- endfor -%}
    {{- '<|im_end|>\n' -}}
  {%- elif m.role == 'tool' -%}
    {%- if loop.previtem and loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
    {{- '\n<tool_response>\n' + content + '\n</tool_response>' -}}
    {%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\n' -}}
  {%- if enable_thinking is defined and not enable_thinking -%}{{- '<think>\n\n</think>\n\n' -}}
  {%- else -%}{{- '<think>\n' -}}{%- endif -%}
{%- endif -%}"""

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "ratio": {"type": "number"}, "opts": {"type": "object"}, "tags": {"type": ["array", "null"]},
        "note": {"anyOf": [{"type": "integer"}, {"type": "string"}]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
    "zone": {"type": "string"}}}}}
TOOLS = [WEATHER, TIME]
ANT_TOOLS = [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
              "input_schema": t["function"]["parameters"]} for t in TOOLS]

XML_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n"
            "<parameter=opts>\n{\"units\": \"C\", \"hourly\": false}\n</parameter>\n</function>\n</tool_call>")
XML_ARGS = {"city": "Paris", "days": 3, "metric": True, "opts": {"units": "C", "hourly": False}}
XML_SCRIPT = "Checking.\n\n" + XML_CALL  # exactly what the template renders for that turn
JSON_CALL = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
USER = [{"role": "user", "content": "weather in Paris?"}]


# ---------------------------------------------------------------------------------------------
# Parser units
# ---------------------------------------------------------------------------------------------

def test_xml_call_with_type_conversion():
    text, calls = ToolParser(TOOLS).parse(XML_SCRIPT)
    assert text == "Checking."
    assert calls == [ToolCall("get_weather", XML_ARGS)]
    assert json.loads(calls[0].arguments_json()) == XML_ARGS


def test_json_call_and_string_arguments():
    p = ToolParser(TOOLS)
    assert p.parse(JSON_CALL) == ("", [ToolCall("get_time", {"zone": "UTC"})])
    s = '<tool_call>\n{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}\n</tool_call>'
    assert p.parse(s)[1] == [ToolCall("get_time", {"zone": "CET"})]
    assert p.parse('<tool_call>{"name": "get_time"}</tool_call>')[1] == [ToolCall("get_time", {})]


def test_value_conversion():
    props = WEATHER["function"]["parameters"]["properties"]
    assert convert_value("42", props["days"]) == 42 and convert_value("4.0", props["days"]) == 4
    assert convert_value("four", props["days"]) == "four"
    assert convert_value("2.5", props["ratio"]) == 2.5 and convert_value("7", props["ratio"]) == 7
    assert convert_value("nan", props["ratio"]) == "nan"
    assert convert_value("false", props["metric"]) is False and convert_value("True", props["metric"]) is True
    assert convert_value("yes", props["metric"]) == "yes"
    assert convert_value("{'a': None}", props["opts"]) == {"a": None}  # a Python repr
    assert convert_value("[1, 2]", props["tags"]) == [1, 2] and convert_value("None", props["tags"]) is None
    assert convert_value("[1, 2]", props["opts"]) == "[1, 2]"
    assert convert_value("12", props["note"]) == 12 and convert_value("soon", props["note"]) == "soon"
    assert convert_value("12", props["city"]) == "12" and convert_value("12", None) == "12"
    assert convert_value(" x \n", {}) == " x \n"


def test_xml_values_keep_their_text():
    body = ("<tool_call>\n<function=get_weather>\n<parameter=city>\n\nline one\n  line two\n\n</parameter>\n"
            "<parameter=unknown>\n7\n</parameter>\n</function>\n</tool_call>")
    _, [call] = ToolParser(TOOLS).parse(body)
    assert call.arguments == {"city": "\nline one\n  line two\n", "unknown": "7"}
    # lenient: no </function>, no </parameter> before the next parameter, no tools given
    loose = "<tool_call>\n<function=f>\n<parameter=a>\n1\n<parameter=b>\n2\n</parameter>\n</tool_call>"
    assert ToolParser(None).parse(loose)[1] == [ToolCall("f", {"a": "1", "b": "2"})]


def test_multiple_calls_and_text_around():
    second = ("<tool_call>\n<function=get_time>\n<parameter=zone>\nUTC\n</parameter>\n</function>\n"
              "</tool_call>")
    text, calls = ToolParser(TOOLS).parse("Two lookups.\n\n" + XML_CALL + "\n" + second + "\n" + JSON_CALL + "\n")
    assert text == "Two lookups."
    assert [c.name for c in calls] == ["get_weather", "get_time", "get_time"]
    text, calls = ToolParser(TOOLS).parse("before " + JSON_CALL + " after")
    assert text == "before  after" and len(calls) == 1


@pytest.mark.parametrize("bad", [
    "<tool_call>\nnot a call\n</tool_call>",
    "<tool_call>\n{\"name\": \"x\", \"arguments\": [1]}\n</tool_call>",
    "<tool_call>\n{\"arguments\": {}}\n</tool_call>",
    "<tool_call>\n{broken json\n</tool_call>",
    "<tool_call>\n<function=has space>\n</function>\n</tool_call>",
    "<tool_call>\n<function=f>\ngarbage\n</function>\n</tool_call>",
    "<tool_call>\n<function=f>\n</function>\ntrailing\n</tool_call>",
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis",  # never closed
    "<tool_call><tool_call><tool_call>",
    "</tool_call>",
])
def test_malformed_blocks_stay_text(bad):
    text, calls = ToolParser(TOOLS).parse("say " + bad)
    assert calls == [] and text == "say " + bad


def test_malformed_block_before_a_good_one():
    text, calls = ToolParser(TOOLS).parse("<tool_call>oops " + JSON_CALL)
    assert text == "<tool_call>oops" and calls == [ToolCall("get_time", {"zone": "UTC"})]


def test_stream_holds_only_a_possible_opener():
    s = ToolStream(ToolParser(TOOLS))
    assert s.feed("hello") == [("text", "hello")]
    assert s.feed(" a <") == [("text", " a ")]  # "<" may begin <tool_call>
    assert s.feed(" b") == [("text", "< b")]
    assert s.feed(" <tool_") == [("text", " ")]
    assert s.feed("cal") == []
    assert s.feed("l>\n{\"name\": \"get_time\", ") == []
    assert s.feed("\"arguments\": {}}\n</tool_call>\n") == [("call", ToolCall("get_time", {}))]
    assert s.feed("\n", final=True) == []  # whitespace after a call is dropped


def test_stream_char_by_char_matches_parse():
    text = "Let me see <b>bold</b>.\n\n" + XML_CALL + "\n" + JSON_CALL + "\n<tool_call>\nbad\n</tool_call> <tool_"
    p = ToolParser(TOOLS)
    s = ToolStream(p)
    parts = []
    for ch in text:
        parts += s.feed(ch)
    parts += s.feed("", final=True)
    calls = [v for k, v in parts if k == "call"]
    streamed = "".join(v for k, v in parts if k == "text")
    whole, whole_calls = p.parse(text)
    assert calls == whole_calls and len(calls) == 2
    assert streamed == "Let me see <b>bold</b>.\n\n\n<tool_call>\nbad\n</tool_call> <tool_"
    assert whole == streamed.strip()


def test_passthrough_and_enabling():
    assert ToolStream(None).feed(XML_CALL) == [("text", XML_CALL)]
    assert tools_enabled(TOOLS, None) and tools_enabled(TOOLS, "auto") and tools_enabled(TOOLS, "required")
    assert tools_enabled(TOOLS, {"type": "function", "function": {"name": "get_time"}})
    assert not tools_enabled(TOOLS, "none") and not tools_enabled(TOOLS, {"type": "none"})
    assert not tools_enabled(None, "auto") and not tools_enabled([], None)
    assert ToolParser([{"bogus": 1}, "x", {"name": "bare", "parameters": None}]).schemas == {"bare": {}}


def test_template_renders_what_the_parser_reads():
    tok = ByteTokenizer(chat_template=QWEN35_LIKE)
    args2 = {"zone": "UTC"}
    msgs = [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "Checking.", "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": XML_ARGS}},
                {"id": "b", "type": "function", "function": {"name": "get_time", "arguments": args2}}]},
            {"role": "tool", "content": "sunny", "tool_call_id": "a"},
            {"role": "tool", "content": "12:00", "tool_call_id": "b"}]
    for json_calls in (False, True):
        out = tok.apply_chat_template(msgs, tools=TOOLS, add_generation_prompt=True, json_calls=json_calls)
        turn = out.split("<|im_start|>assistant\n<think>\n\n</think>\n\n")[1].split("<|im_end|>")[0]
        assert ToolParser(TOOLS).parse(turn) == ("Checking.", [ToolCall("get_weather", XML_ARGS),
                                                                ToolCall("get_time", args2)])
        assert "<tool_response>\nsunny\n</tool_response>\n<tool_response>\n12:00\n</tool_response>" in out


# ---------------------------------------------------------------------------------------------
# Through the server (FakeEngine scripted to emit the call, then EOS)
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def srv():
    engine = FakeEngine().start()
    engine.tokenizer = ByteTokenizer(chat_template=QWEN35_LIKE)
    app = create_app(engine, load_settings(None, {}, environ={}))
    with live_server(app) as url:
        yield engine, url
    engine.stop(2)


def script(engine, text: str, eos: bool = True) -> None:
    engine.text_ids = engine.tokenizer.encode(text)
    engine.eos_after = len(engine.text_ids) if eos else None


def oai(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=20)


def ant(url):
    return anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=20)


def test_openai_tool_calls(srv):
    engine, url = srv
    script(engine, XML_SCRIPT + "\n" + JSON_CALL)
    r = oai(url).chat.completions.create(model="builtin:random", messages=USER, tools=TOOLS, max_tokens=400,
                                         extra_body=NO_THINK)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    calls = choice.message.tool_calls
    assert [(c.type, c.function.name) for c in calls] == [("function", "get_weather"), ("function", "get_time")]
    assert json.loads(calls[0].function.arguments) == XML_ARGS and json.loads(calls[1].function.arguments) == {
        "zone": "UTC"}
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id

    script(engine, JSON_CALL)  # calls only: content is null
    raw = httpx.post(url + "/v1/chat/completions", json={"model": "builtin:random", "messages": USER, "tools": TOOLS,
                                                         "max_tokens": 400, **NO_THINK}).json()
    assert raw["choices"][0]["message"]["content"] is None and raw["choices"][0]["finish_reason"] == "tool_calls"


def test_openai_no_parsing_without_tools_or_with_tool_choice_none(srv):
    engine, url = srv
    script(engine, XML_SCRIPT)
    client = oai(url)
    for extra in ({"tools": TOOLS, "tool_choice": "none"}, {}):
        r = client.chat.completions.create(model="builtin:random", messages=USER, max_tokens=400,
                                           extra_body=NO_THINK, **extra)
        assert r.choices[0].message.content == XML_SCRIPT and not r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "stop"


def test_openai_malformed_and_cut_blocks_are_text(srv):
    engine, url = srv
    client = oai(url)
    bad = "Hm.\n<tool_call>\n<function=get_weather>\nnot a parameter\n</function>\n</tool_call>"
    script(engine, bad)
    r = client.chat.completions.create(model="builtin:random", messages=USER, tools=TOOLS, max_tokens=400,
                                       extra_body=NO_THINK)
    assert r.choices[0].message.content == bad and r.choices[0].finish_reason == "stop"
    script(engine, XML_SCRIPT, eos=False)  # max_tokens cuts the block
    r = client.chat.completions.create(model="builtin:random", messages=USER, tools=TOOLS, max_tokens=40,
                                       extra_body=NO_THINK)
    assert r.choices[0].finish_reason == "length" and not r.choices[0].message.tool_calls
    assert r.choices[0].message.content == engine.tokenizer.decode(engine.text_ids[:40])


def test_openai_stream_tool_calls(srv):
    engine, url = srv
    script(engine, XML_SCRIPT + "\n" + JSON_CALL)
    chunks = list(oai(url).chat.completions.create(model="builtin:random", messages=USER, tools=TOOLS, max_tokens=400,
                                                   stream=True, extra_body=NO_THINK))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Checking.\n\n" and "<" not in text
    calls: dict[int, dict] = {}
    for c in chunks:
        for tc in c.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id:
                assert entry["id"] is None and tc.function.name
                entry.update(id=tc.id, name=tc.function.name)
            entry["arguments"] += tc.function.arguments or ""
    assert [calls[i]["name"] for i in sorted(calls)] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["arguments"]) == XML_ARGS and json.loads(calls[1]["arguments"]) == {"zone": "UTC"}
    assert all(v["id"].startswith("call_") for v in calls.values())
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["tool_calls"]


def test_anthropic_tool_use(srv):
    engine, url = srv
    script(engine, XML_SCRIPT + "\n" + JSON_CALL)
    r = ant(url).messages.create(model="builtin:random", max_tokens=400, tools=ANT_TOOLS, messages=USER)
    assert r.stop_reason == "tool_use" and r.stop_sequence is None
    assert [b.type for b in r.content] == ["text", "tool_use", "tool_use"]
    assert r.content[0].text == "Checking."
    assert (r.content[1].name, r.content[1].input) == ("get_weather", XML_ARGS)
    assert (r.content[2].name, r.content[2].input) == ("get_time", {"zone": "UTC"})
    assert r.content[1].id.startswith("toolu_") and r.content[1].id != r.content[2].id

    script(engine, XML_CALL)
    r = ant(url).messages.create(model="builtin:random", max_tokens=400, tools=ANT_TOOLS, messages=USER,
                                 tool_choice={"type": "none"})
    assert r.stop_reason == "end_turn" and [b.type for b in r.content] == ["text"] and r.content[0].text == XML_CALL


def test_anthropic_stream_tool_use(srv):
    engine, url = srv
    script(engine, XML_SCRIPT + "\n" + JSON_CALL)
    with ant(url).messages.stream(model="builtin:random", max_tokens=400, tools=ANT_TOOLS, messages=USER) as s:
        events = [(e.type, getattr(e, "content_block", None), getattr(e, "delta", None)) for e in s]
        final = s.get_final_message()
    starts = [cb.type for t, cb, _ in events if t == "content_block_start"]
    assert starts == ["text", "tool_use", "tool_use"]
    assert sum(1 for t, _, _ in events if t == "content_block_stop") == 3
    json_deltas = [d.partial_json for t, _, d in events if t == "content_block_delta" and d.type == "input_json_delta"]
    assert [json.loads(j) for j in json_deltas] == [XML_ARGS, {"zone": "UTC"}]
    text = "".join(d.text for t, _, d in events if t == "content_block_delta" and d.type == "text_delta")
    assert text == "Checking.\n\n"
    assert final.stop_reason == "tool_use"
    assert [(b.type, getattr(b, "name", None), getattr(b, "input", None)) for b in final.content[1:]] == [
        ("tool_use", "get_weather", XML_ARGS), ("tool_use", "get_time", {"zone": "UTC"})]

    script(engine, JSON_CALL)  # a call only: no text block
    with ant(url).messages.stream(model="builtin:random", max_tokens=400, tools=ANT_TOOLS, messages=USER) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["tool_use"] and final.stop_reason == "tool_use"


def _assistant_turn(engine) -> str:
    prompt = engine.tokenizer.decode(engine.submitted[-1].request.prompt_tokens)
    return prompt, prompt.split("<|im_start|>assistant\n<think>\n\n</think>\n\n")[1].split("<|im_end|>")[0]


def test_history_round_trip_openai(srv):
    engine, url = srv
    script(engine, XML_SCRIPT)
    client = oai(url)
    r = client.chat.completions.create(model="builtin:random", messages=USER, tools=TOOLS, max_tokens=400,
                                       extra_body=NO_THINK)
    msg = r.choices[0].message
    history = USER + [msg.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "sunny, 21 C"}]
    script(engine, "It is sunny.")
    r2 = client.chat.completions.create(model="builtin:random", messages=history, tools=TOOLS, max_tokens=400,
                                        extra_body=NO_THINK)
    assert r2.choices[0].message.content == "It is sunny." and r2.choices[0].finish_reason == "stop"
    prompt, turn = _assistant_turn(engine)
    assert turn == XML_SCRIPT  # the template re-renders exactly what the model produced
    assert ToolParser(TOOLS).parse(turn) == ("Checking.", [ToolCall("get_weather", XML_ARGS)])
    assert "<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>" in prompt


def test_history_round_trip_anthropic(srv):
    engine, url = srv
    script(engine, XML_SCRIPT)
    client = ant(url)
    r = client.messages.create(model="builtin:random", max_tokens=400, tools=ANT_TOOLS, messages=USER)
    use = r.content[1]
    history = USER + [{"role": "assistant", "content": [b.model_dump() for b in r.content]},
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                    "content": "sunny, 21 C"}]}]
    script(engine, "It is sunny.")
    r2 = client.messages.create(model="builtin:random", max_tokens=400, tools=ANT_TOOLS, messages=history)
    assert r2.stop_reason == "end_turn" and r2.content[0].text == "It is sunny."
    prompt, turn = _assistant_turn(engine)
    assert turn == XML_SCRIPT
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt


def test_reasoning_then_call(srv):
    engine, url = srv
    script(engine, "need weather\n</think>\n\n" + XML_CALL)
    r = oai(url).chat.completions.create(model="builtin:random", messages=USER, tools=TOOLS, max_tokens=400)
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == "need weather\n" and msg.content is None
    assert msg.tool_calls[0].function.name == "get_weather" and r.choices[0].finish_reason == "tool_calls"
    chunks = list(oai(url).chat.completions.create(model="builtin:random", messages=USER, tools=TOOLS,
                                                   max_tokens=400, stream=True))
    assert "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks) == "need weather\n"
    assert not any(c.choices[0].delta.content for c in chunks)
    assert [tc.function.name for c in chunks for tc in c.choices[0].delta.tool_calls or [] if tc.id] == [
        "get_weather"]
