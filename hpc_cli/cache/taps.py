"""TapPlanner (spec §7.1): where a prefill snapshots the recurrent state.

Candidates, in priority order:

1. explicit markers (client breakpoints) -- exact, published as Boundary
2. the final assistant generation opener -- exact (dropped after an endpoint resume)
3. structural boundaries (end of tools, end of the leading System/Developer block) -- exact,
   published as Boundary; protocol-automatic markers are planned here too but published as
   ordinary taps; so is the divergence from a cached path (the deepest cached block boundary
   of a prompt that resumes below it), published as Boundary
4. the prompt tail at floor64(n - 1) -- exact (block aligned: the snapshot anchors on committed
   blocks and owns no tail page), unless an exact tap of 1-3 already lies at or past it
5. the geometric ladder n - G*2^k, snapped back to a message boundary within tap_min_gap --
   flexible

Rules: taps lie in (base, n-1]; a candidate strictly inside a Vision span moves to the span
start; a candidate at the base, at an existing snapshot on the path or at an accepted tap's
position is dropped; ladder candidates keep tap_min_gap on both sides; at most max_new_taps are
kept, in priority order. Flexible taps never split a chunk, so their targets are block aligned;
exact taps keep their position. The plan is a function of its inputs (deterministic).

An exact tap costs a prefill split, which the spec's first design avoided by clustering semantic
boundaries within 64 tokens of each other to the earliest and dropping any tap within 64 tokens
past the base or an existing snapshot. Those rules left a conversation's reuse stuck every other
turn when its new messages were short (the next opener fell within 64 tokens of the last), and a
repeated prompt shorter than one chunk reused nothing (its flexible tail tap fell on its only
chunk's start, the base). A split now costs a short pass (on CUDA one graph replay, elsewhere its
tokens' own work), so every opener and boundary is tapped and the tail is tapped exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, IntEnum
from typing import Iterable, Sequence

from hpc_cli.cache.keys import BLOCK_TOKENS


class TapSource(IntEnum):
    """A hint's origin; the value is the planning priority (lower first)."""

    EXPLICIT = 1
    OPENER = 2
    STRUCTURAL = 3
    AUTOMATIC = 4  # protocol-automatic marker: planned as structural, published as a Tap
    PROMPT_TAIL = 5
    LADDER = 6
    MESSAGE = 7  # a message boundary: only snaps ladder candidates
    #: the deepest cached block boundary of a prompt that leaves a cached path there (planned as
    #: structural, published as Boundary): prompts sharing that prefix resume from it
    DIVERGENCE = 8

    @property
    def priority(self) -> int:
        """The spec's priority 1..5."""
        return {1: 1, 2: 2, 3: 3, 4: 3, 5: 4, 6: 5, 7: 6, 8: 3}[int(self)]


class Placement(Enum):
    EXACT = "exact"  # splits the prefill chunk at the position
    FLEXIBLE = "flexible"  # taken at the end of the chunk that reaches it


@dataclass(slots=True, frozen=True)
class TapHint:
    position: int
    source: TapSource


@dataclass(slots=True, frozen=True)
class Tap:
    position: int
    placement: Placement
    source: TapSource
    boundary: bool  # publish as a Boundary snapshot (§9.3)


_SEMANTIC = (TapSource.OPENER, TapSource.STRUCTURAL, TapSource.AUTOMATIC, TapSource.DIVERGENCE)
_SHARED = (TapSource.STRUCTURAL, TapSource.DIVERGENCE)  # published as Boundary snapshots


@dataclass(slots=True, frozen=True)
class TapPlanner:
    """Tap planning with the §14.2 defaults derived from the prefill chunk and the host tier."""

    chunk: int = 2048
    tap_ladder_tokens: int | None = None  # G; default max(4096, 2*chunk)
    tap_min_gap: int | None = None  # default max(1024, chunk)
    max_new_taps: int | None = None  # default 8 with a host tier, 2 without
    host_tier: bool = True

    @property
    def ladder(self) -> int:
        return self.tap_ladder_tokens or max(4096, 2 * self.chunk)

    @property
    def min_gap(self) -> int:
        return self.tap_min_gap if self.tap_min_gap is not None else max(1024, self.chunk)

    @property
    def budget(self) -> int:
        if self.max_new_taps is not None:
            return self.max_new_taps
        return 8 if self.host_tier else 2

    def plan(self, n: int, base: int, hints: Iterable[TapHint] = (), existing: Iterable[int] = (),
             vision_spans: Sequence[tuple[int, int]] = (), *,
             resumed_from_endpoint: bool = False) -> list[Tap]:
        """Taps for a prompt of ``n`` tokens prefilled from ``base``, sorted by position."""
        last = n - 1
        if last <= base:
            return []
        hints = sorted(set(hints), key=lambda h: (h.position, h.source))
        spans = sorted(vision_spans)

        def fix(p: int, flexible: bool) -> int | None:
            moved = True
            while moved:  # never resume inside a Vision span (spans may overlap)
                moved = False
                for b, ln in spans:
                    if b < p < b + ln:
                        p, moved = b, True
            if flexible:
                p -= p % BLOCK_TOKENS
                if any(b < p < b + ln for b, ln in spans):
                    return None
            return p if base < p <= last else None

        cands: list[Tap] = []
        # 1. explicit markers
        for h in hints:
            if h.source is TapSource.EXPLICIT:
                p = fix(h.position, False)
                if p is not None:
                    cands.append(Tap(p, Placement.EXACT, TapSource.EXPLICIT, True))
        # 2-3. semantic boundaries, each its own exact tap
        sem = [h for h in hints if h.source in _SEMANTIC
               and not (resumed_from_endpoint and h.source is TapSource.OPENER)]
        by_position: dict[int, list[TapHint]] = {}
        for h in sem:
            p = fix(h.position, False)
            if p is not None:
                by_position.setdefault(p, []).append(h)
        for p, group in sorted(by_position.items()):
            structural = any(h.source in _SHARED for h in group)  # published as Boundary
            src = min(h.source for h in group)
            if src is TapSource.AUTOMATIC and structural:
                src = TapSource.STRUCTURAL
            cands.append(Tap(p, Placement.EXACT, src, structural))
        # 4. the prompt tail, exact at a block boundary, where no exact tap covers it
        p = fix(last - last % BLOCK_TOKENS, False)
        if p is not None and not any(t.position >= p for t in cands):
            cands.append(Tap(p, Placement.EXACT, TapSource.PROMPT_TAIL, False))
        # 5. the ladder, snapped back to a message boundary within the minimum gap
        messages = [h.position for h in hints if h.source is TapSource.MESSAGE]
        G, gap = self.ladder, self.min_gap
        k = 0
        while True:
            c = n - G * (1 << k)
            if c <= base:
                break
            snapped = [m for m in messages if c - gap <= m <= c]
            p = fix(max(snapped) if snapped else c, True)
            if p is not None:
                cands.append(Tap(p, Placement.FLEXIBLE, TapSource.LADDER, False))
            k += 1

        taken: list[Tap] = []
        marks = sorted(set(existing))
        budget = self.budget
        for t in sorted(cands, key=lambda t: (t.source.priority, t.position)):
            if len(taken) >= budget:
                break
            p = t.position
            others = [x.position for x in taken] + marks
            if t.source is TapSource.LADDER:
                if any(abs(p - x) < gap for x in others + [base]):
                    continue
            elif p in others:
                continue
            taken.append(t)
        return sorted(taken, key=lambda t: t.position)
