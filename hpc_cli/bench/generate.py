"""Seeded trace files for ``hpc-cli bench``: JSON Lines of chat requests.

The first line describes the trace (``{"hpc_trace": 1, "kind": ..., "seed": ..., "config": ...}``);
every other line is one request::

    {"id": "s0-t1", "session": "s0", "messages": [...], "max_tokens": 8,
     "tools": [...] (optional), "chat_template_kwargs": {"enable_thinking": false}}

The requests of a session are replayed in order, one at a time; sessions interleave (turn 0 of
every session, then turn 1, ...). Assistant turns in a history are the trace's own text, as a
client keeps them (thinking stripped), so every cache mode sees the same prompts. Kinds:

- ``multi-turn``: sessions sharing a system preamble, user turns of random lengths, the whole
  history re-rendered every turn (:func:`hpc_cli.bench.trace.build_trace`);
- ``edits``: the same, where later turns edit an early user message (a change deep in the
  history);
- ``agent-loop``: a system prompt with tools; each step appends the agent's tool call and the
  tool's result to the history (the prompt only grows);
- ``shared-preamble``: many single-turn sessions behind one long system-and-tools preamble.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Literal

from hpc_cli.bench.trace import Lexicon, TokenCounter, TraceConfig, build_trace, compose, render
from hpc_cli.errors import ConfigError

Kind = Literal["multi-turn", "agent-loop", "shared-preamble", "edits"]
KINDS: tuple[Kind, ...] = ("multi-turn", "agent-loop", "shared-preamble", "edits")
NO_THINK = {"enable_thinking": False}


@dataclass(frozen=True, slots=True)
class TraceRequest:
    id: str
    session: str
    messages: list[dict[str, object]]
    max_tokens: int = 8
    tools: list[dict[str, object]] | None = None
    chat_template_kwargs: dict[str, object] = field(default_factory=lambda: dict(NO_THINK))

    def as_json(self) -> dict[str, object]:
        d = asdict(self)
        if d["tools"] is None:
            del d["tools"]
        return d


@dataclass(frozen=True, slots=True)
class GenerateConfig:
    """Sizes in tokens of the embedded model's byte-level tokenizer (UTF-8 bytes)."""

    kind: Kind
    seed: int = 0
    sessions: int = 4
    turns: int = 4
    preamble_tokens: int = 1024
    user_tokens: tuple[int, int] = (40, 160)
    answer_tokens: tuple[int, int] = (40, 120)
    max_tokens: int = 8


@dataclass(frozen=True, slots=True)
class TraceFile:
    meta: dict[str, object]
    requests: list[TraceRequest]


TOOLS = [
    {"type": "function", "function": {"name": "search", "description": "Search the notes for a phrase.",
                                      "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                                                     "required": ["query"]}}},
    {"type": "function", "function": {"name": "read", "description": "Read one note by its number.",
                                      "parameters": {"type": "object", "properties": {"number": {"type": "integer"}},
                                                     "required": ["number"]}}},
]


def generate(cfg: GenerateConfig) -> TraceFile:
    if cfg.kind not in KINDS:
        raise ConfigError(f"unknown trace kind {cfg.kind!r}", hint=f"choose one of {', '.join(KINDS)}")
    if cfg.sessions < 1 or cfg.turns < 1:
        raise ConfigError("a trace needs at least one session and one turn", hint="raise --sessions / --turns")
    make = {"multi-turn": _chat, "edits": _chat, "agent-loop": _agent_loop, "shared-preamble": _shared_preamble}
    meta = {"hpc_trace": 1, "kind": cfg.kind, "seed": cfg.seed, "config": asdict(cfg)}
    return TraceFile(meta, _interleave(make[cfg.kind](cfg)))


def _interleave(sessions: list[list[TraceRequest]]) -> list[TraceRequest]:
    out: list[TraceRequest] = []
    for t in range(max((len(s) for s in sessions), default=0)):
        out += [s[t] for s in sessions if t < len(s)]
    return out


def _answer(lexicon: Lexicon, rng: random.Random, cfg: GenerateConfig, counter: TokenCounter) -> str:
    return compose(lexicon, rng, rng.randint(*cfg.answer_tokens), counter)


def _user(lexicon: Lexicon, rng: random.Random, cfg: GenerateConfig, counter: TokenCounter) -> str:
    return compose(lexicon, rng, rng.randint(*cfg.user_tokens), counter)


def _session_rng(cfg: GenerateConfig, session: int) -> random.Random:
    return random.Random(cfg.seed * 7919 + session)


def _with_system(cfg: GenerateConfig, intro: str) -> tuple[TokenCounter, Lexicon, str]:
    """A token counter, the lexicon and a system prompt: ``intro``, then ``cfg.preamble_tokens``
    of text drawn with the trace's seed."""
    counter, lexicon = TokenCounter(None), Lexicon.make()
    return counter, lexicon, intro + compose(lexicon, random.Random(cfg.seed), cfg.preamble_tokens, counter)


def _chat(cfg: GenerateConfig) -> list[list[TraceRequest]]:
    counter, lexicon = TokenCounter(None), Lexicon.make()
    trace = build_trace(TraceConfig(cfg.seed, cfg.sessions, cfg.turns, cfg.preamble_tokens, cfg.user_tokens,
                                    edits=cfg.kind == "edits", edit_prob=0.5), 0, counter, lexicon)
    out = []
    for session in trace.sessions:
        rng = _session_rng(cfg, session.index)
        users: list[str] = []
        answers: list[str] = []
        reqs = []
        for t, turn in enumerate(session.turns):
            if turn.edit is not None:
                users[turn.edit.message] = turn.edit.text
            users.append(turn.user_text)
            reqs.append(TraceRequest(f"s{session.index}-t{t}", f"s{session.index}",
                                     render(trace.preamble, users, answers), cfg.max_tokens))
            answers.append(_answer(lexicon, rng, cfg, counter))
        out.append(reqs)
    return out


def _agent_loop(cfg: GenerateConfig) -> list[list[TraceRequest]]:
    counter, lexicon, system = _with_system(cfg, "You are an agent. Use the tools to answer.\n\n")
    out = []
    for s in range(cfg.sessions):
        srng = _session_rng(cfg, s)
        history: list[dict[str, object]] = [
            {"role": "system", "content": system}, {"role": "user", "content": _user(lexicon, srng, cfg, counter)}]
        reqs = []
        for t in range(cfg.turns):
            reqs.append(TraceRequest(f"s{s}-t{t}", f"s{s}", [dict(m) for m in history], cfg.max_tokens, tools=TOOLS))
            query = compose(lexicon, srng, 6, counter)
            history.append({"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "search", "arguments": json.dumps({"query": query})}}]})
            history.append({"role": "tool", "content": compose(lexicon, srng, srng.randint(*cfg.answer_tokens), counter)})
        out.append(reqs)
    return out


def _shared_preamble(cfg: GenerateConfig) -> list[list[TraceRequest]]:
    counter, lexicon, system = _with_system(cfg, "You answer questions about the notes below.\n\n")
    n = cfg.sessions * cfg.turns  # single-turn sessions
    out = []
    for s in range(n):
        user = _user(lexicon, _session_rng(cfg, s), cfg, counter)
        out.append([TraceRequest(f"s{s}-t0", f"s{s}", [{"role": "system", "content": system},
                                                      {"role": "user", "content": user}], cfg.max_tokens, tools=TOOLS)])
    return out


# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------

def write_trace(trace: TraceFile, path: str | Path) -> int:
    """Write ``trace`` as JSON Lines; returns the number of requests."""
    with open(path, "w") as f:
        f.write(json.dumps(trace.meta) + "\n")
        for r in trace.requests:
            f.write(json.dumps(r.as_json()) + "\n")
    return len(trace.requests)


def read_trace(path: str | Path) -> TraceFile:
    """Read a trace file: an optional description line, then one chat request per line."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"trace {path} cannot be read: {exc.strerror}",
                          hint="write one with `hpc-cli bench generate --kind multi-turn OUT.jsonl`") from None
    meta: dict[str, object] = {}
    requests = list(_requests(path, lines, meta))
    if not requests:
        raise ConfigError(f"trace {path} holds no requests", hint="each line is a JSON chat request with 'messages'")
    return TraceFile(meta, requests)


def _requests(path: Path, lines: Iterable[str], meta: dict[str, object]) -> Iterator[TraceRequest]:
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"trace {path} line {n}: not JSON ({exc.msg})", hint="one JSON object per line") from None
        if not isinstance(doc, dict):
            raise ConfigError(f"trace {path} line {n}: not a JSON object", hint="one JSON object per line")
        if "hpc_trace" in doc:
            meta.update(doc)
            continue
        messages = doc.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ConfigError(f"trace {path} line {n}: no 'messages' list", hint="each request needs chat messages")
        rid = str(doc.get("id", f"r{n}"))
        yield TraceRequest(rid, str(doc.get("session", rid)), messages, int(doc.get("max_tokens", 8)),
                           doc.get("tools"), dict(doc.get("chat_template_kwargs", NO_THINK)))
