"""A redis-server per test module (tests that stop it start their own)."""

from __future__ import annotations

import pytest

from .redis_proc import RedisProcess


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    server = RedisProcess(tmp_path_factory.mktemp("redis")).start()
    try:
        yield server
    finally:
        server.stop()
