"""The prefill pass over device indices (what a CUDA graph replays) against HybridModel.prefill."""

from __future__ import annotations

import pytest
import torch

from hpc_cli.model import HybridModel
from hpc_cli.model.prefill_core import PrefillIndex, prefill_core, table_width

N = 200
TABLE = [5, 2, 7, 0, 3, 6, 1, 4]


@pytest.fixture(scope="module")
def tiny():
    return HybridModel.from_name_or_path("builtin:random", dtype=torch.float32)


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 272, (N,), generator=torch.Generator().manual_seed(7)).tolist()


def _run(model, tokens, cuts, indexed: bool, profile: str):
    kv, states = model.new_kv_storage(profile, 8), model.new_state_slots(3)
    bounds = [0, *cuts, N]
    logits = []
    model.prefill_pad = 64
    try:
        for a, b in zip(bounds, bounds[1:]):
            if indexed:
                L = -(-(b - a) // 64) * 64
                idx = PrefillIndex.build(model, tokens[a:b], a, TABLE, 2, L, kv.page_tokens)
                logits.append(prefill_core(model, idx, kv, states).logits)
            else:
                logits.append(model.prefill(tokens[a:b], a, TABLE, 2, kv, states).logits)
    finally:
        model.prefill_pad = 1
    return logits, kv, states


@pytest.mark.parametrize("profile", ["bf16", "int8-g64"])
@pytest.mark.parametrize("cuts", [[], [1], [37, 101], [64, 128]], ids=lambda c: "-".join(map(str, c)) or "one")
def test_indexed_pass_is_bit_identical(tiny, tokens, cuts, profile):
    """The same logits, K/V pages, GDN states and hidden, bit for bit, and nothing written past
    the prompt (padding rows have KV slot -1)."""
    ref_logits, ref_kv, ref_states = _run(tiny, tokens, cuts, False, profile)
    logits, kv, states = _run(tiny, tokens, cuts, True, profile)
    for a, b in zip(logits, ref_logits):
        assert torch.equal(a, b), "logits differ"
    for g in range(len(states.recurrent)):
        assert torch.equal(states.recurrent[g][2], ref_states.recurrent[g][2]), f"GDN layer {g} state"
        assert torch.equal(states.conv[g][2], ref_states.conv[g][2]), f"GDN layer {g} conv window"
        assert not states.recurrent[g][:2].any(), "another slot was written"
    assert torch.equal(states.hidden[2], ref_states.hidden[2])
    for layer in range(len(kv.planes)):
        for p, q in zip(kv.planes[layer], ref_kv.planes[layer]):
            assert torch.equal(p, q), f"attention layer {layer}: pages differ"


def test_index_layout():
    """Padding rows write nowhere, the table is padded to a fixed width, meta holds start and valid."""
    packed = PrefillIndex.pack([9, 8, 7], 130, [4, 1, 6], 5, 64, table_width(3), 64, 3)
    idx = PrefillIndex.view(packed, 64, table_width(3))
    assert idx.W == 512 and idx.pages[:3].tolist() == [4, 1, 6] and not idx.pages[3:].any()
    assert idx.tokens[:3].tolist() == [9, 8, 7] and not idx.tokens[3:].any()
    assert idx.positions[:3].tolist() == [130, 131, 132]
    assert idx.write[:3].tolist() == [6 * 64 + 2, 6 * 64 + 3, 6 * 64 + 4]
    assert (idx.write[3:] == -1).all()
    assert idx.meta.tolist() == [130, 3] and idx.slot.tolist() == [5] and idx.kept_rows.tolist() == [2]
    assert idx.conv_index.tolist() == [3, 4, 5]
    assert idx.image_slots.tolist() == [5] and idx.slots == 0


def test_index_layout_with_tap_slots():
    """The lane's slot, then each tap's, in one view; a slot not used names the lane's slot, its
    conv columns and its last row (so what the pass writes there is the lane's own image)."""
    packed = PrefillIndex.pack([9] * 40, 130, [4, 1, 6], 5, 64, 512, 64, 3, taps=[(2, 7), (17, 8)], slots=4)
    idx = PrefillIndex.view(packed, 64, 512, slots=4)
    assert idx.meta.tolist() == [130, 40] and idx.slot.tolist() == [5]
    assert idx.image_slots.tolist() == [5, 7, 8, 5, 5]
    assert idx.conv_index.tolist() == [40, 41, 42]
    assert idx.conv_cols.tolist() == [40, 41, 42, 2, 3, 4, 17, 18, 19, 40, 41, 42, 40, 41, 42]
    assert idx.tap_pos.tolist() == [2, 17, 0, 0] and idx.kept_rows.tolist() == [39, 1, 16, 39, 39]
    with pytest.raises(AssertionError, match="tap slots"):
        PrefillIndex.pack([9] * 40, 130, [4, 1, 6], 5, 64, 512, 64, 3, taps=[(2, 5)], slots=4)
    with pytest.raises(AssertionError, match="need 3"):
        PrefillIndex.pack([1] * 3, 130, [4, 1], 0, 64, 512, 64, 3)


@pytest.mark.parametrize("taps", [[1], [37, 101], [5, 64, 150], [64, 128, 129, 199]],
                         ids=lambda t: "-".join(map(str, t)))
def test_indexed_pass_with_tap_slots_equals_the_tapped_pass(tiny, tokens, taps):
    """A pass with tap slots (the graph form of the zero-split tap: the taps and their state
    slots read from the index, a free slot pointing at the lane's own) gives the eager tapped
    pass's logits, lane state and tap images, each in its own state slot; the other slots are
    untouched."""
    from hpc_cli.model.gdn_taps import TAP_SLOTS
    from hpc_cli.model.model import TapImage

    profile = "bf16"
    images = [TapImage(p, 3 + j) for j, p in enumerate(taps)]
    kv, states = tiny.new_kv_storage(profile, 8), tiny.new_state_slots(3 + TAP_SLOTS)
    ref = tiny.prefill(tokens, 0, TABLE, 2, kv, states, taps=images)
    assert ref.taps == images
    kv2, states2 = tiny.new_kv_storage(profile, 8), tiny.new_state_slots(3 + TAP_SLOTS)
    for part in states2.parts():
        part.fill_(3.0)  # what a slot held before: a slot the pass does not name keeps it
    states2.reset(2)
    idx = PrefillIndex.build(tiny, tokens, 0, TABLE, 2, 256, kv2.page_tokens,
                             taps=[(i.position, i.slot) for i in images], slots=TAP_SLOTS)
    out = prefill_core(tiny, idx, kv2, states2)
    assert torch.equal(out.logits, ref.logits)
    for slot in [2, *(i.slot for i in images)]:
        for g in range(len(states.recurrent)):
            assert torch.equal(states2.recurrent[g][slot], states.recurrent[g][slot]), f"slot {slot}: GDN layer {g}"
            assert torch.equal(states2.conv[g][slot], states.conv[g][slot]), f"slot {slot}: conv window {g}"
        assert torch.equal(states2.hidden[slot], states.hidden[slot]), f"slot {slot}: hidden"
    for slot in [0, 1, *range(3 + len(taps), 3 + TAP_SLOTS)]:
        assert all(bool((part[slot] == 3.0).all()) for part in states2.parts()), f"slot {slot} was written"


@pytest.mark.parametrize("cuts", [[], [37, 101]], ids=lambda c: "-".join(map(str, c)) or "one")
def test_indexed_pass_returns_what_a_speculative_backend_reads(tiny, tokens, cuts):
    """Every position's hidden (MTP) and the residual stream after captured layers (DFlash), which
    a graph writes into shared buffers: the eager pass's values bit for bit on the valid rows, and
    the same logits and hidden state."""
    capture = (3, 1)
    bounds = [0, *cuts, N]
    got, ref = [], []
    for indexed in (True, False):
        kv, states = tiny.new_kv_storage("bf16", 8), tiny.new_state_slots(3)
        tiny.prefill_pad = 64
        try:
            for a, b in zip(bounds, bounds[1:]):
                if indexed:
                    L = -(-(b - a) // 64) * 64
                    H = tiny.config.hidden_size
                    idx = PrefillIndex.build(tiny, tokens[a:b], a, TABLE, 2, L, kv.page_tokens)
                    out = prefill_core(tiny, idx, kv, states, hidden_out=torch.full((L, H), float("nan")),
                                       features_out=torch.full((L, 2 * H), float("nan")), capture=capture)
                    got.append((out.logits, out.hidden[:b - a], out.features[:b - a]))
                else:
                    out = tiny.prefill(tokens[a:b], a, TABLE, 2, kv, states, all_hidden=True, capture=capture)
                    ref.append((out.logits, out.hidden, out.features))
        finally:
            tiny.prefill_pad = 1
    assert len(got) == len(ref) == len(bounds) - 1
    for (lg, hid, feats), (rlg, rhid, rfeats) in zip(got, ref):
        assert torch.equal(lg, rlg), "logits differ"
        assert torch.equal(hid, rhid), "every position's hidden differs"
        assert torch.equal(feats, rfeats), "captured features differ"
