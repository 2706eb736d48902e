"""STRP profiles and HPCT traces: round trips, every malformed file, and k-fold scoring."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from hpc_cli.errors import CacheFileError
from hpc_cli.model import expert_profile as ep


def _profile(layers=3, experts=8, slots=5, seed=0):
    freq = np.random.default_rng(seed).integers(0, 50, size=(layers, experts)).astype(np.uint64)
    freq[0, 0] = 0  # an unrouted pair is not ranked
    return ep.build_profile(freq, slots)


def test_profile_round_trip(tmp_path):
    p = _profile()
    path = tmp_path / "p.bin"
    ep.write_profile(path, p)
    assert ep.is_profile_file(path)
    q = ep.read_profile(path, 3, 8)
    assert (q.n_layers, q.n_expert, q.slots, q.n_ranked) == (3, 8, 5, p.n_ranked)
    np.testing.assert_array_equal(q.ranked, p.ranked)
    np.testing.assert_array_equal(q.freq, p.freq)
    # ranked by descending frequency, every non-zero pair once
    counts = q.freq[q.ranked[:, 0], q.ranked[:, 1]]
    assert (np.diff(counts.astype(np.int64)) <= 0).all()
    assert q.n_ranked == int((q.freq > 0).sum()) and [0, 0] not in q.ranked.tolist()
    assert q.resident_mask().sum() == 5
    size = path.stat().st_size
    assert size == 24 + 8 * q.n_ranked + 8 * 3 * 8


def _corrupt(tmp_path, mutate):
    path = tmp_path / "p.bin"
    ep.write_profile(path, _profile())
    data = bytearray(path.read_bytes())
    data = mutate(data)
    bad = tmp_path / "bad.bin"
    bad.write_bytes(bytes(data))
    return bad


def _set_u32(i, v):
    def f(d):
        struct.pack_into("<I", d, 4 + 4 * i, v)
        return d
    return f


def _set_pair(k, layer, expert):
    def f(d):
        struct.pack_into("<ii", d, 24 + 8 * k, layer, expert)
        return d
    return f


@pytest.mark.parametrize("mutate,match", [
    (lambda d: b"PRTS" + d[4:], "not an expert profile"),
    (lambda d: b"", "not an expert profile"),
    (lambda d: d[:10], "truncated.*header"),
    (_set_u32(0, 2), "version 2"),
    (_set_u32(1, 0), "empty shape"),
    (_set_u32(4, 1000), "ranks 1000 pairs"),
    (lambda d: d[:-1], "truncated"),
    (lambda d: d[:30], "truncated"),
    (lambda d: d + b"\0", "past its end"),
    (_set_pair(0, 3, 0), "outside"),
    (_set_pair(1, 0, -1), "outside"),
    (lambda d: _set_pair(1, *struct.unpack_from("<ii", d, 24))(d), "twice"),
])
def test_malformed_profiles(tmp_path, mutate, match):
    with pytest.raises(CacheFileError, match=match):
        ep.read_profile(_corrupt(tmp_path, mutate))


def test_profile_shape_mismatch_and_missing_file(tmp_path):
    path = tmp_path / "p.bin"
    ep.write_profile(path, _profile())
    with pytest.raises(CacheFileError, match="3 layers x 8 experts; the model has 4 x 8"):
        ep.read_profile(path, 4, 8)
    with pytest.raises(CacheFileError, match="cannot be read"):
        ep.read_profile(tmp_path / "nope.bin")
    assert not ep.is_profile_file(tmp_path / "nope.bin")


def test_trace_round_trip_and_damage(tmp_path):
    rec = ep.synthetic_trace(50, 3, 8, 2, 1.0, seed=3)
    path = tmp_path / "t.bin"
    with ep.TraceWriter(path, 3, 8, 2) as w:
        w.write(rec[:20])
        w.write(rec[20:])
    t = ep.read_trace(path)
    np.testing.assert_array_equal(t.records, rec)
    np.testing.assert_array_equal(t.counts().sum(axis=1), [100, 100, 100])
    # a trace cut mid-record (a killed server) keeps its whole records
    data = path.read_bytes()
    (tmp_path / "cut.bin").write_bytes(data[:-3])
    assert ep.read_trace(tmp_path / "cut.bin").tokens == 49
    (tmp_path / "magic.bin").write_bytes(b"XXXX" + data[4:])
    with pytest.raises(CacheFileError, match="not a routing trace"):
        ep.read_trace(tmp_path / "magic.bin")
    (tmp_path / "ver.bin").write_bytes(data[:4] + struct.pack("<I", 9) + data[8:])
    with pytest.raises(CacheFileError, match="version 9"):
        ep.read_trace(tmp_path / "ver.bin")
    (tmp_path / "ids.bin").write_bytes(data[:20] + struct.pack("<h", 8) + data[22:])
    with pytest.raises(CacheFileError, match="outside"):
        ep.read_trace(tmp_path / "ids.bin")
    with ep.TraceWriter(tmp_path / "other.bin", 4, 8, 2) as w:
        w.write(np.zeros((1, 4, 2)))
    with pytest.raises(CacheFileError, match="is 4 layers x 8 experts, top 2; .* is 3 x 8"):
        ep.read_traces([path, tmp_path / "other.bin"])


def test_hit_rates_by_hand():
    rec = np.array([[[0, 1], [2, 3]], [[0, 2], [0, 1]]], dtype=np.int16)  # 2 tokens, 2 layers, top 2
    mask = np.zeros((2, 4), dtype=bool)
    mask[0, 0] = mask[0, 1] = mask[1, 0] = True
    he, hl, per = ep.hit_rates(rec, mask)
    assert he == pytest.approx(4 / 8)  # hits: t0 l0 both, t1 l0 one, t1 l1 one (0), t0 l1 none
    # (token, layer) pairs all resident: t0 l0 only
    assert hl == pytest.approx(1 / 4)
    np.testing.assert_allclose(per, [3 / 4, 1 / 4])


def test_first_routed_simulation_by_hand():
    rec = np.array([[[0]], [[1]], [[0]], [[1]], [[2]]], dtype=np.int16)  # 5 tokens, 1 layer, top 1
    # one slot: expert 0 admitted at token 0, hits at token 2
    assert ep.simulate_first_routed(rec, 4, 1, per_layer=False) == pytest.approx(1 / 5)
    assert ep.simulate_first_routed(rec, 4, 2, per_layer=True) == pytest.approx(2 / 5)


def test_kfold_on_a_skewed_trace_gives_the_expected_h():
    layers, experts, k, slots = 6, 32, 4, 48  # a quarter of the pairs
    trace = ep.synthetic_trace(3000, layers, experts, k, skew=1.2, seed=11)
    kf = ep.kfold(trace, experts, slots, folds=10)
    # the expected held-out h: a profile from a large independent draw, scored on another
    train = ep.synthetic_trace(30000, layers, experts, k, skew=1.2, seed=11, sample_seed=101)
    test = ep.synthetic_trace(30000, layers, experts, k, skew=1.2, seed=11, sample_seed=202)
    expected, _, _ = ep.hit_rates(test, ep.build_profile(ep.trace_counts(train, experts), slots).resident_mask())
    assert kf["h_expert_min"] - 0.01 <= expected <= kf["h_expert_max"] + 0.01
    assert abs(kf["h_expert"] - expected) < max(2 * kf["h_expert_std"], 0.01)
    assert 0.4 < expected < 0.8  # skewed: far above the 0.25 of uniform routing
    assert kf["h_layer"] < kf["h_expert"]
    # uniform routing: any profile holds its share of the pairs
    flat = ep.kfold(ep.synthetic_trace(3000, layers, experts, k, skew=0.0, seed=5), experts, slots, folds=10)
    assert flat["h_expert"] == pytest.approx(slots / (layers * experts), abs=0.02)


def test_score_reports_in_sample_kfold_and_policies():
    trace = ep.RoutingTrace(4, 16, 2, ep.synthetic_trace(400, 4, 16, 2, skew=1.0, seed=1))
    prof = ep.build_profile(trace.counts(), 16)
    res = ep.score(prof, trace)
    assert res["h_expert"] >= res["kfold"]["h_expert"] - 0.05  # in sample is optimistic
    assert set(res["policies"]) == {"first-routed", "per-layer-first-routed"}
    assert res["policies"]["per-layer-first-routed"] > res["policies"]["first-routed"]
    with pytest.raises(CacheFileError, match="cannot be split"):
        ep.kfold(trace.records[:5], 16, 4, folds=10)
    with pytest.raises(CacheFileError, match="the profile is 3 layers x 16 experts, the trace 4 x 16"):
        ep.score(ep.build_profile(np.ones((3, 16)), 4), trace)
