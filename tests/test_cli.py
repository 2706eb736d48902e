"""The CLI as users meet it: kv table numbers (spec §3.1), config show, errors without tracebacks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from hpc_cli.cli import cli

SPEC_27B = {  # spec §3.1: per token/head B, per token KiB, per page MiB
    "bf16": (1024, "64.0", "4.00"), "int8-g64": (528, "33.0", "2.06"), "fp8-e4m3fn-row256": (516, "32.3", "2.02"),
    "k8v4": (402, "25.1", "1.57"), "nvfp4-g16": (288, "18.0", "1.13"),
}
SPEC_35B = {
    "bf16": (1024, "20.0", "1.25"), "int8-g64": (528, "10.3", "0.64"), "fp8-e4m3fn-row256": (516, "10.1", "0.63"),
    "k8v4": (402, "7.9", "0.49"), "nvfp4-g16": (288, "5.6", "0.35"),
}


def run(*args, env=None):
    return CliRunner().invoke(cli, list(args), env=env)


@pytest.mark.parametrize("model,expected", [("qwen3.5-27b", SPEC_27B), ("qwen3.5-35b-a3b", SPEC_35B)])
def test_kv_table_reproduces_spec_3_1(model, expected):
    res = run("kv", "table", "--model", model, "--json")
    assert res.exit_code == 0, res.output
    rows = {r["profile"]: r for r in json.loads(res.output)["rows"]}
    for name, (b, kib, mib) in expected.items():
        assert (rows[name]["bytes_per_token_head"], rows[name]["kib_per_token"], rows[name]["mib_per_page"]) \
            == (b, kib, mib), name
    res = run("kv", "table", "--model", model)
    for name, (b, kib, mib) in expected.items():
        assert f"{kib} KiB" in res.output and f"{mib} MiB" in res.output and f"{b} B" in res.output


def test_kv_table_takes_the_builtin_models_serve_takes():
    """`hpc-cli serve` serves builtin:tiny by default; kv table reads the same names (the embedded
    model with its weights, a seeded one by its shape) and names them when one is unknown."""
    tiny = json.loads(run("kv", "table", "--model", "builtin:tiny", "--json", "--device", "cpu").output)
    assert tiny["attention_layers"] == 2 and tiny["weights"]["format"] == "unquantized"
    assert tiny["weights"]["stored_bytes"] > 0
    # held as serve holds it on the CPU (model.dtype = auto: float32), twice its bf16 bytes on disk
    assert tiny["weights"]["resident_dtype"] == "float32"
    assert tiny["weights"]["resident_bytes"] == 2 * tiny["weights"]["stored_bytes"]
    shape = json.loads(run("kv", "table", "--model", "builtin:qwen3.5-27b-shape@8", "--json").output)
    full = json.loads(run("kv", "table", "--model", "qwen3.5-27b", "--json").output)
    assert shape["rows"][0]["bytes_per_token_head"] == full["rows"][0]["bytes_per_token_head"]
    assert shape["attention_layers"] == 2 and "weights" not in shape
    res = run("kv", "table", "--model", "builtin:nosuch")
    assert res.exit_code != 0 and "builtin:tiny" in res.output and "Traceback" not in res.output


def test_kv_table_mtp_adds_one_layer_of_pages():
    rows = {r["profile"]: r for r in json.loads(run("kv", "table", "--json").output)["rows"]}
    assert rows["bf16"]["mib_per_page_with_mtp"] == "4.25"  # 17/16 of 4.00 MiB


def test_kv_profiles_lists_layouts():
    data = json.loads(run("kv", "profiles", "--json").output)
    assert {d["name"]: d["bytes_per_token_head"] for d in data} == {
        "bf16": 1024, "int8-g64": 528, "fp8-e4m3fn-row256": 516, "nvfp4-g16": 288, "k8v4": 402}


def test_config_show_sources_for_int8_mtp():
    res = run("config", "show", "--profile", "int8-mtp.toml", "--sources", "--json",
              env={"HPC_SERVER__PORT": "8123"})
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["values"]["kv.profile"] == "int8-g64" and data["sources"]["kv.profile"] == "profile"
    assert data["values"]["server.port"] == 8123 and data["sources"]["server.port"] == "env"
    assert data["values"]["cache.hybrid.device_snapshot_slots"] == 5
    assert data["sources"]["cache.hybrid.device_snapshot_slots"] == "derived"
    assert data["values"]["cache.hybrid.tap_min_gap_tokens"] == 2048
    res = run("config", "show", "--profile", "int8-mtp.toml", "--sources")
    assert "derived" in res.output and "HPC_KV__PROFILE" in res.output


def test_config_validate_ok_and_bad(tmp_path):
    res = run("config", "validate", "default.toml")
    assert res.exit_code == 0 and res.output.startswith("ok:")
    bad = tmp_path / "bad.toml"
    bad.write_text("[kv]\nprofile = 'int9'\n")
    res = run("config", "validate", str(bad))
    assert res.exit_code == 2
    assert "error: kv.profile = 'int9'" in res.output and "hint:" in res.output


def test_plugins_hook_filter_and_unknown_hook():
    res = run("plugins", "--json", "--hook", "hpc_register_cache_modes")
    assert [p["name"] for p in json.loads(res.output)] == ["hpc_plugins.cache_modes"]
    res = run("plugins", "--hook", "nope")
    assert res.exit_code == 2 and "unknown hook 'nope'" in res.output


@pytest.mark.parametrize("text", ["[cache\n", "[cache]\nhost_cache_mib = 'x'\n", "[kv]\nprofile = 'q'\n",
                                  "[cache]\nno_prefix_reuse = true\nhost_cache_mib = 5\n", "[bogus]\na = 1\n"])
def test_real_process_prints_one_clear_error_without_traceback(tmp_path, text):
    p = tmp_path / "p.toml"
    p.write_text(text)
    proc = subprocess.run([sys.executable, "-m", "hpc_cli", "config", "validate", str(p)],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ") and "\nhint: " in proc.stderr
    assert "Traceback" not in proc.stderr
