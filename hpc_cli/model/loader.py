"""Load a HF Qwen3.5 checkpoint directory: config.json, safetensors (sharded or not), tokenizer.

Tensor names are accepted in both layouts that exist: ``model.language_model.*`` (the released
multimodal checkpoints; their ``model.visual.*`` fills the vision tower, hpc_cli.model.vision) and
``model.*`` (what ``Qwen3_5ForCausalLM.save_pretrained`` writes), plus ``lm_head.*`` and ``mtp.*``. MoE experts
may be fused (``experts.gate_up_proj`` / ``experts.down_proj``) or per expert
(``experts.{e}.gate_proj|up_proj|down_proj.weight``); per-expert tensors are fused on load.
A missing or mis-shaped tensor is a :class:`ModelError` that names it.

Quantized checkpoints (block FP8 as Qwen's ``-FP8`` releases and transformers write them, NVFP4
as compressed-tensors and modelopt write it; ``quantization_config`` in config.json says which)
are dequantised into the model dtype as they are read (``hpc_cli.model.quant_weights``), except on
CUDA, where the Linear layers hold their weights as stored and multiply them in place
(``hpc_cli.model.quant_linear``; the model is built with those weights deferred, so they never
take the model dtype's memory).

With ``offload_experts`` the routed experts' parameters are host arrays (see
``hpc_cli.model.moe``): fused expert tensors are copied into them and per-expert tensors are
written into their expert's rows as they are read, so the experts never pass through the device
and no second fused host copy is built.
"""

from __future__ import annotations

import json
import re
from contextlib import ExitStack, nullcontext
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from hpc_cli.errors import CapacityError, ModelError
from hpc_cli.model.config import ModelConfig
from hpc_cli.model.layers import deferred_linear_weights
from hpc_cli.model.quant_linear import (Residency, WeightsChoice, held_linears, keep_quantized, quantized_weight,
                                        residency)
from hpc_cli.model.quant_weights import TensorFile, resolve_entries, scheme_from_config
from hpc_cli.model.vision import attach_vision, vision_name

_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def our_name(hf_name: str) -> str | None:
    """Map a checkpoint tensor name to our parameter name (None: not part of the text model)."""
    for prefix in ("model.language_model.", "language_model.model.", "model."):
        if hf_name.startswith(prefix):
            rest = hf_name[len(prefix):]
            if rest.startswith(("visual.", "vision_tower.")):
                return None
            return rest
    if hf_name.startswith(("lm_head.", "mtp.")):
        return hf_name
    if hf_name.startswith(("visual.", "model.visual.")):
        return None
    return hf_name


def raw_config(path: Path) -> dict:
    """config.json as read (ModelConfig.from_dir has checked it is a JSON object)."""
    return json.loads((path / "config.json").read_text())


def shard_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ModelError(f"{index}: not a safetensors index ({exc})", hint="fix or remove the index file") from exc
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (path / f).is_file()]
        if missing:
            raise ModelError(f"{path}: shard {missing[0]} named by the index is missing",
                             hint="download the complete checkpoint")
        return [path / f for f in files]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelError(f"{path}: no *.safetensors files", hint="a checkpoint directory needs safetensors weights")
    return files


def _iter_tensors(files: list[Path], stack: ExitStack) -> Iterator[tuple[str, TensorFile, str]]:
    from safetensors import safe_open

    for f in files:
        try:
            handle = stack.enter_context(safe_open(str(f), framework="pt"))
        except Exception as exc:
            raise ModelError(f"{f}: cannot open safetensors file: {exc}", hint="the file is damaged; download it again") from exc
        for key in handle.keys():
            yield key, handle, f.name


def load_checkpoint(path: str | Path, dtype=None, device="cpu", progress: bool = True,
                    offload_experts: bool = False, weights: Residency | WeightsChoice | None = None):
    """``weights``: how a quantized checkpoint's Linear weights are held (default ``auto``: as
    stored on CUDA only when dequantised they would not fit; see
    :func:`hpc_cli.model.quant_linear.keep_quantized`)."""
    from hpc_cli import progress as steps
    from hpc_cli.model.footprint import HeldQuantized, check_fits
    from hpc_cli.model.model import HybridModel, resolve_dtype
    from hpc_cli.model.tokenizer import ByteTokenizer, HFTokenizer

    path = Path(path)
    config = ModelConfig.from_dir(path)
    scheme = scheme_from_config(raw_config(path), str(path))
    files = shard_files(path)
    model_dtype = resolve_dtype(dtype, torch.device(device))
    with ExitStack() as stack:
        # quantized weights are checked against their scales here, then dequantised as they are
        # read or (``keep``) held as stored by the Linear layers that take them
        entries = resolve_entries(scheme, list(_iter_tensors(files, stack)), model_dtype)
        names = {our_name(e.name) for e in entries}
        has_mtp = any(n and n.startswith("mtp.") for n in names)
        held = HeldQuantized(scheme, frozenset(n for e in entries if e.quantized and (n := our_name(e.name))))

        def fits_dequantized() -> bool:
            try:
                check_fits(str(path), config, model_dtype, device, with_mtp=has_mtp, offload_experts=offload_experts)
            except CapacityError:
                return False
            return True

        def holdable() -> bool:
            return residency(scheme, device, model_dtype) is Residency.QUANTIZED

        keep = keep_quantized(weights, scheme, holdable, fits_dequantized)
        check_fits(str(path), config, model_dtype, device, with_mtp=has_mtp, offload_experts=offload_experts,
                   held=held if keep else None)  # before allocating anything
        with deferred_linear_weights() if keep else nullcontext():
            model = HybridModel(config, device=device, dtype=dtype, with_mtp=has_mtp,
                                offload_experts=offload_experts)
        attach_vision(model, raw_config(path), path, [e.name for e in entries])  # multimodal checkpoints
        params = dict(model.named_parameters())
        quantized_linears = held_linears(model, held.names) if keep else {}
        loaded: set[str] = set()
        experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
        host_experts: dict[str, set[tuple[int, str]]] = {}  # prefix -> (expert, part) written in place
        host_prefixes = {n for n, mod in model.named_modules() if getattr(mod, "host_packed", None) is not None}

        def put(name: str, tensor: torch.Tensor, source: str) -> None:
            p = params.get(name)
            if p is None:
                return  # tensors the runtime does not use (e.g. visual, unknown extras)
            if tuple(tensor.shape) != tuple(p.shape):
                raise ModelError(f"tensor {source} has shape {tuple(tensor.shape)}, the config needs {tuple(p.shape)}",
                                 hint="the checkpoint does not match its config.json")
            if p.is_meta:  # a Linear weight built deferred: it gets its own tensor on the model's device
                owner, attr = name.rsplit(".", 1)
                setattr(model.get_submodule(owner), attr, nn.Parameter(
                    tensor.to(device=model.device, dtype=p.dtype).contiguous(), requires_grad=False))
            else:
                p.data.copy_(tensor.to(device=p.device, dtype=p.dtype))
            loaded.add(name)

        advance = stack.enter_context(steps.step(f"loading {path} ({len(entries)} tensors)", len(entries),
                                                 enabled=progress))
        for entry in entries:
            key = entry.name
            name = our_name(key)
            if model.vision is not None and vision_name(key) is not None:
                put("vision." + vision_name(key), entry.read(), entry.source)
            elif name is not None:
                m = _EXPERT.match(name)
                if m and m.group(1) in host_prefixes:
                    e, part = int(m.group(2)), m.group(3)
                    if _put_host_expert(m.group(1), e, part, entry.read(), params):
                        host_experts.setdefault(m.group(1), set()).add((e, part))
                elif m and m.group(1) + ".gate_up_proj" in params:
                    experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = entry.read()
                elif name in quantized_linears and entry.read_stored is not None:
                    quantized_linears[name].hold_quantized(quantized_weight(entry.read_stored(), model.device))
                    loaded.add(name)
                elif name in params:
                    put(name, entry.read(), entry.source)
            advance(1)
        for prefix, by_expert in experts.items():
            _fuse_experts(prefix, by_expert, params, put)
        for prefix, seen in host_experts.items():
            n = params[prefix + ".gate_up_proj"].shape[0]
            for e in range(n):
                for part in ("gate_proj", "up_proj", "down_proj"):
                    if (e, part) not in seen:
                        raise ModelError(f"tensor {prefix}.{e}.{part}.weight is missing",
                                         hint="the checkpoint is incomplete or does not match config.json")
            loaded.update((prefix + ".gate_up_proj", prefix + ".down_proj"))
    missing = [n for n in params if n not in loaded]
    if missing:
        raise ModelError(f"{path}: tensor {_hf_hint(missing[0])} is missing"
                         + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""),
                         hint="the checkpoint is incomplete or does not match config.json")
    model.eval()
    eos = config.eos_token_id
    if (path / "tokenizer.json").is_file():
        model.tokenizer = HFTokenizer(path, eos_token_ids=eos)
    else:
        model.tokenizer = ByteTokenizer() if config.vocab_size >= 263 else None
    return model


def _hf_hint(name: str) -> str:
    if name.startswith(("lm_head.", "mtp.")):
        return name
    if name.startswith("vision."):
        return f"model.visual.{name[len('vision.'):]}"
    return f"model.language_model.{name} (or model.{name})"


def _put_host_expert(prefix: str, e: int, part: str, tensor: torch.Tensor, params) -> bool:
    """Write one per-expert tensor into its rows of the host expert arrays; False for an expert
    index the config does not have (ignored, as the fused path ignores it)."""
    gate_up, down = params[prefix + ".gate_up_proj"], params[prefix + ".down_proj"]
    n, inter = gate_up.shape[0], gate_up.shape[1] // 2
    if not 0 <= e < n:
        return False
    if part == "down_proj":
        dst, want = down.data[e], tuple(down.shape[1:])
    else:
        lo = 0 if part == "gate_proj" else inter
        dst, want = gate_up.data[e, lo:lo + inter], (inter, gate_up.shape[2])
    got = tuple(tensor.shape)
    if got != want:
        raise ModelError(f"tensor {prefix}.{e}.{part}.weight has shape {got}, the config needs {want}",
                         hint="the checkpoint does not match its config.json")
    dst.copy_(tensor.to(dtype=dst.dtype))
    return True


def _fuse_experts(prefix: str, by_expert: dict[int, dict[str, torch.Tensor]], params, put) -> None:
    gate_up = params[prefix + ".gate_up_proj"]
    n = gate_up.shape[0]
    for e in range(n):
        parts = by_expert.get(e, {})
        for part in ("gate_proj", "up_proj", "down_proj"):
            if part not in parts:
                raise ModelError(f"tensor {prefix}.{e}.{part}.weight is missing",
                                 hint="the checkpoint is incomplete or does not match config.json")
    want_gu = (gate_up.shape[1] // 2, gate_up.shape[2])
    want_d = tuple(params[prefix + ".down_proj"].shape[1:])
    for e in range(n):
        for part, want in (("gate_proj", want_gu), ("up_proj", want_gu), ("down_proj", want_d)):
            got = tuple(by_expert[e][part].shape)
            if got != tuple(want):
                raise ModelError(f"tensor {prefix}.{e}.{part}.weight has shape {got}, the config needs {tuple(want)}",
                                 hint="the checkpoint does not match its config.json")
    fused_gu = torch.stack([torch.cat([by_expert[e]["gate_proj"], by_expert[e]["up_proj"]], dim=0) for e in range(n)])
    put(prefix + ".gate_up_proj", fused_gu, f"{prefix}.*.gate_proj/up_proj (fused)")
    fused_d = torch.stack([by_expert[e]["down_proj"] for e in range(n)])
    put(prefix + ".down_proj", fused_d, f"{prefix}.*.down_proj (fused)")
