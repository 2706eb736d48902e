"""Shared setup for the engine scenarios (spec §13.3 on one device, CPU, builtin:random)."""

from __future__ import annotations

import pytest
import torch



@pytest.fixture(scope="module")
def model():
    from hpc_cli.model.model import HybridModel

    torch.manual_seed(0)
    return HybridModel.from_name_or_path("builtin:random", dtype=torch.float32)


