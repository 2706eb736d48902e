"""Write a quantized copy of a bf16/fp32 Qwen3.5 checkpoint (``hpc-cli quantize``).

FP8 is written in transformers' FineGrainedFP8 layout (``X.weight`` float8_e4m3fn plus float32
``X.weight_scale_inv`` per block, ``quant_method: "fp8"``), NVFP4 in compressed-tensors'
``nvfp4-pack-quantized`` layout (weights only). Quantized: the Linear weights of attention
(``q/k/v/o_proj``), the Gated DeltaNet projections (``in_proj_qkv``, ``in_proj_z``, ``out_proj``)
and the MLPs and experts, when their dims divide into whole blocks (FP8) or groups (NVFP4).
Everything else (embeddings, lm_head, norms, conv1d, ``in_proj_a``/``in_proj_b``, the router
``mlp.gate``, ``shared_expert_gate``, the vision tower) is copied as stored and its matrices are
listed in ``modules_to_not_convert`` (``ignore`` for NVFP4).

Shards keep their file names and are written one at a time; the index, config.json (with the
``quantization_config``) and every other file of the directory (tokenizer, generation config,
chat template) come along. :mod:`hpc_cli.model.quant_weights` reads the result.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from hpc_cli.errors import ModelError
from hpc_cli.model.quant_weights import (CT_NVFP4_FORMAT, NVFP4_GROUP, WeightFormat, module_of, quantize_fp8,
                                         quantize_nvfp4)

_LINEAR = re.compile(r"(self_attn\.[qkvo]_proj|linear_attn\.(in_proj_qkv|in_proj_z|out_proj)"
                     r"|mlp\.(gate_proj|up_proj|down_proj)|mlp\.shared_expert\.(gate_proj|up_proj|down_proj)"
                     r"|mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj))\.weight$")
_FUSED_EXPERTS = re.compile(r"mlp\.experts\.(gate_up_proj|down_proj)$")
_VISUAL = re.compile(r"^(.*?visual|.*?vision_tower)\.")
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
_WEIGHT_FILES = ("model.safetensors.index.json", "config.json")


@dataclass(frozen=True, slots=True)
class QuantizeResult:
    quantized: int  # tensors written quantized
    kept: int  # tensors copied as stored
    bytes_in: int  # tensor bytes read
    bytes_out: int  # tensor bytes written (scales included)
    not_convert: tuple[str, ...]


def quantizable(key: str, tensor: torch.Tensor, fmt: WeightFormat, block: int) -> bool:
    """Whether ``hpc-cli quantize`` writes this checkpoint tensor quantized."""
    if _VISUAL.match(key):
        return False
    if fmt is WeightFormat.FP8:
        linear = (_LINEAR.search(key) is not None and tensor.dim() == 2) or \
            (_FUSED_EXPERTS.search(key) is not None and tensor.dim() == 3)
        return linear and tensor.shape[-1] % block == 0 and tensor.shape[-2] % block == 0
    assert fmt is WeightFormat.NVFP4, f"no quantizer for {fmt}"
    return _LINEAR.search(key) is not None and tensor.dim() == 2 and tensor.shape[-1] % NVFP4_GROUP == 0


def check_output_dir(src: Path, out: Path, force: bool) -> None:
    if out.resolve() == src.resolve():
        raise ModelError(f"{out}: the output directory is the checkpoint itself",
                         hint="name a new directory for the quantized checkpoint")
    if out.exists() and not out.is_dir():
        raise ModelError(f"{out} exists and is not a directory", hint="name a new directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ModelError(f"{out} is not empty", hint="name a new or empty directory, or pass --force to write into it")


def quantize_checkpoint(src: str | Path, out: str | Path, fmt: WeightFormat, *, block: int = 128,
                        force: bool = False, progress: bool = True) -> QuantizeResult:
    from safetensors import safe_open
    from safetensors.torch import save_file

    from hpc_cli import progress as steps
    from hpc_cli.model.config import ModelConfig
    from hpc_cli.model.loader import shard_files

    src, out = Path(src), Path(out)
    ModelConfig.from_dir(src)  # a Qwen3.5 checkpoint, or a clear error
    raw = json.loads((src / "config.json").read_text())
    if raw.get("quantization_config") is not None:
        raise ModelError(f"{src}: config.json already has a quantization_config "
                         f"({raw['quantization_config'].get('quant_method')!r})",
                         hint="quantize the bf16 (or fp32) checkpoint")
    if fmt is WeightFormat.FP8 and block <= 0:
        raise ModelError(f"block size {block} is not positive", hint="Qwen's -FP8 checkpoints use 128")
    files = shard_files(src)
    check_output_dir(src, out, force)
    out.mkdir(parents=True, exist_ok=True)
    for stale in list(out.glob("*.safetensors")) + [out / "model.safetensors.index.json"]:
        if stale.is_file():
            stale.unlink()  # --force: no shard of an earlier run may stay beside the new ones

    counts = {"quantized": 0, "kept": 0, "in": 0, "out": 0}
    not_convert: list[str] = []
    weight_map: dict[str, str] = {}
    total = 0
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            total += len(list(h.keys()))
    with steps.step(f"quantizing {src} to {fmt.value} ({total} tensors)", total, enabled=progress) as advance:
        for f in files:
            written: dict[str, torch.Tensor] = {}
            with safe_open(str(f), framework="pt") as h:
                for key in h.keys():
                    t = h.get_tensor(key)
                    counts["in"] += t.numel() * t.element_size()
                    if t.is_floating_point() and t.dtype not in _FLOATS:
                        raise ModelError(f"tensor {key} ({f.name}) is stored as {t.dtype}",
                                         hint="quantize a bf16, fp16 or fp32 checkpoint")
                    parts = _quantize_one(key, t, fmt, block) if quantizable(key, t, fmt, block) else None
                    if parts is None:
                        parts = {key: t}
                        counts["kept"] += 1
                        if t.dim() >= 2:
                            _note_kept(key, not_convert)
                    else:
                        counts["quantized"] += 1
                    for k, v in parts.items():
                        written[k] = v.contiguous()
                        weight_map[k] = f.name
                        counts["out"] += v.numel() * v.element_size()
                    advance(1)
            save_file(written, str(out / f.name), metadata={"format": "pt"})
            del written
    if (src / "model.safetensors.index.json").is_file():
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": counts["out"]}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    raw["quantization_config"] = quantization_config(fmt, block, not_convert)
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    for other in sorted(src.iterdir()):
        if other.is_file() and other.suffix != ".safetensors" and other.name not in _WEIGHT_FILES:
            shutil.copy2(other, out / other.name)
    return QuantizeResult(counts["quantized"], counts["kept"], counts["in"], counts["out"], tuple(not_convert))


def _quantize_one(key: str, t: torch.Tensor, fmt: WeightFormat, block: int) -> dict[str, torch.Tensor]:
    if fmt is WeightFormat.FP8:
        q, scale_inv = quantize_fp8(t, (block, block))
        return {key: q, key + "_scale_inv": scale_inv}
    packed, scale, global_scale = quantize_nvfp4(t, NVFP4_GROUP)
    base = key[:-len(".weight")]
    return {base + ".weight_packed": packed, base + ".weight_scale": scale, base + ".weight_global_scale": global_scale}


def _note_kept(key: str, not_convert: list[str]) -> None:
    visual = _VISUAL.match(key)
    module = visual.group(1) if visual else module_of(key)
    if module not in not_convert:
        not_convert.append(module)


def quantization_config(fmt: WeightFormat, block: int, not_convert: list[str]) -> dict:
    """The ``quantization_config`` written into config.json (what transformers / compressed-tensors write)."""
    if fmt is WeightFormat.FP8:
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [block, block], "modules_to_not_convert": list(not_convert)}
    weights = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": NVFP4_GROUP,
               "symmetric": True, "dynamic": False, "observer": "minmax"}
    return {"quant_method": "compressed-tensors", "format": CT_NVFP4_FORMAT, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None, "format": CT_NVFP4_FORMAT}},
            "ignore": list(not_convert)}
