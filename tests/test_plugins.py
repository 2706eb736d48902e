"""The plugin host: built-ins, registries, duplicate and unknown names, third-party packages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import hpc_cli
from hpc_cli import plugins
from hpc_cli.errors import PluginError
from hpc_cli.kv_profile import KVProfile, PlaneSpec, RecordLayout

ROOT = Path(__file__).resolve().parents[1]


def test_builtins_register_everything():
    regs = plugins.registries()
    assert regs.kv_profiles.names() == ["bf16", "int8-g64", "fp8-e4m3fn-row256", "nvfp4-g16", "k8v4"]
    assert regs.spec_backends.names() == ["none", "mtp", "dflash", "dflash2"]
    assert regs.cache_modes.names() == ["hybrid", "legacy", "off"]
    assert regs.kv_profiles.entry("int8").plugin == "hpc_plugins.kv_profiles"


@pytest.mark.parametrize("alias,name", [("int8", "int8-g64"), ("fp8", "fp8-e4m3fn-row256"),
                                        ("nvfp4", "nvfp4-g16"), ("bf16", "bf16"), ("k8v4", "k8v4")])
def test_aliases(alias, name):
    assert plugins.registries().kv_profiles.canonical(alias) == name


def test_unknown_name_lists_registered_names_and_plugins():
    with pytest.raises(PluginError) as exc:
        plugins.kv_profile("int9")
    msg = str(exc.value)
    assert "int9" in msg and "bf16 (hpc_plugins.kv_profiles)" in msg and "k8v4" in msg
    assert "kv.profile" in exc.value.hint


class _Dup(KVProfile):
    name = "bf16"

    def layout(self, head_dim):
        return RecordLayout(head_dim, (PlaneSpec("k_data", "k", 1), PlaneSpec("v_data", "v", 1)))


class _DupPlugin:
    @hpc_cli.hookimpl
    def hpc_register_kv_profiles(self, register):
        register(_Dup())


def test_duplicate_name_names_both_plugins():
    pm = plugins.get_plugin_manager()
    pm.register(_DupPlugin(), name="dup-plugin")
    with pytest.raises(PluginError) as exc:
        plugins.registries()
    assert "hpc_plugins.kv_profiles" in str(exc.value) and "dup-plugin" in str(exc.value)


class _Misspelt:
    @hpc_cli.hookimpl
    def hpc_register_kv_profile(self, register):  # missing "s": not a hook
        pass


def test_check_pending_catches_misspelt_hooks():
    import pluggy

    pm = plugins.get_plugin_manager()
    pm.register(_Misspelt(), name="misspelt")
    with pytest.raises(pluggy.PluginValidationError):
        pm.check_pending()


def test_plugin_info_reports_hooks_and_versions():
    info = {p["name"]: p for p in plugins.plugin_info()}
    kv = info["hpc_plugins.kv_profiles"]
    assert kv["builtin"] and kv["version"] == hpc_cli.__version__
    assert kv["hooks"] == ["hpc_register_kv_profiles"]
    assert info["hpc_plugins.cache_modes"]["registers"]["cache_modes"] == ["hybrid", "legacy", "off"]


def test_unknown_load_plugins_name_is_an_error(monkeypatch):
    monkeypatch.setenv("HPC_LOAD_PLUGINS", "not-installed")
    with pytest.raises(PluginError, match="not-installed"):
        plugins.get_plugin_manager()


@pytest.fixture(scope="module")
def example_site(tmp_path_factory):
    """examples/hpc-kv-example installed into a private folder, as `pip install` would."""
    target = tmp_path_factory.mktemp("site")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                           "--no-index", "--target", str(target), str(ROOT / "examples" / "hpc-kv-example")],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.fail(f"installing the example plugin failed: {proc.stderr[-2000:]}")
    return target


def _cli(args, site, **env):
    e = {k: v for k, v in os.environ.items() if not k.startswith("HPC_")}
    e["PYTHONPATH"] = os.pathsep.join([str(site), e.get("PYTHONPATH", "")])
    e.update(env)
    return subprocess.run([sys.executable, "-m", "hpc_cli", *args], capture_output=True, text=True, env=e)


def test_third_party_plugin_appears_after_install(example_site):
    proc = _cli(["plugins", "--json"], example_site)
    assert proc.returncode == 0, proc.stderr
    info = {p["name"]: p for p in json.loads(proc.stdout)}
    assert info["kv_example"]["registers"] == {"kv_profiles": ["fp16"]}
    assert info["kv_example"]["version"] == "0.1.0"
    assert not info["kv_example"]["builtin"]
    assert "hpc_register_commands" in info["kv_example"]["hooks"]
    proc = _cli(["fp16-info", "--head-dim", "128"], example_site)
    assert proc.returncode == 0 and "512 B per token per KV head" in proc.stdout
    proc = _cli(["config", "show", "--json"], example_site, HPC_KV__PROFILE="half")
    assert json.loads(proc.stdout)["values"]["kv.profile"] == "fp16"


def test_load_plugins_excludes_the_example(example_site):
    proc = _cli(["plugins", "--json"], example_site, HPC_LOAD_PLUGINS="")
    assert "kv_example" not in {p["name"] for p in json.loads(proc.stdout)}
    proc = _cli(["config", "show"], example_site, HPC_LOAD_PLUGINS="", HPC_KV__PROFILE="fp16")
    assert proc.returncode == 2 and "unknown KV profile 'fp16'" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.fixture(scope="module")
def cache_example_site(tmp_path_factory):
    """examples/hpc-cache-example installed into a private folder, as `pip install` would."""
    target = tmp_path_factory.mktemp("cache-site")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                           "--no-index", "--target", str(target), str(ROOT / "examples" / "hpc-cache-example")],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.fail(f"installing the example cache mode failed: {proc.stderr[-2000:]}")
    return target


def test_third_party_cache_mode_appears_after_install(cache_example_site):
    proc = _cli(["plugins", "--json"], cache_example_site)
    assert proc.returncode == 0, proc.stderr
    info = {p["name"]: p for p in json.loads(proc.stdout)}
    assert info["cache_example"]["registers"] == {"cache_modes": ["system-prompt"]}
    proc = _cli(["config", "show", "--json"], cache_example_site, HPC_CACHE__MODE="system-prompt")
    values = json.loads(proc.stdout)["values"]
    assert values["cache.mode"] == "system-prompt" and values["cache.system-prompt.min_tokens"] == 64


def test_third_party_cache_mode_serves_with_cache_mode_flag(cache_example_site, monkeypatch):
    """`hpc-cli serve --cache-mode system-prompt` selects the installed mode; the engine it
    builds resumes a second request at the end of the shared system block."""
    import importlib

    from click.testing import CliRunner

    from hpc_cli.cli import cli, serve_cmd
    from hpc_cli.engine.api import GenerationRequest, SamplingParams, TapHint
    from hpc_cli.engine.engine import Engine

    monkeypatch.syspath_prepend(str(cache_example_site))
    importlib.invalidate_caches()
    plugins.reset()
    seen = {}

    def run_server(resolved, log_level="info"):
        engine = Engine.from_settings(resolved).start()
        sp = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        system = list(range(1, 151))
        try:
            seen["fins"] = [engine.submit(GenerationRequest(system + [200 + i] * 30, sp, tap_hints=[TapHint(150, 3)]))
                            .result(60)[1] for i in range(2)]
        finally:
            engine.stop()
        seen["mode"] = engine.cache.mode

    monkeypatch.setattr(serve_cmd, "run_server", run_server)
    res = CliRunner().invoke(cli, ["serve", "--cache-mode", "system-prompt", "--kv-capacity", "16",
                                   "--max-concurrency", "1", "--host-cache-mib", "0"])
    assert res.exit_code == 0, res.output
    assert seen["mode"] == "system-prompt"
    assert [f.usage.reuse_tokens for f in seen["fins"]] == [0, 150]
