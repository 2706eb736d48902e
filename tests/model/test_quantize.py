"""`hpc-cli quantize` (hpc_cli.model.quantize): its FP8 and NVFP4 output loads within each
format's error of the bf16 model, in the layouts the loader and transformers read; what it
leaves unquantized; OUT handling."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from hpc_cli.cli import cli

from .helpers import rewrite_checkpoint
from .test_quant_weights import FP8_LOGIT_BOUND, TOKENS, _load_error, _logits, _tensors, _write

# e2m1 keeps 1 mantissa bit: the widest step is a third of a group's range, ~10 % RMS per weight;
# the tiny model's logits move by 8.6e-2 (dense) and 8.0e-2 (MoE) (measured).
NVFP4_LOGIT_BOUND = 0.12
NOT_CONVERTED = ("model.embed_tokens", "lm_head", "model.layers.0.linear_attn.in_proj_a",
                 "model.layers.0.linear_attn.in_proj_b", "model.layers.0.linear_attn.conv1d")


def quantize(src: Path, out: Path, fmt: str, *extra: str):
    return CliRunner().invoke(cli, ["quantize", str(src), str(out), "--format", fmt, "--block-size", "32", *extra])


def test_fp8_output_is_transformers_layout_and_loads_within_fp8_error(hf_dense, tmp_path):
    _, path = hf_dense
    src = rewrite_checkpoint(path, tmp_path / "src")  # with a tokenizer file beside the weights
    (src / "tokenizer_config.json").write_text('{"model_max_length": 4096}')
    res = quantize(src, tmp_path / "fp8", "fp8", "--json")
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    out = tmp_path / "fp8"
    assert "quantizing" in res.stderr  # progress on stderr, not in the JSON
    assert (out / "tokenizer_config.json").read_text() == '{"model_max_length": 4096}'
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert {k: qc[k] for k in ("quant_method", "fmt", "weight_block_size", "activation_scheme")} == \
        {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [32, 32], "activation_scheme": "dynamic"}
    assert set(NOT_CONVERTED) <= set(qc["modules_to_not_convert"])
    t = _tensors(out)
    w, s = t["model.layers.0.mlp.down_proj.weight"], t["model.layers.0.mlp.down_proj.weight_scale_inv"]
    assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and s.shape == (2, 3)  # [64, 96] / 32
    for module in NOT_CONVERTED:
        assert t[module + ".weight"].dtype == torch.float32 and module + ".weight_scale_inv" not in t
    assert summary["quantized_tensors"] == sum(k.endswith("_scale_inv") for k in t)
    err = torch.linalg.norm(_logits(out) - _logits(path)) / torch.linalg.norm(_logits(path))
    assert 1e-4 < err <= FP8_LOGIT_BOUND, f"quantize --format fp8 logits differ by {err:.2e}"


@pytest.mark.parametrize("which", ["dense", "moe"])
def test_nvfp4_output_loads_within_nvfp4_error(hf_dense, hf_moe, tmp_path, which):
    _, path = hf_dense if which == "dense" else hf_moe
    res = quantize(path, tmp_path / "nvfp4", "nvfp4")
    assert res.exit_code == 0, res.output
    out = tmp_path / "nvfp4"
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "nvfp4-pack-quantized"
    assert set(NOT_CONVERTED) <= set(qc["ignore"])
    t = _tensors(out)
    base = "model.layers.1.self_attn.o_proj"  # [64, 128]
    assert t[base + ".weight_packed"].shape == (64, 64) and t[base + ".weight_packed"].dtype == torch.uint8
    assert t[base + ".weight_scale"].shape == (64, 8) and t[base + ".weight_global_scale"].shape == (1,)
    assert base + ".weight" not in t
    ref = _logits(path)
    err = (torch.linalg.norm(_logits(out) - ref) / torch.linalg.norm(ref)).item()
    assert 1e-3 < err <= NVFP4_LOGIT_BOUND, f"quantize --format nvfp4 ({which}) logits differ by {err:.2e}"


def test_nvfp4_modelopt_layout_reads_as_compressed_tensors(hf_dense, tmp_path):
    _, path = hf_dense
    assert quantize(path, tmp_path / "ct", "nvfp4").exit_code == 0
    ct = tmp_path / "ct"
    tensors, ignore = {}, json.loads((ct / "config.json").read_text())["quantization_config"]["ignore"]
    for k, v in _tensors(ct).items():
        if k.endswith(".weight_packed"):
            tensors[k.removesuffix("_packed")] = v
        elif k.endswith(".weight_global_scale"):
            tensors[k.replace(".weight_global_scale", ".weight_scale_2")] = 1.0 / v  # modelopt multiplies
        else:
            tensors[k] = v
    cfg = json.loads((ct / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                                  "exclude_modules": ignore}
    mo = _write(tmp_path / "modelopt", cfg, tensors)
    a, b = _logits(mo), _logits(ct)
    assert (torch.linalg.norm(a - b) / torch.linalg.norm(b)).item() < 1e-6


def test_nvfp4_missing_global_scale_names_it(hf_dense, tmp_path):
    _, path = hf_dense
    assert quantize(path, tmp_path / "ct", "nvfp4").exit_code == 0
    name = "model.layers.2.linear_attn.out_proj.weight_global_scale"
    t = _tensors(tmp_path / "ct")
    del t[name]
    broken = _write(tmp_path / "broken", json.loads((tmp_path / "ct" / "config.json").read_text()), t)
    assert _load_error(broken).message.startswith(f"tensor {name} is missing")


def test_refuses_a_non_empty_out_unless_forced(hf_dense, tmp_path):
    _, path = hf_dense
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    res = quantize(path, out, "fp8")
    assert res.exit_code == 2 and f"error: {out} is not empty" in res.output and "--force" in res.output
    assert not (out / "model.safetensors").exists()
    res = quantize(path, out, "fp8", "--force")
    assert res.exit_code == 0, res.output
    assert (out / "notes.txt").read_text() == "mine" and (out / "model.safetensors").is_file()


def test_refuses_an_already_quantized_checkpoint(hf_dense, tmp_path):
    _, path = hf_dense
    assert quantize(path, tmp_path / "fp8", "fp8").exit_code == 0
    res = quantize(tmp_path / "fp8", tmp_path / "again", "nvfp4")
    assert res.exit_code == 2 and "already has a quantization_config ('fp8')" in res.output


def test_transformers_reads_the_fp8_output(hf_dense, tmp_path):
    """transformers' FineGrainedFP8 loader (dequantising on CPU) gives the logits ours gives."""
    pytest.importorskip("accelerate", reason="transformers' FP8 loader needs accelerate")
    from transformers import FineGrainedFP8Config, Qwen3_5ForCausalLM

    _, path = hf_dense
    assert quantize(path, tmp_path / "fp8", "fp8").exit_code == 0
    hf = Qwen3_5ForCausalLM.from_pretrained(tmp_path / "fp8", dtype=torch.float32,
                                            quantization_config=FineGrainedFP8Config(dequantize=True,
                                                                                     weight_block_size=[32, 32]))
    with torch.no_grad():
        theirs = hf(TOKENS[None]).logits[0]
    ours = _logits(tmp_path / "fp8")
    assert (torch.linalg.norm(ours - theirs) / torch.linalg.norm(theirs)).item() < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (transformers quantizes to FP8 on a GPU)")
def test_a_checkpoint_of_transformers_own_fp8_quantizer_loads_as_its_weights_say(hf_dense, tmp_path):
    """transformers' FineGrainedFP8 quantizer writes the checkpoint (it quantizes on a GPU only):
    its logits here are those of the same model with each weight dequantised by hand from the
    stored codes and ``weight_scale_inv`` blocks, dequantised on the CPU and held as stored on
    CUDA (the held product against the dequantised one). It quantizes more Linears than
    ``hpc-cli quantize`` (the GDN gates too) from a bf16 copy, so its distance to the fp32 model
    is larger than FP8_LOGIT_BOUND: 6.7e-2 (measured on an H200)."""
    pytest.importorskip("accelerate", reason="transformers' FP8 quantizer needs accelerate")
    from transformers import FineGrainedFP8Config, Qwen3_5ForCausalLM

    from .test_quant_linear import assert_held_agrees_on_cuda

    _, path = hf_dense
    hf = Qwen3_5ForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda",
                                            quantization_config=FineGrainedFP8Config(weight_block_size=[32, 32]))
    out = tmp_path / "transformers-fp8"
    hf.save_pretrained(out)
    config = json.loads((out / "config.json").read_text())
    assert config.pop("quantization_config")["quant_method"] == "fp8"
    stored = _tensors(out)
    by_hand = {}
    for name, t in stored.items():
        if name.endswith("_scale_inv"):
            continue
        s = stored.get(name + "_scale_inv")
        if s is None:
            by_hand[name] = t.float()
        else:  # each 32 x 32 block of codes times its scale
            n, k = t.shape
            by_hand[name] = t.float() * s.float().repeat_interleave(32, 0)[:n].repeat_interleave(32, 1)[:, :k]
    assert len(by_hand) < len(stored)
    expected = _logits(_write(tmp_path / "by-hand", config, by_hand))
    got = _logits(out)
    assert torch.linalg.norm(got - expected) / torch.linalg.norm(expected) <= 1e-5
    assert torch.linalg.norm(got - _logits(path)) / torch.linalg.norm(_logits(path)) <= 0.1
    assert_held_agrees_on_cuda(out)


def test_sharded_checkpoint_keeps_its_shards_and_index(hf_dense, tmp_path):
    _, path = hf_dense
    src = rewrite_checkpoint(path, tmp_path / "sharded", language_model=True, shards=3)
    res = quantize(src, tmp_path / "fp8", "fp8")
    assert res.exit_code == 0, res.output
    out = tmp_path / "fp8"
    assert sorted(f.name for f in out.glob("*.safetensors")) == sorted(f.name for f in src.glob("*.safetensors"))
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.language_model.layers.1.self_attn.q_proj.weight"
    assert weight_map[name + "_scale_inv"] == weight_map[name]  # a scale lives in its weight's shard
    assert set(weight_map) == set(_tensors(out))
    ref = _logits(path)
    err = (torch.linalg.norm(_logits(out) - ref) / torch.linalg.norm(ref)).item()
    assert 1e-4 < err <= FP8_LOGIT_BOUND, f"sharded fp8 logits differ by {err:.2e}"
