"""Chat templates and the tap hints they imply (spec §7.1, §8.3).

The prompt is the chat template rendered once and tokenized once. Positions worth a snapshot are
found by rendering message prefixes of the same conversation:

- message boundaries: the end of ``messages[:i]`` rendered without a generation prompt, when that
  text is a prefix of the full prompt (templates that rewrite history, e.g. strip earlier
  reasoning, simply yield fewer boundaries), plus, for ChatML templates, every ``<|im_start|>``;
- priority 3 (structural): the end of the leading system/developer block and the end of the tools
  (the Qwen templates render tools inside the system block);
- priority 2: the start of the final assistant generation opener (``<|im_start|>assistant``);
- priority 1: explicit breakpoints (Anthropic ``cache_control``, OpenAI-format ``cache_control``
  on content parts or messages): the end of the marked content block, found by rendering the
  conversation with that message's content cut after the block and taking the common prefix;
  a breakpoint on a whole message is its end. Protocol-automatic markers (Anthropic's top-level
  ``cache_control``) are structural hints flagged ``automatic``.

Character offsets become token positions through the tokenizer's character spans
(``encode_spans``) of the one tokenization of the prompt: an offset where a token starts (and
every earlier token has ended) is that token's position; an offset inside a token (a BPE merge
across it) snaps back, when hinted (markers, opener, system and tools ends), to the tokens that
end before it, and is dropped otherwise (other message boundaries).

The cost is linear in the conversation: the template renders a bounded number of message
prefixes (the first, the last :data:`RECENT_PREFIXES`, and the marked ones; for ChatML templates
every message start is found in the prompt itself), and the prompt is tokenized once. A chat
re-sends its history every turn, so the prefix renders are kept (:class:`PrefixRenders`, keyed by
a digest of the template, the tools, the template arguments and the messages): a turn renders
the prompt and only the prefixes the previous turns did not (a 24-message chat with a 3,000-word
system message: 10 renders, 6.4 ms on the 2-core CPU machine, before). A ChatML prompt that is
one ``<|im_start|>{role}`` block per message, in order, with the first message's render ending
where the second block starts, has its message ends at its block starts, which one scan finds:
such a chat renders only the prompt and its first message (kept, so once per system prompt),
unless it has markers (:func:`_chatml_framed`). A template that fails on the messages is a 400.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

from hpc_cli.engine.api import TapHint
from hpc_cli.errors import HpcError, RequestError

CHATML_START = "<|im_start|>"
SENTINEL = "\ue000\ue001"
#: the last message prefixes rendered for message ends (besides the first and the marked ones)
RECENT_PREFIXES = 8
#: a ChatML prompt with one block per message takes its message ends from the prompt itself
#: (:func:`_chatml_framed`); off, every chat renders its recent prefixes (tests compare the two)
CHATML_SCAN = True


@dataclass(slots=True)
class Marker:
    """A breakpoint on template message ``message_index``: ``content_prefix`` is its content cut
    after the marked block (None: the whole message)."""

    message_index: int
    content_prefix: str | None = None
    automatic: bool = False
    tools: bool = False  # a breakpoint on the tools: the end of the tools


@dataclass(slots=True)
class PreparedChat:
    text: str
    prompt_tokens: list[int]
    tap_hints: list[TapHint] = field(default_factory=list)
    message_boundaries: list[int] = field(default_factory=list)
    opener_position: int | None = None
    system_end: int | None = None
    tools_end: int | None = None
    marker_positions: list[int] = field(default_factory=list)  # explicit and automatic, in order given
    opens_thinking: bool = False


def _render(tokenizer, messages: Sequence[dict], tools, add_generation_prompt: bool, kwargs: dict) -> str:
    try:
        return tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                             tools=tools or None, **kwargs)
    except HpcError:
        raise
    except Exception as exc:  # the template is code over the request's data: its failure is the request's
        text = str(exc)
        raise RequestError(f"the chat template cannot render these messages: {type(exc).__name__}: "
                           f"{text[:200] + '...' if len(text) > 200 else text}", param="messages",
                           code="invalid_value") from None


def _try_render(tokenizer, messages, tools, add_generation_prompt, kwargs) -> str | None:
    try:
        return _render(tokenizer, messages, tools, add_generation_prompt, kwargs)
    except HpcError:
        return None


class PrefixRenders:
    """Prefix renders (``messages[:i]``, no generation prompt) kept across requests, least
    recently used first out, at most ``max_chars`` characters in all; thread-safe (the server
    prepares chats on a thread pool). A render is a function of the template, the messages, the
    tools and the template arguments, which the key digests; a template that reads the clock
    (``strftime_now``) may keep yesterday's date in a kept prefix, which then is no prefix of
    the prompt and gives no boundary (hints are lost, never tokens)."""

    def __init__(self, max_chars: int = 32 << 20) -> None:
        self.max_chars = max_chars
        self.chars = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[bytes, str | None] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def digests(tokenizer, messages: Sequence[dict], tools, kwargs: dict) -> list[bytes]:
        """``digests[i]``: the key of ``messages[:i]`` (each built on the one before: linear)."""
        # what a render reads besides the messages: the template, the special tokens it is given,
        # the tools and the template arguments
        specials = getattr(tokenizer, "special_tokens_map", dict)()
        head = json.dumps([getattr(tokenizer, "chat_template", None), specials, tools, kwargs], sort_keys=True,
                          default=str, ensure_ascii=False)
        d = hashlib.blake2b(head.encode(), digest_size=16).digest()
        out = [d]
        for m in messages:
            d = hashlib.blake2b(d + json.dumps(m, sort_keys=True, default=str, ensure_ascii=False).encode(),
                                digest_size=16).digest()
            out.append(d)
        return out

    def render(self, key: bytes, tokenizer, messages: Sequence[dict], tools, kwargs: dict) -> str | None:
        """:func:`_try_render` of ``messages`` without a generation prompt, kept under ``key``."""
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                self.hits += 1
                return self._entries[key]
            self.misses += 1
        text = _try_render(tokenizer, messages, tools, False, kwargs)
        size = len(text or "")
        if size > self.max_chars:
            return text
        with self._lock:
            if key not in self._entries:
                self._entries[key] = text
                self.chars += size
            while self.chars > self.max_chars:
                _, old = self._entries.popitem(last=False)
                self.chars -= len(old or "")
        return text


#: the server's prefix renders
PREFIX_RENDERS = PrefixRenders()


def _common_prefix_len(a: str, b: str) -> int:
    return len(os.path.commonprefix([a, b]))


def _positions(tokenizer, text: str, offsets: Sequence[int], hinted: Sequence[int] = ()
               ) -> tuple[list[int], dict[int, int]]:
    """One tokenization with each token's character span: an offset where a token starts (and
    every earlier token has ended) is that token's position; an offset inside a token keeps, when
    hinted, the tokens that end before it, else it is dropped."""
    full, spans = tokenizer.encode_spans(text)
    hinted_set = set(hinted)
    at: dict[int, int] = {}
    for c in sorted({o for o in offsets if 0 < o < len(text)}):
        i = spans.token_at(c)
        if i is not None:
            at[c] = i
        elif c in hinted_set:
            at[c] = spans.tokens_ending_by(c)
    at[len(text)] = len(full)
    at[0] = 0
    return full, at


def prepare_chat(tokenizer, messages: list[dict[str, Any]], tools: list[dict] | None = None,
                 markers: Sequence[Marker] = (), template_kwargs: dict[str, Any] | None = None,
                 add_generation_prompt: bool = True, continue_final: bool = False) -> PreparedChat:
    """Render ``messages`` (template-ready dicts) and compute tap hints and message boundaries.

    ``continue_final``: the last message is an assistant turn the model continues (Anthropic
    prefill): rendered without a generation prompt and cut right after its content."""
    kwargs = dict(template_kwargs or {})
    if not messages:
        raise RequestError("messages must not be empty", param="messages")
    if continue_final:
        add_generation_prompt = False
        full = _render(tokenizer, messages, tools, False, kwargs)
        last = messages[-1].get("content") or ""
        cut = full.rfind(last) if last else -1
        if cut < 0:
            raise RequestError("the final assistant message cannot be continued with this chat template",
                               param="messages")
        full = full[:cut + len(last)]
    else:
        full = _render(tokenizer, messages, tools, add_generation_prompt, kwargs)
    n_msgs = len(messages)

    # message ends from prefix renders: a bounded number of them (see the module doc)
    ends: dict[int, int] = {}  # message count i -> char offset of the end of messages[:i]
    keys = PrefixRenders.digests(tokenizer, messages[:1], tools, kwargs)
    starts = _find_all(full, CHATML_START)
    first = PREFIX_RENDERS.render(keys[1], tokenizer, messages[:1], tools, kwargs)
    if first and full.startswith(first):
        ends[1] = len(first)
    if not (CHATML_SCAN and not markers and not continue_final
            and _chatml_framed(full, starts, messages, add_generation_prompt, ends.get(1))):
        counts = set(range(max(1, n_msgs - RECENT_PREFIXES + 1), n_msgs + 1))
        counts |= {m.message_index + 1 for m in markers if 0 <= m.message_index < n_msgs}
        keys = PrefixRenders.digests(tokenizer, messages, tools, kwargs)
        for i in sorted(counts - {1}):
            pre = PREFIX_RENDERS.render(keys[i], tokenizer, messages[:i], tools, kwargs)
            if pre and full.startswith(pre):
                ends[i] = len(pre)
    chatml = [i for i in starts if i > 0]
    boundary_chars = set(ends.values()) | set(chatml)

    opener = None
    if add_generation_prompt:
        if n_msgs in ends and ends[n_msgs] < len(full):
            opener = ends[n_msgs]
        elif chatml and full.startswith(CHATML_START + "assistant", chatml[-1]):
            opener = chatml[-1]
    system_end = None
    if messages[0].get("role") in ("system", "developer"):
        system_end = ends.get(1)
        if system_end is None and chatml:
            system_end = chatml[0]
    tools_end = None
    if tools:
        empty = _try_render(tokenizer, [], tools, False, kwargs)
        if empty and full.startswith(empty):
            tools_end = len(empty)
        elif system_end is not None:
            tools_end = system_end
        elif chatml and full.startswith(CHATML_START + "system", 0):
            tools_end = chatml[0]

    marker_chars: list[tuple[int, bool]] = []
    for m in markers:
        if m.tools:
            c = tools_end if tools_end is not None else system_end
            if c is not None:
                marker_chars.append((c, m.automatic))
            continue
        c = _marker_offset(tokenizer, messages, tools, add_generation_prompt, kwargs, full, m, ends, boundary_chars)
        if c is not None:
            marker_chars.append((c, m.automatic))

    offsets = set(boundary_chars) | {c for c, _ in marker_chars}
    for c in (opener, system_end, tools_end):
        if c is not None:
            offsets.add(c)
    hinted = [c for c in (opener, system_end, tools_end, *(c for c, _ in marker_chars)) if c is not None]
    tokens, at = _positions(tokenizer, full, sorted(offsets), hinted)
    n = len(tokens)

    def pos(c: int | None) -> int | None:
        return None if c is None else at.get(c)

    hints: dict[int, TapHint] = {}

    def add(p: int | None, priority: int, automatic: bool = False) -> None:
        if p is None or not (0 < p <= n - 1):
            return
        old = hints.get(p)
        if old is None or priority < old.priority or (priority == old.priority and old.automatic and not automatic):
            hints[p] = TapHint(position=p, priority=priority, automatic=automatic)

    marker_positions = []
    for c, automatic in marker_chars:
        p = pos(c)
        if p is not None:
            marker_positions.append(min(p, max(n - 1, 0)))
            add(min(p, n - 1), 3 if automatic else 1, automatic)
    add(pos(opener), 2)
    add(pos(system_end), 3)
    add(pos(tools_end), 3)
    boundaries = sorted({p for p in (pos(c) for c in boundary_chars) if p is not None and 0 < p < n})
    tail = full[opener:] if opener is not None else ""
    if continue_final:
        tail = full[full.rfind(CHATML_START):] if CHATML_START in full else ""
    opens_thinking = "<think>" in tail and "</think>" not in tail
    return PreparedChat(text=full, prompt_tokens=tokens, tap_hints=sorted(hints.values(), key=lambda h: h.position),
                        message_boundaries=boundaries, opener_position=pos(opener), system_end=pos(system_end),
                        tools_end=pos(tools_end), marker_positions=marker_positions, opens_thinking=opens_thinking)


def _chatml_framed(full: str, starts: list[int], messages: Sequence[dict], add_generation_prompt: bool,
                   first_end: int | None) -> bool:
    """Whether the prompt is one ``<|im_start|>{role}`` block per message, in order, then the
    generation opener, with the first message's own render ending where the second block starts.
    Then the end of ``messages[:i]`` is taken to be the start of block ``i``, as it is for the
    first message (a template whose later renders ended elsewhere would lose those ends as tap
    hints, never a token: the prompt is rendered and tokenized whole either way)."""
    n = len(messages)
    if n < 2 or len(starts) != n + (1 if add_generation_prompt else 0) or starts[0] != 0:
        return False
    if first_end != starts[1]:
        return False
    for at, m in zip(starts, messages):
        role = m.get("role")
        if not isinstance(role, str) or not full.startswith(f"{CHATML_START}{role}\n", at):
            return False
    return not add_generation_prompt or full.startswith(CHATML_START + "assistant", starts[-1])


def _find_all(text: str, needle: str) -> list[int]:
    out, i = [], text.find(needle)
    while i >= 0:
        out.append(i)
        i = text.find(needle, i + 1)
    return out


def _marker_offset(tokenizer, messages, tools, add_generation_prompt, kwargs, full, m: Marker,
                   ends: dict[int, int], boundary_chars: set[int]) -> int | None:
    i = m.message_index
    if i < 0 or i >= len(messages):
        return None
    msg = messages[i]
    content = msg.get("content") if isinstance(msg.get("content"), str) else ""
    if m.content_prefix is not None and m.content_prefix != content and content.startswith(m.content_prefix):
        cut = dict(msg, content=m.content_prefix)
        variant = _try_render(tokenizer, [*messages[:i], cut, *messages[i + 1:]], tools, add_generation_prompt, kwargs)
        if variant is not None:
            return _common_prefix_len(full, variant)
    # the whole message: its end
    if (i + 1) in ends:
        return ends[i + 1]
    marked = dict(msg, content=content + SENTINEL)
    variant = _try_render(tokenizer, [*messages[:i], marked, *messages[i + 1:]], tools, add_generation_prompt, kwargs)
    if variant is None:
        return None
    content_end = _common_prefix_len(full, variant)
    after = [b for b in boundary_chars if b >= content_end]
    return min(after) if after else content_end
