"""Seeded chat text and multi-turn chat traces: a Zipf-weighted lexicon of pseudo-words (so
frequent words become single BPE tokens and rare ones split), text of a given token count,
sessions of user turns sharing a system preamble with optional edits deep in the history, and
the history as a chat client re-renders it (answers without their thinking). Used by
``hpc-cli bench generate`` (:mod:`hpc_cli.bench.generate`) and ``benchmarks/serve_trace.py``."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Sequence

if TYPE_CHECKING:
    import tokenizers

Messages = list[dict[str, str]]

# ---------------------------------------------------------------------------------------------
# Words: a seeded lexicon used both for the trace text and to train the checkpoint's tokenizer
# ---------------------------------------------------------------------------------------------

_ONSETS = ("", "b", "c", "d", "f", "g", "h", "j", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z",
           "br", "ch", "cl", "dr", "fl", "gr", "pl", "pr", "sh", "sk", "st", "th", "tr", "qu")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "ou", "io", "y", "oo", "ei")
_CODAS = ("", "", "", "n", "r", "s", "t", "l", "m", "nd", "rk", "st", "x", "ng")


@dataclass(frozen=True)
class Lexicon:
    """Pseudo-words in rank order; drawn with Zipf weights, so frequent words become single BPE
    tokens and rare ones split into several (prompt lengths in tokens vary)."""

    words: tuple[str, ...]
    cum_weights: tuple[float, ...]

    @classmethod
    def make(cls, seed: int = 7, size: int = 12000) -> "Lexicon":
        rng = random.Random(seed)
        seen: dict[str, None] = {}
        while len(seen) < size:
            syllables = rng.choices((1, 2, 3, 4), weights=(3, 4, 2, 1))[0]
            word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables))
            seen.setdefault(word, None)
        words = tuple(seen)
        acc, cum = 0.0, []
        for rank in range(len(words)):
            acc += 1.0 / (rank + 8)
            cum.append(acc)
        return cls(words, tuple(cum))

    def pieces(self, rng: random.Random, n: int, capital: bool = True) -> list[str]:
        """``n`` words as text pieces: each with its leading space (none after a paragraph
        break), sentence capitals, punctuation and paragraph breaks."""
        out: list[str] = []
        words = rng.choices(self.words, cum_weights=self.cum_weights, k=n)
        start = capital
        for word in words:
            if start:
                word = word.capitalize()
            out.append(("" if out and out[-1].endswith("\n") else " ") + word)
            start = False
            r = rng.random()
            if r < 0.08:
                out.append(".")
                start = True
                if rng.random() < 0.15:
                    out.append("\n\n")
            elif r < 0.12:
                out.append(",")
        return out

    def corpus(self, seed: int, words: int) -> Iterator[str]:
        """Training text for the tokenizer, in lines of about 200 words."""
        rng = random.Random(seed)
        for _ in range(max(1, words // 200)):
            yield "".join(self.pieces(rng, 200))


class TokenCounter:
    """Counts tokens of trace text: the checkpoint's ``tokenizer.json`` when there is one, else
    UTF-8 bytes (the byte-level tokenizer of the builtin models). Pieces are counted one by one
    and cached; a byte-level BPE splits at the same boundaries, so the sum is the text's count."""

    def __init__(self, tokenizer_dir: str | None) -> None:
        self.kind = "bytes"
        self._tok: "tokenizers.Tokenizer | None" = None
        path = Path(tokenizer_dir) / "tokenizer.json" if tokenizer_dir else None
        if path is not None and path.is_file():
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_file(str(path))
            self.kind = f"tokenizer.json ({tokenizer_dir})"
        self._cache: dict[str, int] = {}

    def count(self, text: str) -> int:
        if self._tok is None:
            return len(text.encode("utf-8"))
        return len(self._tok.encode(text, add_special_tokens=False).ids)

    def piece(self, piece: str) -> int:
        n = self._cache.get(piece)
        if n is None:
            n = self._cache[piece] = self.count(piece)
        return n


def compose(lexicon: Lexicon, rng: random.Random, tokens: int, counter: TokenCounter) -> str:
    """Text of about ``tokens`` tokens."""
    out: list[str] = []
    total = 0
    while total < tokens:
        for p in lexicon.pieces(rng, 16, capital=not out or out[-1] == "." or out[-1].endswith("\n")):
            out.append(p)
            total += counter.piece(p)
            if total >= tokens:
                break
    return "".join(out).strip()


# ---------------------------------------------------------------------------------------------
# The trace
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TraceConfig:
    seed: int
    sessions: int
    turns: int
    preamble_tokens: int
    user_tokens: tuple[int, int]
    edits: bool
    edit_prob: float


@dataclass(frozen=True)
class Edit:
    """At this turn, user message ``message`` (an earlier turn's) is replaced by ``text``."""

    message: int
    text: str


@dataclass(frozen=True)
class TurnPlan:
    user_text: str
    edit: Edit | None = None


@dataclass(frozen=True)
class SessionPlan:
    index: int
    turns: tuple[TurnPlan, ...]


@dataclass(frozen=True)
class Trace:
    config: TraceConfig
    preamble: str
    sessions: tuple[SessionPlan, ...]
    headers: tuple[str, ...]  # one per concurrency level: keeps runs from reusing each other
    counter_kind: str


def edited(lexicon: Lexicon, rng: random.Random, text: str) -> str:
    """``text`` with one word near its middle replaced by another."""
    words = text.split(" ")
    lo, hi = len(words) // 3, max(len(words) // 3 + 1, 2 * len(words) // 3)
    i = rng.randrange(lo, min(hi, len(words))) if len(words) > 1 else 0
    new = words[i]
    while new == words[i]:
        new = rng.choice(lexicon.words[:2000])
    words[i] = new
    return " ".join(words)


def plan_session(cfg: TraceConfig, index: int, lexicon: Lexicon, counter: TokenCounter) -> SessionPlan:
    rng = random.Random(cfg.seed * 1000 + index + 1)
    users: list[str] = []
    turns: list[TurnPlan] = []
    edit_turns: set[int] = set()
    if cfg.edits and cfg.turns >= 3:
        edit_turns = {t for t in range(2, cfg.turns) if rng.random() < cfg.edit_prob}
        if not edit_turns:
            edit_turns = {rng.randrange(2, cfg.turns)}
    for t in range(cfg.turns):
        edit = None
        if t in edit_turns:
            j = rng.randrange(0, max(1, (t + 1) // 2))  # an early message: deep in the history
            users[j] = edited(lexicon, rng, users[j])
            edit = Edit(j, users[j])
        text = compose(lexicon, rng, rng.randint(*cfg.user_tokens), counter)
        users.append(text)
        turns.append(TurnPlan(text, edit))
    return SessionPlan(index, tuple(turns))


def build_trace(cfg: TraceConfig, runs: int, counter: TokenCounter, lexicon: Lexicon | None = None) -> Trace:
    lexicon = lexicon or Lexicon.make()
    rng = random.Random(cfg.seed)
    intro = "You are a careful assistant. Follow the notes below.\n\n"
    preamble = intro + compose(lexicon, rng, max(1, cfg.preamble_tokens - counter.count(intro)), counter)
    headers = tuple(f"[run {k + 1}: {compose(lexicon, rng, 6, counter)}]\n" for k in range(runs))
    sessions = tuple(plan_session(cfg, i, lexicon, counter) for i in range(cfg.sessions))
    return Trace(cfg, preamble, sessions, headers, counter.kind)


def strip_thinking(text: str) -> str:
    """An answer as a chat client keeps it in the history: without a <think> block."""
    if "</think>" in text:
        text = text.split("</think>")[-1]
    return text.replace("<think>", "").strip()


def render(system: str, users: Sequence[str], answers: Sequence[str]) -> Messages:
    """The whole history, re-rendered: system, then user/assistant pairs, then the new user message."""
    messages: Messages = [{"role": "system", "content": system}]
    for i, user in enumerate(users):
        messages.append({"role": "user", "content": user})
        if i < len(answers):
            messages.append({"role": "assistant", "content": answers[i]})
    return messages
