"""Our loader + math against transformers' Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM (fp32)."""

from __future__ import annotations

import pytest
import torch

from hpc_cli.model import HybridModel

from .helpers import F32, rel_err, rewrite_checkpoint

TOKENS = torch.randint(0, 300, (150,), generator=torch.Generator().manual_seed(3))
BOUND = 1e-4


def _reference(hf_model) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(TOKENS[None]).logits[0]


def _ours(path) -> torch.Tensor:
    model = HybridModel.from_name_or_path(str(path), dtype=torch.float32, progress=False)
    return model.forward_tokens(TOKENS, kv_profile=F32)


@pytest.mark.parametrize("layout", ["model", "language_model", "sharded"])
def test_dense_logits_match_transformers(hf_dense, tmp_path, layout):
    hf_model, path = hf_dense
    if layout == "language_model":
        path = rewrite_checkpoint(path, tmp_path / "lm", language_model=True)
    elif layout == "sharded":
        path = rewrite_checkpoint(path, tmp_path / "sharded", language_model=True, shards=3)
    err = rel_err(_ours(path), _reference(hf_model))
    assert err <= BOUND, f"dense logits differ from transformers by {err:.2e} ({layout} layout)"


@pytest.mark.parametrize("layout", ["model", "language_model-fused"])
def test_moe_logits_match_transformers(hf_moe, tmp_path, layout):
    hf_model, path = hf_moe
    if layout != "model":
        path = rewrite_checkpoint(path, tmp_path / "lm", language_model=True, fuse_experts=True)
    err = rel_err(_ours(path), _reference(hf_model))
    assert err <= BOUND, f"MoE logits differ from transformers by {err:.2e} ({layout} layout)"


def test_mtp_weights_are_loaded_and_kept(hf_dense, tmp_path):
    _, path = hf_dense
    plain = HybridModel.from_name_or_path(str(path), dtype=torch.float32, progress=False)
    assert plain.mtp is None  # save_pretrained of the CausalLM drops mtp.*
    probe = HybridModel(plain.config, with_mtp=True)
    g = torch.Generator().manual_seed(7)
    extra = {f"mtp.{n}": torch.randn(p.shape, generator=g) for n, p in probe.mtp.named_parameters()}
    path2 = rewrite_checkpoint(path, tmp_path / "mtp", language_model=True, extra=extra)
    model = HybridModel.from_name_or_path(str(path2), dtype=torch.float32, progress=False)
    assert model.mtp is not None
    got = dict(model.mtp.named_parameters())
    assert set(got) == {k[len("mtp."):] for k in extra}
    for k, v in extra.items():
        assert torch.equal(got[k[len("mtp."):]], v), k
    assert "mtp.layers.0.self_attn.q_proj.weight" in extra


def test_shape_matches_config(hf_dense):
    _, path = hf_dense
    model = HybridModel.from_name_or_path(str(path), dtype=torch.float32, progress=False)
    shape = model.shape()
    assert shape.attention_layers == [1, 3] and shape.gdn_layers == [0, 2]
    assert shape.conv_dim == 2 * 2 * 16 + 4 * 16
    states = model.new_state_slots(2)
    assert states.image_bytes == shape.state_image_bytes()
