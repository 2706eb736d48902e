"""Request bodies at the API boundary: JSON within this server's limits, then the API's model.

Everything a client sends is checked here before any of it reaches a template, the tokenizer
or the engine, and every failure is a 400 (``RequestError``) in the API's own error shape:

- the body is UTF-8 JSON whose top level is an object, nested at most :data:`MAX_DEPTH` deep,
  without ``NaN``/``Infinity``, integer literals the interpreter can convert, and no lone
  UTF-16 surrogate (``"\\ud800"``) in any string (such text cannot be encoded);
- ``chat_template_kwargs`` may not name what the server passes the template itself;
- ``cache_salt`` is a non-empty string of at most :data:`MAX_SALT_CHARS` characters.

Large bodies are parsed and validated on a worker thread (:func:`read_model`), so a big request
does not stall the event loop.
"""

from __future__ import annotations

import json
import re
from typing import Mapping, TypeVar

from pydantic import BaseModel, JsonValue
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from hpc_cli.errors import RequestError
from hpc_cli.server.common import validate_model

MAX_DEPTH = 64
MAX_SALT_CHARS = 1024
#: bodies at least this large are parsed off the event loop
THREAD_BYTES = 64 << 10
#: an echoed client value (an unknown model name) is cut to this many characters
ECHO_CHARS = 200

#: the arguments the chat template already gets from the server
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "add_generation_prompt", "documents",
                                      "continue_final_message", "bos_token", "eos_token", "pad_token"})

Model = TypeVar("Model", bound=BaseModel)
JSONValue = JsonValue  # any JSON value (pydantic's recursive type)

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _bad_json(why: str) -> RequestError:
    return RequestError(f"the request body is not valid JSON: {why}", code="invalid_json")


def _no_constant(name: str) -> float:
    raise _bad_json(f"{name} is not a JSON number")


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise _bad_json("a string holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape)") from None


def _check_tree(data: JSONValue, strings: bool) -> None:
    """Depth at most MAX_DEPTH; with ``strings``, every string and key encodable as UTF-8.
    Iterative, so the check itself cannot overflow the stack."""
    stack: list[tuple[JSONValue, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise RequestError(f"the request body nests deeper than {MAX_DEPTH} levels", code="invalid_json")
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for key, item in items:
            if strings and isinstance(key, str):
                _check_text(key)
            if isinstance(item, (dict, list)):
                stack.append((item, depth + 1))
            elif strings and isinstance(item, str):
                _check_text(item)


def parse_json_object(raw: bytes) -> dict[str, JSONValue]:
    """The body as a JSON object within the limits of the module doc; RequestError otherwise."""
    if not raw.strip():
        raise RequestError("the request body is empty; send a JSON object", code="invalid_json")
    try:
        data = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise RequestError(f"the request body nests deeper than {MAX_DEPTH} levels", code="invalid_json") from None
    except UnicodeDecodeError:
        raise _bad_json("it is not UTF-8") from None
    except json.JSONDecodeError as exc:
        raise _bad_json(str(exc)) from None
    except ValueError as exc:  # an integer literal longer than the interpreter converts
        digits = "integer string conversion" in str(exc)
        raise _bad_json("an integer literal has too many digits" if digits else str(exc)) from None
    if not isinstance(data, dict):
        raise RequestError("the request body must be a JSON object", code="invalid_json")
    # a lone surrogate can only come from a \\u escape (raw UTF-8 cannot encode one)
    _check_tree(data, strings=bool(_SURROGATE_ESCAPE.search(raw)))
    return data


def parse_model(raw: bytes, model_cls: type[Model]) -> Model:
    return validate_model(model_cls, parse_json_object(raw))


async def read_model(request: Request, model_cls: type[Model]) -> Model:
    """Read, parse and validate the body as ``model_cls`` (on a worker thread when large)."""
    raw = await request.body()
    if len(raw) < THREAD_BYTES:
        return parse_model(raw, model_cls)
    return await run_in_threadpool(parse_model, raw, model_cls)


def echo(value: object) -> str:
    """A client value quoted in an error message, cut to ECHO_CHARS characters."""
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= ECHO_CHARS else text[:ECHO_CHARS] + f"... ({len(text)} characters)"


def template_kwargs(kwargs: Mapping[str, JSONValue] | None, reserved: frozenset[str] = RESERVED_TEMPLATE_KWARGS,
                    param: str = "chat_template_kwargs") -> dict[str, JSONValue]:
    """``chat_template_kwargs`` without the names the server passes the template itself."""
    out = dict(kwargs or {})
    clash = sorted(k for k in out if k in reserved)
    if clash:
        raise RequestError(f"{param} may not set {', '.join(clash)}: the server passes "
                           f"{'it' if len(clash) == 1 else 'them'} to the chat template itself",
                           param=param, code="invalid_value")
    return out


def cache_salt(value: object, param: str = "cache_salt") -> str | None:
    """A request's cache salt: None, or a non-empty string of at most MAX_SALT_CHARS."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise RequestError(f"{param} must be a non-empty string", param=param, code="invalid_value")
    if len(value) > MAX_SALT_CHARS:
        raise RequestError(f"{param} is longer than {MAX_SALT_CHARS} characters", param=param,
                           code="invalid_value")
    return value
