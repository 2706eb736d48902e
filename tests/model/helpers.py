"""Helpers for the Qwen3.5 runtime tests: an exact fp32 KV profile, error metric, the gated delta
rule's inputs, checkpoint rewriting, a test module's kernel checks run in Triton's interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from hpc_cli.kv_profile import KVProfile, PlaneSpec, RecordLayout


class F32Profile(KVProfile):
    """Test-only profile storing K/V as fp32 bytes, so the oracle comparisons are not bf16-bound."""

    name = "test-f32"

    def layout(self, head_dim):
        return RecordLayout(head_dim, (PlaneSpec("k_data", "k", 4 * head_dim), PlaneSpec("v_data", "v", 4 * head_dim)))

    def quantize(self, x, side, global_scale=None):
        n, h, d = x.shape
        return [x.to(torch.float32).contiguous().view(torch.uint8).view(n, h, 4 * d)]

    def dequantize(self, planes, side, dtype, global_scale=None):
        (data,) = planes
        n, h, b = data.shape
        return data.contiguous().view(torch.float32).view(n, h, b // 4).to(dtype)


F32 = F32Profile()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def rule_inputs(seed: int, b: int, t: int, hk: int, hv: int, d: int, dtype=torch.float32,
                decay_scale: float = 1.0, state_scale: float = 1.0) -> tuple[torch.Tensor, ...]:
    """The gated delta rule's inputs, seeded: q, k ``[b, t, hk, d]``, v ``[b, t, hv, d]``, log decay
    (in ``(-decay_scale, 0]``) and beta ``[b, t, hv]``, an initial state ``[b, hv, d, d]``."""
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, t, hk, d, generator=g, dtype=dtype) for _ in range(2))
    v = torch.randn(b, t, hv, d, generator=g, dtype=dtype)
    decay = -torch.rand(b, t, hv, generator=g, dtype=dtype) * decay_scale
    beta = torch.rand(b, t, hv, generator=g, dtype=dtype)
    return q, k, v, decay, beta, torch.randn(b, hv, d, d, generator=g, dtype=dtype) * state_scale


def rewrite_checkpoint(src: Path, dst: Path, *, language_model: bool = False, fuse_experts: bool = False,
                       drop: str | None = None, reshape: str | None = None, extra: dict | None = None,
                       shards: int = 1) -> Path:
    """Copy a save_pretrained checkpoint into another layout (or damage it)."""
    import re

    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    cfg = json.loads((src / "config.json").read_text())
    if fuse_experts:
        pat = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
        groups: dict = {}
        for k in list(tensors):
            m = pat.match(k)
            if m:
                groups.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = tensors.pop(k)
        for prefix, by in groups.items():
            n = len(by)
            tensors[prefix + ".gate_up_proj"] = torch.stack(
                [torch.cat([by[e]["gate_proj"], by[e]["up_proj"]]) for e in range(n)])
            tensors[prefix + ".down_proj"] = torch.stack([by[e]["down_proj"] for e in range(n)])
    if language_model:
        tensors = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
                   for k, v in tensors.items()}
        moe = "moe" in cfg["model_type"]
        text = dict(cfg)
        text["model_type"] = "qwen3_5_moe_text" if moe else "qwen3_5_text"
        cfg = {"model_type": "qwen3_5_moe" if moe else "qwen3_5", "text_config": text,
               "tie_word_embeddings": cfg.get("tie_word_embeddings", False)}
    if drop:
        del tensors[drop]
    if reshape:
        tensors[reshape] = tensors[reshape][..., :-1].contiguous()
    if extra:
        tensors.update(extra)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    (dst / "config.json").write_text(json.dumps(cfg))
    if shards == 1:
        save_file(tensors, str(dst / "model.safetensors"))
    else:
        keys = sorted(tensors)
        weight_map = {}
        for s in range(shards):
            name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {k: tensors[k] for k in keys[s::shards]}
            save_file(part, str(dst / name))
            weight_map.update({k: name for k in part})
        (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


def run_interpreted(module: str, env: dict[str, str] | None = None, timeout: float = 600):
    """``python -m module`` in a child process with ``TRITON_INTERPRET=1`` (Triton reads it at
    import, so the Triton kernels run on CPU tensors there), from the repository root; the JSON
    document the child prints last."""
    root = Path(__file__).resolve().parents[2]
    path = os.pathsep.join([str(root)] + [p for p in sys.path if p])
    child_env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path, **(env or {}))
    proc = subprocess.run([sys.executable, "-m", module], cwd=root, env=child_env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"interpreter run failed:\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])
