"""Cache-mode options in profiles (spec "Coexistence rules", §14.1-14.2): each mode's table
applies only to it, legacy's capacities are derived when unset, and what a mode cannot do is
refused with a hint."""

from __future__ import annotations

import pytest

from hpc_cli.errors import ConfigError
from hpc_cli.settings import load_settings


def write(tmp_path, text: str):
    p = tmp_path / "p.toml"
    p.write_text(text)
    return p


def test_legacy_derives_its_catalog_from_the_engine():
    r = load_settings(None, {"cache.mode": "legacy", "engine.max_concurrency": 3, "engine.prefill_chunk": 4096,
                             "cache.host_cache_mib": 1024}, environ={})
    e = r.effective
    assert (e["cache.legacy.device_state_slots"], e["cache.legacy.host_state_slots"], e["cache.legacy.host_kv_mib"]) \
        == (4, 12, 1024)
    assert (e["cache.legacy.max_private_continuations"], e["cache.legacy.max_shared_prefixes"]) == (6, 3)
    assert e["cache.legacy.long_anchor_spacing"] == 8192 and r.source("cache.legacy.long_anchor_spacing") == "derived"
    assert "cache.hybrid.max_new_taps" not in e


@pytest.mark.parametrize("text,match", [
    ("[cache]\nmode = 'hybrid'\n[cache.legacy]\nmax_shared_prefixes = 2\n",
     r"\[cache.legacy\] options are set but cache.mode is 'hybrid' \(max_shared_prefixes apply only to cache mode 'legacy'\)"),
    ("[cache]\nmode = 'legacy'\n[cache.hybrid]\nmax_new_taps = 2\n",
     r"\[cache.hybrid\] options are set but cache.mode is 'legacy'"),
    ("[cache]\nmode = 'off'\n[cache.legacy]\nlong_anchor_spacing = 128\n", r"cache.mode is 'off'"),
    ("[cache]\nmode = 'legacy'\nno_prefix_reuse = true\n", "no_prefix_reuse"),
    ("[cache]\nmode = 'legacy'\n[speculative]\nbackend = 'mtp'\n", "without a speculative backend"),
    ("[cache]\nmode = 'legacy'\nhost_cache_mib = 0\n[cache.legacy]\nhost_state_slots = 4\n", "holds no KV"),
    ("[cache]\nmode = 'legacy'\n[cache.legacy]\nmax_long_anchors = 2\n", "unknown key cache.legacy.max_long_anchors"),
])
def test_options_outside_their_mode_are_refused(tmp_path, text, match):
    with pytest.raises(ConfigError, match=match):
        load_settings(write(tmp_path, text), environ={})


def test_a_mode_option_at_the_top_of_cache_names_its_mode(tmp_path):
    with pytest.raises(ConfigError) as exc:
        load_settings(write(tmp_path, "[cache]\nmax_private_continuations = 4\n"), environ={})
    assert "unknown key cache.max_private_continuations" in exc.value.message
    assert "[cache.legacy]" in exc.value.hint and "cache.mode = 'legacy'" in exc.value.hint


def test_prefix_cache_file_needs_a_mode_that_keeps_one(tmp_path):
    with pytest.raises(ConfigError, match="cache.mode is 'legacy', which keeps no prefix cache file"):
        load_settings(None, {"cache.mode": "legacy", "cache.prefix_cache_file": str(tmp_path / "p.bin")}, environ={})


def test_shared_tier_is_refused_outside_hybrid():
    from hpc_cli.settings import CacheSettings

    if "shared_cache" not in CacheSettings.model_fields:
        pytest.skip("no shared cache tier in this build")
    with pytest.raises(ConfigError, match=r"cache.shared_cache (does not apply to|is set but) cache.mode is 'legacy'|"
                                          r"cache.shared_cache does not apply to cache mode 'legacy'"):
        load_settings(None, {"cache.mode": "legacy", "cache.shared_cache": "redis://127.0.0.1:6379/0"}, environ={})
