"""The stats document parsed once (hpc_cli.tui.stats.EngineStats): each field's fallbacks, an
absent cache, and a section that is not an object."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpc_cli.tui.stats import EngineStats

FIX = Path(__file__).parent / "fixtures"


def test_the_fixtures_parse_with_their_numbers():
    s = json.loads((FIX / "busy.json").read_text())
    st = EngineStats.parse(s)
    assert st.model == s["model"] and st.max_concurrency == s["max_concurrency"]
    assert st.requests.running == s["requests"]["running"]
    assert st.counters.prompt_tokens == s["counters"]["prompt_tokens"]
    assert st.cache is not None and st.cache.pool.free == s["cache"]["pool"]["free"]
    assert st.cache.snapshots.rows is not None and len(st.cache.snapshots.rows) == len(s["cache"]["top_snapshots"])
    assert st.ttft_recent_s == tuple(s["ttft_recent_s"])


def test_fallback_keys_are_read_in_one_place():
    top = EngineStats.parse({"kv_profile": "int8", "spec_backend": "mtp", "cache_mode": "hybrid", "profile": "p"})
    assert (top.settings.kv_profile, top.settings.spec_backend, top.settings.cache_mode, top.settings.profile) == \
        ("int8", "mtp", "hybrid", "p")
    meta = EngineStats.parse({"settings": {"spec_backend": "eagle", "profile_path": "/x/h200.toml"},
                              "speculative": {"backend": "mtp"}})
    assert meta.settings.spec_backend == "eagle" and meta.settings.profile == "/x/h200.toml"
    assert EngineStats.parse({"speculative": {"backend": "mtp"}}).settings.spec_backend == "mtp"
    host = {"index": {"host": {"slabs": 4, "slabs_by_use": {"free": 3, "node": 1, "odd": 2}}}}
    h = EngineStats.parse({"cache": host}).cache.host
    assert (h.free, h.node, h.filling, h.enabled) == (3, 1, 2, True)
    host["index"]["host"]["free_slabs"] = 1
    assert EngineStats.parse({"cache": host}).cache.host.free == 1
    pages = EngineStats.parse({"cache": {"pool": {"free": 2, "active": 3}}}).cache.pool.pages
    assert pages == 5


def test_no_cache_and_a_section_that_is_not_an_object():
    st = EngineStats.parse({"model": "m", "cache": {}})
    assert st.cache is None and st.speculative is None and st.experts is None
    with pytest.raises(AttributeError):
        EngineStats.parse({"model": "m", "cache": "not a dict"})
