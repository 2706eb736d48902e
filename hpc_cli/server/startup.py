"""Checks ``serve`` makes before it listens, and what it does once the engine has failed.

- :func:`prepare_cache_file`: the prefix cache file's path is absent or a regular file, and the
  temporary files of saves a kill interrupted are removed (:mod:`hpc_cli.engine.cache_path`, through :mod:`hpc_cli.engine.api`).
- :func:`check_host_tier`: a host tier of which not one chunk could be allocated refuses the
  start (a CapacityError, exit status 2) instead of serving without it, and above all instead of
  replacing a saved cache file with an empty one at the stop. A tier that stops short keeps
  serving with what it has (a warning says so).
- :func:`fatal_exit`: the error ``serve`` exits with (status 3) after the engine failed and
  ``[server] exit_on_fatal`` stopped the server.
"""

from __future__ import annotations

import os

from hpc_cli.engine.api import HostTier, check_cache_path, remove_stale_temps
from hpc_cli.errors import CapacityError, EngineFatalError

#: how long the start waits for the host tier's first chunk (pinning 4 GiB takes ~1.5 s on an H200)
FIRST_CHUNK_TIMEOUT_S = 60.0


def prepare_cache_file(path: str | os.PathLike) -> None:
    check_cache_path(path)
    remove_stale_temps(path)


def check_host_tier(host: HostTier, timeout_s: float = FIRST_CHUNK_TIMEOUT_S) -> None:
    """Raise CapacityError when the host tier has slabs to allocate and none could be."""
    if host.num_slabs == 0:
        return
    host.wait_ready(host.slabs_per_chunk, timeout=timeout_s)
    if host.ready_slabs == 0 and host.error is not None:
        raise CapacityError(f"the host cache tier could not be allocated: {host.error}",
                            hint="lower --host-cache-mib (cache.host_cache_mib), free host memory, or set it to 0 "
                                 "to serve without a host tier")


def fatal_exit(reason: str) -> EngineFatalError:
    return EngineFatalError(f"the engine stopped after an error: {reason}",
                            hint="the log above has the traceback; the server exited (status 3) so that a "
                                 "supervisor restarts it ([server] exit_on_fatal)")
