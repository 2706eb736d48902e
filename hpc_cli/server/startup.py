"""Checks ``serve`` makes before it listens, and what it does once the engine has failed.

- :func:`prepare_cache_file`: the prefix cache file's path is absent or a regular file, and the
  temporary files of saves a kill interrupted are removed (:mod:`hpc_cli.engine.cache_path`, through :mod:`hpc_cli.engine.api`).
- :func:`check_host_tier`: a host tier of which not one chunk could be allocated refuses the
  start (a CapacityError, exit status 2) instead of serving without it, and above all instead of
  replacing a saved cache file with an empty one at the stop. A tier that stops short keeps
  serving with what it has (a warning says so).
- :func:`warm_request_path`: the chat template is compiled (and jinja2 imported) before the
  server listens, so the first chat request does not pay for it (about 0.3 s on the 2-core CPU
  machine, 80 ms on the H200's host).
- :func:`fatal_exit`: the error ``serve`` exits with (status 3) after the engine failed and
  ``[server] exit_on_fatal`` stopped the server.
"""

from __future__ import annotations

import os

from hpc_cli.engine.api import HostTier, check_cache_path, remove_stale_temps
from hpc_cli.errors import CapacityError, EngineFatalError, HpcError

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


def warm_request_path(tokenizer) -> bool:
    """Prepare one short chat as a request would, on a worker thread of an event loop (which
    imports the loop's thread backend, another ~20 ms of the first request) with the template
    render, prefix renders and tokenizer; returns whether the tokenizer has a chat template that
    renders it. A template that cannot render it is left for the requests to report."""
    import asyncio

    from starlette.concurrency import run_in_threadpool

    from hpc_cli.server.chat import prepare_chat

    if not getattr(tokenizer, "chat_template", None):
        return False

    def prepare() -> bool:
        try:
            prepare_chat(tokenizer, [{"role": "system", "content": "warm-up"}, {"role": "user", "content": "warm-up"}])
        except HpcError:
            return False
        return True

    return asyncio.run(run_in_threadpool(prepare))


def fatal_exit(reason: str) -> EngineFatalError:
    return EngineFatalError(f"the engine stopped after an error: {reason}",
                            hint="the log above has the traceback; the server exited (status 3) so that a "
                                 "supervisor restarts it ([server] exit_on_fatal)")
