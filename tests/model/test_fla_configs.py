"""The shipped fla launch configurations: fla's file layout, one directory per GPU model, and
pinned only where the user left fla's own settings alone."""

from __future__ import annotations

import json

import pytest

from hpc_cli.model import fla_configs


def test_shipped_configurations_have_flas_layout():
    dirs = [d for d in fla_configs.HERE.iterdir() if d.is_dir()]
    assert fla_configs.gpu_dir("NVIDIA H200") in dirs
    for d in dirs:
        files = list(d.glob("*.json"))
        assert files, f"{d} holds no configuration"
        for f in files:
            doc = json.loads(f.read_text())
            assert doc["kernel_name"] == f.stem
            for entry in doc["autotune_entries"].values():
                cfg = entry["config"]
                assert isinstance(entry["autotune_key"], list) and cfg["num_warps"] in (1, 2, 4, 8, 16, 32)
                assert isinstance(cfg["kwargs"], dict) and cfg["num_stages"] >= 1


def test_gpu_dir_sanitises_like_fla():
    assert fla_configs.gpu_dir("NVIDIA H200").name == "NVIDIA_H200"
    assert fla_configs.gpu_dir("NVIDIA GeForce RTX 5090").name == "NVIDIA_GeForce_RTX_5090"


@pytest.mark.parametrize("var", ["FLA_CACHE_MODE", "FLA_CONFIG_DIR"])
def test_a_users_setting_wins(monkeypatch, var):
    monkeypatch.setenv(var, "x")
    assert fla_configs.pin() is None


def test_l2norm_takes_one_configuration_for_every_pass_length():
    """fla tunes its q/k l2norm per row-count bucket (NB, 65,536 rows each), and the per-row
    reduction follows the configuration: passes in different buckets would normalise the same
    rows differently, and a tap would not equal a truncated call bit for bit. The shipped file
    gives every bucket up to 8 the same configuration."""
    for d in (d for d in fla_configs.HERE.iterdir() if d.is_dir()):
        f = d / "l2norm_fwd_kernel.json"
        if not f.exists():
            continue
        entries = json.loads(f.read_text())["autotune_entries"].values()
        by_width = {}
        for e in entries:
            by_width.setdefault(tuple(e["autotune_key"][:1] + e["autotune_key"][2:]), []).append(e)
        for width, group in by_width.items():
            assert sorted(e["autotune_key"][1] for e in group) == list(range(1, 9)), width
            assert len({json.dumps(e["config"], sort_keys=True) for e in group}) == 1, width
