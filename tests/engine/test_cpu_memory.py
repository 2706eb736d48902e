"""Freed memory kept in the process on the CPU (hpc_cli/engine/cpu_memory.py): buffers freed and
allocated again come back without faulting their pages in again, and the engine keeps memory so
where ``[engine] cpu_keep_memory`` asks."""

import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent("""
    import resource, sys
    import torch
    from hpc_cli.engine.cpu_memory import keep_freed_memory
    kept = keep_freed_memory() if sys.argv[1] == "keep" else None
    def faults_of_a_fill():
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t = torch.empty(96 << 20, dtype=torch.uint8)
        t.fill_(1)
        del t
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    print(kept, *[faults_of_a_fill() for _ in range(12)])
""")


def _fills(mode: str) -> tuple[str, list[int]]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
    kept, *faults = out.stdout.split()
    return kept, [int(f) for f in faults]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_buffers_freed_and_allocated_again_come_back_without_faults():
    kept, faults = _fills("keep")
    if kept != "True":
        pytest.skip("the C library is not glibc")
    # 96 MiB is 24,576 pages: glibc's default maps such a block anew each time, every page a fault;
    # kept, a block comes back from the heap (once freed blocks have merged: an aligned block is a
    # little larger than the one freed before it)
    _, default = _fills("default")
    assert min(default) > 20_000, default
    assert min(faults) < 1_000, faults


@pytest.mark.parametrize("keep", [True, False])
def test_the_engine_keeps_freed_memory_where_asked(monkeypatch, keep):
    import torch

    import hpc_cli.engine.engine as engine_module
    from hpc_cli.engine.engine import Engine
    from hpc_cli.model import HybridModel

    calls = []
    monkeypatch.setattr(engine_module, "keep_freed_memory", lambda: calls.append(1) or True)
    model = HybridModel.from_name_or_path("builtin:random", dtype=torch.float32, device="cpu")
    e = Engine(model, kv_pages=16, max_concurrency=1, cpu_keep_memory=keep).start()
    try:
        assert calls == ([1] if keep else [])
    finally:
        e.stop()
