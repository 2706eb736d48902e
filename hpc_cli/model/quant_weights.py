"""Quantized weight checkpoints, dequantised on load.

Two formats are read, named by ``quantization_config`` in ``config.json``:

* **FP8** (``quant_method: "fp8"``, ``fmt: "e4m3"``): the fine-grained layout of transformers'
  FineGrainedFP8 integration and Qwen's ``-FP8`` releases. A quantized tensor ``X.weight`` is
  float8_e4m3fn with a float32 ``X.weight_scale_inv`` of shape ``[ceil(out/b0), ceil(in/b1)]``
  for ``weight_block_size: [b0, b1]`` (one scalar without blocks); fused expert tensors
  ``experts.gate_up_proj`` carry ``experts.gate_up_proj_scale_inv`` with a leading expert dim.
  The weight is ``fp8 value * scale_inv`` of its block; scales may be float32, bf16, fp16 or
  UE8M0 (float8_e8m0fnu, ``scale_fmt: "ue8m0"``).
* **NVFP4**: e2m1 values packed two per uint8 (the even element in the low nibble), one
  float8_e4m3fn scale per group of 16 along the input dim and one float32 global scale, in
  either layout that exists: compressed-tensors (``quant_method: "compressed-tensors"``,
  ``format: "nvfp4-pack-quantized"``: ``X.weight_packed``, ``X.weight_scale``,
  ``X.weight_global_scale``; weight = e2m1 * scale / global) or modelopt (``quant_method:
  "modelopt"``, ``quant_algo: "NVFP4"``: ``X.weight`` uint8, ``X.weight_scale``,
  ``X.weight_scale_2``; weight = e2m1 * scale * scale_2).

A tensor is dequantised when its scale tensors are there; every other tensor loads as stored
(norms, embeddings, lm_head, gates, whatever ``modules_to_not_convert`` / ``ignore`` lists).
A float8 or packed tensor without its scales, a mis-shaped scale, an unknown method or format
is a :class:`ModelError` that names the tensor. Weights are held in the model dtype after
loading: memory and speed are those of the unquantized model.

The quantizers (:func:`quantize_fp8`, :func:`quantize_nvfp4`) write exactly what is read here;
``hpc-cli quantize`` (:mod:`hpc_cli.model.quantize`) uses them.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Protocol

import torch

from hpc_cli.errors import ModelError

FP8_MAX = 448.0  # largest finite float8_e4m3fn
E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of codes 0..7; bit 3 is the sign
_E2M1_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # round to nearest between neighbours
NVFP4_GROUP = 16
CT_NVFP4_FORMAT = "nvfp4-pack-quantized"

_FP8_SCALE_DTYPES = ("F32", "BF16", "F16", "F8_E8M0")  # F8_E8M0: UE8M0 (power-of-two) scales
_MISMATCH_HINT = "the checkpoint is damaged, or its quantization_config does not match its tensors"


class WeightFormat(str, Enum):
    UNQUANTIZED = "unquantized"
    FP8 = "fp8"
    NVFP4 = "nvfp4"


class Layout(str, Enum):
    """How the quantized tensors are named on disk."""

    PLAIN = "plain"
    FP8_SCALE_INV = "fp8"  # X.weight + X.weight_scale_inv (transformers FineGrainedFP8)
    COMPRESSED_TENSORS = "compressed-tensors"  # X.weight_packed + X.weight_scale + X.weight_global_scale
    MODELOPT = "modelopt"  # X.weight (uint8) + X.weight_scale + X.weight_scale_2


@dataclass(frozen=True, slots=True)
class QuantScheme:
    format: WeightFormat
    layout: Layout
    block: tuple[int, int] | None = None  # fp8: rows x cols sharing one scale; None: one scale per tensor
    group_size: int = NVFP4_GROUP  # nvfp4: input elements sharing one e4m3 scale
    not_convert: tuple[str, ...] = ()  # modules the checkpoint says it left unquantized

    @property
    def quantized(self) -> bool:
        return self.format is not WeightFormat.UNQUANTIZED

    def describe(self) -> str:
        if self.format is WeightFormat.FP8:
            blocks = f"{self.block[0]}x{self.block[1]} blocks" if self.block else "one scale per tensor"
            return f"fp8 e4m3, {blocks}"
        if self.format is WeightFormat.NVFP4:
            return f"nvfp4 e2m1 ({self.layout.value}), groups of {self.group_size}"
        return "unquantized"


UNQUANTIZED = QuantScheme(WeightFormat.UNQUANTIZED, Layout.PLAIN)


def scheme_from_config(raw: dict, where: str) -> QuantScheme:
    """The quantization scheme ``config.json`` declares (top level, or in ``text_config``)."""
    qc = raw.get("quantization_config")
    if qc is None and isinstance(raw.get("text_config"), dict):
        qc = raw["text_config"].get("quantization_config")
    if qc is None:
        return UNQUANTIZED
    if not isinstance(qc, dict):
        raise ModelError(f"{where}: quantization_config in config.json is not an object", hint="fix config.json")
    method = str(qc.get("quant_method", "")).lower()
    if method == "fp8":
        return _fp8_scheme(qc, where)
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(qc, where)
    if method == "modelopt":
        algo = str(qc.get("quant_algo", "")).upper()
        if algo != "NVFP4":
            raise ModelError(f"{where}: modelopt quant_algo {qc.get('quant_algo')!r} is not supported",
                             hint="hpc-cli reads modelopt NVFP4 checkpoints; use the bf16 checkpoint otherwise")
        group = _int_field(qc, "group_size", NVFP4_GROUP, where)
        excluded = qc.get("exclude_modules") or qc.get("ignore") or []
        return QuantScheme(WeightFormat.NVFP4, Layout.MODELOPT, group_size=group,
                           not_convert=tuple(str(m) for m in excluded))
    raise ModelError(f"{where}: quantization_config.quant_method {qc.get('quant_method')!r} is not supported",
                     hint="hpc-cli reads quant_method 'fp8' (block FP8), 'compressed-tensors' "
                          f"({CT_NVFP4_FORMAT}) and 'modelopt' (NVFP4); use the bf16 checkpoint otherwise")


def _int_field(qc: dict, key: str, default: int, where: str) -> int:
    value = qc.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0 or value % 2:
        raise ModelError(f"{where}: quantization_config.{key} {value!r} is not a positive even integer",
                         hint="fix config.json")
    return value


def _fp8_scheme(qc: dict, where: str) -> QuantScheme:
    fmt = str(qc.get("fmt", "e4m3")).lower()
    if fmt != "e4m3":
        raise ModelError(f"{where}: fp8 fmt {qc.get('fmt')!r} is not supported",
                         hint="hpc-cli reads float8_e4m3fn weights (fmt 'e4m3')")
    block = qc.get("weight_block_size")
    if block is not None:
        if (not isinstance(block, list) or len(block) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise ModelError(f"{where}: quantization_config.weight_block_size {block!r} is not two positive "
                             "integers", hint="fix config.json (Qwen's -FP8 checkpoints use [128, 128])")
        block = (block[0], block[1])
    not_convert = tuple(str(m) for m in (qc.get("modules_to_not_convert") or []))
    return QuantScheme(WeightFormat.FP8, Layout.FP8_SCALE_INV, block=block, not_convert=not_convert)


def _compressed_tensors_scheme(qc: dict, where: str) -> QuantScheme:
    fmt = qc.get("format")
    groups = qc.get("config_groups") or {}
    formats = {fmt} | {g.get("format") for g in groups.values() if isinstance(g, dict) and g.get("format")}
    formats.discard(None)
    if formats != {CT_NVFP4_FORMAT}:
        raise ModelError(f"{where}: compressed-tensors format {sorted(map(str, formats)) or fmt!r} is not supported",
                         hint=f"hpc-cli reads compressed-tensors checkpoints in format {CT_NVFP4_FORMAT!r}")
    sizes = {g.get("weights", {}).get("group_size", NVFP4_GROUP) for g in groups.values() if isinstance(g, dict)}
    if len(sizes) > 1:
        raise ModelError(f"{where}: compressed-tensors config_groups use different group sizes {sorted(sizes)}",
                         hint="hpc-cli reads one NVFP4 group size per checkpoint")
    group = _int_field({"group_size": sizes.pop() if sizes else NVFP4_GROUP}, "group_size", NVFP4_GROUP, where)
    return QuantScheme(WeightFormat.NVFP4, Layout.COMPRESSED_TENSORS, group_size=group,
                       not_convert=tuple(str(m) for m in (qc.get("ignore") or [])))


# ---------------------------------------------------------------------------------- e2m1 codes
def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """``[..., n/2]`` uint8 -> ``[..., n]`` float32 (the low nibble holds the even element)."""
    assert packed.dtype == torch.uint8, f"packed e2m1 must be uint8, got {packed.dtype}"
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2).long()
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=packed.device)
    return table[codes]


def pack_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round ``x`` (already divided by its scales, within +-6) to the nearest e2m1 value and pack
    two per byte: ``[..., n]`` -> ``[..., n/2]`` uint8."""
    assert x.shape[-1] % 2 == 0, f"e2m1 packing needs an even last dim, got {tuple(x.shape)}"
    bounds = torch.tensor(_E2M1_BOUNDS, dtype=torch.float32, device=x.device)
    mag = torch.bucketize(x.abs().float().contiguous(), bounds)  # 0..7
    codes = (mag | (torch.signbit(x).long() << 3)).to(torch.uint8)
    codes = torch.where(mag == 0, torch.zeros_like(codes), codes)  # no negative zero
    pairs = codes.unflatten(-1, (x.shape[-1] // 2, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


# ------------------------------------------------------------------------- dequantise / quantise
def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] | None,
                   dtype: torch.dtype) -> torch.Tensor:
    """``[..., out, in]`` float8 times the scale of its block (or the one scale), in ``dtype``."""
    w = weight.to(torch.float32)
    s = scale_inv.to(torch.float32)
    if block is None:
        return (w * s.reshape(())).to(dtype)
    rows, cols = w.shape[-2:]
    s = s.repeat_interleave(block[0], dim=-2)[..., :rows, :].repeat_interleave(block[1], dim=-1)[..., :cols]
    return (w * s).to(dtype)


def quantize_fp8(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., out, in]`` -> (float8_e4m3fn weight, float32 scale_inv ``[..., ceil(out/b0), ceil(in/b1)]``),
    each block scaled so that its largest magnitude is 448."""
    w = weight.to(torch.float32)
    rows, cols = w.shape[-2:]
    b0, b1 = block
    pr, pc = -rows % b0, -cols % b1
    padded = torch.nn.functional.pad(w, (0, pc, 0, pr))
    blocks = padded.unflatten(-1, ((cols + pc) // b1, b1)).unflatten(-3, ((rows + pr) // b0, b0))
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., out/b0, in/b1]
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    full = scale_inv.repeat_interleave(b0, dim=-2)[..., :rows, :].repeat_interleave(b1, dim=-1)[..., :cols]
    q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale_inv.contiguous()


def dequantize_nvfp4(packed: torch.Tensor, scale: torch.Tensor, global_factor: float | torch.Tensor,
                     group: int, dtype: torch.dtype) -> torch.Tensor:
    """e2m1 ``[..., out, in/2]`` uint8 times its group's e4m3 scale times ``global_factor``."""
    values = unpack_e2m1(packed)
    s = scale.to(torch.float32) * torch.as_tensor(global_factor, dtype=torch.float32, device=packed.device)
    return (values.unflatten(-1, (values.shape[-1] // group, group)) * s.unsqueeze(-1)).flatten(-2).to(dtype)


def quantize_nvfp4(weight: torch.Tensor, group: int = NVFP4_GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[out, in]`` -> (packed uint8 ``[out, in/2]``, float8_e4m3fn scale ``[out, in/group]``,
    float32 global scale ``[1]``) in compressed-tensors' convention: the weight is
    ``e2m1 * scale / global``, with ``global = 448 * 6 / amax`` so the largest group scale is 448."""
    w = weight.to(torch.float32)
    assert w.shape[-1] % group == 0, f"nvfp4 needs the input dim {w.shape[-1]} to be a multiple of {group}"
    amax = w.abs().amax()
    global_scale = (FP8_MAX * E2M1_MAX / amax) if amax > 0 else torch.tensor(1.0)
    groups = w.unflatten(-1, (w.shape[-1] // group, group))
    scale = (groups.abs().amax(dim=-1) / E2M1_MAX * global_scale).clamp(max=FP8_MAX).to(torch.float8_e4m3fn)
    real = scale.to(torch.float32) / global_scale  # what the reader multiplies by
    safe = torch.where(real > 0, real, torch.ones_like(real))
    packed = pack_e2m1((groups / safe.unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX).flatten(-2))
    return packed, scale, global_scale.reshape(1).to(torch.float32)


# ------------------------------------------------------------------------- reading a checkpoint
class TensorSlice(Protocol):
    def get_shape(self) -> list[int]: ...

    def get_dtype(self) -> str: ...


class TensorFile(Protocol):
    """An open safetensors file (``safetensors.safe_open``)."""

    def get_tensor(self, name: str) -> torch.Tensor: ...

    def get_slice(self, name: str) -> TensorSlice: ...


@dataclass(frozen=True, slots=True)
class StoredFP8:
    """An FP8 weight as stored: float8_e4m3fn ``[out, in]`` and float32 block scales."""

    weight: torch.Tensor
    scale: torch.Tensor  # [ceil(out / block[0]), ceil(in / block[1])], or one value without blocks
    block: tuple[int, int] | None


@dataclass(frozen=True, slots=True)
class StoredNVFP4:
    """An NVFP4 weight as stored: packed e2m1 ``[out, in / 2]``, e4m3 group scales ``[out, in /
    group]`` and the global factor the weight is multiplied by."""

    packed: torch.Tensor
    scale: torch.Tensor
    factor: float
    group: int


StoredQuantized = StoredFP8 | StoredNVFP4


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor as the model sees it: its checkpoint name (``X.weight`` also for packed NVFP4)
    and how to read it, dequantised when it is stored quantized; ``read_stored`` reads a
    quantized tensor as stored (for weights kept quantized in memory)."""

    name: str
    source: str  # "name (file)" for messages
    read: Callable[[], torch.Tensor]
    quantized: bool = False
    read_stored: Callable[[], StoredQuantized] | None = None


_COMPANIONS = {
    Layout.PLAIN: (),
    Layout.FP8_SCALE_INV: ("_scale_inv", ".activation_scale", ".input_scale"),
    Layout.COMPRESSED_TENSORS: (".weight_scale", ".weight_global_scale", ".input_global_scale"),
    Layout.MODELOPT: (".weight_scale", ".weight_scale_2", ".input_scale"),
}


def _is_companion(key: str, layout: Layout) -> bool:
    return key.endswith(_COMPANIONS[layout])


class _Stored:
    """The checkpoint's tensors by name: shape and dtype from the file header, data on demand."""

    def __init__(self, raw: list[tuple[str, TensorFile, str]]) -> None:
        self.where = {key: (handle, fname) for key, handle, fname in raw}

    def __contains__(self, key: str) -> bool:
        return key in self.where

    def meta(self, key: str) -> tuple[tuple[int, ...], str]:
        sl = self.where[key][0].get_slice(key)
        return tuple(sl.get_shape()), sl.get_dtype()

    def tensor(self, key: str) -> torch.Tensor:
        return self.where[key][0].get_tensor(key)

    def label(self, key: str) -> str:
        return f"{key} ({self.where[key][1]})"


def resolve_entries(scheme: QuantScheme, raw: list[tuple[str, TensorFile, str]],
                    dtype: torch.dtype) -> list[TensorEntry]:
    """The checkpoint's tensors (``(key, open file, file name)``) as the model reads them: scale
    tensors folded into the weights they scale, every quantized weight checked against its scales
    before anything is read. Raises :class:`ModelError` naming the tensor at fault."""
    stored = _Stored(raw)
    out: list[TensorEntry] = []
    for key, _, _ in raw:
        if _is_companion(key, scheme.layout):
            continue
        shape, dt = stored.meta(key)
        if scheme.layout is Layout.FP8_SCALE_INV and key + "_scale_inv" in stored:
            out.append(_fp8_entry(key, shape, dt, scheme, stored, dtype))
        elif scheme.layout is Layout.COMPRESSED_TENSORS and key.endswith(".weight_packed"):
            base = key[:-len("_packed")]
            out.append(_nvfp4_entry(base, key, base + "_scale", base + "_global_scale", True, shape, dt, scheme,
                                    stored, dtype))
        elif scheme.layout is Layout.MODELOPT and dt == "U8" and key.endswith(".weight"):
            out.append(_nvfp4_entry(key, key, key + "_scale", key + "_scale_2", False, shape, dt, scheme,
                                    stored, dtype))
        elif dt.startswith("F8") or (dt == "U8" and scheme.layout is not Layout.PLAIN):
            what = f"stored as {dt}" if dt != "U8" else "packed (uint8)"
            need = {Layout.PLAIN: "config.json has no quantization_config",
                    Layout.FP8_SCALE_INV: f"{key}_scale_inv is missing",
                    Layout.COMPRESSED_TENSORS: f"it is not a {key}_packed tensor with its scales",
                    Layout.MODELOPT: f"{key}_scale is missing"}[scheme.layout]
            raise ModelError(f"tensor {stored.label(key)} is {what} but {need}",
                             hint=_MISMATCH_HINT if scheme.quantized else
                             "add the checkpoint's quantization_config to config.json, or use its bf16 release")
        else:
            out.append(TensorEntry(key, stored.label(key), lambda k=key: stored.tensor(k)))
    return out


def _fp8_entry(key: str, shape: tuple[int, ...], dt: str, scheme: QuantScheme, stored: _Stored,
               dtype: torch.dtype) -> TensorEntry:
    scale_key = key + "_scale_inv"
    if dt != "F8_E4M3":
        raise ModelError(f"tensor {stored.label(key)} is stored as {dt}; fp8 fmt e4m3 needs F8_E4M3 "
                         "(float8_e4m3fn)", hint=_MISMATCH_HINT)
    if len(shape) < 2:
        raise ModelError(f"tensor {stored.label(key)} has shape {shape}; a quantized weight has at least 2 dims",
                         hint=_MISMATCH_HINT)
    sshape, sdt = stored.meta(scale_key)
    if sdt not in _FP8_SCALE_DTYPES:
        raise ModelError(f"tensor {stored.label(scale_key)} is stored as {sdt}; fp8 scales are "
                         f"{', '.join(_FP8_SCALE_DTYPES)}", hint=_MISMATCH_HINT)
    if scheme.block is None:
        if math.prod(sshape) != 1:
            raise ModelError(f"tensor {stored.label(scale_key)} has shape {sshape}; without weight_block_size the "
                             f"fp8 weight {key} takes one scale", hint=_MISMATCH_HINT)
    else:
        b0, b1 = scheme.block
        want = shape[:-2] + (-(-shape[-2] // b0), -(-shape[-1] // b1))
        if sshape != want:
            raise ModelError(f"tensor {stored.label(scale_key)} has shape {sshape}; the fp8 weight {key} of shape "
                             f"{shape} needs {want} for {b0}x{b1} blocks", hint=_MISMATCH_HINT)
    block = scheme.block

    def raw() -> StoredFP8:
        return StoredFP8(stored.tensor(key), stored.tensor(scale_key).to(torch.float32), block)

    return TensorEntry(key, stored.label(key),
                       lambda: dequantize_fp8(stored.tensor(key), stored.tensor(scale_key), block, dtype), True, raw)


def _nvfp4_entry(name: str, key: str, scale_key: str, global_key: str, reciprocal: bool, shape: tuple[int, ...],
                 dt: str, scheme: QuantScheme, stored: _Stored, dtype: torch.dtype) -> TensorEntry:
    """``reciprocal``: the global scale divides (compressed-tensors) rather than multiplies (modelopt)."""
    label = stored.label
    if dt != "U8":
        raise ModelError(f"tensor {label(key)} is stored as {dt}; packed nvfp4 is uint8", hint=_MISMATCH_HINT)
    for k in (scale_key, global_key):
        if k not in stored:
            raise ModelError(f"tensor {k} is missing: the nvfp4 weight {label(key)} needs it", hint=_MISMATCH_HINT)
    if len(shape) < 2:
        raise ModelError(f"tensor {label(key)} has shape {shape}; a quantized weight has at least 2 dims",
                         hint=_MISMATCH_HINT)
    g = scheme.group_size
    if (2 * shape[-1]) % g:
        raise ModelError(f"tensor {label(key)} holds {2 * shape[-1]} inputs per row, not a multiple of the "
                         f"group size {g}", hint=_MISMATCH_HINT)
    want = shape[:-1] + (2 * shape[-1] // g,)
    sshape, sdt = stored.meta(scale_key)
    if sshape != want:
        raise ModelError(f"tensor {label(scale_key)} has shape {sshape}; the nvfp4 weight {key} of shape {shape} "
                         f"needs {want} (one scale per {g} inputs)", hint=_MISMATCH_HINT)
    if sdt != "F8_E4M3":
        raise ModelError(f"tensor {label(scale_key)} is stored as {sdt}; nvfp4 group scales are F8_E4M3",
                         hint=_MISMATCH_HINT)
    gshape, _ = stored.meta(global_key)
    if math.prod(gshape) != 1:
        raise ModelError(f"tensor {label(global_key)} has shape {gshape}; the nvfp4 weight {key} takes one global "
                         "scale", hint=_MISMATCH_HINT)

    def factor() -> float:  # computed in float32, as the dequantisation always has
        glob = stored.tensor(global_key).to(torch.float32).reshape(())
        return float(1.0 / glob if reciprocal else glob)

    def read() -> torch.Tensor:
        return dequantize_nvfp4(stored.tensor(key), stored.tensor(scale_key), factor(), g, dtype)

    def raw() -> StoredNVFP4:
        return StoredNVFP4(stored.tensor(key), stored.tensor(scale_key), factor(), g)

    return TensorEntry(name, label(key), read, True, raw)


def quantized_weight_names(scheme: QuantScheme, keys: list[str]) -> list[str]:
    """The checkpoint names (``X.weight``) of the quantized weights among ``keys``, from the
    names alone (a safetensors header): those stored with their scale tensors."""
    present = set(keys)
    if scheme.layout is Layout.FP8_SCALE_INV:
        return [k for k in keys if k + "_scale_inv" in present]
    if scheme.layout is Layout.COMPRESSED_TENSORS:
        bases = (k[:-len("_packed")] for k in keys if k.endswith(".weight_packed"))
        return [b for b in bases if b + "_scale" in present]
    if scheme.layout is Layout.MODELOPT:
        return [k for k in keys if k.endswith(".weight") and k + "_scale" in present and k + "_scale_2" in present]
    return []


_NOT_CONVERT_SPLIT = re.compile(r"\.(weight|weight_packed)$")


def module_of(key: str) -> str:
    """The module a weight tensor belongs to (``a.b.weight`` -> ``a.b``)."""
    return _NOT_CONVERT_SPLIT.sub("", key)
