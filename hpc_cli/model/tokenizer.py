"""Tokenizers: a byte-level one with ChatML specials (builtin models) and HF ``tokenizer.json``.

Both give ``encode(text) -> list[int]`` (special tokens written in the text are recognised),
``decode(ids, skip_special=False) -> str``, ``apply_chat_template(messages, ...) -> str``,
``eos_token_ids``, ``special_tokens`` and ``vocab_size``; :class:`IncrementalDecoder` turns a
stream of ids into text pieces without splitting a UTF-8 character.
"""

from __future__ import annotations

import bisect
import itertools
import json
import re
import threading
from collections import OrderedDict
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Sequence

from hpc_cli.errors import ModelError

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
                  "<tool_call>", "</tool_call>")

# Qwen3.5-style ChatML: <think> blocks survive only in assistant turns after the last user query;
# the generation prompt opens <think> (or an empty block when thinking is disabled).
BYTE_CHAT_TEMPLATE = r"""
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- macro text(c) -%}{{- c if c is string else ((c or []) | map(attribute='text') | join('')) -}}{%- endmacro -%}
{%- if tools -%}
  {{- '<|im_start|>system\n' -}}
  {%- if messages and messages[0].role == 'system' -%}{{- text(messages[0].content) + '\n\n' -}}{%- endif -%}
  {{- '# Tools\n\nFunctions you may call:\n<tools>' -}}
  {%- for t in tools -%}{{- '\n' + ((t.function if t.function is defined else t) | tojson) -}}{%- endfor -%}
  {{- '\n</tools>\n\nTo call one, reply with\n<tool_call>\n<function=NAME>\n<parameter=ARGUMENT>\nVALUE\n</parameter>\n</function>\n</tool_call><|im_end|>\n' -}}
{%- endif -%}
{%- for m in messages -%}
  {%- set content = text(m.content) -%}
  {%- if m.role == 'system' and tools and loop.first -%}
  {%- elif m.role == 'assistant' -%}
    {%- set reasoning = m.reasoning_content if m.reasoning_content is defined and m.reasoning_content else '' -%}
    {%- if '</think>' in content -%}
      {%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\n') -%}
      {%- set content = content.split('</think>')[-1].lstrip('\n') -%}
    {%- endif -%}
    {%- if loop.index0 > ns.last_user and reasoning -%}
      {{- '<|im_start|>assistant\n<think>\n' + reasoning + '\n</think>\n\n' + content -}}
    {%- else -%}
      {{- '<|im_start|>assistant\n' + content -}}
    {%- endif -%}
    {%- for call in (m.tool_calls or []) -%}
      {%- set f = call.function if call.function is defined else call -%}
      {%- set args = f.arguments | fromjson if f.arguments is string else f.arguments -%}
      {{- ('\n\n' if (loop.first and content) else ('\n' if not loop.first else '')) + '<tool_call>\n<function=' + f.name + '>\n' -}}
      {%- for k, v in (args or {}).items() -%}
        {{- '<parameter=' + k + '>\n' + (v if v is string else (v | tojson)) + '\n</parameter>\n' -}}
      {%- endfor -%}
      {{- '</function>\n</tool_call>' -}}
    {%- endfor -%}
    {{- '<|im_end|>\n' -}}
  {%- elif m.role == 'tool' -%}
    {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
    {{- '\n<tool_response>\n' + content + '\n</tool_response>' -}}
    {%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
  {%- else -%}
    {{- '<|im_start|>' + m.role + '\n' + content + '<|im_end|>\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\n' -}}
  {%- if enable_thinking is defined and not enable_thinking -%}
    {{- '<think>\n\n</think>\n\n' -}}
  {%- else -%}
    {{- '<think>\n' -}}
  {%- endif -%}
{%- endif -%}"""


def _jinja_env():
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, **_: Any) -> str:
        return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.filters["fromjson"] = json.loads
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class _ChatTemplateMixin:
    chat_template: str | None

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: Sequence[dict[str, Any]] | None = None, **kwargs: Any) -> str:
        if not self.chat_template:
            raise ModelError("this tokenizer has no chat template",
                             hint="add chat_template.jinja to the checkpoint directory")
        import jinja2

        try:
            template = self._compiled_template()
            return template.render(messages=list(messages), tools=tools, add_generation_prompt=add_generation_prompt,
                                   **self.special_tokens_map(), **kwargs)
        except jinja2.exceptions.TemplateError as exc:
            raise ModelError(f"chat template failed: {exc}", hint="check the messages or the chat template") from exc

    def _compiled_template(self):
        """The chat template compiled once (per template text): compiling costs more than a render."""
        cached = getattr(self, "_template_cache", None)
        if cached is None or cached[0] != self.chat_template:
            cached = (self.chat_template, _jinja_env().from_string(self.chat_template))
            self._template_cache = cached
        return cached[1]

    def special_tokens_map(self) -> dict[str, str]:
        return {}


class PieceSpans:
    """One piece's tokenization: ids, each token's ``(start, end)`` character span in the piece,
    and, made at the first lookup inside the piece (most lookups fall on a piece's start, which
    needs neither), the starts and the running maximum of the ends (spans may overlap)."""

    __slots__ = ("ids", "spans", "_starts", "_ends")

    def __init__(self, ids: list[int], spans: list[tuple[int, int]]) -> None:
        self.ids = ids
        self.spans = spans
        self._starts: list[int] | None = None
        self._ends: list[int] | None = None

    @classmethod
    def of(cls, ids: list[int], spans: list[tuple[int, int]]) -> "PieceSpans":
        return cls(ids, spans)

    @property
    def starts(self) -> list[int]:
        if self._starts is None:
            self._starts = [a for a, _ in self.spans]
        return self._starts

    @property
    def ends(self) -> list[int]:
        if self._ends is None:
            self._ends = list(itertools.accumulate((b for _, b in self.spans), max))
        return self._ends


class TokenSpans:
    """Where a text's tokens lie in it, as the pieces it was tokenized in (``(character offset,
    index of the piece's first token, PieceSpans)``): a lookup bisects the pieces, then one
    piece, so it costs the same for a long conversation as for a short one."""

    __slots__ = ("_cuts", "_pieces")

    def __init__(self, pieces: Sequence[tuple[int, int, PieceSpans]]) -> None:
        assert pieces and pieces[0][0] == 0, "the first piece starts the text"
        self._pieces = list(pieces)
        self._cuts = [cut for cut, _, _ in self._pieces]

    @classmethod
    def whole(cls, ids: list[int], spans: list[tuple[int, int]]) -> "TokenSpans":
        return cls([(0, 0, PieceSpans.of(ids, spans))])

    def _at(self, c: int) -> tuple[int, int, PieceSpans]:
        return self._pieces[max(0, bisect.bisect_right(self._cuts, c) - 1)]

    def token_at(self, c: int) -> int | None:
        """The index of the token that starts at character ``c`` when every earlier token has
        ended by ``c``; None when ``c`` falls inside a token or past the last start."""
        cut, first, piece = self._at(c)
        if c == cut and piece.ids and piece.spans[0][0] == 0:
            return first  # the usual lookup, at a piece's start: no starts or ends needed
        j = bisect.bisect_left(piece.starts, c - cut)
        if j < len(piece.starts) and piece.starts[j] == c - cut and (j == 0 or piece.ends[j - 1] <= c - cut):
            return first + j  # a piece's first token: the earlier pieces end by its cut
        return None

    def spans(self) -> list[tuple[int, int]]:
        """Every token's ``(start, end)`` character span in the whole text."""
        return [(a + cut, b + cut) for cut, _, piece in self._pieces for a, b in piece.spans]

    def tokens_ending_by(self, c: int) -> int:
        """How many tokens (from the first) have ended by character ``c``."""
        cut, first, piece = self._at(c)
        return first + bisect.bisect_right(piece.ends, c - cut)


class ByteTokenizer(_ChatTemplateMixin):
    """UTF-8 bytes are ids 0..255; the ChatML specials follow (256 ...)."""

    def __init__(self, chat_template: str | None = BYTE_CHAT_TEMPLATE) -> None:
        self.special_tokens = {tok: 256 + i for i, tok in enumerate(SPECIAL_TOKENS)}
        self.id_to_special = {i: t for t, i in self.special_tokens.items()}
        self.chat_template = chat_template
        self._split = re.compile("(" + "|".join(re.escape(t) for t in SPECIAL_TOKENS) + ")")

    @property
    def vocab_size(self) -> int:
        return 256 + len(SPECIAL_TOKENS)

    @property
    def eos_token_ids(self) -> list[int]:
        return [self.special_tokens["<|im_end|>"], self.special_tokens["<|endoftext|>"]]

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        ids: list[int] = []
        parts = self._split.split(text) if allow_special else [text]
        for part in parts:
            if allow_special and part in self.special_tokens:
                ids.append(self.special_tokens[part])
            elif part:
                ids.extend(part.encode("utf-8"))
        return ids

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids of ``text`` and each token's ``(start, end)`` character span in it (every byte
        of a character spans that character)."""
        ids: list[int] = []
        spans: list[tuple[int, int]] = []
        at = 0
        for part in self._split.split(text):
            if part in self.special_tokens:
                ids.append(self.special_tokens[part])
                spans.append((at, at + len(part)))
            elif part.isascii():
                ids.extend(part.encode("ascii"))
                spans.extend(zip(range(at, at + len(part)), range(at + 1, at + len(part) + 1)))
            else:
                for i, ch in enumerate(part, at):
                    b = ch.encode("utf-8")
                    ids.extend(b)
                    spans.extend([(i, i + 1)] * len(b))
            at += len(part)
        return ids, spans

    def encode_spans(self, text: str) -> tuple[list[int], TokenSpans]:
        ids, spans = self.encode_offsets(text)
        return ids, TokenSpans.whole(ids, spans)

    def decode_bytes(self, ids: Sequence[int], skip_special: bool = False) -> bytes:
        out = bytearray()
        for i in ids:
            i = int(i)
            if i < 256:
                out.append(i)
            elif not skip_special and i in self.id_to_special:
                out.extend(self.id_to_special[i].encode())
        return bytes(out)

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        return self.decode_bytes(ids, skip_special).decode("utf-8", errors="replace")

    def token_to_id(self, token: str) -> int | None:
        return self.special_tokens.get(token)


class SegmentCache:
    """Tokenizations of a prompt's messages, kept by their text, so a conversation's next turn
    tokenizes only what it added.

    A tokenizer splits its added tokens out of the text before anything else (normalisation,
    pre-tokenisation, BPE), so the text between two of them is tokenized on its own: a prompt
    cut right before each ChatML message start (``<|im_start|>``, an added token) tokenizes as
    the concatenation of its pieces. Pieces are kept in an LRU bounded by their characters; a
    multi-turn chat re-sends its history, whose pieces hit. Used only where the start marker is
    an added token that strips nothing around it and a sample conversation tokenizes the same
    whole and in pieces (:meth:`for_tokenizer`)."""

    MARKER = "<|im_start|>"
    MAX_CHARS = 16 << 20  # characters of text kept
    MIN_CHARS = 32  # shorter pieces are tokenized every time

    def __init__(self, encode: Callable[[str], tuple[list[int], list[tuple[int, int]]]]) -> None:
        self._encode = encode
        self._pieces: "OrderedDict[str, PieceSpans]" = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @classmethod
    def for_tokenizer(cls, tok, added: dict) -> "SegmentCache | None":
        marker = next((t for t in added.values() if t.content == cls.MARKER), None)
        if marker is None or marker.lstrip or marker.rstrip or getattr(marker, "single_word", False):
            return None

        def encode(text: str) -> tuple[list[int], list[tuple[int, int]]]:
            enc = tok.encode(text, add_special_tokens=False)
            return enc.ids, enc.offsets

        cache = cls(encode)
        sample = ("<|im_start|>system\nBe brief.  \n<|im_end|>\n<|im_start|>user\n héllo,\n\n world\t"
                  "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nhi<|im_end|>\n<|im_start|>user\n"
                  "x<|im_start|>y \n<|im_start|>assistant\n")
        if cache.encode(sample, keep=False) != encode(sample):
            return None
        return cache

    def pieces(self, text: str, keep: bool = True) -> tuple[list[int], TokenSpans]:
        """The ids of ``text`` and their spans, tokenized piece by piece (no per-token work for
        the pieces kept from earlier prompts but concatenating their ids)."""
        ids: list[int] = []
        parts: list[tuple[int, int, PieceSpans]] = []
        cut = 0
        while cut < len(text):
            nxt = text.find(self.MARKER, cut + 1)
            end = len(text) if nxt < 0 else nxt
            piece = self._piece(text[cut:end], keep)
            parts.append((cut, len(ids), piece))
            ids.extend(piece.ids)
            cut = end
        return ids, TokenSpans(parts or [(0, 0, PieceSpans.of([], []))])

    def encode(self, text: str, keep: bool = True) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids of ``text`` and each token's character span in it."""
        ids, spans = self.pieces(text, keep)
        return ids, spans.spans()

    def _piece(self, piece: str, keep: bool) -> PieceSpans:
        if len(piece) < self.MIN_CHARS or not keep:
            return PieceSpans.of(*self._encode(piece))
        with self._lock:
            found = self._pieces.get(piece)
            if found is not None:
                self._pieces.move_to_end(piece)
                self.hits += 1
                return found
        found = PieceSpans.of(*self._encode(piece))
        with self._lock:
            self.misses += 1
            if piece not in self._pieces and len(piece) <= self.MAX_CHARS // 4:
                self._pieces[piece] = found
                self._chars += len(piece)
                while self._chars > self.MAX_CHARS:
                    old, _ = self._pieces.popitem(last=False)
                    self._chars -= len(old)
        return found


class HFTokenizer(_ChatTemplateMixin):
    """``tokenizer.json`` through the ``tokenizers`` package, the chat template through jinja2."""

    def __init__(self, directory: str | Path, eos_token_ids: Sequence[int] = ()) -> None:
        from tokenizers import Tokenizer

        directory = Path(directory)
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise ModelError(f"{directory}: no tokenizer.json", hint="copy the checkpoint's tokenizer.json next to config.json")
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as exc:
            raise ModelError(f"{path}: cannot load tokenizer: {exc}", hint="replace tokenizer.json") from exc
        cfg: dict[str, Any] = {}
        cfg_path = directory / "tokenizer_config.json"
        if cfg_path.is_file():
            try:
                cfg = json.loads(cfg_path.read_text())
            except json.JSONDecodeError as exc:
                raise ModelError(f"{cfg_path}: bad JSON: {exc}", hint="fix or remove tokenizer_config.json") from exc
        tpl_path = directory / "chat_template.jinja"
        if tpl_path.is_file():
            self.chat_template = tpl_path.read_text()
        else:
            tpl = cfg.get("chat_template")
            if isinstance(tpl, list):  # named templates: take "default"
                tpl = next((t.get("template") for t in tpl if t.get("name") == "default"), None)
            self.chat_template = tpl
        self._cfg = cfg
        eos = list(eos_token_ids)
        for key in ("eos_token", "pad_token"):
            value = cfg.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if key == "eos_token" and isinstance(value, str):
                tid = self._tok.token_to_id(value)
                if tid is not None and tid not in eos:
                    eos.append(tid)
        for name in ("<|im_end|>", "<|endoftext|>"):
            tid = self._tok.token_to_id(name)
            if tid is not None and tid not in eos:
                eos.append(tid)
        self._eos = eos
        added = self._tok.get_added_tokens_decoder()
        self.special_tokens = {tok.content: i for i, tok in added.items()}
        self._segments = SegmentCache.for_tokenizer(self._tok, added)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self._eos)

    def encode(self, text: str, allow_special: bool = True) -> list[int]:
        if self._segments is not None:
            return self._segments.pieces(text)[0]
        return self._tok.encode(text, add_special_tokens=False).ids  # ids only: no span work

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids of ``text`` and each token's ``(start, end)`` character span in it."""
        if self._segments is not None:
            return self._segments.encode(text)
        enc = self._tok.encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets

    def encode_spans(self, text: str) -> tuple[list[int], TokenSpans]:
        """The ids of ``text`` and where they lie in it (:class:`TokenSpans`)."""
        if self._segments is not None:
            return self._segments.pieces(text)
        enc = self._tok.encode(text, add_special_tokens=False)
        return enc.ids, TokenSpans.whole(enc.ids, enc.offsets)

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def special_tokens_map(self) -> dict[str, str]:
        out = {}
        for key in ("bos_token", "eos_token", "pad_token"):
            value = self._cfg.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, str):
                out[key] = value
        return out


class IncrementalDecoder:
    """Feeds ids one by one and returns only complete text (no half UTF-8 characters).

    Only a short window of recent ids is re-decoded per push (prefix/read offsets), so a long
    stream costs linear time."""

    def __init__(self, tokenizer: ByteTokenizer | HFTokenizer, skip_special: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read] were decoded already and anchor the next decode
        self.read = 0

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        dec = self.tokenizer.decode
        before = dec(self.ids[self.prefix:self.read], skip_special=self.skip_special)
        after = dec(self.ids[self.prefix:], skip_special=self.skip_special)
        if after.endswith("\ufffd") or len(after) <= len(before):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before):]
