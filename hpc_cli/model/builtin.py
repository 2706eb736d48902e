"""Built-in models: ``builtin:tiny`` (the embedded default, trained), seeded ones and full-width shapes.

``builtin:tiny`` is a small trained Qwen3.5 model (8 layers in the 3:1 GDN / gated-attention
pattern, hidden 256, a 6144-token byte-level BPE vocabulary, an MTP head) shipped inside the
package as a HF checkpoint directory (``hpc_cli/model/tiny``: config.json, tokenizer.json,
tokenizer_config.json, model.safetensors, and the ``dflash``/``dflash2`` drafters) and loaded
offline through the same loader as a user's checkpoint; it answers questions about the Python
standard library (docs/tiny-model.md; ``scripts/train_tiny.py`` trains it).
``builtin:random`` has the same layer geometry with a byte-level tokenizer and random (seeded)
weights: it produces meaningless text, and tests use it. ``builtin:qwen3.5-27b-shape`` and
``builtin:qwen3.5-35b-a3b-shape`` carry the released widths with a reduced layer count (8 by
default, ``@N`` for N layers, a multiple of 4) for GPU benchmarks: cost does not depend on the
weight values.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import torch

from hpc_cli.errors import ModelError
from hpc_cli.model.config import ModelConfig
from hpc_cli.model.tokenizer import ByteTokenizer

SEED = 20250501
#: the trained embedded default model, a HF checkpoint directory inside the package
TINY_DIR = Path(__file__).resolve().parent / "tiny"


def trained_tiny_config() -> ModelConfig:
    if not (TINY_DIR / "config.json").is_file():
        raise ModelError(f"the embedded model's files are missing from {TINY_DIR}",
                         hint="reinstall hpc-cli, or use builtin:random")
    cfg = ModelConfig.from_dir(TINY_DIR)
    cfg.name = "builtin:tiny"
    return cfg


def tiny_config() -> ModelConfig:
    """The seeded ``builtin:random`` model (the former ``builtin:tiny``): byte tokenizer, random weights."""
    return ModelConfig(
        name="builtin:random", model_type="qwen3_5", vocab_size=272, hidden_size=256, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=512,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
        max_position_embeddings=32768, eos_token_id=[258, 256], mtp_num_hidden_layers=1)


def tiny_moe_config() -> ModelConfig:
    """A small Qwen3.5-MoE-shaped model (8 layers, 32 experts, top 4) for the expert tier's tools."""
    return ModelConfig(
        name="builtin:tiny-moe", model_type="qwen3_5_moe", vocab_size=272, hidden_size=128, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32, num_experts=32,
        num_experts_per_tok=4, moe_intermediate_size=64, shared_expert_intermediate_size=128,
        max_position_embeddings=32768, eos_token_id=[258, 256], mtp_num_hidden_layers=1)


def qwen35_27b_shape(layers: int = 8) -> ModelConfig:
    return ModelConfig(
        name=f"builtin:qwen3.5-27b-shape@{layers}", model_type="qwen3_5", vocab_size=248320, hidden_size=5120,
        num_hidden_layers=layers, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
        intermediate_size=17408, linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
        linear_value_head_dim=128, eos_token_id=[258, 256])


def qwen35_35b_a3b_shape(layers: int = 8) -> ModelConfig:
    return ModelConfig(
        name=f"builtin:qwen3.5-35b-a3b-shape@{layers}", model_type="qwen3_5_moe", vocab_size=248320,
        hidden_size=2048, num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        eos_token_id=[258, 256])


BUILTINS = {
    "tiny": lambda layers: trained_tiny_config(),
    "random": lambda layers: tiny_config() if layers is None else _relayer(tiny_config(), layers),
    "tiny-moe": lambda layers: tiny_moe_config() if layers is None else _relayer(tiny_moe_config(), layers),
    "qwen3.5-27b-shape": lambda layers: qwen35_27b_shape(layers or 8),
    "qwen3.5-35b-a3b-shape": lambda layers: qwen35_35b_a3b_shape(layers or 8),
}


def _relayer(cfg: ModelConfig, layers: int) -> ModelConfig:
    d = cfg.to_dict()
    d.update(num_hidden_layers=layers, layer_types=[], name=f"{cfg.name}@{layers}")
    return ModelConfig(**d)


def builtin_config(name: str) -> ModelConfig:
    key = name.removeprefix("builtin:")
    layers = None
    if "@" in key:
        key, _, count = key.partition("@")
        if not count.isdigit() or int(count) < 4 or int(count) % 4:
            raise ModelError(f"bad layer count in {name!r}", hint="write builtin:NAME@N with N a multiple of 4")
        layers = int(count)
        if key == "tiny":
            raise ModelError("builtin:tiny is a trained model and takes no layer count",
                             hint=f"builtin:random@{count} has the same geometry with seeded weights")
    if key not in BUILTINS:
        raise ModelError(f"unknown built-in model {name!r}",
                         hint="choose one of: " + ", ".join(f"builtin:{k}" for k in BUILTINS))
    return BUILTINS[key](layers)


def config_for(name_or_path: str) -> ModelConfig:
    """The configuration of the model :meth:`HybridModel.from_name_or_path` would load for
    ``name_or_path`` (``builtin:NAME`` or a checkpoint directory), read without its weights."""
    if name_or_path.startswith("builtin:"):
        return builtin_config(name_or_path)
    return ModelConfig.from_dir(Path(name_or_path).expanduser())


_CHUNK_BYTES = 64 << 20


def _normal(p: torch.Tensor, mean: float, std: float, gen: torch.Generator) -> None:
    """``p.normal_`` from ``gen``. A parameter on the generator's device, contiguous, draws in
    place (the plain path). Host experts of an offloaded model (strided views of the packed host
    array) draw into a contiguous temporary: one of the full shape when the generator is on the
    host, so the values equal the all-resident model's; a few experts at a time when it is on the
    device, so at most ``_CHUNK_BYTES`` of them are ever on the device (the values then differ
    from the all-resident model's on that device: the draws are chunked)."""
    if p.device.type == gen.device.type and p.is_contiguous():
        p.normal_(mean, std, generator=gen)
    elif gen.device.type == "cpu":
        p.copy_(torch.empty(p.shape, dtype=p.dtype).normal_(mean, std, generator=gen))
    else:
        per = max(1, _CHUNK_BYTES // max(1, p[0].numel() * p.element_size()))
        for lo in range(0, p.shape[0], per):
            hi = min(p.shape[0], lo + per)
            tmp = torch.empty((hi - lo, *p.shape[1:]), dtype=p.dtype, device=gen.device)
            p[lo:hi].copy_(tmp.normal_(mean, std, generator=gen))


@torch.no_grad()
def init_seeded(model, seed: int = SEED, advance: Callable[[int], None] | None = None) -> None:
    """Fill every parameter from a seeded generator, scaled so activations stay O(1) and the
    logits are peaked enough that greedy decoding is not a coin toss between near-ties.
    ``advance(nbytes)`` is called as each parameter is filled (progress)."""
    gen = torch.Generator(device=model.device).manual_seed(seed)
    n_layers = max(1, model.config.num_hidden_layers)
    for name, p in model.named_parameters():
        if advance is not None:
            advance(p.numel() * p.element_size())
        leaf = name.rsplit(".", 2)
        if name.endswith("A_log"):
            p.copy_(torch.empty(p.shape, device=p.device).uniform_(1.0, 16.0, generator=gen).log())
        elif name.endswith("dt_bias"):
            p.fill_(1.0)
        elif name.endswith("linear_attn.norm.weight"):
            p.normal_(1.0, 0.05, generator=gen)
        elif name.endswith("norm.weight") or "norm_" in leaf[-2]:
            p.normal_(0.0, 0.05, generator=gen)  # zero-centred (1 + w) norms
        elif name.endswith("conv1d.weight"):
            p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]), generator=gen)
        elif name == "embed_tokens.weight":
            p.normal_(0.0, 1.0, generator=gen)
        elif name == "lm_head.weight":
            p.normal_(0.0, 4.0 / math.sqrt(p.shape[-1]), generator=gen)
        else:
            fan_in = p.shape[-1]
            std = 1.0 / math.sqrt(fan_in)
            if any(name.endswith(s) for s in ("o_proj.weight", "out_proj.weight", "down_proj.weight")):
                std /= math.sqrt(2 * n_layers)
            _normal(p, 0.0, std, gen)


def build_builtin(name: str, dtype=None, device="cpu", offload_experts: bool = False, progress: bool = False,
                  vocab_size: int | None = None):
    """``offload_experts``: the routed experts are created in host memory and seeded there (see
    :func:`_normal`), never on ``device``. Refuses (CapacityError) a model whose weights do not
    fit the free memory before allocating anything; ``progress`` shows the seeding on stderr.
    ``vocab_size``: a seeded shape with another vocabulary (a benchmark of what does not depend
    on it, which a 248k-row ``lm_head``'s time would only blur)."""
    from hpc_cli import progress as steps
    from hpc_cli.model.footprint import check_fits
    from hpc_cli.model.model import HybridModel, resolve_dtype

    cfg = builtin_config(name)
    if vocab_size is not None:
        assert name.removeprefix("builtin:") != "tiny", "builtin:tiny is trained with its own vocabulary"
        cfg = ModelConfig(**{**cfg.to_dict(), "vocab_size": int(vocab_size)})
    if name.removeprefix("builtin:") == "tiny":
        from hpc_cli.model.loader import load_checkpoint

        model = load_checkpoint(TINY_DIR, dtype=dtype, device=device, progress=progress)
        model.config.name = cfg.name
        return model
    dt = resolve_dtype(dtype, torch.device(device))
    fp = check_fits(name, cfg, dt, device, with_mtp=True, offload_experts=offload_experts)
    what = f"building {name} ({fp.total_bytes / (1 << 30):.2f} GiB of {str(dt).replace('torch.', '')} weights on {device})"
    with steps.step(what, fp.total_bytes, unit="bytes", enabled=progress) as advance:
        model = HybridModel(cfg, device=device, dtype=dtype, with_mtp=True, offload_experts=offload_experts)
        init_seeded(model, advance=advance)
    model.tokenizer = ByteTokenizer()
    model.eval()
    return model
