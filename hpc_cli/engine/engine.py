"""The engine: one worker thread that owns the model, the pools and the cache (spec §4, §10.9).

``Engine.from_settings(resolved)`` builds everything from a resolved profile. Callers
``submit`` requests from any thread and read their events; the worker runs a FIFO scheduler:
admission (a blocked head is never overtaken, spec §6.3), one prefill pass per step for the
oldest prefilling lane (chunked, split at exact taps), then one batched decode round over every
decoding lane. Cancellation takes effect at the next unit boundary.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import sys
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from hpc_cli import plugins
from hpc_cli.cache.keys import BLOCK_TOKENS, prepare_prompt
from hpc_cli.engine.api import (AdmittedEvent, FinishEvent, GenerationRequest, PrefillPass, RequestHandle,
                                SamplingParams, TokenEvent)
from hpc_cli.engine.binding import BindingContext, Blocked, CacheBinding, mode_options
from hpc_cli.engine.config import EngineConfig
from hpc_cli.engine.lane import Lane
from hpc_cli.engine.media import check_images, decode_offsets, media_items, prefill_media
from hpc_cli.engine.sampling import make_generator, prompt_logprobs, sample
from hpc_cli.errors import EngineError, HpcError, RequestError, UnavailableError

MiB = 1 << 20
log = logging.getLogger("hpc_cli.engine")


@dataclass(slots=True, eq=False)
class StatsRequest:
    """A client's request for detailed stats, answered by the worker between two steps."""

    done: threading.Event = field(default_factory=threading.Event)
    result: dict[str, Any] | None = None


class Engine:
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

            self.spec = SpecRuntime(backend, model, k=c.num_draft_tokens, rollback=c.spec_rollback,
                                    drafter_path=c.drafter)
        self.spec_backend = backend
        extra_parts = backend.state_extra_parts(model) if self.spec is not None else None
        self.states = model.new_state_slots(self.C + mode_slots, extra_parts=extra_parts)
        transfer_factory = c.transfer_factory
        if c.transfer_copy is not None:  # [cache] transfer_copy: the transfer engine's and the taps' method
            self.states.tap_method = "torch" if c.transfer_copy == "dma" else None
            if transfer_factory is None:
                import functools

                from hpc_cli.memory.transfer.engine import TransferEngine

                transfer_factory = functools.partial(TransferEngine, copy_method=c.transfer_copy)
        pages = c.kv_pages or self._auto_pages(c.device_memory_fraction)
        self.storage, self.backend_storage = self._spec_storage(model, pages)
        from hpc_cli.memory.transfer.engine import TransferEngine

        self.cache: CacheBinding = self.cache_mode.build(BindingContext(
            model=model, storage=self.storage, states=self.states, lanes=self.C, snapshot_slots=mode_slots,
            host_bytes=host_bytes, prefill_chunk=c.prefill_chunk, options=options,
            transfer_factory=transfer_factory or TransferEngine, backend_storage=self.backend_storage,
            frontier_lag=backend.frontier_lag if self.spec is not None else 0, speculative=self.spec is not None,
            concurrent_prefill=c.concurrent_prefill, pending_timeout_s=c.pending_timeout_ms / 1000.0))
        if self.spec is not None:
            self.spec.bind(self.storage, self.backend_storage, self.states)
        self.eos = set(getattr(self.tokenizer, "eos_token_ids", None) or cfg.eos_token_id or [])
        self._inbox: "queue.Queue[tuple[str, Any]]" = queue.Queue()
        self._wake = threading.Event()
        self._waiting: collections.deque[Lane] = collections.deque()
        self._lanes: list[Lane] = []
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
        self._stats_snapshot: dict[str, Any] = {}
        self._serving = False  # lanes or waiting requests (the host tier pins between, not during)
        # a host chunk finished pinning: wake the worker, which hands its slabs to the index
        self.cache.host.on_ready = lambda _ready: self._wake.set()
        self.counters = collections.Counter()
        self.ttft = collections.deque(maxlen=2048)  # (monotonic time, seconds)
        self.itl = collections.deque(maxlen=4096)
        if self.spec is not None:  # what a speculative round may touch of the engine
            from hpc_cli.speculative.runtime import RoundHost

            self._round_host = RoundHost(self.storage, self.cache.commit_blocks, self._emit, self.itl.append)
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
                                              progress=progress, offload_experts=s.experts.offload)
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
        spec = b.backend_pool(model.shape())
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
        return self._inbox.qsize() + len(self._waiting) + len(self._lanes)

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
        self._inbox.put(("submit", (handle, prepared)))
        self._wake.set()
        return handle

    def cancel(self, request_id: str) -> None:
        self._inbox.put(("cancel", request_id))
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
        self._inbox.put(("call", (fn, fut)))
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

    def stats(self) -> dict[str, Any]:
        """The engine's stats as the worker last published them: a few times a second while it
        works, and once more before it sleeps (running counts only, O(1) to take; /metrics)."""
        with self._stats_lock:
            return dict(self._stats_snapshot) if self._stats_snapshot else {}

    def detailed_stats(self, timeout: float = 2.0) -> dict[str, Any]:
        """Fresh stats with what takes a walk of the cache (the snapshot table), for a client that
        asks (/v1/cache/stats, ``hpc-cli top``). The worker, the cache's only mutator (spec
        §10.9), makes them between two steps; this waits up to ``timeout`` seconds and falls back
        to :meth:`stats` when the worker does not answer in time. Without a running worker they
        are made on the calling thread."""
        th = self._thread
        if th is None or not th.is_alive():
            return self._take_stats(detailed=True)
        req = StatsRequest()
        self._inbox.put(("stats", req))
        self._wake.set()
        if req.done.wait(timeout) and req.result is not None:
            return req.result
        return self.stats()

    # ------------------------------------------------------------------ the worker
    #: the published stats are refreshed at most this often while the engine works
    STATS_PERIOD_S = 0.2
    #: nothing to step but transfers in flight: how often they are polled
    TRANSFER_POLL_S = 0.001
    #: lanes or waiting requests but no step possible this round: when to look again
    RECHECK_S = 0.05

    def _run(self) -> None:
        last_stats = 0.0
        # Subnormal floats are handled in microcode on x86 CPUs, 10-100x slower than normal ones,
        # and a GDN state's decayed entries fall into that range: on the CPU a cold 2.4k-token
        # prefill took 4.8 s with them and 3.1 s flushed to zero (values below 1.2e-38). The flag
        # is per thread: the worker, which runs every pass, sets it for itself.
        if self.model.device.type == "cpu":
            torch.set_flush_denormal(True)
        try:
            while not self._stopping.is_set():
                self._drain_inbox()
                self.cache.poll()
                if self.cache.failed:
                    raise EngineError(self.cache.failed, hint="check the device; restart the server")
                self._admit()
                worked = self._step()
                busy = bool(self._lanes or self._waiting)
                self._serve_or_pin(busy)
                now = time.monotonic()
                if worked or busy or self.cache.transfers_pending:
                    if now - last_stats > self.STATS_PERIOD_S:
                        self._take_stats()
                        last_stats = now
                    if not worked:  # poll transfers only while some are pending
                        self._wake.wait(self.TRANSFER_POLL_S if self.cache.transfers_pending else self.RECHECK_S)
                        self._wake.clear()
                    continue
                # idle: publish the stats as they are, then sleep until submit, cancel, stop, a
                # stats request or a host chunk wakes the worker (no polling: an idle server
                # uses no CPU)
                self._take_stats()
                last_stats = now
                self._wake.wait()
                self._wake.clear()
            self._shutdown("unavailable", "the server is stopping")
            self.cache.drain()
            self.cache.host.stop_growth()
            self._take_stats()
            for hook in self.on_stop:
                hook(self)
        except Exception as exc:  # a fatal error: fail everything, release everything, save nothing
            self.fatal = f"{type(exc).__name__}: {exc}" if not isinstance(exc, HpcError) else exc.message
            log.error("the engine stopped after an error: %s (every request fails from now on; the prefix "
                      "cache is not saved)", self.fatal, exc_info=exc)
            self._shutdown("error", self.fatal, publish=False)
            try:  # land (or abandon) the transfers still queued so that their pins drop
                self.cache.drain()
            except Exception:  # pragma: no cover - a broken device may fail the wait too
                pass
            self.cache.host.stop_growth()
            self._take_stats()
        finally:
            self._stopping.set()
            pending = sys.exc_info()[1]  # a BaseException, or the error path itself failed
            if self.fatal is None and pending is not None:
                self.fatal = f"the worker stopped: {type(pending).__name__}: {pending}"
                log.error("the engine stopped after an error: %s", self.fatal)  # never silently
            if self.fatal is not None:
                self._run_fatal_hooks()

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "submit":
                handle, prepared = item
                self._count += 1
                req = handle.request
                lane = Lane(req, handle, prepared, self._count, tokens=list(req.prompt_tokens),
                            n_prompt=len(req.prompt_tokens))
                try:
                    lane.generator = make_generator(req.sampling, self._count, self.seed)
                except Exception as exc:  # this request's own parameters: it fails alone
                    self._fail_lane(lane, exc)
                    self._emit_finish(lane)
                    continue
                if self.tokenizer is not None and req.sampling.stop:
                    from hpc_cli.model.tokenizer import IncrementalDecoder

                    lane.decoder = IncrementalDecoder(self.tokenizer)
                self._by_id[req.request_id] = lane
                self._waiting.append(lane)
                self.counters["requests"] += 1
            elif kind == "call":
                fn, fut = item
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn())
                    except BaseException as exc:  # handed to the caller, not fatal to the worker
                        fut.set_exception(exc)
            elif kind == "cancel":
                lane = self._by_id.get(item)
                if lane is not None:
                    lane.finish_reason = lane.finish_reason or "cancelled"
            elif kind == "stats":
                self._answer_stats(item)

    def _answer_stats(self, req: "StatsRequest") -> None:
        """A client's detailed stats, made between steps; a failure answers None (the caller
        falls back to the published stats) and never stops the worker."""
        try:
            req.result = self._take_stats(detailed=True)
        except Exception:  # noqa: BLE001 - stats must never take the engine down
            log.exception("detailed stats failed")
        finally:
            req.done.set()

    def _serve_or_pin(self, busy: bool) -> None:
        """The host tier pins its next chunk only while nothing is served (a registration stalls
        every CUDA call of the process); tell it when that changes."""
        if busy != self._serving:
            self._serving = busy
            if busy:
                self.cache.host.may_pin.clear()
            else:
                self.cache.host.may_pin.set()

    def _admit(self) -> None:
        while self._waiting:
            head = self._waiting[0]
            if head.finish_reason == "cancelled":
                self._waiting.popleft()
                self._emit_finish(head)
                continue
            if len(self._lanes) >= self.C or (not self.concurrent_prefill
                                              and any(l.prefilling for l in self._lanes)):
                self.cache.prefetch(head)  # spec §6.6: restore the waiting head's path meanwhile
                return
            try:
                adm = self.cache.admit(head, [l for l in self._lanes if l.prefilling])
            except Blocked:
                self.cache.prefetch(head)
                return  # the FIFO head is never overtaken (spec §6.3)
            except HpcError as exc:
                self._waiting.popleft()
                head.finish_reason, head.error = "error", exc.message
                self._emit_finish(head)
                continue
            self._waiting.popleft()
            head.admitted_at = time.monotonic()
            u = head.usage
            u.prompt_tokens = head.n_prompt
            u.reuse_tokens = adm.reuse_tokens
            u.cached_prefix_tokens = adm.cached_prefix_tokens
            u.queue_seconds = head.admitted_at - head.handle.submitted_at
            u.timing.admission = u.queue_seconds
            head.handle.put(AdmittedEvent(adm.reuse_tokens, adm.cached_prefix_tokens))
            self._lanes.append(head)

    def _step(self) -> bool:
        worked = False
        for lane in [l for l in self._lanes if l.finish_reason]:
            self._finish(lane, publish=lane.finish_reason != "error")  # a failed lane leaves nothing
            worked = True
        prefilling = [l for l in self._lanes if l.prefilling]
        if prefilling:
            try:
                self._prefill(prefilling[0])
            except Exception as exc:  # this request's pass failed: it alone ends (a broken device
                self._fail_lane(prefilling[0], exc)  # fails the next decode round, which is fatal)
            worked = True
        decoding = [l for l in self._lanes if not l.prefilling and l.next_token is not None and not l.finish_reason]
        if decoding:
            self._decode(decoding)
            worked = True
        return worked

    def _prefill(self, lane: Lane) -> None:
        timing = lane.usage.timing  # phase seconds (RequestTiming): host time, no device syncs
        t_start = time.perf_counter()
        waited = timing.restore_wait
        start = lane.pos
        end = self.cache.next_stop(lane, min(lane.n_prompt, start + self.chunk))
        taps, t = self.cache.counters.get("taps", 0), time.perf_counter()
        self.cache.before_pass(lane, end)
        tapped = timing.add_taps(time.perf_counter() - t, self.cache.counters.get("taps", 0) - taps)
        sp = lane.request.sampling
        want_all = sp.prompt_logprobs
        spec_kw = self.spec.prefill_kwargs() if self.spec is not None else {}
        pre_hidden = self.spec.pre_hidden(lane) if self.spec is not None else None
        ready = self.cache.layer_ready(lane)
        in_pass = self.cache.pass_taps(lane, end)  # exact taps the pass takes itself (no split)
        out = self.model.prefill(lane.tokens[start:end], start, lane.pages[:math.ceil(end / BLOCK_TOKENS)],
                                 lane.state_slot, self.storage, self.states,
                                 layer_ready=timing.timed_wait(ready) if ready is not None else None,
                                 all_logits=want_all, **spec_kw, **prefill_media(self.model, lane, start, end),
                                 **({"taps": in_pass} if in_pass else {}))
        if self.spec is not None:
            self.spec.after_prefill(lane, start, end, out, pre_hidden)
        lane.pos = end
        lane.usage.prefill_tokens += end - start
        self.counters["prefill_tokens"] += end - start
        logits = out.logits
        if want_all:  # prompt_logprobs requests always prefill from the root (see HybridBinding.admit)
            if lane.prompt_logprobs is None:
                lane.prompt_logprobs, lane.prompt_top_logprobs = [None], [None]
            lps, tops = prompt_logprobs(logits, lane.tokens[:lane.n_prompt], start, top=sp.logprobs or 0)
            lane.prompt_logprobs += lps
            lane.prompt_top_logprobs += tops
            logits = logits[-1]
        taps, t = self.cache.counters.get("taps", 0), time.perf_counter()
        if in_pass:
            self.cache.after_pass(lane, out.taps)
        else:
            self.cache.after_pass(lane)
        tapped += timing.add_taps(time.perf_counter() - t, self.cache.counters.get("taps", 0) - taps)
        if lane.pos == lane.n_prompt and not lane.finish_reason:
            if sp.max_tokens == 0:
                lane.finish_reason = "length"
            else:
                self._sample(lane, logits)
        t_end = time.perf_counter()
        timing.passes.append(PrefillPass(t_end - t_start - tapped - (timing.restore_wait - waited), end - start))
        if lane.pos == lane.n_prompt:
            timing.decode_from = t_end
        lane.prefill_pass_done(t_start, t_end)  # progress lines of a long prefill

    def _decode(self, lanes: list[Lane]) -> None:
        if self.spec is not None:  # propose + verify per lane (docs/speculative.md)
            self.spec.round(self._round_host, lanes)
            self.counters["decode_rounds"] += 1
            return
        t0 = time.monotonic()
        tokens = [l.next_token for l in lanes]
        positions = [l.pos for l in lanes]
        tables = [l.pages[:math.ceil((l.pos + 1) / BLOCK_TOKENS)] for l in lanes]
        logits = self.model.decode(tokens, positions, tables, [l.state_slot for l in lanes],
                                   self.storage, self.states, **decode_offsets(lanes))
        dt = time.monotonic() - t0
        for i, lane in enumerate(lanes):
            lane.pos += 1
            lane.next_token = None
            self.cache.commit_blocks(lane)
            if not lane.finish_reason:
                self._sample(lane, logits[i])
            self.itl.append(dt)
        self.counters["decode_rounds"] += 1

    def _sample(self, lane: Lane, logits: torch.Tensor) -> None:
        try:
            event = sample(logits, lane.request.sampling, lane.generator)
        except Exception as exc:  # this request's sampling failed: it alone ends
            self._fail_lane(lane, exc)
            return
        self._emit(lane, event)

    def _fail_lane(self, lane: Lane, exc: Exception) -> None:
        """End ``lane`` with reason "error" at the next step (published: nothing), keep serving."""
        message = exc.message if isinstance(exc, HpcError) else f"{type(exc).__name__}: {exc}"
        log.warning("request %s failed: %s", lane.request.request_id, message,
                    exc_info=None if isinstance(exc, HpcError) else exc)
        lane.finish_reason, lane.error = "error", f"the request failed in the engine: {message}"
        lane.next_token = None

    def _run_fatal_hooks(self) -> None:
        for hook in self.on_fatal:
            try:
                hook(self)
            except Exception:  # a hook's failure must not hide the engine's
                log.exception("an engine fatal-error hook failed")

    def _emit(self, lane: Lane, ev: TokenEvent) -> None:
        """Hand one chosen token to the lane: usage, stop conditions, the event, ``next_token``."""
        sp = lane.request.sampling
        now = time.monotonic()
        lane.usage.timing.last_token_at = time.perf_counter()
        if lane.first_token_at is None:
            lane.first_token_at = now
            lane.usage.time_to_first_token = now - lane.handle.submitted_at
            self.ttft.append((now, lane.usage.time_to_first_token))
        tok = ev.token_id
        lane.generated.append(tok)
        lane.usage.completion_tokens += 1
        self.counters["generated_tokens"] += 1
        if (tok in self.eos or tok in sp.stop_token_ids) and not sp.ignore_eos:
            lane.finish_reason = "stop"
            return
        lane.tokens.append(tok)
        lane.handle.put(ev)
        if lane.decoder is not None:
            lane.text += lane.decoder.push(tok)
            for s in sp.stop:
                if s and s in lane.text:
                    lane.finish_reason = "stop"
                    lane.stop_text = s
                    return
        if len(lane.generated) >= sp.max_tokens:
            lane.finish_reason = "length"
            return
        lane.next_token = tok

    def _finish(self, lane: Lane, *, publish: bool = True) -> None:
        t0 = time.perf_counter()
        if self.spec is not None and publish:
            self.spec.before_finish(lane)
        self.cache.finish(lane, publish=publish)
        self._lanes.remove(lane)
        lane.usage.timing.finish = time.perf_counter() - t0
        self._emit_finish(lane)

    def _emit_finish(self, lane: Lane) -> None:
        self._by_id.pop(lane.request.request_id, None)
        reason = lane.finish_reason or "stop"
        self.counters[f"finished_{reason}"] += 1
        self.counters["prompt_tokens"] += lane.n_prompt
        self.counters["reuse_tokens"] += lane.usage.reuse_tokens
        self.counters["cached_prefix_tokens"] += lane.usage.cached_prefix_tokens
        lane.handle.put(FinishEvent(reason, lane.usage, error=lane.error,
                                    stop_text=getattr(lane, "stop_text", None),
                                    prompt_logprobs=lane.prompt_logprobs,
                                    prompt_top_logprobs=lane.prompt_top_logprobs))

    def _shutdown(self, reason: str, message: str, *, publish: bool = True) -> None:
        self._drain_inbox()
        for lane in list(self._lanes):
            lane.finish_reason, lane.error = reason, message
            try:
                self._finish(lane, publish=publish)
            except Exception:  # never leave a caller waiting
                if lane in self._lanes:
                    self._lanes.remove(lane)
                self._emit_finish(lane)
        while self._waiting:
            lane = self._waiting.popleft()
            lane.finish_reason, lane.error = reason, message
            self._emit_finish(lane)

    # ------------------------------------------------------------------ stats
    def _take_stats(self, *, detailed: bool = False) -> dict[str, Any]:
        """Publish the stats (running counts: O(1) in the size of the cache) and return them;
        ``detailed`` returns them with the snapshot table as well (a walk; clients only)."""
        cache = self.cache.stats(detailed=detailed)
        now = time.monotonic()
        recent = [t for at, t in self.ttft if now - at <= 60]
        snap = {
            "model": self.model_name, "kv_profile": self.kv_profile.name,
            "max_concurrency": self.C, "prefill_chunk": self.chunk, "uptime_s": time.time() - self.started_at,
            "requests": {"running": len(self._lanes), "waiting": len(self._waiting),
                         "prefilling": sum(1 for l in self._lanes if l.prefilling)},
            "counters": dict(self.counters), "cache": cache,
            "ttft_recent_s": recent, "fatal": self.fatal,
            "compilations": self.compile_counts.since_warm,
            "kernel_compilations": self.compile_counts.as_dict(),
        }
        if getattr(self.model, "expert_tier", None) is not None:
            snap["experts"] = self.model.expert_tier.stats()
        if self.spec is not None:
            snap["speculative"] = self.spec.stats()
        snap["settings"] = self._settings_meta()
        published = snap
        if detailed:
            published = dict(snap, cache={k: v for k, v in cache.items() if k != "top_snapshots"})
        with self._stats_lock:
            self._stats_snapshot = published
        return snap

    def _settings_meta(self) -> dict[str, Any]:
        """The names a client shows next to the stats (``hpc-cli top``'s header)."""
        path = getattr(self.settings, "profile_path", None)
        return {"kv_profile": self.kv_profile.name,
                "speculative_backend": getattr(self.spec_backend, "name", None) or "none",
                "cache_mode": self.cache_mode.name,
                "profile_path": str(path) if path is not None else None}

    # ------------------------------------------------------------------ tests
    def check_invariants(self) -> None:
        """Walk the cache against spec §10 (call only while the worker is idle or stopped)."""
        self.cache.check_invariants()
