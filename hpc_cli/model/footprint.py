"""A model's weight bytes before it is built, against the memory that is free.

The model is constructed on PyTorch's ``meta`` device (shapes only, no memory) to count its
parameter bytes where they will live: on the device, or in host memory for routed experts with
``offload_experts``. :func:`check_fits` refuses a model that cannot fit, before any allocation,
with its size and what would make it fit.

A quantized checkpoint (FP8, NVFP4) keeps its Linear weights as stored on CUDA (counted at their
stored size: codes and scales) and is dequantised on load elsewhere (counted at the model dtype);
:func:`checkpoint_weights` puts that beside the bytes the checkpoint stores (``hpc-cli kv table
--model DIR``).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from hpc_cli.errors import CapacityError
from hpc_cli.model.config import ModelConfig
from hpc_cli.model.quant_weights import QuantScheme

GiB = 1 << 30


@dataclass(frozen=True, slots=True)
class Footprint:
    device_bytes: int  # parameters on the model's device
    host_bytes: int  # routed experts kept in host memory (offload_experts)

    @property
    def total_bytes(self) -> int:
        return self.device_bytes + self.host_bytes


@dataclass(frozen=True, slots=True)
class HeldQuantized:
    """Linear weights kept quantized once loaded: the scheme and the weights' names."""

    scheme: QuantScheme
    names: frozenset[str]


def weight_footprint(config: ModelConfig, dtype: torch.dtype, *, with_mtp: bool = True,
                     offload_experts: bool = False, held: HeldQuantized | None = None) -> Footprint:
    from hpc_cli.model.model import HybridModel
    from hpc_cli.model.quant_linear import held_linears, resident_bytes

    model = HybridModel(config, device="meta", dtype=dtype, with_mtp=with_mtp)
    quantized = held_linears(model, held.names) if held is not None else {}
    device = host = 0
    for name, p in model.named_parameters():
        n = p.numel() * p.element_size()
        if name in quantized:
            assert held is not None, "quantized weights come with their scheme"
            n = resident_bytes(held.scheme, *p.shape)
        routed = offload_experts and config.is_moe and name.startswith("layers.") and ".mlp.experts." in name
        if routed:
            host += n
        else:
            device += n
    return Footprint(device, host)


@dataclass(frozen=True, slots=True)
class CheckpointWeights:
    """A checkpoint directory's weights: as stored, and as held once loaded."""

    format: str  # "unquantized", "fp8", "nvfp4"
    description: str  # e.g. "fp8 e4m3, 128x128 blocks"
    stored_bytes: int  # tensor bytes in its safetensors files (scales included)
    resident_bytes: int  # the language model's parameters (and MTP's) once loaded on ``device``
    dtype: str
    dequantized_on_load: bool
    device: str = "cpu"  # where the weights are held ("cuda": a quantized format's Linear weights as stored)
    held_quantized: bool = False


def safetensors_bytes(files: list[Path]) -> tuple[int, list[str]]:
    """Tensor bytes and tensor names of safetensors files, from their headers (nothing is read)."""
    total, names = 0, []
    for f in files:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, info in header.items():
            if name != "__metadata__":
                start, end = info["data_offsets"]
                total += end - start
                names.append(name)
    return total, names


def checkpoint_weights(path: str | Path, dtype: torch.dtype, device: str = "cpu") -> CheckpointWeights:
    """``device``: where the weights would be held; on ``cuda`` a quantized checkpoint's Linear
    weights stay as stored (:mod:`hpc_cli.model.quant_linear`), elsewhere they are dequantised."""
    from hpc_cli.model.loader import our_name, raw_config, shard_files
    from hpc_cli.model.quant_linear import supports
    from hpc_cli.model.quant_weights import quantized_weight_names, scheme_from_config

    path = Path(path)
    config = ModelConfig.from_dir(path)
    scheme = scheme_from_config(raw_config(path), str(path))
    stored, names = safetensors_bytes(shard_files(path))
    with_mtp = any((our_name(n) or "").startswith("mtp.") for n in names)
    held = None
    if device == "cuda" and scheme.quantized and supports(scheme):
        ours = (our_name(n) for n in quantized_weight_names(scheme, names))
        held = HeldQuantized(scheme, frozenset(n for n in ours if n))
    resident = weight_footprint(config, dtype, with_mtp=with_mtp, held=held).total_bytes
    return CheckpointWeights(scheme.format.value, scheme.describe(), stored, resident,
                             str(dtype).replace("torch.", ""), scheme.quantized and held is None, device,
                             held is not None)


def host_available_bytes() -> int:
    """Memory a new allocation can take without swapping: MemAvailable on Linux, else free pages."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - no way to know: do not refuse
        return 1 << 62


def available_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return host_available_bytes()


def _gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB"


def fits_hint(name: str, dtype: torch.dtype, config: ModelConfig) -> str:
    ways = []
    if dtype == torch.float32:
        ways.append("--dtype bfloat16 halves it")
    if name.startswith("builtin:") and config.num_hidden_layers > 4:
        base = name.partition("@")[0]
        ways.append(f"fewer layers ({base}@4)")
    elif not name.startswith("builtin:"):
        ways.append("a machine with more memory, or --device cuda on a larger GPU")
    if config.is_moe:
        ways.append("[experts] offload = true keeps the routed experts in host memory")
    return "; ".join(ways) if ways else "free some memory or use a larger machine"


def check_fits(name: str, config: ModelConfig, dtype: torch.dtype, device: torch.device | str, *,
               with_mtp: bool = True, offload_experts: bool = False, held: HeldQuantized | None = None,
               available: dict[str, int] | None = None) -> Footprint:
    """Raise :class:`CapacityError` when the weights do not fit the free memory; return the
    footprint otherwise. ``available`` (``{"device": bytes, "host": bytes}``) overrides the
    measurement (tests)."""
    device = torch.device(device)
    if device.type == "meta":  # shapes only: nothing to fit, and nothing is built to count them
        return Footprint(0, 0)
    fp = weight_footprint(config, dtype, with_mtp=with_mtp, offload_experts=offload_experts, held=held)
    where = "cuda" if device.type == "cuda" else "cpu"
    if available is None:
        available = {"device": available_bytes(device), "host": host_available_bytes()}
    needs = {"device": fp.device_bytes, "host": fp.host_bytes} if where == "cuda" else \
        {"host": fp.total_bytes}
    dt = str(dtype).replace("torch.", "")
    if held is not None and held.names:
        dt = f"{held.scheme.describe()} Linear and {dt}"
    for pool, need in needs.items():
        have = available["device" if pool == "device" else "host"]
        if need > have:
            memory = f"free memory on {device}" if pool == "device" else "available host memory"
            raise CapacityError(f"{name} needs {_gib(need)} for its {dt} weights, but only {_gib(have)} of "
                                f"{memory} is left", hint=fits_hint(name, dtype, config))
    return fp
