"""A model's weights are measured before it is built and refused when they do not fit."""

from __future__ import annotations

import pytest
import torch

from hpc_cli.errors import CapacityError
from hpc_cli.model.builtin import builtin_config
from hpc_cli.model.footprint import check_fits, weight_footprint

GiB = 1 << 30


def test_footprint_counts_every_parameter_byte():
    from hpc_cli.model.model import HybridModel

    cfg = builtin_config("builtin:random")
    built = HybridModel(cfg, dtype=torch.float32, with_mtp=True)
    want = sum(p.numel() * p.element_size() for p in built.parameters())
    fp = weight_footprint(cfg, torch.float32)
    assert fp.total_bytes == fp.device_bytes == want
    assert weight_footprint(cfg, torch.bfloat16).total_bytes * 2 == want


def test_offloaded_experts_count_as_host_bytes():
    cfg = builtin_config("builtin:tiny-moe")
    all_device = weight_footprint(cfg, torch.float32)
    split = weight_footprint(cfg, torch.float32, offload_experts=True)
    assert split.total_bytes == all_device.total_bytes and split.host_bytes > split.device_bytes > 0


def test_too_big_is_refused_with_size_and_hint():
    name = "builtin:qwen3.5-27b-shape@4"
    cfg = builtin_config(name)
    with pytest.raises(CapacityError) as exc:
        check_fits(name, cfg, torch.float32, "cpu", available={"device": 0, "host": 8 * GiB})
    assert exc.value.message.startswith(f"{name} needs 16.7 GiB for its float32 weights, but only 8.0 GiB")
    assert "--dtype bfloat16" in exc.value.hint
    big = "builtin:qwen3.5-27b-shape@8"
    with pytest.raises(CapacityError) as exc:
        check_fits(big, builtin_config(big), torch.bfloat16, "cpu", available={"device": 0, "host": 8 * GiB})
    assert "@4" in exc.value.hint and "--dtype" not in exc.value.hint
    fp = check_fits(name, cfg, torch.bfloat16, "cpu", available={"device": 0, "host": 9 * GiB})
    assert 8 * GiB < fp.total_bytes < 9 * GiB


def test_loading_a_checkpoint_shows_progress(hf_dense, capsys):
    """Not on a terminal (here): a line when the load starts and one when it ends, on stderr."""
    from hpc_cli.model.loader import load_checkpoint

    _, path = hf_dense
    load_checkpoint(path, dtype=torch.float32, progress=True)
    err = capsys.readouterr().err
    assert f"hpc-cli: loading {path} (" in err and " tensors) ..." in err and ": done in " in err


def test_building_a_builtin_shows_progress(capsys):
    from hpc_cli.model.builtin import build_builtin

    build_builtin("builtin:random", progress=True)
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "hpc-cli: building builtin:random (0.02 GiB of float32 weights on cpu) ..."
    assert err[-1].startswith("hpc-cli: building builtin:random (0.02 GiB of float32 weights on cpu): done in ")


def test_a_seeded_builtin_with_another_vocabulary():
    """``build_builtin(vocab_size=N)``: the same seeded shape with N embedding and lm_head rows (a
    benchmark's), everything else as the named shape; the trained builtin:tiny refuses."""
    import pytest
    import torch

    from hpc_cli.model.builtin import build_builtin

    base, small = build_builtin("builtin:random"), build_builtin("builtin:random", vocab_size=64)
    assert small.config.vocab_size == 64 and small.lm_head.weight.shape[0] == 64
    assert {k: v for k, v in small.config.to_dict().items() if k != "vocab_size"} == \
        {k: v for k, v in base.config.to_dict().items() if k != "vocab_size"}
    logits = small.prefill(list(range(1, 40)), 0, list(range(2)), 0, small.new_kv_storage("bf16", 2),
                           small.new_state_slots(1)).logits
    assert logits.shape[-1] == 64 and torch.isfinite(logits).all()
    with pytest.raises(AssertionError):
        build_builtin("builtin:tiny", vocab_size=64)


def test_a_checkpoint_too_big_is_refused_before_loading(hf_dense, monkeypatch):
    from hpc_cli.model import footprint, loader

    _, path = hf_dense
    monkeypatch.setattr(footprint, "host_available_bytes", lambda: 1024)
    with pytest.raises(CapacityError, match=f"{path} needs .* GiB for its float32 weights"):
        loader.load_checkpoint(path, dtype=torch.float32, progress=False)


def test_a_quantized_checkpoint_counts_its_dequantised_weights(hf_dense, tmp_path):
    """Stored bytes are the file's tensors; resident bytes are what the loaded model holds (weights
    are dequantised on load), the same as the unquantized checkpoint's."""
    import json

    from click.testing import CliRunner
    from safetensors.torch import load_file

    from hpc_cli.cli import cli
    from hpc_cli.model import HybridModel
    from hpc_cli.model.footprint import checkpoint_weights

    _, path = hf_dense
    out = tmp_path / "fp8"
    res = CliRunner().invoke(cli, ["quantize", str(path), str(out), "--format", "fp8", "--block-size", "32"])
    assert res.exit_code == 0, res.output
    fp8 = checkpoint_weights(out, torch.float32)
    plain = checkpoint_weights(path, torch.float32)
    on_disk = sum(t.numel() * t.element_size() for t in load_file(str(out / "model.safetensors")).values())
    model = HybridModel.from_name_or_path(str(out), dtype=torch.float32, progress=False)
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    assert (fp8.format, fp8.stored_bytes, fp8.resident_bytes, fp8.dequantized_on_load) == ("fp8", on_disk, held, True)
    assert fp8.resident_bytes == plain.resident_bytes and fp8.stored_bytes < plain.stored_bytes
    assert (plain.format, plain.dequantized_on_load) == ("unquantized", False)

    res = CliRunner().invoke(cli, ["kv", "table", "--model", str(out), "--dtype", "float32", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["weights"] == {
        "format": "fp8", "description": "fp8 e4m3, 32x32 blocks", "stored_bytes": on_disk, "resident_bytes": held,
        "resident_dtype": "float32", "dequantized_on_load": True, "device": "cpu", "held_quantized": False}
    text = CliRunner().invoke(cli, ["kv", "table", "--model", str(out)]).output
    assert "weights on disk: fp8 e4m3, 32x32 blocks" in text and "(dequantised on load)" in text
