"""Speculative decoding on CPU with builtin:random (docs/speculative.md)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def model():
    from hpc_cli.model.model import HybridModel

    torch.manual_seed(0)
    return HybridModel.from_name_or_path("builtin:random", dtype=torch.float32)
