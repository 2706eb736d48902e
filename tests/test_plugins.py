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
    assert regs.cache_modes.names() == ["hybrid", "off"]
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
    assert info["hpc_plugins.cache_modes"]["registers"]["cache_modes"] == ["hybrid", "off"]


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
