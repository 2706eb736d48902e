"""Linear weights kept quantized in memory (FP8 blocks, NVFP4), multiplied in place.

On CUDA a quantized checkpoint's Linear weights stay as stored: :class:`QuantizedWeight` holds
the codes and scales as buffers, and ``Linear`` calls :meth:`QuantizedWeight.matmul`, which runs
the Triton kernels of ``hpc_kernels.quant_gemm`` (the weight is read in place, never dequantised
into a copy). Elsewhere the reference path dequantises the weight for the one product (CPU
serving dequantises on load instead; the reference exists for tests and for devices without the
kernels). Norms, embeddings, ``lm_head``, gates, convolutions, routed experts and the vision
tower load as the checkpoint stores them or dequantised, as before (docs/quantized-weights.md).
"""

from __future__ import annotations

import importlib.util
from enum import Enum

import torch
from torch import nn

from hpc_cli.model.layers import Linear
from hpc_cli.model.quant_weights import (NVFP4_GROUP, QuantScheme, StoredFP8, StoredNVFP4, StoredQuantized,
                                         WeightFormat, dequantize_fp8, dequantize_nvfp4)


class Residency(str, Enum):
    """How a quantized checkpoint's Linear weights are held once loaded."""

    DEQUANTIZED = "dequantized"  # in the model dtype (dequantised on load)
    QUANTIZED = "quantized"  # as stored, multiplied in place


def kernels_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def supports(scheme: QuantScheme) -> bool:
    """Whether the in-place kernels take this scheme's layout."""
    if scheme.format is WeightFormat.FP8:
        return scheme.block is not None and scheme.block[1] >= 16 and scheme.block[1] & (scheme.block[1] - 1) == 0
    if scheme.format is WeightFormat.NVFP4:
        return scheme.group_size == NVFP4_GROUP
    return False


def residency(scheme: QuantScheme, device: torch.device | str) -> Residency:
    """Quantized on CUDA when the kernels take the scheme; dequantised otherwise (the CPU)."""
    if (scheme.quantized and torch.device(device).type == "cuda" and supports(scheme)
            and kernels_available()):
        return Residency.QUANTIZED
    return Residency.DEQUANTIZED


def resident_bytes(scheme: QuantScheme, out_features: int, in_features: int) -> int:
    """The bytes a ``[out, in]`` weight holds when kept quantized in ``scheme``."""
    if scheme.format is WeightFormat.FP8:
        assert scheme.block is not None, "fp8 weights kept quantized have block scales"
        b0, b1 = scheme.block
        return out_features * in_features + 4 * (-(-out_features // b0)) * (-(-in_features // b1))
    assert scheme.format is WeightFormat.NVFP4, f"no resident size for {scheme.format}"
    return out_features * in_features // 2 + out_features * in_features // scheme.group_size


class QuantizedWeight(nn.Module):
    """A ``[out, in]`` weight as stored; :meth:`matmul` is ``x @ W^T``."""

    out_features: int
    in_features: int

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.dequantized(x.dtype))


class FP8Weight(QuantizedWeight):
    def __init__(self, stored: StoredFP8, device: torch.device | str) -> None:
        super().__init__()
        assert stored.block is not None, "fp8 weights kept quantized have block scales"
        self.block = stored.block
        self.register_buffer("weight", stored.weight.to(device).contiguous())
        self.register_buffer("scale", stored.scale.to(device=device, dtype=torch.float32).contiguous())
        self.out_features, self.in_features = self.weight.shape

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_fp8(self.weight, self.scale, self.block, dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cuda":
            return self._reference(x)
        from hpc_kernels.quant_gemm import fp8_linear

        return fp8_linear(x, self.weight, self.scale, self.block)


class NVFP4Weight(QuantizedWeight):
    def __init__(self, stored: StoredNVFP4, device: torch.device | str) -> None:
        super().__init__()
        self.group, self.factor = stored.group, stored.factor
        self.register_buffer("packed", stored.packed.to(device).contiguous())
        self.register_buffer("scale", stored.scale.to(device).contiguous())
        self.out_features, self.in_features = self.packed.shape[0], 2 * self.packed.shape[1]

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_nvfp4(self.packed, self.scale, self.factor, self.group, dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cuda":
            return self._reference(x)
        from hpc_kernels.quant_gemm import nvfp4_linear

        return nvfp4_linear(x, self.packed, self.scale, self.factor, self.group)


def held_linears(model: nn.Module, names: frozenset[str]) -> dict[str, Linear]:
    """The Linear layers (by weight name) of ``model`` whose weights ``names`` holds: those that
    keep a quantized checkpoint's weight as stored. The vision tower is not among them."""
    return {f"{n}.weight": m for n, m in model.named_modules()
            if isinstance(m, Linear) and f"{n}.weight" in names and not n.startswith("vision.")}


def quantized_weight(stored: StoredQuantized, device: torch.device | str) -> QuantizedWeight:
    if isinstance(stored, StoredFP8):
        return FP8Weight(stored, device)
    return NVFP4Weight(stored, device)
