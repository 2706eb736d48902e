"""A tiny Qwen3.5-MoE model with seeded weights for the expert tier tests."""

from __future__ import annotations

import torch

from hpc_cli.model.builtin import init_seeded
from hpc_cli.model.config import ModelConfig
from hpc_cli.model.model import HybridModel
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
