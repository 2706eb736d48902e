"""§13.1 TapPlanner (property tests over random prompts and boundaries) and unit cases."""

import math

from hypothesis import given, settings, strategies as st

from hpc_cli.cache import Placement, TapHint, TapPlanner, TapSource

SOURCES = [TapSource.EXPLICIT, TapSource.OPENER, TapSource.STRUCTURAL, TapSource.AUTOMATIC, TapSource.MESSAGE,
           TapSource.DIVERGENCE]


@st.composite
def prompts(draw):
    n = draw(st.integers(1, 60000))
    base = draw(st.integers(0, max(0, n - 1))) // 64 * 64 if draw(st.booleans()) else 0
    hints = draw(st.lists(st.builds(TapHint, st.integers(0, n), st.sampled_from(SOURCES)), max_size=12))
    existing = draw(st.lists(st.integers(1, n), max_size=4))
    spans = []
    for _ in range(draw(st.integers(0, 3))):
        b = draw(st.integers(0, n))
        spans.append((b, draw(st.integers(1, 3000))))
    planner = TapPlanner(chunk=draw(st.sampled_from([512, 2048, 4096])),
                         host_tier=draw(st.booleans()),
                         max_new_taps=draw(st.sampled_from([None, 1, 3, 8])))
    return planner, n, base, hints, existing, spans, draw(st.booleans())


@settings(max_examples=max(50, settings.default.max_examples // 3))
@given(prompts())
def test_taps_in_range_outside_vision_and_flexible_taps_block_aligned(case):
    planner, n, base, hints, existing, spans, ep = case
    for t in planner.plan(n, base, hints, existing, spans, resumed_from_endpoint=ep):
        assert base < t.position <= n - 1
        assert not any(b < t.position < b + ln for b, ln in spans)
        if t.placement is Placement.FLEXIBLE:
            assert t.position % 64 == 0
        if t.source is TapSource.PROMPT_TAIL:
            assert t.placement is Placement.EXACT


@settings(max_examples=max(50, settings.default.max_examples // 3))
@given(prompts())
def test_every_semantic_hint_is_tapped_within_the_budget(case):
    """No clustering and no proximity rule: each opener and boundary past the base that is not
    already a snapshot on the path is an exact tap, when the budget leaves room for it."""
    planner, n, base, hints, existing, spans, ep = case
    bigger = TapPlanner(chunk=planner.chunk, host_tier=planner.host_tier, max_new_taps=1000)
    taps = bigger.plan(n, base, hints, existing, [], resumed_from_endpoint=ep)
    exact = {t.position for t in taps if t.placement is Placement.EXACT}
    for h in hints:
        if h.source in (TapSource.OPENER, TapSource.STRUCTURAL, TapSource.AUTOMATIC) and base < h.position <= n - 1:
            if ep and h.source is TapSource.OPENER:
                continue
            assert h.position in exact or h.position in existing, f"hint {h} not tapped"


@settings(max_examples=max(50, settings.default.max_examples // 3))
@given(prompts())
def test_taps_deduplicated_against_the_path(case):
    planner, n, base, hints, existing, spans, ep = case
    taps = planner.plan(n, base, hints, existing, spans, resumed_from_endpoint=ep)
    pos = [t.position for t in taps]
    assert len(pos) == len(set(pos))
    for t in taps:
        assert t.position not in existing and t.position != base
        if t.source is TapSource.LADDER:
            assert not any(abs(t.position - x) < planner.min_gap for x in existing + [base])


@settings(max_examples=max(50, settings.default.max_examples // 3))
@given(prompts())
def test_taps_priority_order_and_budget_respected(case):
    planner, n, base, hints, existing, spans, ep = case
    taps = planner.plan(n, base, hints, existing, spans, resumed_from_endpoint=ep)
    assert len(taps) <= planner.budget
    if len(taps) == planner.budget:
        # nothing of a better priority was left out for a worse one: an unconstrained plan's
        # best-priority taps are all kept
        worst = max(t.source.priority for t in taps)
        bigger = TapPlanner(chunk=planner.chunk, host_tier=planner.host_tier, max_new_taps=100)
        full = bigger.plan(n, base, hints, existing, spans, resumed_from_endpoint=ep)
        for t in full:
            if t.source.priority < worst and t.source is TapSource.EXPLICIT:
                assert t in taps
    assert taps == sorted(taps, key=lambda t: t.position)
    if ep:
        assert all(t.source is not TapSource.OPENER for t in taps)


@given(st.integers(1, 2_000_000), st.sampled_from([512, 2048, 8192]))
def test_ladder_stays_within_log2_n_over_G_plus_one(n, chunk):
    planner = TapPlanner(chunk=chunk, max_new_taps=1000)
    taps = planner.plan(n, 0)
    ladder = [t for t in taps if t.source is TapSource.LADDER]
    G = planner.ladder
    bound = math.floor(math.log2(n / G)) + 1 if n > G else 0
    assert len(ladder) <= bound


@settings(max_examples=max(50, settings.default.max_examples // 3))
@given(prompts())
def test_tap_plan_is_deterministic(case):
    planner, n, base, hints, existing, spans, ep = case
    a = planner.plan(n, base, hints, existing, spans, resumed_from_endpoint=ep)
    b = planner.plan(n, base, list(reversed(hints)), list(reversed(existing)), list(reversed(spans)),
                     resumed_from_endpoint=ep)
    assert a == b


def test_semantic_boundaries_close_together_are_each_tapped():
    p = TapPlanner(chunk=2048)
    taps = p.plan(5000, 0, [TapHint(1000, TapSource.STRUCTURAL), TapHint(1040, TapSource.OPENER)])
    exact = [t for t in taps if t.placement is Placement.EXACT]
    assert [(t.position, t.boundary) for t in exact] == [(1000, True), (1040, False), (4992, False)]


def test_an_opener_just_past_the_base_is_tapped():
    """A short new message: the opener 40 tokens past the restored snapshot is still tapped, so the
    next turn reuses up to it (the old 64-token rule left reuse stuck every other turn)."""
    p = TapPlanner(chunk=2048)
    taps = p.plan(740, 700, [TapHint(737, TapSource.OPENER)], existing=[700])
    assert [(t.position, t.placement) for t in taps] == [(737, Placement.EXACT)]


def test_a_short_prompt_is_tapped_at_its_last_block():
    """A /v1/completions prompt shorter than one chunk: an exact tail tap at floor64(n - 1), so the
    same prompt sent again reuses all but its last block."""
    p = TapPlanner(chunk=2048)
    assert [(t.position, t.placement, t.source) for t in p.plan(300, 0)] == \
        [(256, Placement.EXACT, TapSource.PROMPT_TAIL)]
    assert p.plan(60, 0) == []  # nothing to keep before the first block


def test_opener_absorbs_the_prompt_tail_and_endpoint_resume_drops_the_opener():
    p = TapPlanner(chunk=2048)
    taps = p.plan(3000, 0, [TapHint(2950, TapSource.OPENER)])
    assert [(t.position, t.source) for t in taps] == [(2950, TapSource.OPENER)]
    taps = p.plan(3000, 0, [TapHint(2950, TapSource.OPENER)], resumed_from_endpoint=True)
    assert [(t.position, t.source) for t in taps] == [(2944, TapSource.PROMPT_TAIL)]


def test_explicit_markers_are_exact_boundaries_and_vision_moves_to_span_start():
    p = TapPlanner(chunk=2048)
    taps = p.plan(4000, 0, [TapHint(1500, TapSource.EXPLICIT)], vision_spans=[(1400, 200)])
    first = taps[0]
    assert (first.position, first.placement, first.boundary) == (1400, Placement.EXACT, True)
    auto = p.plan(4000, 0, [TapHint(1500, TapSource.AUTOMATIC)])
    assert [t.boundary for t in auto if t.position == 1500] == [False]


def test_ladder_snaps_back_to_a_message_boundary_and_keeps_the_min_gap():
    p = TapPlanner(chunk=2048, tap_ladder_tokens=4096, tap_min_gap=1024)
    taps = p.plan(20000, 0, [TapHint(15500, TapSource.MESSAGE)])
    ladder = [t.position for t in taps if t.source is TapSource.LADDER]
    assert ladder[-1] == 15488  # 20000-4096 = 15904 snapped to 15500, then block aligned
    assert all(b - a >= 1024 for a, b in zip(ladder, ladder[1:]))


def test_the_divergence_from_a_cached_path_is_an_exact_boundary_planned_as_structural():
    p = TapPlanner(chunk=2048, host_tier=False)  # two taps
    taps = p.plan(3200, 0, [TapHint(2944, TapSource.DIVERGENCE)])
    assert [(t.position, t.placement, t.source, t.boundary) for t in taps] == [
        (2944, Placement.EXACT, TapSource.DIVERGENCE, True), (3136, Placement.EXACT, TapSource.PROMPT_TAIL, False)]
    # planned before the prompt tail: with one tap, the divergence is the one kept
    one = TapPlanner(chunk=2048, max_new_taps=1).plan(3200, 0, [TapHint(2944, TapSource.DIVERGENCE)])
    assert [t.position for t in one] == [2944]
    # at an opener it adds the Boundary publication to the opener's tap
    both = p.plan(3200, 0, [TapHint(2944, TapSource.DIVERGENCE), TapHint(2944, TapSource.OPENER)])
    assert [(t.position, t.source, t.boundary) for t in both][0] == (2944, TapSource.OPENER, True)
