"""Quantized checkpoints read by the loader (hpc_cli.model.quant_weights): block FP8 in transformers'
FineGrainedFP8 layout written here block by block, NVFP4 in the compressed-tensors and modelopt
layouts, the quantizers' per-element error, and every error a damaged checkpoint gives."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from hpc_cli.errors import ModelError
from hpc_cli.model import HybridModel
from hpc_cli.model.quant_weights import (E2M1_MAX, FP8_MAX, NVFP4_GROUP, dequantize_fp8, dequantize_nvfp4,
                                         pack_e2m1, quantize_fp8, quantize_nvfp4, unpack_e2m1)

from .helpers import F32, rel_err

TOKENS = torch.randint(0, 300, (150,), generator=torch.Generator().manual_seed(3))
# e4m3 keeps 3 mantissa bits: each weight moves by up to 1/16 of itself, ~2-3 % RMS; through the
# whole tiny model the logits move by 2.3-2.4e-2 (measured: dense blocks 32 and 48, UE8M0 scales,
# MoE per-expert and fused); ignoring the scales moves them by 1.4, scales applied to the wrong
# blocks (their order reversed) by 0.15 (measured).
FP8_LOGIT_BOUND = 4e-2
LINEAR = re.compile(r"(self_attn\.[qkvo]_proj|linear_attn\.(in_proj_qkv|in_proj_z|out_proj)|mlp\.(shared_expert\.)?"
                    r"(gate|up|down)_proj|mlp\.experts\.\d+\.(gate|up|down)_proj)\.weight$"
                    r"|mlp\.experts\.(gate_up|down)_proj$")


def _logits(path: Path) -> torch.Tensor:
    model = HybridModel.from_name_or_path(str(path), dtype=torch.float32, progress=False)
    return model.forward_tokens(TOKENS, kv_profile=F32)


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _write(dst: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dst / "model.safetensors"))
    return dst


def _fp8_blockwise(w: torch.Tensor, b: int, ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """FineGrainedFP8's layout, one block at a time: scale_inv = amax / 448 (rounded up to a power
    of two for UE8M0 scales), weight = w / scale_inv."""
    rows, cols = w.shape[-2:]
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    s = torch.empty(w.shape[:-2] + (math.ceil(rows / b), math.ceil(cols / b)), dtype=torch.float32)
    for i in range(s.shape[-2]):
        for j in range(s.shape[-1]):
            blk = w[..., i * b:(i + 1) * b, j * b:(j + 1) * b].float()
            amax = blk.abs().amax(dim=(-2, -1), keepdim=True).clamp(min=1e-12)
            scale = 2.0 ** torch.ceil(torch.log2(amax / FP8_MAX)) if ue8m0 else amax / FP8_MAX
            s[..., i, j] = scale[..., 0, 0]
            q[..., i * b:(i + 1) * b, j * b:(j + 1) * b] = (blk / scale).to(torch.float8_e4m3fn)
    return q, (s.to(torch.float8_e8m0fnu) if ue8m0 else s)


def write_fp8_checkpoint(src: Path, dst: Path, block: int, ue8m0: bool = False, **qc_extra) -> Path:
    """``src`` in the layout transformers' FineGrainedFP8 and Qwen's -FP8 releases use."""
    tensors, kept = {}, []
    for k, v in _tensors(src).items():
        if LINEAR.search(k):
            tensors[k], tensors[k + "_scale_inv"] = _fp8_blockwise(v, block, ue8m0)
        else:
            tensors[k] = v
            if v.dim() >= 2:
                kept.append(k.removesuffix(".weight"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [block, block],
                                  "activation_scheme": "dynamic", "modules_to_not_convert": kept, **qc_extra}
    return _write(dst, cfg, tensors)


@pytest.mark.parametrize("block", [32, 48])  # 48: partial blocks at the edges of every matrix
def test_fp8_checkpoint_logits_within_fp8_error(hf_dense, tmp_path, block):
    _, path = hf_dense
    fp8 = write_fp8_checkpoint(path, tmp_path / "fp8", block)
    stored = _tensors(fp8)
    assert stored["model.layers.1.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert stored["model.embed_tokens.weight"].dtype == torch.float32
    err = rel_err(_logits(fp8), _logits(path))
    assert 1e-4 < err <= FP8_LOGIT_BOUND, f"fp8 (block {block}) logits differ from the fp32 model's by {err:.2e}"


def test_fp8_checkpoint_with_ue8m0_scales(hf_dense, tmp_path):
    _, path = hf_dense
    fp8 = write_fp8_checkpoint(path, tmp_path / "fp8", 32, ue8m0=True, scale_fmt="ue8m0")
    assert _tensors(fp8)["model.layers.1.self_attn.q_proj.weight_scale_inv"].dtype == torch.float8_e8m0fnu
    err = rel_err(_logits(fp8), _logits(path))
    assert 1e-4 < err <= FP8_LOGIT_BOUND, f"fp8 with UE8M0 scales: logits differ by {err:.2e}"


@pytest.mark.parametrize("fused", [False, True])
def test_fp8_moe_checkpoint_per_expert_and_fused(hf_moe, tmp_path, fused):
    from .helpers import rewrite_checkpoint

    _, path = hf_moe
    src = rewrite_checkpoint(path, tmp_path / "fused", fuse_experts=True) if fused else path
    fp8 = write_fp8_checkpoint(src, tmp_path / "fp8", 32)
    names = _tensors(fp8)
    assert ("model.layers.0.mlp.experts.gate_up_proj_scale_inv" in names) == fused
    err = rel_err(_logits(fp8), _logits(path))
    assert 1e-4 < err <= FP8_LOGIT_BOUND, f"fp8 MoE logits (fused={fused}) differ by {err:.2e}"


def test_fp8_dequantised_weights_are_within_half_an_e4m3_step():
    w = torch.randn(96, 160, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.01, 3, 160)
    q, s = quantize_fp8(w, (32, 64))
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 3)
    got = dequantize_fp8(q, s, (32, 64), torch.float32)
    scale = s.repeat_interleave(32, 0)[:96].repeat_interleave(64, 1)[:, :160]
    # e4m3: 3 mantissa bits (half a step is 1/16 of the value), subnormal step 2^-9 of the scale
    bound = torch.maximum(w.abs() / 16, scale * 2.0 ** -10) * (1 + 1e-6)
    assert ((got - w).abs() <= bound).all()
    block = w[32:64, 64:128]
    assert torch.isclose(s[1, 1], block.abs().max() / FP8_MAX)


def test_e2m1_pack_round_trip_and_nibble_order():
    values = torch.tensor([[0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0, 0.0]])
    packed = pack_e2m1(values)
    assert packed.dtype == torch.uint8 and packed.shape == (1, 8)
    assert packed[0, 0].item() == 0x10  # 0.0 in the low nibble, 0.5 (code 1) in the high one
    assert packed[0, 4].item() == (0x9 | (0xA << 4))  # -0.5 is code 9, -1.0 code 10
    assert torch.equal(unpack_e2m1(packed), values)
    assert torch.equal(unpack_e2m1(pack_e2m1(torch.tensor([[0.2, 0.3, 2.4, 2.6, 5.1, 4.9, 7.0, -0.74]]))),
                       torch.tensor([[0.0, 0.5, 2.0, 3.0, 6.0, 4.0, 6.0, -0.5]]))


def test_nvfp4_dequantised_weights_are_within_one_group_step():
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(1)) * torch.linspace(0.01, 2, 96)
    packed, scale, glob = quantize_nvfp4(w)
    assert packed.shape == (64, 48) and scale.shape == (64, 96 // NVFP4_GROUP) and glob.shape == (1,)
    assert scale.dtype == torch.float8_e4m3fn and glob.dtype == torch.float32
    assert torch.isclose(scale.float().max(), torch.tensor(FP8_MAX))  # the largest group uses the whole e4m3 range
    got = dequantize_nvfp4(packed, scale, 1.0 / glob, NVFP4_GROUP, torch.float32)
    amax = w.unflatten(-1, (-1, NVFP4_GROUP)).abs().amax(-1, keepdim=True)
    # the widest e2m1 gap (4 -> 6) is a third of a group's range, plus e4m3 rounding of its scale
    err = (got - w).unflatten(-1, (-1, NVFP4_GROUP)).abs()
    assert (err <= amax / E2M1_MAX * (1 + 2.0 ** -4) + 1e-7).all()


# ---------------------------------------------------------------------------------------- errors
def _fp8(hf_dense, tmp_path) -> Path:
    _, path = hf_dense
    return write_fp8_checkpoint(path, tmp_path / "fp8", 32)


def _damaged(src: Path, dst: Path, *, config=None, drop: str | None = None,
             replace: dict[str, torch.Tensor] | None = None) -> Path:
    cfg = json.loads((src / "config.json").read_text())
    if config is not None:
        config(cfg)
    tensors = _tensors(src)
    if drop:
        del tensors[drop]
    tensors.update(replace or {})
    return _write(dst, cfg, tensors)


def _load_error(path: Path) -> ModelError:
    with pytest.raises(ModelError) as info:
        HybridModel.from_name_or_path(str(path), dtype=torch.float32, progress=False)
    assert info.value.hint, "a ModelError carries a hint"
    return info.value


def test_unknown_quant_method_is_refused(hf_dense, tmp_path):
    path = _damaged(_fp8(hf_dense, tmp_path), tmp_path / "awq",
                    config=lambda c: c["quantization_config"].update(quant_method="awq"))
    err = _load_error(path)
    assert "quant_method 'awq' is not supported" in err.message and "'fp8'" in err.hint


@pytest.mark.parametrize("qc,message", [
    ({"quant_method": "compressed-tensors", "format": "pack-quantized"},
     "compressed-tensors format ['pack-quantized'] is not supported"),
    ({"quant_method": "modelopt", "quant_algo": "FP8"}, "modelopt quant_algo 'FP8' is not supported"),
])
def test_other_compressed_tensors_and_modelopt_formats_are_refused(hf_dense, tmp_path, qc, message):
    path = _damaged(_fp8(hf_dense, tmp_path), tmp_path / "other", config=lambda c: c.update(quantization_config=qc))
    assert message in _load_error(path).message


def test_unsupported_fp8_fmt_is_refused(hf_dense, tmp_path):
    path = _damaged(_fp8(hf_dense, tmp_path), tmp_path / "e5m2",
                    config=lambda c: c["quantization_config"].update(fmt="e5m2"))
    assert "fp8 fmt 'e5m2' is not supported" in _load_error(path).message


def test_bad_block_size_is_refused(hf_dense, tmp_path):
    path = _damaged(_fp8(hf_dense, tmp_path), tmp_path / "block",
                    config=lambda c: c["quantization_config"].update(weight_block_size=[128]))
    assert "weight_block_size [128]" in _load_error(path).message


def test_missing_scale_names_the_weight(hf_dense, tmp_path):
    name = "model.layers.1.self_attn.o_proj.weight"
    path = _damaged(_fp8(hf_dense, tmp_path), tmp_path / "noscale", drop=name + "_scale_inv")
    msg = _load_error(path).message
    assert msg.startswith(f"tensor {name} (model.safetensors) is stored as F8_E4M3")
    assert f"{name}_scale_inv is missing" in msg


def test_misshaped_scale_names_the_scale(hf_dense, tmp_path):
    name = "model.layers.0.mlp.down_proj.weight"  # [64, 96]: blocks of 32 need a [2, 3] scale
    src = _fp8(hf_dense, tmp_path)
    path = _damaged(src, tmp_path / "shape", replace={name + "_scale_inv": torch.ones(2, 2)})
    msg = _load_error(path).message
    assert f"tensor {name}_scale_inv (model.safetensors) has shape (2, 2)" in msg and "needs (2, 3)" in msg


def test_integer_scale_is_refused(hf_dense, tmp_path):
    name = "model.layers.0.mlp.up_proj.weight_scale_inv"  # [96, 64] in blocks of 32: [3, 2]
    path = _damaged(_fp8(hf_dense, tmp_path), tmp_path / "int", replace={name: torch.ones(3, 2, dtype=torch.int32)})
    assert _load_error(path).message.startswith(f"tensor {name} (model.safetensors) is stored as I32; fp8 scales")


def test_fp8_weights_without_quantization_config_are_refused(hf_dense, tmp_path):
    path = _damaged(_fp8(hf_dense, tmp_path), tmp_path / "nocfg", config=lambda c: c.pop("quantization_config"))
    err = _load_error(path)
    assert "is stored as F8_E4M3 but config.json has no quantization_config" in err.message


def test_fp8_experts_offloaded_to_host_read_as_on_the_device(hf_moe, tmp_path):
    """Per-expert FP8 tensors are dequantised into the host expert arrays as they are read."""
    _, path = hf_moe
    fp8 = write_fp8_checkpoint(path, tmp_path / "fp8", 32)
    on_device = HybridModel.from_name_or_path(str(fp8), dtype=torch.float32, progress=False)
    offloaded = HybridModel.from_name_or_path(str(fp8), dtype=torch.float32, progress=False, offload_experts=True)
    a = dict(on_device.named_parameters())["layers.0.mlp.experts.down_proj"]
    b = dict(offloaded.named_parameters())["layers.0.mlp.experts.down_proj"]
    assert torch.equal(a.cpu(), b.cpu())
    err = rel_err(offloaded.forward_tokens(TOKENS, kv_profile=F32), on_device.forward_tokens(TOKENS, kv_profile=F32))
    assert err < 1e-5, f"offloaded fp8 experts give logits {err:.2e} away"
