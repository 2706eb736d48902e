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

import functools
import importlib.util
import logging
from enum import Enum
from typing import Callable

import torch
from torch import nn

from hpc_cli.model.layers import Linear
from hpc_cli.model.quant_weights import (NVFP4_GROUP, QuantScheme, StoredFP8, StoredNVFP4, StoredQuantized,
                                         WeightFormat, dequantize_fp8, dequantize_nvfp4)
from hpc_kernels.split_sums import SplitSums


log = logging.getLogger(__name__)


class Residency(str, Enum):
    """How a quantized checkpoint's Linear weights are held once loaded."""

    DEQUANTIZED = "dequantized"  # in the model dtype (dequantised on load)
    QUANTIZED = "quantized"  # as stored, multiplied in place


class WeightsChoice(str, Enum):
    """``[model] quantized_weights``: how a quantized checkpoint's Linear weights are held on CUDA.

    ``auto`` holds FP8 weights as stored wherever the kernels take them: measured on an H200 at
    the 27B widths (``benchmarks/model_throughput.py``, docs/quantized-weights.md) the held FP8
    model prefills at 1.07x and decodes at 1.02-1.05x the bf16 one, in half the weight memory.
    NVFP4 weights it dequantises on load when they fit the device (held, that model prefills at
    0.82x and decodes at 0.26-0.33x) and holds them only when they would not fit. ``held`` holds
    them as stored wherever the kernels take the format; ``dequantized`` never does."""

    AUTO = "auto"
    HELD = "held"
    DEQUANTIZED = "dequantized"


def kernels_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def supports(scheme: QuantScheme) -> bool:
    """Whether the in-place kernels take this scheme's layout."""
    if scheme.format is WeightFormat.FP8:
        return scheme.block is not None and scheme.block[1] >= 16 and scheme.block[1] & (scheme.block[1] - 1) == 0
    if scheme.format is WeightFormat.NVFP4:
        return scheme.group_size == NVFP4_GROUP
    return False


def residency(scheme: QuantScheme, device: torch.device | str, dtype: torch.dtype = torch.bfloat16) -> Residency:
    """Quantized on CUDA when the kernels take the scheme (and pass their check on this device,
    :func:`kernels_check`); dequantised otherwise (the CPU)."""
    dev = torch.device(device)
    if (scheme.quantized and dev.type == "cuda" and supports(scheme) and kernels_available()
            and kernels_check(scheme.format, dev, dtype)):
        return Residency.QUANTIZED
    return Residency.DEQUANTIZED


def keep_quantized(choice: "Residency | WeightsChoice | None", scheme: QuantScheme, holdable: Callable[[], bool],
                   fits_dequantized: Callable[[], bool]) -> bool:
    """Whether a checkpoint of ``scheme`` keeps its Linear weights as stored. ``choice``: the
    user's :class:`WeightsChoice` (None: ``auto``), or a :class:`Residency` that forces one
    (``Residency.QUANTIZED`` holds them even where only the reference path runs them, as tests
    do). ``holdable()``: whether the kernels can hold them on this device (:func:`residency`,
    which compiles and checks them: asked only when the answer matters); ``fits_dequantized()``:
    whether the dequantised weights fit the device (``auto`` asks it first for NVFP4)."""
    if not scheme.quantized or choice in (Residency.DEQUANTIZED, WeightsChoice.DEQUANTIZED):
        return False
    if choice is Residency.QUANTIZED:
        return True
    if choice is WeightsChoice.HELD:
        if holdable():
            return True
        log.warning("model.quantized_weights = 'held', but %s weights cannot be held as stored here: "
                    "they are dequantised on load", scheme.describe())
        return False
    if scheme.format is WeightFormat.FP8:  # held: as fast as bf16 or faster, in half the memory
        return holdable()
    if fits_dequantized():
        log.info("%s weights are dequantised on load (they fit; model.quantized_weights = 'held' keeps "
                 "them as stored where the kernels run, in less memory but slower)", scheme.describe())
        return False
    if not holdable():
        return False
    log.info("%s Linear weights are held as stored: dequantised they would not fit", scheme.describe())
    return True


@functools.cache
def kernels_check(fmt: WeightFormat, device: torch.device, dtype: torch.dtype) -> bool:
    """Compile the format's kernel for both tiles on ``device`` and compare a small product with
    the dequantised reference. A kernel that does not build or disagrees leaves the weights
    dequantised on load (a warning says so) rather than failing or serving wrong numbers."""
    from hpc_cli.model.quant_weights import quantize_fp8, quantize_nvfp4

    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 256, generator=g)
    try:
        from hpc_kernels.quant_gemm import DECODE_ROWS, TILES, fp8_decode_tile

        if fmt is WeightFormat.FP8:
            q, s = quantize_fp8(w, (128, 128))
            held: QuantizedWeight = FP8Weight(StoredFP8(q, s, (128, 128)), device)
        else:
            p, sc, glob = quantize_nvfp4(w)
            held = NVFP4Weight(StoredNVFP4(p, sc, float(1.0 / glob), NVFP4_GROUP), device)
        for rows in (3, 40):  # the decode tile and the prefill tile
            x = torch.randn(rows, 256, generator=g).to(device=device, dtype=dtype)
            ref = x.float() @ held.dequantized(torch.float32).T
            err = float((held.matmul(x).float() - ref).abs().max())
            # an FP8 pass on the FP8 matrix units rounds its rows to e4m3: 2-3%
            tensor_cores = (rows > DECODE_ROWS or bool(TILES["fp8"].get("scaled_mm"))
                            or bool(fp8_decode_tile(dtype, (128, 128), device).get("e4m3")))
            tol = 5e-2 if fmt is WeightFormat.FP8 and tensor_cores else 2e-2
            if not err <= tol * float(ref.abs().max()):
                raise ValueError(f"{rows} rows: max error {err:.3g} against {float(ref.abs().max()):.3g}")
    except Exception as exc:  # any failure to build or to agree: keep the dequantised path
        log.warning("the %s weight kernel failed its check on %s (%s): weights are dequantised on load",
                    fmt.value, device, exc)
        return False
    return True


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

    def matmul(self, x: torch.Tensor, unsummed: bool = False) -> "torch.Tensor | SplitSums":
        """``x @ W^T``; ``unsummed``: where a decode-sized pass splits K, its :class:`SplitSums`
        (for a kernel that adds them as it reads them)."""
        raise NotImplementedError

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def nbytes(self) -> int:
        """The stored codes and scales (a derived copy such as FP8's cuBLAS scale layout, 4 bytes a
        128 x 128 block, is not counted: it is not part of what the checkpoint stores)."""
        return sum(b.numel() * b.element_size() for b in self.state_dict().values())

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
        mm_scales = None  # the scales as cuBLAS's FP8 product reads them (prefill passes)
        if self.weight.is_cuda and self.block == (128, 128):
            from hpc_kernels.quant_gemm import scales_for_mm

            mm_scales = scales_for_mm(self.scale)
        self.register_buffer("mm_scales", mm_scales, persistent=False)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_fp8(self.weight, self.scale, self.block, dtype)

    def matmul(self, x: torch.Tensor, unsummed: bool = False) -> "torch.Tensor | SplitSums":
        if x.device.type != "cuda":
            return self._reference(x)
        from hpc_kernels.quant_gemm import fp8_linear

        return fp8_linear(x, self.weight, self.scale, self.block, self.mm_scales, unsummed)


class NVFP4Weight(QuantizedWeight):
    def __init__(self, stored: StoredNVFP4, device: torch.device | str) -> None:
        super().__init__()
        self.group, self.factor = stored.group, stored.factor
        self.register_buffer("packed", stored.packed.to(device).contiguous())
        self.register_buffer("scale", stored.scale.to(device).contiguous())
        self.out_features, self.in_features = self.packed.shape[0], 2 * self.packed.shape[1]

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_nvfp4(self.packed, self.scale, self.factor, self.group, dtype)

    def matmul(self, x: torch.Tensor, unsummed: bool = False) -> "torch.Tensor | SplitSums":
        if x.device.type != "cuda":
            return self._reference(x)
        from hpc_kernels.quant_gemm import nvfp4_linear

        return nvfp4_linear(x, self.packed, self.scale, self.factor, self.group, unsummed)


def held_linears(model: nn.Module, names: frozenset[str]) -> dict[str, Linear]:
    """The Linear layers (by weight name) of ``model`` whose weights ``names`` holds: those that
    keep a quantized checkpoint's weight as stored. The vision tower is not among them."""
    return {f"{n}.weight": m for n, m in model.named_modules()
            if isinstance(m, Linear) and f"{n}.weight" in names and not n.startswith("vision.")}


def quantized_weight(stored: StoredQuantized, device: torch.device | str) -> QuantizedWeight:
    if isinstance(stored, StoredFP8):
        return FP8Weight(stored, device)
    return NVFP4Weight(stored, device)
