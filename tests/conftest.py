"""Shared test setup: `gpu` tests skip without CUDA; plugin state is reset around each test."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch missing
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_plugins(monkeypatch):
    """Each test sees the plugins of its own environment (HPC_LOAD_PLUGINS, PYTHONPATH)."""
    from hpc_cli import plugins

    for name in list(__import__("os").environ):
        if name.startswith("HPC_"):
            monkeypatch.delenv(name)
    plugins.reset()
    yield
    plugins.reset()
