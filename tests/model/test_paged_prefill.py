"""The paged prefill attention kernel (hpc_kernels.paged_prefill) equals gather + causal SDPA over the
same pages for every built-in KV profile: on CPU through Triton's interpreter (fp32), on CUDA
compiled (fp32 and bf16)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CHECK = Path(__file__).with_name("_paged_prefill_check.py")


def _run(env_extra: dict, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, **env_extra)
    return subprocess.run([sys.executable, str(CHECK), *args], env=env, capture_output=True, text=True, timeout=600)


def test_kernel_matches_sdpa_in_interpreter():
    pytest.importorskip("triton")
    r = _run({"TRITON_INTERPRET": "1"})
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.gpu
def test_kernel_matches_sdpa_on_cuda():
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    r = _run({}, "--cuda")
    assert r.returncode == 0, r.stdout + r.stderr
