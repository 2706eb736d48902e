"""The cache-mode contract (hpc_cli.engine.binding): every built-in mode builds a CacheBinding
through the registry, options of another mode are refused, persistence only where a mode keeps
a prefix cache file, and a mode registered by a plugin runs the engine."""

from __future__ import annotations

import time

import pytest

import hpc_cli
from hpc_cli import plugins
from hpc_cli.cache_mode import CacheMode
from hpc_cli.engine.api import GenerationRequest, SamplingParams, TapHint, to_json
from hpc_cli.engine.binding import CacheBinding
from hpc_cli.engine.engine import Engine
from hpc_cli.engine.off import OffBinding
from hpc_cli.errors import ConfigError, PluginError

KW = dict(kv_pages=16, prefill_chunk=128, max_concurrency=2, host_cache_mib=8)


@pytest.mark.parametrize("mode,persistent", [("hybrid", True), ("legacy", False), ("off", False)])
def test_builtin_modes_build_their_binding_through_the_registry(model, mode, persistent):
    e = Engine(model, cache_mode=mode, **KW)
    assert isinstance(e.cache, CacheBinding) and e.cache.mode == mode == e.cache_mode.name
    assert e.cache.persistent is persistent and e.cache.reuse is (mode != "off")
    assert not any(e.cache.leftovers().values())
    assert set(to_json(e.cache.stats())["residency"]) == {"device_kv_bytes", "device_state_bytes", "host_bytes", "entries"}
    options = e.cache_mode.options_model()
    taps = e.cache_mode.tap_slots(options, model=model, speculative=False)
    assert taps == (4 if mode == "hybrid" else 0)  # a prefill pass's tap slots (the zero-split tap)
    assert e.states.num_slots == e.C + e.cache_mode.snapshot_slots(options, lanes=e.C, host=True) + taps
    e.check_invariants()


def test_reuse_false_is_mode_off(model):
    e = Engine(model, reuse=False, **KW)
    assert e.cache_mode.name == "off" and isinstance(e.cache, OffBinding) and e.states.num_slots == e.C


def test_options_of_another_mode_are_refused(model):
    with pytest.raises(ConfigError, match="device_snapshot_slots is not an option of cache mode 'legacy'") as exc:
        Engine(model, cache_mode="legacy", snapshot_slots=1, **KW)
    assert "'hybrid'" in exc.value.hint
    with pytest.raises(ConfigError, match="device_state_slots: not options of cache mode 'hybrid'"):
        Engine(model, cache_options={"device_state_slots": 2}, **KW)
    with pytest.raises(ConfigError, match="cache.legacy.max_shared_prefixes"):
        Engine(model, cache_mode="legacy", cache_options={"max_shared_prefixes": -1}, **KW)
    with pytest.raises(ConfigError, match="without a speculative backend"):
        Engine(model, cache_mode="legacy", speculative="mtp", **KW)
    with pytest.raises(PluginError, match="legacy"):
        Engine(model, cache_mode="nope", **KW)


def test_prefix_cache_file_only_where_the_mode_keeps_one(model, tmp_path):
    from hpc_cli.engine.persistence import attach_cache_file

    with pytest.raises(ConfigError, match="cache mode 'legacy' keeps no prefix cache file"):
        attach_cache_file(Engine(model, cache_mode="legacy", **KW), tmp_path / "p.bin", progress=False)
    assert attach_cache_file(Engine(model, cache_mode="off", **KW), tmp_path / "p.bin", progress=False,
                             save=False).status == "disabled"


class _Counting(OffBinding):
    mode = "counting"

    def admit(self, lane, siblings=()):
        self.counters["admitted"] = self.counters.get("admitted", 0) + 1
        return super().admit(lane, siblings)


class _CountingMode(CacheMode):
    name = "counting"
    description = "cache mode off that counts admissions (a test plugin)"

    def build(self, context):
        return _Counting(context)


class _Plugin:
    @hpc_cli.hookimpl
    def hpc_register_cache_modes(self, register):
        register(_CountingMode())


def test_a_plugin_mode_is_selected_by_name_and_runs_the_engine(model):
    from hpc_cli.settings import load_settings

    plugins.get_plugin_manager().register(_Plugin(), name="counting-plugin")
    r = load_settings(None, {"cache.mode": "counting", "model.name": "builtin:random", "engine.kv_capacity": 16,
                             "engine.max_concurrency": 1}, environ={})
    assert r.effective["cache.mode"] == "counting"
    e = Engine.from_settings(r).start()
    try:
        toks, fin = e.submit(GenerationRequest(list(range(1, 100)), SamplingParams(max_tokens=2, temperature=0,
                                                                                   ignore_eos=True))).result(60)
        assert fin.reason == "length" and fin.usage.reuse_tokens == 0
    finally:
        e.stop()
    assert e.cache.counters["admitted"] == 1 and e.stats().settings.cache_mode == "counting"


def test_legacy_demotes_to_the_host_and_restores_exactly(model):
    """One device state slot: a second session's endpoint demotes the first (copy before
    release); the first session's next turn restores it from the host and matches the root."""
    e = Engine(model, cache_mode="legacy", cache_options={"device_state_slots": 1}, **KW).start()
    sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    a, b = list(range(1, 200)), list(range(3, 230))
    for p in (a, b):
        e.submit(GenerationRequest(p, sp)).result(60)
    assert e.cache.stats().catalog.checkpoints.by_residency == {"device": 1, "host": 1}
    in_use = set(range(e.cache._host_ready)) - set(e.cache.free_slabs)
    assert in_use and e.cache.host_high == max(in_use) + 1  # the mark the CPU tier faults pages in ahead of
    ext = a + [7] * 30
    toks, fin = e.submit(GenerationRequest(ext, SamplingParams(max_tokens=6, temperature=0,
                                                               ignore_eos=True))).result(60)
    assert fin.usage.reuse_tokens == len(a) and fin.usage.restored_host_bytes > 0
    e.stop()
    e.check_invariants()
    assert not any(e.cache.leftovers().values())
    ref = Engine(model, reuse=False, **KW).start()
    want, _ = ref.generate(GenerationRequest(ext, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)))
    ref.stop()
    assert [t.token_id for t in toks] == want


def test_the_cpu_host_tier_faults_pages_in_ahead_of_the_slabs_in_use(model):
    """The hybrid binding hands the index's high-water mark to the host storage as it polls:
    the storage's prefault thread (CPU) is asked for every slab below it, and more."""
    if model.device.type != "cpu":
        pytest.skip("a pinned host tier has every page in memory")
    e = Engine(model, **KW).start()
    try:
        sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        for p in (list(range(1, 200)), list(range(3, 230))):
            e.submit(GenerationRequest(p, sp)).result(60)
        high = e.cache.index.host.high_water
        assert high > 0, "the requests wrote through to the host tier"
        prefault = e.cache.host._prefault
        end = time.monotonic() + 10
        while prefault._target <= high and time.monotonic() < end:  # the worker's next poll
            time.sleep(0.01)
        assert prefault._target > high
    finally:
        e.stop()
    e.check_invariants()


def test_legacy_shared_prefix_is_published_where_two_sessions_meet(model):
    e = Engine(model, cache_mode="legacy", **dict(KW, prefill_chunk=256)).start()  # the capture splits a pass
    pre = list(range(1, 129))
    sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    fins = [e.submit(GenerationRequest(pre + [200 + i] * 20, sp, tap_hints=[TapHint(128, 3)])).result(60)[1]
            for i in range(3)]
    assert [f.usage.reuse_tokens for f in fins] == [0, 0, 128]
    e.stop()
    st = to_json(e.cache.stats())
    assert st["catalog"]["shared_prefixes"] == 1 and st["prefill_splits"] >= 1
