"""The warm-up's plan (hpc_cli.engine.warmup): every prefill length and decode shape on CUDA, the
speculative verify pass's column counts in place of plain decode steps, nothing on the CPU."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from hpc_cli.engine.warmup import plan


def _engine(device: str, spec=None, C: int = 2):
    model = SimpleNamespace(device=torch.device(device), prefill_pad=256)
    return SimpleNamespace(model=model, chunk=1024, max_model_len=4096, C=C, spec=spec)


def test_plain_decode_shapes():
    p = plan(_engine("cuda", C=3))
    assert p.prefill_lengths == (1, 2, 3, 256, 512, 768, 1024)
    assert p.decode_batches == (1, 2, 3)
    assert p.decode_widths == (8, 16, 32, 64)  # 4096 tokens: 64 pages of 64
    assert p.verify_batches == () and p.verify_columns == ()
    assert p.steps == 7 + 3 * 4


def test_speculative_verify_shapes():
    p = plan(_engine("cuda", spec=SimpleNamespace(k=3), C=2))
    assert p.decode_batches == ()  # every decode round is a verify pass
    assert p.verify_batches == (1, 2)
    assert p.verify_columns == (1, 2, 3, 4)  # a round near max_tokens drafts fewer than k
    assert p.steps == 7 + 2 * 4 * 4


def test_nothing_on_cpu():
    assert plan(_engine("cpu", spec=SimpleNamespace(k=3))).steps == 0
