"""The engine: one worker thread that owns the model, the pools and the cache (spec §4, §10.9).

``Engine.from_settings(resolved)`` builds everything from a resolved profile. Callers
``submit`` requests from any thread and read their events; the worker runs a FIFO scheduler:
admission (a blocked head is never overtaken, spec §6.3), one prefill pass per step for the
oldest prefilling lane (chunked, split at exact taps), then one batched decode round over every
decoding lane. Cancellation takes effect at the next unit boundary.

The worker's parts are one module each: :mod:`.worker` (its loop and step), :mod:`.admission`,
:mod:`.prefill_step`, :mod:`.decode_step`, :mod:`.finish` and :mod:`.stats`, over the state in
:mod:`.core`; this module builds the engine and is its public API (any thread).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import threading
import time
from typing import Any, Callable

import torch

from hpc_cli import plugins
from hpc_cli.cache.keys import BLOCK_TOKENS, prepare_prompt
from hpc_cli.engine.admission import Admission
from hpc_cli.engine.api import FinishEvent, GenerationRequest, RequestHandle, SamplingParams
from hpc_cli.engine.binding import BindingContext, CacheBinding, mode_options
from hpc_cli.engine.config import EngineConfig, draft_tokens
from hpc_cli.engine.cpu_memory import keep_freed_memory
from hpc_cli.engine.cpu_threads import release_thread_team
from hpc_cli.engine.decode_step import DecodeStep
from hpc_cli.engine.finish import Finish
from hpc_cli.engine.lane import Lane
from hpc_cli.engine.media import check_images, media_items
from hpc_cli.engine.prefill_step import PrefillStep
from hpc_cli.engine.stats import StatsPublisher, StatsRequest
from hpc_cli.engine.stats_types import EngineStats
from hpc_cli.engine.worker import Worker
from hpc_cli.errors import EngineError, RequestError, UnavailableError
from hpc_cli.model import layers as model_layers

MiB = 1 << 20
#: rotary table rows past ``max_model_len``: a round's drafts (k <= 16) reach k + 1 positions past
#: a sequence's end
ROTARY_MARGIN = 64
log = logging.getLogger("hpc_cli.engine")


class Engine(Worker, Admission, PrefillStep, DecodeStep, Finish, StatsPublisher):
    """The engine (see the module doc): built here, its worker's parts mixed in from their modules."""

    def __init__(self, model: Any, config: EngineConfig | None = None, **overrides: Any) -> None:
        """An engine for ``model`` built with ``config`` (keyword arguments override its fields), or
        with ``EngineConfig(**overrides)`` when no config is given."""
        if config is None:
            config = EngineConfig(**overrides)
        elif overrides:
            config = dataclasses.replace(config, **overrides)
        self.config = c = config
        self.model = model
        model.cuda_graphs = bool(c.cuda_graphs)  # hpc_cli.model.graphs reads it
        model_layers.FUSED_KERNELS = bool(c.fused_kernels)  # one engine a process: the model's kernels
        self.settings = c.settings
        self.tokenizer = getattr(model, "tokenizer", None)
        self.model_name = c.model_name or model.config.name
        cfg = model.config
        self.max_model_len = int(c.max_model_len or min(cfg.max_position_embeddings, 32768))
        self.C = c.max_concurrency
        self.chunk = c.prefill_chunk
        self.concurrent_prefill = c.concurrent_prefill
        self.default_max_tokens = c.default_max_tokens
        self.kv_profile = plugins.kv_profile(c.kv_profile)
        # the cache mode (docs/cache-modes.md): a name or a CacheMode; reuse=False is mode off. The
        # hybrid keywords (snapshot_slots ...) are options of [cache.hybrid]; another mode refuses them
        mode = c.cache_mode if c.cache_mode is not None and not isinstance(c.cache_mode, str) else \
            plugins.cache_mode(c.cache_mode or "hybrid")
        self.cache_mode = mode if c.reuse else plugins.cache_mode("off")
        options = mode_options(self.cache_mode, c.cache_options if c.reuse else None,
                               {"device_snapshot_slots": c.snapshot_slots, "max_new_taps": c.max_new_taps,
                                "tap_ladder_tokens": c.tap_ladder_tokens, "tap_min_gap_tokens": c.tap_min_gap_tokens,
                                "coalesce": c.coalesce})
        host_bytes = c.host_cache_mib * MiB if self.cache_mode.reuses else 0
        mode_slots = self.cache_mode.snapshot_slots(options, lanes=self.C, host=host_bytes > 0)
        # the speculative backend (docs/speculative.md): its drafter, pools and image parts
        backend = plugins.spec_backend(c.speculative) if isinstance(c.speculative, str) else c.speculative
        self.spec = None
        if backend is not None and backend.drafts:
            from hpc_cli.speculative import SpecRuntime

            self.spec = SpecRuntime(backend, model, k=draft_tokens(c.num_draft_tokens, model.config),
                                    rollback=c.spec_rollback,
                                    drafter_path=c.drafter)
        self.spec_backend = backend
        extra_parts = self.spec.state_parts() if self.spec is not None else None
        drafter = self.spec.drafter if self.spec is not None else None
        # a backend whose state lives in pages (MTP's layer, DFlash's pool) lets a pass take its
        # taps itself, and so does one that fills its parts of the state image for the pass's taps
        # (DFlash2's ring taps); another that adds parts to the image splits the pass at each tap
        untapped = bool(extra_parts) and not getattr(drafter, "taps_its_parts", False)
        tap_slots = self.cache_mode.tap_slots(options, model=model, speculative=untapped)
        self.states = model.new_state_slots(self.C + mode_slots + tap_slots, extra_parts=extra_parts)
        transfer_factory = c.transfer_factory
        if c.transfer_copy is not None:  # [cache] transfer_copy: the transfer engine's and the taps' method
            self.states.tap_method = "torch" if c.transfer_copy == "dma" else None
            if transfer_factory is None:
                import functools

                from hpc_cli.memory.transfer.engine import TransferEngine

                transfer_factory = functools.partial(TransferEngine, copy_method=c.transfer_copy)
        # rotary rows read from a table in every pass instead of computed (CUDA, Rotary.hold_table):
        # the longest sequence and the drafts a round places past its end; held before the pages
        # take what memory is left
        for rotary in (model.rotary, getattr(drafter, "rotary", None)):
            if rotary is not None:
                rotary.hold_table(self.max_model_len + ROTARY_MARGIN, model.dtype)
        pages = c.kv_pages or self._auto_pages(c.device_memory_fraction)
        self.storage, self.backend_storage = self._spec_storage(model, pages)
        from hpc_cli.memory.transfer.engine import TransferEngine

        self.cache: CacheBinding = self.cache_mode.build(BindingContext(
            model=model, storage=self.storage, states=self.states, lanes=self.C, snapshot_slots=mode_slots,
            host_bytes=host_bytes, prefill_chunk=c.prefill_chunk, options=options,
            transfer_factory=transfer_factory or TransferEngine, backend_storage=self.backend_storage,
            frontier_lag=backend.frontier_lag if self.spec is not None else 0, speculative=self.spec is not None,
            concurrent_prefill=c.concurrent_prefill, pending_timeout_s=c.pending_timeout_ms / 1000.0,
            tap_slots=tap_slots))
        if self.spec is not None:
            self.spec.bind(self.storage, self.backend_storage, self.states)
        self.eos = set(getattr(self.tokenizer, "eos_token_ids", None) or cfg.eos_token_id or [])
        # submissions, cancellations, calls and stats requests from any thread: a deque (append
        # and popleft are atomic), so the worker's look between rounds costs no lock or exception
        self._inbox: collections.deque[tuple[str, Any]] = collections.deque()
        self._wake = threading.Event()
        self._waiting: collections.deque[Lane] = collections.deque()
        self._lanes: list[Lane] = []
        self._pass_commits: list[Lane] = []
        self._prepared_decode = None
        self.decode_ahead = bool(c.decode_ahead)
        self.hold_tokens = (model.device.type == "cuda") if c.send_after_launch is None else bool(c.send_after_launch)
        self._held = []
        self._by_id: dict[str, Lane] = {}
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._stopped = threading.Event()
        self.fatal: str | None = None
        self._count = 0
        self.on_stop: list[Callable[["Engine"], None]] = []  # run by the worker after the last request
        self.on_fatal: list[Callable[["Engine"], None]] = []  # run by the worker once it stopped on an error
        self.seed = c.seed  # [engine] seed: the base seed of requests that name none
        self._stats_lock = threading.Lock()
        self._stats_snapshot: EngineStats | None = None
        self._serving = False  # lanes or waiting requests (the host tier pins between, not during)
        # a host chunk finished pinning: wake the worker, which hands its slabs to the index
        self.cache.host.on_ready = lambda _ready: self._wake.set()
        self.counters = collections.Counter()
        self.ttft = collections.deque(maxlen=2048)  # (monotonic time, seconds)
        self.itl = collections.deque(maxlen=4096)
        if self.spec is not None:  # what a speculative round may touch of the engine
            from hpc_cli.speculative.runtime import RoundHost

            self._round_host = RoundHost(self.storage, self.cache.commit_blocks, self._emit_from_round,
                                         self.itl.append, self._round_launched)
        self.started_at = time.time()
        from hpc_cli.model.compile_watch import watch

        self.compile_counts = watch()  # Triton compilations and autotune runs (process-wide)
        self.warmup_report = None  # hpc_cli.engine.warmup.WarmupReport of the last warm-up (CUDA)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_settings(cls, resolved: Any, *, progress: bool = False, **overrides: Any) -> "Engine":
        """Build the model, pools, index and transfer engine from a resolved profile."""
        from hpc_cli.model.model import HybridModel

        s = resolved.settings
        device = s.model.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        elif device == "cuda" and not torch.cuda.is_available():
            raise EngineError("model.device is 'cuda' but no CUDA device is available",
                              hint="set model.device = 'auto' or 'cpu'")
        dtype = s.model.dtype
        if dtype == "auto":
            dtype = "bfloat16" if device == "cuda" else "float32"
        # with [experts] offload the routed experts are loaded straight into host memory: the tier
        # attached below adopts them, so they are never on the device (a model too big for it loads)
        model = HybridModel.from_name_or_path(s.model.name, dtype=getattr(torch, dtype), device=device,
                                              progress=progress, offload_experts=s.experts.offload,
                                              quantized_weights=s.model.quantized_weights,
                                              merge=s.model.merged_projections)
        engine = cls(model, EngineConfig.from_settings(resolved), **overrides)
        if s.experts.offload or s.experts.trace_file is not None:  # after the KV pools: they set what is free
            from hpc_cli.experts.placement import attach_expert_tier

            tier = attach_expert_tier(model, s)
            engine.on_stop.append(lambda _engine: tier.close())
        return engine

    def _spec_storage(self, model: Any, pages: int):
        """The main pool (plus MTP's layer(s) of pages) and the backend's own BF16 pool, if any."""
        if self.spec is None:
            return model.new_kv_storage(self.kv_profile, pages), None
        from hpc_cli.memory.kv_pool import PagedKVStorage

        b, c = self.spec.backend, model.config
        extra = b.extra_main_kv_layers and len(model.mtp.layers if getattr(model, "mtp", None) else [0])
        main = PagedKVStorage(self.kv_profile, len(c.attention_layers) + extra, c.num_key_value_heads, c.head_dim,
                              pages, device=model.device, name="main")
        spec = self.spec.pool_spec()
        own = None
        if spec is not None:
            own = PagedKVStorage(plugins.kv_profile("bf16"), spec.layers, spec.kv_heads, spec.head_dim, pages,
                                 device=model.device, name=b.name)
        return main, own

    def _auto_pages(self, fraction: float) -> int:
        """Device pages: on CUDA what free memory allows, elsewhere every lane's full context
        plus as much again for the cache (at least max(L, C), spec §5.4)."""
        per_seq = math.ceil(self.max_model_len / BLOCK_TOKENS)
        probe = self.model.new_kv_storage(self.kv_profile, 1)
        page_bytes = probe.page_bytes
        del probe
        if self.model.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.model.device)
            pages = int(free * fraction) // page_bytes
        else:
            pages = min(2 * self.C * per_seq, max(self.C * per_seq, (2048 * MiB) // page_bytes))
        return max(pages, per_seq, self.C)

    # ------------------------------------------------------------------ public API (any thread)
    def start(self) -> "Engine":
        if self._thread is None:
            if self.model.device.type == "cpu":  # the worker computes: this thread's CPU team goes
                release_thread_team()
                if self.config.cpu_keep_memory:  # passes do not fault their buffers in again
                    keep_freed_memory()
            self._thread = threading.Thread(target=self._run, name="hpc-engine", daemon=True)
            self._thread.start()
        return self

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping.is_set()

    @property
    def in_flight(self) -> int:
        """Requests submitted and not finished (read from any thread; submissions not yet taken
        by the worker included)."""
        return len(self._inbox) + len(self._waiting) + len(self._lanes)

    def submit(self, request: GenerationRequest) -> RequestHandle:
        """Queue a request; its events arrive on the returned handle."""
        if self.fatal:
            raise EngineError(f"the engine stopped after an error: {self.fatal}", hint="restart the server")
        if self._stopping.is_set():
            raise UnavailableError("the engine is stopping", hint="retry against a running server")
        request.sampling.validate()
        n = len(request.prompt_tokens)
        if n == 0:
            raise RequestError("the prompt is empty", param="prompt")
        vocab = self.model.config.vocab_size
        if min(request.prompt_tokens) < 0 or max(request.prompt_tokens) >= vocab:
            raise RequestError(f"prompt token ids must be in [0, {vocab})", param="prompt")
        if n >= self.max_model_len:
            raise RequestError(f"the prompt has {n} tokens; this model's context is {self.max_model_len}",
                               param="messages", code="context_length_exceeded")
        sp = request.sampling
        sp.max_tokens = min(sp.max_tokens, self.max_model_len - n)
        handle = RequestHandle(request, self.cancel)
        check_images(self.model, request, speculative=self.spec is not None)
        # block hashes off the worker (spec §5.1), salted per tenant, keyed by images (hpc_cli.cache.keys)
        prepared = prepare_prompt(request.prompt_tokens, media_items(request.media), cache_salt=request.cache_salt)
        self._inbox.append(("submit", (handle, prepared)))
        self._wake.set()
        return handle

    def cancel(self, request_id: str) -> None:
        self._inbox.append(("cancel", request_id))
        self._wake.set()

    def generate(self, request: GenerationRequest, timeout: float | None = 600) -> tuple[list[int], FinishEvent]:
        """Submit and wait: the generated token ids and the finish event (tests, scripts)."""
        toks, fin = self.submit(request).result(timeout=timeout)
        return [t.token_id for t in toks], fin

    def warmup(self, tokens: int | None = None, decode: int = 4,
               progress: Callable[[int, int], None] | None = None) -> float:
        """Compile, tune and capture every kernel shape serving will meet before the first request:
        on CUDA every padded prefill length and every decode (lanes, table width) shape
        (:mod:`hpc_cli.engine.warmup`, on the worker thread), then one disabled request (it leaves
        nothing in the cache, spec §7.7) through a prefill pass and a few decode rounds. The stats
        forget it; compilations counted from here on happened while serving
        (``stats()["compilations"]``). ``progress(done, total)`` follows the shape passes.
        Returns the seconds it took."""
        from hpc_cli.engine import warmup as shapes

        self.start()
        t0 = time.monotonic()
        plan = shapes.plan(self)
        if plan.steps:
            self.warmup_report = self.call(lambda: shapes.run_shapes(self, plan, progress))
        n = min(tokens or self.chunk, self.max_model_len - decode - 1)
        vocab = self.model.config.vocab_size
        prompt = [(17 * i + 3) % max(2, vocab - 1) + 1 for i in range(max(1, n))]
        req = GenerationRequest(prompt, SamplingParams(max_tokens=decode, temperature=0, ignore_eos=True),
                                cache_enabled=False, request_id="warmup")
        self.submit(req).result(timeout=600)
        with self._stats_lock:
            self.counters.clear()
            self.ttft.clear()
            self.itl.clear()
        self._wake.set()  # the idle worker publishes the cleared stats before it sleeps again
        self.compile_counts.mark_warm()
        return time.monotonic() - t0

    def call(self, fn: Callable[[], Any], timeout: float | None = 600) -> Any:
        """Run ``fn`` on the worker thread between steps and return its result (or raise its error)."""
        import concurrent.futures

        if self._thread is None or not self._thread.is_alive():
            raise EngineError("the engine is not running", hint="start the engine first")
        fut: "concurrent.futures.Future[Any]" = concurrent.futures.Future()
        self._inbox.append(("call", (fn, fut)))
        self._wake.set()
        return fut.result(timeout=timeout)

    def stop(self, timeout: float | None = 60) -> None:
        """Orderly stop: admission ends, running and queued requests finish as unavailable at the
        next unit boundary, transfers land, then the stop hooks run (the cache file save)."""
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._stopped.set()

    def stats(self) -> EngineStats | None:
        """The engine's stats as the worker last published them: a few times a second while it
        works, and once more before it sleeps (running counts only, O(1) to take; /metrics);
        None before the worker first published them. Each publication is a new object."""
        with self._stats_lock:
            return self._stats_snapshot

    def detailed_stats(self, timeout: float = 2.0) -> EngineStats | None:
        """Fresh stats with what takes a walk of the cache (the snapshot table), for a client that
        asks (/v1/cache/stats, ``hpc-cli top``). The worker, the cache's only mutator (spec
        §10.9), makes them between two steps; this waits up to ``timeout`` seconds and falls back
        to :meth:`stats` when the worker does not answer in time. Without a running worker they
        are made on the calling thread."""
        th = self._thread
        if th is None or not th.is_alive():
            return self._take_stats(detailed=True)
        req = StatsRequest()
        self._inbox.append(("stats", req))
        self._wake.set()
        if req.done.wait(timeout) and req.result is not None:
            return req.result
        return self.stats()

    # ------------------------------------------------------------------ tests
    def check_invariants(self) -> None:
        """Walk the cache against spec §10 (call only while the worker is idle or stopped)."""
        self.cache.check_invariants()
