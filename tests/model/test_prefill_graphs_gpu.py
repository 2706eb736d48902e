"""Prefill passes replayed from CUDA graphs: bit-identical to the eager pass, for every start and
length a padded length serves, with nothing compiled after the first pass of a shape."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def _cuda_model(dtype):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from hpc_cli.model.model import HybridModel

    return HybridModel.from_name_or_path("builtin:random", dtype=dtype, device="cuda")


# (start, length): several passes share one padded length (64 or 128) at other starts and tables
PASSES = [(0, 100), (100, 37), (137, 64), (201, 120), (321, 1), (322, 90), (412, 128), (540, 7)]


def _run(model, profile, graphs: bool):
    model.cuda_graphs = graphs
    kv, states = model.new_kv_storage(profile, 16), model.new_state_slots(3)
    table = [11, 3, 14, 0, 9, 5, 12, 1, 7, 15]
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(1, model.config.vocab_size, (600,), generator=g).tolist()
    logits = []
    for start, n in PASSES:
        out = model.prefill(tokens[start:start + n], start, table, 2, kv, states)
        logits.append(out.logits.float().cpu())
    torch.cuda.synchronize()
    return logits, kv, states


@pytest.mark.parametrize("profile", ["bf16", "int8-g64", "nvfp4-g16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_graph_replays_equal_eager_passes(profile, dtype):
    from hpc_cli.model.compile_watch import watch

    model = _cuda_model(dtype)
    eager = _run(model, profile, graphs=False)
    first = _run(model, profile, graphs=True)  # eager first passes of each shape, then captures
    graphs = model.prefill_graphs(first[1])
    assert graphs is not None and graphs.disabled is None, "prefill graphs are not used"
    counts = watch()
    before = counts.compilations + counts.autotunes
    replayed = _run(model, profile, graphs=True)
    assert graphs.replays >= len(PASSES) - 2, f"only {graphs.replays} passes replayed a graph"
    assert counts.compilations + counts.autotunes == before, "a replayed pass compiled or tuned a kernel"
    for run in (first, replayed):
        for a, b in zip(run[0], eager[0]):
            assert torch.equal(a, b), "logits differ from the eager pass"
        states, ref = run[2], eager[2]
        for i in range(len(states.recurrent)):
            assert torch.equal(states.recurrent[i], ref.recurrent[i]), f"GDN layer {i} state"
            assert torch.equal(states.conv[i], ref.conv[i]), f"GDN layer {i} conv window"
        assert torch.equal(states.hidden, ref.hidden)
        for layer in range(len(run[1].planes)):
            for p, q in zip(run[1].planes[layer], eager[1].planes[layer]):
                assert torch.equal(p, q), f"attention layer {layer}: pages differ"
