"""Fixtures for the Qwen3.5 runtime tests: tiny HF checkpoints written with save_pretrained."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch




@pytest.fixture(autouse=True)
def _one_thread():
    # These models are tiny: one thread is faster, and torch's CPU advanced indexing is
    # pathologically slow with a 2-thread pool on small machines.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _common(**extra):
    base = dict(vocab_size=300, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                linear_value_head_dim=16, layer_types=["linear_attention", "full_attention"] * 2)
    base.update(extra)
    return base


def _perturb_norms(model) -> None:
    # HF initialises the (1 + w) norms at zero; perturb them so the norm form is actually tested.
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or "dt_bias" in n:
                p.add_(torch.randn(p.shape, generator=g) * 0.2)


@pytest.fixture(scope="session")
def hf_dense(tmp_path_factory):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    cfg = Qwen3_5TextConfig(**_common(intermediate_size=96))
    model = Qwen3_5ForCausalLM(cfg).eval()
    _perturb_norms(model)
    path = tmp_path_factory.mktemp("dense")
    model.save_pretrained(path)
    return model, Path(path)


@pytest.fixture(scope="session")
def hf_moe(tmp_path_factory):
    from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(0)
    cfg = Qwen3_5MoeTextConfig(**_common(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=48))
    model = Qwen3_5MoeForCausalLM(cfg).eval()
    _perturb_norms(model)
    path = tmp_path_factory.mktemp("moe")
    model.save_pretrained(path)
    return model, Path(path)


