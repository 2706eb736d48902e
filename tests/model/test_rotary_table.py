"""The rotary table (:meth:`hpc_cli.model.layers.Rotary.hold_table`): on CUDA every pass reads
cos/sin rows from a table the engine holds, bit for bit what computing them gives; on the CPU
nothing changes."""

from __future__ import annotations

import pytest
import torch

from hpc_cli.engine.engine import ROTARY_MARGIN, Engine
from hpc_cli.model.layers import Rotary
from hpc_cli.model.model import HybridModel

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_the_cpu_holds_no_table_and_computes():
    r = Rotary(64, 1e7)
    r.hold_table(4096, torch.float32)
    assert r.tables == {}
    pos = torch.tensor([0, 5, 4095, 9000])
    for got, want in zip(r.cos_sin(pos, torch.float32), r.compute(pos, torch.float32)):
        assert torch.equal(got, want)


def test_a_held_table_gives_its_rows_and_clamps_padding_positions():
    r = Rotary(16, 1e4)
    table = r.compute(torch.arange(100), torch.float32)
    r.tables[torch.float32] = table  # as hold_table keeps it on CUDA
    pos = torch.tensor([0, 7, 99, 100, 5000, -3])
    cos, sin = r.cos_sin(pos, torch.float32)
    rows = torch.tensor([0, 7, 99, 99, 99, 0])
    assert torch.equal(cos, table[0][rows]) and torch.equal(sin, table[1][rows])
    assert cos.is_contiguous() and sin.is_contiguous()  # the fused norm-and-rope kernel reads them so
    # another dtype, or positions on another device, are computed
    assert torch.equal(r.cos_sin(pos[:3], torch.float64)[0], r.compute(pos[:3], torch.float64)[0])


def test_an_engine_on_the_cpu_leaves_the_model_computing():
    model = HybridModel.from_name_or_path("builtin:random", dtype=torch.float32, device="cpu")
    Engine(model, kv_pages=8, max_concurrency=1, reuse=False)
    assert model.rotary.tables == {}


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_table_rows_are_the_computed_values_bit_for_bit(dtype):
    r = Rotary(64, 1e7, device="cuda")
    r.hold_table(40_000, dtype)
    gen = torch.Generator().manual_seed(0)
    for n in (1, 2, 3, 4, 5, 8, 17, 64, 513, 2048, 4099):  # the lengths of a step, a verify pass, a prefill
        pos = torch.randint(0, 40_000, (n,), generator=gen).cuda()
        for got, want in zip(r.cos_sin(pos, dtype), r.compute(pos, dtype)):
            assert torch.equal(got, want), (n, dtype)


@cuda
@pytest.mark.gpu
def test_cuda_engine_holds_its_longest_sequence_and_keeps_older_tables():
    model = HybridModel.from_name_or_path("builtin:random", dtype=torch.bfloat16, device="cuda")
    e = Engine(model, kv_pages=8, max_concurrency=1, reuse=False, max_model_len=512)
    cos, _ = model.rotary.tables[torch.bfloat16]
    assert cos.shape[0] == e.max_model_len + ROTARY_MARGIN and cos.device.type == "cuda"
    first = cos
    Engine(model, kv_pages=8, max_concurrency=1, reuse=False, max_model_len=1024)
    assert model.rotary.tables[torch.bfloat16][0].shape[0] == 1024 + ROTARY_MARGIN
    assert any(t[0] is first for t in model.rotary.retired)  # graphs captured with it still read it
