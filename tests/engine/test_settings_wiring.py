"""Profile keys that reach the engine's parts: ``[engine] cuda_graphs`` and ``[cache] transfer_copy``."""

from __future__ import annotations

import pytest

from hpc_cli.engine.engine import Engine
from hpc_cli.settings import load_settings


def _engine(**keys):
    base = {"engine.kv_capacity": 32, "engine.max_concurrency": 1, "model.name": "builtin:random",
            "cache.host_cache_mib": 16}
    return Engine.from_settings(load_settings(None, {**base, **keys}, environ={}))


@pytest.mark.parametrize("copy", ["auto", "dma", "kernel"])
def test_transfer_copy_reaches_the_transfer_engine_and_the_taps(copy):
    e = _engine(**{"cache.transfer_copy": copy, "engine.cuda_graphs": False})
    assert e.cache.transfer.copy_method == copy
    assert e.states.tap_method == ("torch" if copy == "dma" else None)
    assert e.model.cuda_graphs is False


def test_defaults_keep_graphs_on_and_auto_copies():
    e = _engine()
    assert e.cache.transfer.copy_method == "auto" and e.model.cuda_graphs is True


def test_bad_transfer_copy_is_a_config_error():
    from hpc_cli.errors import HpcError

    with pytest.raises(HpcError, match="transfer_copy"):
        load_settings(None, {"cache.transfer_copy": "fast"}, environ={})
