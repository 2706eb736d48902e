"""What the engine's parts share: the attributes :class:`~hpc_cli.engine.engine.Engine` sets up
and its worker-side parts (:mod:`.worker`, :mod:`.admission`, :mod:`.prefill_step`,
:mod:`.decode_step`, :mod:`.finish`, :mod:`.stats`) read. Only the worker thread mutates them
(spec §10.9), except where a part says otherwise."""

from __future__ import annotations

import collections
import threading
from typing import TYPE_CHECKING, Any, Callable

from hpc_cli.engine.binding import CacheBinding
from hpc_cli.engine.config import EngineConfig
from hpc_cli.engine.lane import Lane

if TYPE_CHECKING:
    from hpc_cli.cache_mode import CacheMode
    from hpc_cli.engine.api import TokenEvent
    from hpc_cli.kv_profile import KVProfile
    from hpc_cli.memory.kv_pool import PagedKVStorage
    from hpc_cli.model.compile_watch import CompileCounts
    from hpc_cli.model.graphs import PreparedDecode
    from hpc_cli.speculative import SpecRuntime
    from hpc_cli.speculative.runtime import RoundHost


class EngineCore:
    """The engine's state, as its parts see it (set by ``Engine.__init__``)."""

    config: EngineConfig
    model: Any  # the HybridModel (or a test's stand-in with the same surface)
    tokenizer: Any
    model_name: str
    max_model_len: int
    C: int  # lanes (max_concurrency)
    chunk: int  # prefill_chunk
    concurrent_prefill: bool
    kv_profile: "KVProfile"
    cache_mode: "CacheMode"
    cache: CacheBinding
    spec: "SpecRuntime | None"
    spec_backend: Any
    storage: "PagedKVStorage"
    states: Any
    eos: set[int]
    seed: int
    fatal: str | None
    started_at: float
    compile_counts: "CompileCounts"
    counters: collections.Counter[str]
    ttft: collections.deque[tuple[float, float]]  # (monotonic time, seconds)
    itl: collections.deque[float]
    on_stop: list[Callable[[Any], None]]
    on_fatal: list[Callable[[Any], None]]
    _inbox: collections.deque[tuple[str, Any]]
    _wake: threading.Event
    _waiting: collections.deque[Lane]
    _lanes: list[Lane]
    _pass_commits: list[Lane]  # lanes whose last pass's commits and taps wait (Lane.pass_commit)
    _prepared_decode: "PreparedDecode | None"  # the next decode step's index, built ahead
    decode_ahead: bool  # [engine] decode_ahead
    hold_tokens: bool  # [engine] send_after_launch, where launches are asynchronous
    _held: list[tuple[Lane, TokenEvent]]  # chosen tokens not handed to the server yet
    _by_id: dict[str, Lane]
    _stopping: threading.Event
    _count: int
    _serving: bool
    _round_host: "RoundHost"
