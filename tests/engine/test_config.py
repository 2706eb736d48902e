"""EngineConfig: what a profile maps to, and the three ways an Engine takes it."""

from __future__ import annotations

import dataclasses

import pytest

from hpc_cli.engine.config import EngineConfig
from hpc_cli.engine.engine import Engine
from hpc_cli.settings import load_settings


def test_from_settings_maps_the_profile_keys():
    keys = {"engine.kv_capacity": 32, "engine.max_concurrency": 2, "engine.prefill_chunk": 128,
            "model.name": "builtin:random", "cache.host_cache_mib": 16, "cache.transfer_copy": "dma",
            "engine.seed": 7, "engine.cuda_graphs": False}
    c = EngineConfig.from_settings(load_settings(None, keys, environ={}))
    assert (c.kv_pages, c.max_concurrency, c.prefill_chunk, c.host_cache_mib) == (32, 2, 128, 16)
    assert (c.transfer_copy, c.seed, c.cuda_graphs, c.reuse) == ("dma", 7, False, True)
    assert c.model_name == "builtin:random" and c.cache_mode.name == "hybrid"
    auto = EngineConfig.from_settings(load_settings(None, {"model.name": "builtin:random"}, environ={}))
    assert auto.kv_pages is None


def test_no_reuse_has_no_host_tier_and_no_options():
    s = load_settings(None, {"model.name": "builtin:random", "cache.no_prefix_reuse": True}, environ={})
    c = EngineConfig.from_settings(s)
    assert (c.reuse, c.host_cache_mib, c.cache_options) == (False, 0, None)


def test_config_is_frozen_and_rejects_unknown_fields():
    c = EngineConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.kv_pages = 3
    with pytest.raises(TypeError):
        EngineConfig(kv_page=3)


def test_engine_takes_a_config_keywords_or_both(model):
    kw = dict(kv_pages=32, prefill_chunk=128, max_concurrency=2, host_cache_mib=0)
    by_kw = Engine(model, **kw)
    by_config = Engine(model, EngineConfig(**kw))
    both = Engine(model, EngineConfig(**kw), max_concurrency=1)
    assert by_kw.config == by_config.config == EngineConfig(**kw)
    assert (by_kw.C, by_kw.chunk, by_kw.storage.num_pages) == (2, 128, 32)
    assert both.C == 1 and both.config.prefill_chunk == 128
    with pytest.raises(TypeError):
        Engine(model, kv_page=32)


@pytest.mark.parametrize("env, merged", [({}, True), ({"HPC_MODEL__MERGED_PROJECTIONS": "false"}, False)])
def test_model_merged_projections_picks_how_the_served_model_multiplies(env, merged):
    r = load_settings(None, {"model.name": "builtin:random", "engine.kv_capacity": 16, "engine.max_concurrency": 1},
                      environ=env)
    e = Engine.from_settings(r)
    try:
        mlps = [layer.mlp for layer in e.model.layers]
        assert all((m.merged is not None) == merged for m in mlps), merged
    finally:
        e.stop()
