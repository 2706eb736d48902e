"""hpc_cli.engine.cpu_threads: the thread that starts a CPU engine hands its OpenMP team back, so
that the worker's parallel ops do not wait on a throttled team (the module doc has the figures)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from hpc_cli.engine.cpu_threads import release_thread_team


def _threads() -> set[str]:
    return set(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.skipif(torch.get_num_threads() < 2 or "OpenMP" not in torch.__config__.parallel_info(),
                    reason="needs torch's OpenMP with two threads or more")
def test_the_calling_threads_team_ends_and_comes_back_on_its_next_parallel_op():
    x = torch.randn(1 << 22)
    x.mul_(1.0001)  # a parallel op: this thread's team exists
    with_team = _threads()
    assert release_thread_team() is True
    without = _threads()
    assert len(with_team - without) >= torch.get_num_threads() - 1  # its idle threads are gone
    x.mul_(1.0001)
    assert len(_threads() - without) >= torch.get_num_threads() - 1  # a parallel op gets a new team


def test_a_cpu_engine_started_after_a_parallel_op_answers_as_before(model):
    from hpc_cli.engine.api import GenerationRequest, SamplingParams
    from hpc_cli.engine.engine import Engine

    prompt = list(range(3, 90))
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    kv = model.new_kv_storage("bf16", 8)
    states = model.new_state_slots(1)
    out = model.prefill(torch.tensor(prompt), 0, list(range(8)), 0, kv, states)
    first = int(out.logits.argmax())
    torch.randn(1 << 22).mul_(2.0)  # this thread runs a parallel op, then starts the engine
    eng = Engine(model, kv_profile="bf16", prefill_chunk=256, max_model_len=1024).start()
    try:
        toks, _ = eng.generate(GenerationRequest(prompt, sp))
    finally:
        eng.stop()
    assert eng.fatal is None and len(toks) == 12 and toks[0] == first
