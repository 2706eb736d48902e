"""Settings: each precedence layer, derived values (spec §14.2) and each rejected combination."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpc_cli.errors import ConfigError, PluginError
from hpc_cli.settings import env_var, load_settings, resolve_profile_path, shipped_profiles


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "p.toml"
    p.write_text(text)
    return p


def test_defaults_and_derived_values_with_host_tier():
    r = load_settings(None, environ={})
    assert r.settings.cache.host_cache_mib == 8192 and r.source("cache.host_cache_mib") == "default"
    c, chunk = r.settings.engine.max_concurrency, r.settings.engine.prefill_chunk
    assert r.effective["cache.hybrid.device_snapshot_slots"] == c + 1
    assert r.effective["cache.hybrid.max_new_taps"] == 8
    assert r.effective["cache.hybrid.tap_ladder_tokens"] == max(4096, 2 * chunk)
    assert r.effective["cache.hybrid.tap_min_gap_tokens"] == max(1024, chunk)
    assert r.source("cache.hybrid.max_new_taps") == "derived"


def test_derived_values_without_host_tier_and_big_chunk(tmp_path):
    p = write(tmp_path, "[engine]\nmax_concurrency = 3\nprefill_chunk = 4096\n[cache]\nhost_cache_mib = 0\n")
    r = load_settings(p, environ={})
    assert r.effective["cache.hybrid.device_snapshot_slots"] == 5
    assert r.effective["cache.hybrid.max_new_taps"] == 2
    assert r.effective["cache.hybrid.tap_ladder_tokens"] == 8192
    assert r.effective["cache.hybrid.tap_min_gap_tokens"] == 4096


def test_explicit_option_beats_derivation(tmp_path):
    p = write(tmp_path, "[cache.hybrid]\nmax_new_taps = 3\n")
    r = load_settings(p, environ={})
    assert r.effective["cache.hybrid.max_new_taps"] == 3 and r.source("cache.hybrid.max_new_taps") == "profile"


def test_precedence_cli_over_env_over_profile_over_default(tmp_path):
    p = write(tmp_path, "[server]\nport = 9001\nhost = '127.0.0.2'\n[engine]\nprefill_chunk = 256\n")
    env = {"HPC_SERVER__PORT": "9002", "HPC_ENGINE__PREFILL_CHUNK": "128"}
    r = load_settings(p, {"server.port": 9003, "engine.prefill_chunk": None}, environ=env)
    assert (r.settings.server.port, r.source("server.port")) == (9003, "cli")
    # a flag left unset (None) never masks a lower layer
    assert (r.settings.engine.prefill_chunk, r.source("engine.prefill_chunk")) == (128, "env")
    assert (r.settings.server.host, r.source("server.host")) == ("127.0.0.2", "profile")
    assert (r.settings.tui.refresh_hz, r.source("tui.refresh_hz")) == (4.0, "default")


def test_env_nested_mode_options():
    r = load_settings(None, environ={"HPC_CACHE__HYBRID__MAX_NEW_TAPS": "5"})
    assert r.effective["cache.hybrid.max_new_taps"] == 5 and r.source("cache.hybrid.max_new_taps") == "env"


def test_every_shipped_profile_loads():
    names = shipped_profiles()
    assert {"default.toml", "int8-mtp.toml", "no-reuse.toml", "device-only.toml"} <= set(names)
    for name in names:
        r = load_settings(name, environ={})
        assert r.profile_path is not None
    r = load_settings("int8-mtp.toml", environ={})
    assert (r.settings.kv.profile, r.settings.speculative.backend) == ("int8-g64", "mtp")


def test_profile_path_resolution_prefers_existing_path(tmp_path, monkeypatch):
    (tmp_path / "int8.toml").write_text("[kv]\nprofile = 'bf16'\n")
    monkeypatch.chdir(tmp_path)
    assert resolve_profile_path("int8.toml") == (tmp_path / "int8.toml").resolve()
    monkeypatch.chdir("/")
    assert resolve_profile_path("int8").name == "int8.toml"
    with pytest.raises(ConfigError, match="not found"):
        resolve_profile_path("nope.toml")


def test_aliases_resolve_to_canonical_names():
    r = load_settings(None, environ={"HPC_KV__PROFILE": "nvfp4"})
    assert r.settings.kv.profile == "nvfp4-g16"


@pytest.mark.parametrize("text,needle,hint", [
    ("[cache]\nhost_cache_mib = \n", "invalid TOML", "syntax"),
    ("[cache]\nhostcache_mib = 5\n", "unknown key cache.hostcache_mib", "did you mean cache.host_cache_mib?"),
    ("[caches]\nmode = 'off'\n", "unknown key caches", "did you mean cache?"),
    ("[cache]\nhost_cache_mib = 'lots'\n", "cache.host_cache_mib = 'lots'", None),
    ("[engine]\nmax_concurrency = 9\n", "engine.max_concurrency", None),
    ("[cache.hybrid]\nmax_new_tap = 1\n", "unknown key cache.hybrid.max_new_tap", "max_new_taps"),
    ("[cache.hybird]\nmax_new_taps = 1\n", "unknown key cache.hybird", "cache.hybrid"),
])
def test_bad_profiles_name_the_key(tmp_path, text, needle, hint):
    with pytest.raises(ConfigError) as exc:
        load_settings(write(tmp_path, text), environ={})
    assert needle in exc.value.message
    if hint:
        assert hint in exc.value.hint


def test_wrong_type_names_env_var(tmp_path):
    with pytest.raises(ConfigError) as exc:
        load_settings(write(tmp_path, "[server]\nport = 'x'\n"), environ={})
    assert env_var("server.port") in exc.value.message and "profile" in exc.value.message


def test_bad_env_value_names_the_variable():
    with pytest.raises(ConfigError, match="HPC_CACHE__HOST_CACHE_MIB"):
        load_settings(None, environ={"HPC_CACHE__HOST_CACHE_MIB": "abc"})
    with pytest.raises(ConfigError, match="HPC_NOPE"):
        load_settings(None, environ={"HPC_NOPE": "1"})


@pytest.mark.parametrize("key,value,registry", [("kv.profile", "int9", "KV profile"),
                                                ("speculative.backend", "eagle", "speculative backend"),
                                                ("cache.mode", "legacyy", "cache mode")])
def test_unknown_plugin_names(key, value, registry):
    with pytest.raises(ConfigError) as exc:
        load_settings(None, {key: value}, environ={})
    assert f"unknown {registry} {value!r}" in exc.value.message and "registered:" in exc.value.message
    assert key in exc.value.hint


def test_mode_options_rejected_in_another_mode(tmp_path):
    with pytest.raises(ConfigError, match=r"\[cache.hybrid\] options are set but cache.mode is 'off'"):
        load_settings(write(tmp_path, "[cache]\nmode = 'off'\n[cache.hybrid]\nmax_new_taps = 1\n"), environ={})


@pytest.mark.parametrize("extra", ["prefix_cache_file = '{tmp}/x.bin'", "host_cache_mib = 100",
                                   "mode = 'hybrid'\n[cache.hybrid]\nmax_new_taps = 2"])
def test_no_prefix_reuse_rejects_cache_options(tmp_path, extra):
    text = "[cache]\nno_prefix_reuse = true\n" + extra.format(tmp=tmp_path) + "\n"
    with pytest.raises(ConfigError, match="no_prefix_reuse"):
        load_settings(write(tmp_path, text), environ={})


def test_no_prefix_reuse_alone_is_fine():
    r = load_settings("no-reuse.toml", environ={})
    assert r.settings.cache.no_prefix_reuse


def test_prefix_cache_file_rules(tmp_path):
    ok = load_settings(None, {"cache.prefix_cache_file": str(tmp_path / "p.bin")}, environ={})
    assert ok.settings.cache.prefix_cache_file == tmp_path / "p.bin"
    with pytest.raises(ConfigError, match="is a directory"):
        load_settings(None, {"cache.prefix_cache_file": str(tmp_path)}, environ={})
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(None, {"cache.prefix_cache_file": str(tmp_path / "no" / "p.bin")}, environ={})
    with pytest.raises(ConfigError, match="host_cache_mib is 0"):
        load_settings(None, {"cache.prefix_cache_file": str(tmp_path / "p.bin"), "cache.host_cache_mib": 0},
                      environ={})
    with pytest.raises(ConfigError, match="cache.mode is 'off'"):
        load_settings(None, {"cache.prefix_cache_file": str(tmp_path / "p.bin"), "cache.mode": "off"},
                      environ={})


def test_relative_prefix_cache_file_becomes_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = load_settings(None, {"cache.prefix_cache_file": "p.bin"}, environ={})
    assert r.settings.cache.prefix_cache_file == tmp_path / "p.bin"


def test_api_key_is_masked_in_effective_values():
    r = load_settings(None, {"server.api_key": "s3cret"}, environ={})
    assert r.effective["server.api_key"] == "***"
    assert r.settings.server.api_key.get_secret_value() == "s3cret"


def test_plugin_error_type_for_unknown_names_is_config_error():
    # A user setting a wrong name in a profile gets a ConfigError naming the key, not a bare PluginError.
    with pytest.raises(ConfigError):
        load_settings(None, {"kv.profile": "x"}, environ={})
    assert issubclass(ConfigError, Exception) and not issubclass(PluginError, ConfigError)


def test_debug_timing_from_env_and_serve_flag(monkeypatch):
    assert load_settings(None, environ={}).settings.server.debug_timing is False
    r = load_settings(None, environ={"HPC_SERVER__DEBUG_TIMING": "true"})
    assert r.settings.server.debug_timing is True and r.source("server.debug_timing") == "env"
    from click.testing import CliRunner

    from hpc_cli.cli import cli, serve_cmd

    seen = []
    monkeypatch.setattr(serve_cmd, "run_server", lambda resolved, log_level="info": seen.append(resolved))
    for args, want in ((["--debug-timing"], True), ([], False)):
        res = CliRunner().invoke(cli, ["serve", *args], env={"HPC_SERVER__DEBUG_TIMING": None})
        assert res.exit_code == 0, res.output
        assert seen[-1].settings.server.debug_timing is want
    assert seen[0].source("server.debug_timing") == "cli"


def test_process_switches_pass_the_environment_check_and_typos_do_not():
    """The variables the project itself reads outside the settings (documented switches, another
    command's key) never stop `hpc-cli serve`; an HPC_* name that is neither refuses, naming the
    closest known one."""
    from hpc_cli.settings.sections import PROCESS_ENV

    resolved = load_settings(environ={**{name: "0" for name in PROCESS_ENV}, "HPC_ENGINE__SEED": "5"})
    assert resolved.settings.engine.seed == 5
    with pytest.raises(ConfigError, match=r"HPC_FUSED_KERNEL\b.*did you mean HPC_FUSED_KERNELS"):
        load_settings(environ={"HPC_FUSED_KERNEL": "0"})
    with pytest.raises(ConfigError, match=r"HPC_ENGNE__SEED \(did you mean HPC_ENGINE__SEED\?\)"):
        load_settings(environ={"HPC_ENGNE__SEED": "1"})
    with pytest.raises(ConfigError, match="unknown environment variable HPC_NOSUCH"):
        load_settings(environ={"HPC_NOSUCH": "1"})


def test_every_variable_the_source_reads_is_a_key_or_a_process_switch():
    """Scans the packages (hpc_cli, hpc_kernels, the built-in plugins) for HPC_* names in string literals: each is a settings key's variable
    (HPC_<SECTION>__<KEY>) or listed in PROCESS_ENV (which docs/configuration.md shows), so no
    switch the code reads makes the server refuse to start."""
    import re

    from hpc_cli.settings.sections import PROCESS_ENV, SECTIONS

    root = Path(__file__).resolve().parents[1]
    found = set()
    for pkg in ("hpc_cli", "hpc_kernels", "plugins"):
        for path in (root / pkg).rglob("*.py"):
            found |= set(re.findall(r"[\"'](HPC_[A-Z0-9_]+)[\"']", path.read_text()))
    assert {"HPC_FUSED_KERNELS", "HPC_TRANSFER_COPY", "HPC_BENCH_API_KEY"} <= found  # the scan sees them
    keys = {n for n in found if "__" in n and n[4:].split("__")[0].lower() in SECTIONS}
    assert found - keys <= set(PROCESS_ENV), sorted(found - keys - set(PROCESS_ENV))
