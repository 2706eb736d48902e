"""The embedded model's chat template renders tools, tool calls and tool results so that the
server's tool-call parser reads back what the template wrote (agent round trips on builtin:random)."""

from __future__ import annotations

import json

from hpc_cli.model.tokenizer import ByteTokenizer
from hpc_cli.server.tools import ToolParser

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather for a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "days": {"type": "integer"},
                                                "opts": {"type": "object"}}}}}]


def test_tool_call_round_trip_through_the_builtin_template():
    tok = ByteTokenizer()
    args = {"city": "Oslo", "days": 2, "opts": {"units": "metric"}}
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "Checking.", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(args)}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "rain"},
            {"role": "tool", "tool_call_id": "c2", "content": "wind"},
            {"role": "user", "content": "thanks"}]
    text = tok.apply_chat_template(msgs, tools=TOOLS, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert '"name": "get_weather"' in text
    assert text.count("<|im_start|>system") == 1  # the system message is folded into the tools block
    # the assistant turn parses back to the same call, with the schema's types
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    content, calls = ToolParser(TOOLS).parse(turn)
    assert content == "Checking."
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", args)]
    # consecutive tool results share one user turn
    assert "<tool_response>\nrain\n</tool_response>\n<tool_response>\nwind\n</tool_response><|im_end|>" in text


def test_without_tools_the_template_is_unchanged_chatml():
    tok = ByteTokenizer()
    text = tok.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}],
                                   add_generation_prompt=True, enable_thinking=False)
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
