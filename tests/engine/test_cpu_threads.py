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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.skipif(torch.get_num_threads() < 2 or "OpenMP" not in torch.__config__.parallel_info(),
                    reason="needs torch's OpenMP with two threads or more")
def test_an_idle_cpu_engine_holds_no_thread_team(model):
    """A worker that goes idle hands its team back: a second engine in the process (a benchmark's
    other backend) or any other thread's parallel ops then do not find more busy threads than
    cores (two started engines decoded 1.75x slower each before)."""
    import threading
    import time

    from hpc_cli.engine.api import GenerationRequest, SamplingParams
    from hpc_cli.engine.engine import Engine

    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    eng = Engine(model, kv_profile="bf16", prefill_chunk=256, max_model_len=1024).start()
    try:
        eng.generate(GenerationRequest(list(range(3, 40)), sp))  # the worker's first ops
        time.sleep(0.2)
        before = _threads()  # the engine's thread, idle, and no team of its own
        seen: set[str] = set()
        running = threading.Event()
        running.set()

        def sample() -> None:  # the threads that appear while the worker computes
            me = str(threading.get_native_id())
            while running.is_set():
                seen.update(_threads() - before - {me})
                time.sleep(0.002)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        eng.generate(GenerationRequest(list(range(3, 250)), SamplingParams(
            max_tokens=64, temperature=0, ignore_eos=True)))
        running.clear()
        sampler.join()
        deadline = time.monotonic() + 5.0
        while _threads() - before and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen, "the worker ran its parallel ops without a team (nothing to hand back)"
        assert not (_threads() - before), "the idle worker kept its OpenMP team"
    finally:
        eng.stop()
