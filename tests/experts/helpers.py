"""A tiny Qwen3.5-MoE model with seeded weights for the expert tier tests."""

from __future__ import annotations

import torch

from hpc_cli.model.builtin import init_seeded
from hpc_cli.model.config import ModelConfig
from hpc_cli.experts.tier import ExpertTier
from hpc_cli.model.model import HybridModel
from hpc_cli.model.moe import Experts
from hpc_cli.model.tokenizer import ByteTokenizer


def tiny_moe_config(layers: int = 4, experts: int = 16, top_k: int = 4) -> ModelConfig:
    return ModelConfig(
        name=f"tiny-moe@{layers}", model_type="qwen3_5_moe", vocab_size=272, hidden_size=64,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, eos_token_id=[258, 256], mtp_num_hidden_layers=0)


def tiny_moe(seed: int = 7, **kw) -> HybridModel:
    model = HybridModel(tiny_moe_config(**kw), device="cpu", dtype=torch.float32)
    init_seeded(model, seed)
    model.tokenizer = ByteTokenizer()
    model.eval()
    return model


def logits_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal within fp32 rounding: the misses are computed on the host CPU and the hits with other
    GEMM shapes than the reference's, so a few small logits differ by ~1e-3 absolute after the
    layers (measured on an H200: 40 of 17408, largest 6.5e-4); the whole agrees to 1e-4 in norm
    and every position keeps its top-1."""
    rel = ((got.double() - ref.double()).norm() / ref.double().norm()).item()
    assert rel <= 1e-4, f"relative difference {rel:.3g}"
    assert torch.equal(got.argmax(-1), ref.argmax(-1)), "a top-1 token differs"


def check_layer_equals_plain_experts(m: HybridModel, path: str, resident: int, tol: float) -> ExpertTier:
    """Layer 1 of ``m`` through an ExpertTier (``path``: "gather", "chunked" (one token a gather)
    or "loop"; ``resident`` of the layer's experts admitted) against the plain fused experts of
    the same weights, at a decode and two prefill batches, on ``m``'s device and dtype, to
    ``rtol = atol = tol``. Returns the tier (for its counters)."""
    c = m.config
    ref = m.layers[1].mlp.experts
    device, dtype = ref.gate_up_proj.device, ref.gate_up_proj.dtype
    plain = Experts(c.num_experts, c.hidden_size, c.moe_intermediate_size, device=device, dtype=dtype)
    with torch.no_grad():
        plain.gate_up_proj.copy_(ref.gate_up_proj)
        plain.down_proj.copy_(ref.down_proj)
    tier = ExpertTier(m, slots=c.num_hidden_layers * c.num_experts, admission="first-routed")
    if path == "loop":
        tier.gather_max_picks = 0
    if path == "chunked":  # one token a gather
        tier.gather_max_bytes = 1
    for e in range(resident):
        tier.admit_blocking(1, (3 * e) % c.num_experts)
    gen = torch.Generator(device=device).manual_seed(3)
    for n in (1, 3, 40):
        x = torch.randn(n, c.hidden_size, generator=gen, device=device).to(dtype)
        w, idx = m.layers[1].mlp.route(x)
        torch.testing.assert_close(tier.routed(1, x, idx, w, None), plain(x, idx, w), rtol=tol, atol=tol)
    return tier
