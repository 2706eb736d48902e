"""The paged attention kernels equal gather + SDPA over the same pages for every built-in KV
profile: decode (hpc_kernels.paged_attention) and prefill (hpc_kernels.paged_prefill, causal, with
padded rows); on CPU through Triton's interpreter (fp32), on CUDA compiled (fp32 and bf16)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CHECKS = ["_paged_attention_check.py", "_paged_prefill_check.py"]


def _run(check: str, env_extra: dict, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, **env_extra)
    return subprocess.run([sys.executable, str(Path(__file__).with_name(check)), *args], env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("check", CHECKS)
def test_kernel_matches_sdpa_in_interpreter(check):
    pytest.importorskip("triton")
    r = _run(check, {"TRITON_INTERPRET": "1"})
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("check", CHECKS)
def test_kernel_matches_sdpa_on_cuda(check):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    r = _run(check, {}, "--cuda")
    assert r.returncode == 0, r.stdout + r.stderr
