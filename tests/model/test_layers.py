"""hpc_cli.model.layers: :func:`linear`'s form for a few rows on the CPU, and :func:`fused`. The
fused kernels have no backward, so a forward that autograd records (a training forward such as
scripts/train_tiny.py's) takes the torch ops, and one that it does not (serving: gradients off,
weights that require none) takes the kernels. On the CPU the kernels' launch check is forced on
and the kernels are replaced by recorders; on CUDA a drafter training step of
scripts/train_tiny.py must move every drafter weight (``-m gpu``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from hpc_cli.model import gdn, layers
from hpc_cli.model.layers import MLP, GatedRMSNorm, RMSNorm

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def kernels_on(monkeypatch):
    """The fused path "available" on the CPU; every kernel it would launch records its name and
    returns its torch twin's result (so a forward that takes it still runs)."""
    called: list[str] = []
    monkeypatch.setattr(layers, "FUSED_KERNELS", True)
    monkeypatch.setattr(layers, "launchable", lambda x: True)
    norm = layers.norm_kernels

    def recorder(name, twin):
        def run(*args, **kwargs):
            called.append(name)
            return twin(*args, **kwargs)
        return run

    monkeypatch.setattr(norm, "rms_norm", recorder("rms_norm", norm.rms_norm_ref))
    monkeypatch.setattr(norm, "add_rms_norm", recorder("add_rms_norm", norm.add_rms_norm_ref))
    monkeypatch.setattr(norm, "gated_rms_norm", recorder("gated_rms_norm", norm.gated_rms_norm_ref))
    monkeypatch.setattr(layers.swiglu, "swiglu", recorder("swiglu", layers.swiglu.swiglu_ref))
    return called


def _norm(dim: int) -> RMSNorm:
    n = RMSNorm(dim)
    with torch.no_grad():
        n.weight.normal_(0, 0.1)
    return n


def _mlp(hidden: int = 16, inter: int = 32) -> MLP:
    m = MLP(hidden, inter)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.2)
    return m


def test_serving_forwards_take_the_kernels(kernels_on):
    x = torch.randn(4, 16)
    with torch.inference_mode():
        _norm(16)(x)
        _norm(16).add(x, x)
        GatedRMSNorm(16)(x, torch.randn(4, 16))
        _mlp()(x)
    with torch.no_grad():  # gradients off, even with weights that would require them
        n = _norm(16)
        n.weight.requires_grad_(True)
        n(x)
    assert kernels_on == ["rms_norm", "add_rms_norm", "gated_rms_norm", "swiglu", "rms_norm"]
    assert layers.fused(x)  # plain tensors with gradients on: nothing to record either


def test_a_recorded_forward_takes_the_torch_ops_and_gets_its_gradients(kernels_on):
    # the input requires its gradient (a drafter's hidden built from trained weights)
    x = torch.randn(4, 16, requires_grad=True)
    norm = _norm(16)
    norm(x).square().sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    # only the weight does (a drafter's first norm reads the frozen model's embedding)
    norm.weight.requires_grad_(True)
    plain = torch.randn(4, 16)
    norm(plain).square().sum().backward()
    assert norm.weight.grad is not None and norm.weight.grad.abs().sum() > 0
    gnorm = GatedRMSNorm(16)
    with torch.no_grad():
        gnorm.weight.fill_(1.0)
    gate = torch.randn(4, 16, requires_grad=True)
    gnorm(plain, gate).sum().backward()
    assert gate.grad is not None and gate.grad.abs().sum() > 0
    mlp = _mlp()
    for p in mlp.parameters():
        p.requires_grad_(True)
    mlp(plain).square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in mlp.parameters())
    s, _ = norm.add(x, plain)
    assert s.grad_fn is not None
    assert kernels_on == [], kernels_on  # no kernel without a backward ran


def test_the_attention_norm_rope_and_conv_follow_the_same_rule(kernels_on, monkeypatch):
    calls = []
    monkeypatch.setattr(layers.norm_kernels, "rms_norm_rope",
                        lambda *a, **k: calls.append("rms_norm_rope") or torch.zeros(1))
    norm = _norm(8)
    x = torch.randn(3, 2, 8)
    cos, sin = torch.ones(3, 4), torch.zeros(3, 4)
    with torch.inference_mode():
        layers.norm_rope(norm, x, cos, sin)
    assert calls == ["rms_norm_rope"]
    x.requires_grad_(True)
    out = layers.norm_rope(norm, x, cos, sin)
    assert calls == ["rms_norm_rope"] and out.grad_fn is not None
    assert gdn.fused is layers.fused  # the GDN layer's conv asks the same question


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_drafter_training_step_moves_every_drafter_weight():
    """Two steps of scripts/train_tiny.py's drafter phase on CUDA (the fused kernels on) move every
    DFlash and DFlash2 weight: before the rule, the fused norms cut the graph and only DFlash2's
    selector (which reads the hidden past the last norm) ever trained on a GPU."""
    from types import SimpleNamespace

    sys.path.insert(0, str(ROOT / "scripts"))
    import train_tiny

    from hpc_cli.model.model import HybridModel
    from hpc_cli.speculative.dflash import load_drafter

    dev = torch.device("cuda")
    tiny = ROOT / "hpc_cli" / "model" / "tiny"
    model = HybridModel.from_name_or_path(str(tiny), dtype=torch.float32, device=dev)
    nets = {kind: load_drafter(str(tiny / kind), kind, dev, torch.float32).train() for kind in ("dflash", "dflash2")}
    before = {kind: {n: p.detach().clone() for n, p in net.named_parameters()} for kind, net in nets.items()}
    rows = torch.randint(1, 6000, (4, 129), generator=torch.Generator().manual_seed(0))
    args = SimpleNamespace(no_mtp=True, draft_lr=1e-3, draft_steps=2, draft_seconds=1e9, block_sizes=[3],
                           anchors=8, batch=2, log_every=100, corpus_every=0, checkpoint_every=0)
    try:
        train_tiny.train_drafters(model, nets, {"train": rows, "val": rows}, args, dev, {})
    finally:
        for p in model.parameters():
            p.requires_grad_(False)
    for kind, net in nets.items():
        still = [n for n, p in net.named_parameters() if torch.equal(p.detach(), before[kind][n])]
        assert not still, f"{kind}: weights the steps did not move: {still}"


def test_a_few_rows_product_on_the_cpu_runs_as_weight_times_rows(monkeypatch):
    """hpc_cli.model.layers.linear: float32 products of 2..FEW_ROWS rows on the CPU are
    ``(W @ x^T)^T`` (decode's and verify's row blocks), bit for bit the same whatever the leading
    dims, and one row with a tall weight the same padded to two rows; other single rows, longer
    runs, a bias and bf16 keep ``F.linear``; the forms agree to float32 rounding."""
    seen: list[tuple[int, ...]] = []
    real = layers.F.linear

    def spy(x, w, b=None):
        seen.append(tuple(x.shape))
        return real(x, w, b)

    monkeypatch.setattr(layers.F, "linear", spy)
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 32, generator=g)
    for rows in (2, 4, layers.FEW_ROWS):
        x = torch.randn(rows, 32, generator=g)
        y = layers.linear(x, w)
        assert torch.equal(y, torch.mm(w, x.t()).t())
        assert torch.equal(layers.linear(x.view(1, rows, 32), w), y.view(1, rows, 96))
        assert torch.allclose(y, real(x, w), rtol=1e-5, atol=1e-5)
    assert seen == []
    layers.linear(torch.randn(1, 32), w)
    layers.linear(torch.randn(layers.FEW_ROWS + 1, 32), w)
    layers.linear(torch.randn(4, 32), w, torch.zeros(96))
    layers.linear(torch.randn(4, 32, dtype=torch.bfloat16), w.bfloat16())
    assert seen == [(1, 32), (layers.FEW_ROWS + 1, 32), (4, 32), (4, 32)]
    # one row with a tall weight (an lm_head): padded to two rows, the padding's column dropped
    monkeypatch.setattr(layers, "TALL_ELEMENTS", 128 * 32)
    tall = torch.randn(128, 32, generator=g)
    x1 = torch.randn(1, 1, 32, generator=g)
    y1 = layers.linear(x1, tall)
    two = torch.cat([x1[0], torch.zeros(1, 32)])
    assert y1.shape == (1, 1, 128) and torch.equal(y1[0, 0], torch.mm(tall, two.t())[:, 0])
    assert torch.allclose(y1, real(x1, tall), rtol=1e-5, atol=1e-5)
    assert len(seen) == 4
    layers.linear(torch.randn(1, 32), tall[:127])  # fewer than 4x as many outputs as inputs
    layers.linear(torch.randn(1, 32), torch.randn(64, 32))  # under TALL_ELEMENTS
    assert seen[4:] == [(1, 32), (1, 32)]
    lin = layers.Linear(32, 96)
    with torch.no_grad():
        lin.weight.copy_(w)
    x = torch.randn(4, 32)
    assert torch.equal(lin(x), torch.mm(w, x.t()).t())
