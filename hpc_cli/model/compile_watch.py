"""Counting Triton compilations and autotuning runs, so "no compilation while serving" is a number.

Triton calls ``knobs.runtime.jit_post_compile_hook`` after every kernel it compiles into a
function's in-memory cache (a new specialization: a new constexpr, dtype, or integer/pointer
divisibility class); an autotuner that meets a new key benchmarks its configs (and compiles the
ones it had not). Both are seconds of work on the engine thread when they happen while serving.
:func:`watch` installs one process-wide counter (Triton's hooks are process-wide; an existing
hook is chained, not replaced); the engine marks the end of its warm-up and reports the counts
since then (``stats()["compilations"]``, ``/metrics``). Without Triton (CPU builds of torch) the
counts stay zero: nothing is compiled.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class CompileStats:
    """The counts as the engine's stats carry them (``kernel_compilations``)."""

    after_warmup: int  # compilations plus autotune runs after the warm-up (0 before it ends)
    total: int  # compilations since the process started
    autotunes: int
    warm: bool  # the warm-up ended
    after_warmup_by_kernel: dict[str, int]  # kernel (``autotune:<name>`` for a tuning run) -> count


@dataclass
class CompileCounts:
    """Compilations and autotune runs since the process started and since :meth:`mark_warm`."""

    compilations: int = 0
    autotunes: int = 0
    by_kernel: Counter = field(default_factory=Counter)
    warm_compilations: int | None = None  # the counts when the warm-up ended
    warm_autotunes: int | None = None
    after_warm: Counter = field(default_factory=Counter)  # kernel -> compilations after the warm-up
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def _compiled(self, name: str) -> None:
        with self.lock:
            self.compilations += 1
            self.by_kernel[name] += 1
            if self.warm_compilations is not None:
                self.after_warm[name] += 1

    def _autotuned(self, name: str) -> None:
        with self.lock:
            self.autotunes += 1
            if self.warm_autotunes is not None:
                self.after_warm[f"autotune:{name}"] += 1

    def mark_warm(self) -> None:
        """The warm-up is over: what compiles from now on happens while serving."""
        with self.lock:
            self.warm_compilations = self.compilations
            self.warm_autotunes = self.autotunes
            self.after_warm.clear()

    @property
    def since_warm(self) -> int:
        """Compilations plus autotune runs after the warm-up (0 before it ends)."""
        if self.warm_compilations is None:
            return 0
        return (self.compilations - self.warm_compilations) + (self.autotunes - (self.warm_autotunes or 0))

    def stats(self) -> CompileStats:
        with self.lock:
            return CompileStats(after_warmup=self.since_warm, total=self.compilations, autotunes=self.autotunes,
                                warm=self.warm_compilations is not None, after_warmup_by_kernel=dict(self.after_warm))


_COUNTS: CompileCounts | None = None  # process-wide, as Triton's hooks are
_INSTALL = threading.Lock()


def watch() -> CompileCounts:
    """The process's counter, installing Triton's hooks on the first call (no-op without Triton)."""
    global _COUNTS
    with _INSTALL:
        if _COUNTS is not None:
            return _COUNTS
        counts = CompileCounts()
        try:
            import triton
            from triton import knobs
            from triton.runtime.autotuner import Autotuner
        except Exception:  # no Triton (a CPU build of torch): nothing is ever compiled
            _COUNTS = counts
            return counts
        _install_compile_hook(knobs, counts)
        _install_autotune_count(Autotuner, counts)
        del triton
        _COUNTS = counts
        return counts


def _install_compile_hook(knobs, counts: CompileCounts) -> None:
    previous = knobs.runtime.jit_post_compile_hook

    def hook(*args, **kwargs):
        fn = kwargs.get("fn")
        name = getattr(getattr(fn, "fn", None), "__qualname__", None) or getattr(fn, "name", None) or "?"
        counts._compiled(str(name))
        return previous(*args, **kwargs) if previous is not None else None

    knobs.runtime.jit_post_compile_hook = hook


def _install_autotune_count(Autotuner, counts: CompileCounts) -> None:
    """An autotuner benchmarks when its cache of best configs grows: count those calls."""
    run = Autotuner.run
    if getattr(run, "_hpc_counted", False):
        return

    def counted_run(self, *args, **kwargs):
        before = len(self.cache)
        try:
            return run(self, *args, **kwargs)
        finally:
            if len(self.cache) > before:
                counts._autotuned(getattr(getattr(self, "base_fn", None), "__name__", None) or "?")

    counted_run._hpc_counted = True
    Autotuner.run = counted_run
