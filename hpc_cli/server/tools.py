"""Tool calls in generated text: ``<tool_call>`` blocks become structured calls.

Two block bodies are understood, the ones Qwen chat templates render for ``tool_calls`` in the
history (so a call the server returns and the client sends back renders as the same text):

- XML (Qwen3.5, Qwen3-Coder)::

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call>

  Values are text; one newline after ``<parameter=KEY>`` and one before ``</parameter>`` belong
  to the format. A value is converted to the JSON-schema type the request's tool definition
  gives the parameter (integer, number, boolean, null, object, array; ``True``/``False`` and
  Python-literal objects as the Qwen templates render them are accepted), else kept as a string.

- JSON (Qwen2.5, Qwen3)::

    <tool_call>
    {"name": NAME, "arguments": {...}}
    </tool_call>

A block that is not well formed stays in the text, unchanged. :class:`ToolStream` does the same
incrementally: it holds back only text that may be the start of ``<tool_call>`` and the body of
an open block; whitespace between and after calls is dropped.
"""

from __future__ import annotations

import ast
import json
import math
import re
from dataclasses import dataclass
from typing import Any, Iterable

OPEN = "<tool_call>"
CLOSE = "</tool_call>"

_NAME = re.compile(r"[^\s<>=\"']+")
_FUNCTION = re.compile(r"<function=([^>\n]+)>")
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>")
_END_FUNCTION = "</function>"
_END_PARAMETER = "</parameter>"


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]

    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


def tools_enabled(tools: Any, tool_choice: Any) -> bool:
    """Parse calls only when tools were given and the request did not turn them off
    (OpenAI ``"none"``, Anthropic ``{"type": "none"}``)."""
    if not tools:
        return False
    if tool_choice == "none":
        return False
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "none":
        return False
    return True


class ToolParser:
    """Parses ``<tool_call>`` bodies against the request's tools (OpenAI shape
    ``{"type": "function", "function": {"name", "parameters"}}``, or a bare function)."""

    def __init__(self, tools: Iterable[Any] | None = None) -> None:
        self.schemas: dict[str, dict] = {}
        for tool in tools or ():
            if not isinstance(tool, dict):
                continue
            fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool
            name = fn.get("name")
            params = fn.get("parameters", fn.get("input_schema"))
            if isinstance(name, str):
                self.schemas[name] = params if isinstance(params, dict) else {}

    # ------------------------------------------------------------------------------------------
    def parse_block(self, body: str) -> ToolCall | None:
        """The call in one block body (the text between the tags), or None when malformed."""
        s = body.strip()
        if s.startswith("{"):
            return self._parse_json(s)
        if s.startswith("<function="):
            return self._parse_xml(s)
        return None

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """All of ``text`` at once: (the text outside the calls, the calls). With calls, the text
        is stripped of surrounding whitespace."""
        stream = ToolStream(self)
        parts = stream.feed(text, final=True)
        calls = [p for k, p in parts if k == "call"]
        rest = "".join(p for k, p in parts if k == "text")
        return (rest.strip() if calls else rest), calls

    # ------------------------------------------------------------------------------------------
    @staticmethod
    def _parse_json(s: str) -> ToolCall | None:
        try:
            obj = json.loads(s)
        except (json.JSONDecodeError, RecursionError):
            return None
        if not isinstance(obj, dict):
            return None
        name = obj.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if args is None:
            args = {}
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except (json.JSONDecodeError, RecursionError):
                return None
        if not isinstance(args, dict):
            return None
        return ToolCall(name, args)

    def _parse_xml(self, s: str) -> ToolCall | None:
        m = _FUNCTION.match(s)
        if m is None:
            return None
        name = m.group(1).strip()
        if not _NAME.fullmatch(name):
            return None
        props = self._properties(name)
        args: dict[str, Any] = {}
        i = m.end()
        while True:
            j = _skip_ws(s, i)
            if j == len(s):
                break  # a missing </function> is tolerated
            if s.startswith(_END_FUNCTION, j):
                if s[j + len(_END_FUNCTION):].strip():
                    return None
                break
            p = _PARAMETER.match(s, j)
            if p is None:
                return None
            key = p.group(1).strip()
            if not key:
                return None
            start = p.end()
            end = s.find(_END_PARAMETER, start)
            nxt = s.find("\n<parameter=", start)
            if end >= 0 and (nxt < 0 or end < nxt):
                after = end + len(_END_PARAMETER)
            else:  # no </parameter>: the value runs to the next parameter's line or the end of the function
                ends = [k for k in (nxt + 1 if nxt >= 0 else -1, s.find(_END_FUNCTION, start)) if k >= 0]
                end = after = min(ends) if ends else len(s)
            value = s[start:end]
            if value.startswith("\n"):
                value = value[1:]
            if value.endswith("\n"):
                value = value[:-1]
            args[key] = convert_value(value, props.get(key))
            i = after
        return ToolCall(name, args)

    def _properties(self, name: str) -> dict[str, Any]:
        schema = self.schemas.get(name) or {}
        props = schema.get("properties")
        return props if isinstance(props, dict) else {}


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i].isspace():
        i += 1
    return i


# ---------------------------------------------------------------------------------------------
# Parameter values
# ---------------------------------------------------------------------------------------------

def _schema_types(schema: Any) -> list[str]:
    if not isinstance(schema, dict):
        return []
    t = schema.get("type")
    if isinstance(t, str):
        return [t]
    if isinstance(t, list):
        return [x for x in t if isinstance(x, str)]
    out: list[str] = []
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or ():
            for x in _schema_types(sub):
                if x not in out:
                    out.append(x)
    return out


def _literal(v: str) -> Any:
    try:
        return json.loads(v)
    except (json.JSONDecodeError, RecursionError):
        pass
    try:
        return ast.literal_eval(v)  # Python reprs (True, None, single quotes)
    except Exception:  # noqa: BLE001 - any failure means "not a literal"
        return _FAIL


_FAIL = object()


def _number(s: str) -> Any:
    """An int, else a finite float, else _FAIL."""
    try:
        return int(s)
    except ValueError:
        try:
            f = float(s)
        except ValueError:
            return _FAIL
        return f if math.isfinite(f) else _FAIL


def _as(v: str, t: str) -> Any:
    s = v.strip()
    if t == "null":
        return None if s in ("null", "None") else _FAIL
    if t in ("integer", "number"):
        x = _number(s)
        if x is _FAIL or t == "number":
            return x
        return int(x) if isinstance(x, float) and x.is_integer() else x if isinstance(x, int) else _FAIL
    if t == "boolean":
        low = s.lower()
        return True if low == "true" else False if low == "false" else _FAIL
    if t == "object":
        x = _literal(s)
        return x if isinstance(x, dict) else _FAIL
    if t == "array":
        x = _literal(s)
        return x if isinstance(x, list) else _FAIL
    return _FAIL


def convert_value(value: str, schema: Any) -> Any:
    """A parameter's text as the JSON type its schema names; a string when the schema says
    string, names no type, or no conversion fits."""
    for t in _schema_types(schema):
        if t == "string":
            continue
        x = _as(value, t)
        if x is not _FAIL:
            return x
    return value


# ---------------------------------------------------------------------------------------------
# Streaming
# ---------------------------------------------------------------------------------------------

class ToolStream:
    """Incremental split of generated content into ``("text", str)`` and ``("call", ToolCall)``.

    Text that cannot begin ``<tool_call>`` is released at once; a possible prefix of it is held,
    and an open block is held until ``</tool_call>`` (a block still open at the end, or one that
    does not parse, is released as text). Whitespace-only text after a call is dropped (it
    separates calls); it is released with the text if other text follows. ``parser=None``
    passes everything through as text."""

    def __init__(self, parser: ToolParser | None) -> None:
        self.parser = parser
        self.buffer = ""
        self.in_block = False
        self.after_call = False
        self.pending_ws = ""
        self.calls = 0

    def feed(self, text: str, final: bool = False) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        if self.parser is None:
            if text:
                out.append(("text", text))
            return out
        self.buffer += text
        while self.buffer:
            if not self.in_block:
                i = self.buffer.find(OPEN)
                if i >= 0:
                    self._text(self.buffer[:i], out)
                    self.buffer = self.buffer[i:]
                    self.in_block = True
                    continue
                hold = 0 if final else _prefix_hold(self.buffer, OPEN)
                self._text(self.buffer[:len(self.buffer) - hold], out)
                self.buffer = self.buffer[len(self.buffer) - hold:]
                break
            j = self.buffer.find(CLOSE, len(OPEN))
            again = self.buffer.find(OPEN, len(OPEN))
            if again >= 0 and (j < 0 or again < j):  # a new block opens first: the open one was not a call
                self._text(self.buffer[:again], out)
                self.buffer = self.buffer[again:]
                continue
            if j < 0:
                if final:
                    self._text(self.buffer, out)
                    self.buffer = ""
                    self.in_block = False
                break
            block, self.buffer = self.buffer[:j + len(CLOSE)], self.buffer[j + len(CLOSE):]
            self.in_block = False
            call = self.parser.parse_block(block[len(OPEN):-len(CLOSE)])
            if call is None:
                self._text(block, out)
            else:
                self.pending_ws = ""
                self.after_call = True
                self.calls += 1
                out.append(("call", call))
        if final:
            self.pending_ws = ""
        return _merge(out)

    def _text(self, s: str, out: list) -> None:
        if not s:
            return
        if self.after_call:
            s = self.pending_ws + s
            if not s.strip():
                self.pending_ws = s
                return
            self.pending_ws = ""
            self.after_call = False
        out.append(("text", s))


def _prefix_hold(text: str, token: str) -> int:
    for k in range(min(len(token) - 1, len(text)), 0, -1):
        if text.endswith(token[:k]):
            return k
    return 0


def _merge(parts: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for kind, v in parts:
        if kind == "text" and out and out[-1][0] == "text":
            out[-1] = ("text", out[-1][1] + v)
        else:
            out.append((kind, v))
    return out
