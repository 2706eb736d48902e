"""The tier on CUDA: asynchronous first-routed fills, blocking profile fills, verify, the split."""

from __future__ import annotations

import pytest
import torch

from hpc_cli.model.builtin import init_seeded
from hpc_cli.model.expert_profile import build_profile, synthetic_trace, trace_counts
from hpc_cli.model.experts import ExpertTier
from hpc_cli.model.model import HybridModel

from .helpers import tiny_moe_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _model():
    m = HybridModel(tiny_moe_config(), device="cuda", dtype=torch.float32)
    init_seeded(m, 7)
    return m.eval()


@pytest.mark.parametrize("policy", ["profile", "first-routed", "per-layer-first-routed"])
def test_split_on_cuda(policy):
    prompt = list(range(5, 69))
    ref = _model().forward_tokens(prompt)
    m = _model()
    c = m.config
    prof = build_profile(trace_counts(synthetic_trace(100, c.num_hidden_layers, c.num_experts,
                                                      c.num_experts_per_tok), c.num_experts), 24)
    tier = ExpertTier(m, slots=24, admission=policy, profile=prof, verify=True)
    assert tier.host[0].packed.is_pinned() and tier.cache.base.is_cuda
    for _ in range(3):
        torch.testing.assert_close(m.forward_tokens(prompt), ref, rtol=1e-4, atol=1e-4)
    tier.verify_all()
    st = tier.stats()
    assert st["resident"] == 24 and st["hit_rate"] > 0
    slot = next(i for i, o in enumerate(tier.cache.owner) if o is not None)
    tier.cache.device_slot(slot)[3] ^= 1
    with pytest.raises(Exception, match="differs from the host copy"):
        tier.verify_all()
