"""The engine on CUDA: device resume and host restore give the same greedy output as a cold
prefill, for BF16 and quantised KV, with the copy-engine transfer path and per-layer events."""

from __future__ import annotations

import pytest
import torch

from hpc_cli.engine.api import GenerationRequest, SamplingParams
from hpc_cli.engine.engine import Engine

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("profile", ["bf16", "int8-g64", "nvfp4-g16"])
def test_cuda_resume_and_host_restore_match_cold(profile):
    from hpc_cli.model.model import HybridModel

    model = HybridModel.from_name_or_path("builtin:random", dtype=torch.float32, device="cuda")
    # few pages and snapshot slots, so that the unrelated prompts below push the prompt's device
    # copies out (with 600 pages and the default slots they all stayed on the device)
    eng = Engine(model, kv_profile=profile, kv_pages=160, snapshot_slots=4, host_cache_mib=256,
                 prefill_chunk=256, max_model_len=4096).start()
    prompt = list(range(10, 250)) * 8  # 1920 tokens: the final chunk starts at 1792, where the tail tap is taken
    sp = SamplingParams(max_tokens=24, temperature=0)
    try:
        cold, _ = eng.generate(GenerationRequest(prompt, sp))
        resumed, f2 = eng.generate(GenerationRequest(prompt, sp))
        for s in range(3):  # unrelated prompts push the device copies out (they stay on the host)
            eng.generate(GenerationRequest([(7 * i + s) % 250 + 1 for i in range(3000)],
                                           SamplingParams(max_tokens=2, temperature=0)))
        restored, f3 = eng.generate(GenerationRequest(prompt, sp))
    finally:
        eng.stop()
    assert eng.fatal is None
    eng.check_invariants()
    # fp32 on the device: a different chunk decomposition may still flip a late near-tie, so the
    # first tokens must agree exactly and the rest almost everywhere.
    def agree(a, b):
        return sum(x == y for x, y in zip(a, b)) / len(a)

    assert f2.usage.reuse_tokens >= 1792 and resumed[:8] == cold[:8] and agree(resumed, cold) >= 0.9
    assert f3.usage.reuse_tokens >= 1792 and f3.usage.restored_host_bytes > 0
    assert restored[:8] == cold[:8] and agree(restored, cold) >= 0.9


def test_cuda_decode_steps_built_ahead_equal_steps_built_in_turn():
    """Each decode step's index is built while the device runs the step before, and used when the
    lanes go on as they were: the tokens equal those of steps whose index is built in turn, for
    one lane and for three (lanes joining and ending mid-decode, positions crossing pages)."""
    from hpc_cli.model.model import HybridModel

    model = HybridModel.from_name_or_path("builtin:random", dtype=torch.bfloat16, device="cuda")
    prompts = [[(13 * i + 7 * n) % 250 + 1 for i in range(length)] for n, length in enumerate((50, 130, 200))]
    sp = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (90, 70, 40)]

    def run(ahead: bool) -> tuple[list[list[int]], int]:
        eng = Engine(model, kv_profile="int8-g64", prefill_chunk=256, max_model_len=1024, decode_ahead=ahead).start()
        graphs = model.column_graphs(eng.storage)
        before = graphs.prepared_replays if graphs is not None else 0
        try:
            alone = [eng.generate(GenerationRequest(p, s))[0] for p, s in zip(prompts, sp)]
            handles = [eng.submit(GenerationRequest(p, s)) for p, s in zip(prompts, sp)]
            together = [[ev.token_id for ev in h.result(timeout=120)[0]] for h in handles]
            used = graphs.prepared_replays - before if graphs is not None else 0
        finally:
            eng.stop()
        assert eng.fatal is None
        return alone + together, used

    ahead, used = run(True)
    in_turn, unused = run(False)
    assert unused == 0 and used >= 150, (used, unused)  # most of the 400 steps
    assert ahead == in_turn
