"""Prefix cache persistence for an Engine (spec §5.5): load before start, save at the orderly stop.

    report = attach_cache_file(engine, path)     # before engine.start()
    engine.start()
    ...
    report.control.abandon.set()                 # second Ctrl+C: the save stops, the old file stays
    report.control.finished.wait(2.0)

The file is used only when its fingerprint (checkpoint, prefill signature, KV profile and global
scales, speculative backend, RoPE scaling, product build) and host geometry equal the engine's.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import struct
import threading
import time
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from hpc_cli.cache.cachefile.format import (
    FORMAT_VERSION,
    MAGIC,
    PREAMBLE,
    CacheFile,
    Geometry,
    fingerprint_diff,
    geometry_diff,
    open_cache_file,
)
from hpc_cli.cache.cachefile.plan import adopt_plan, export_saveable, plan_host_restore
from hpc_cli.cache.cachefile.slab_io import SaveAbandoned, read_plan_slabs, save_cache_file
from hpc_cli.cache.host import SlabUse
from hpc_cli.errors import CacheFileError, ConfigError, EngineError

log = logging.getLogger("hpc_cli.cache.cachefile")  # the prefix cache file's lines, here and in cache_path
MiB = 1 << 20


def _rate(nbytes: int, seconds: float) -> str:
    return f"{nbytes / max(seconds, 1e-9) / (1 << 30):.2f} GiB/s"


@dataclass
class SaveControl:
    """Shared between the server and the save: ``abandon`` stops the save before its next slab
    run or before the rename; ``finished`` is set when the save hook returns (saved or not)."""

    abandon: threading.Event = field(default_factory=threading.Event)
    finished: threading.Event = field(default_factory=threading.Event)
    result: str | None = None  # "saved", "abandoned", "skipped: why", "failed: why"
    saved_bytes: int = 0


class LoadStatus(StrEnum):
    """What loading the prefix cache file came to (a ``str``: it compares and formats as its value)."""

    RESTORED = "restored"  # every snapshot of the file is in the host tier
    PARTIAL = "partial"  # some of them (the host tier is smaller than the file)
    NOT_RESTORED = "not_restored"  # none fit
    MISSING = "missing"  # no file yet
    MISMATCH = "mismatch"  # the file is for another engine (fingerprint or geometry)
    DAMAGED = "damaged"  # the file does not read (checksum, truncation, format)
    DISABLED = "disabled"  # no host tier to load into


@dataclass
class LoadReport:
    path: Path
    status: LoadStatus
    reason: str | None = None
    error: CacheFileError | None = None
    blocks: int = 0
    snapshots: int = 0
    saved_snapshots: int = 0
    bytes_read: int = 0
    seconds: float = 0.0
    need_host_bytes: int = 0
    control: SaveControl = field(default_factory=SaveControl)

    @property
    def loaded(self) -> bool:
        return self.status in (LoadStatus.RESTORED, LoadStatus.PARTIAL)


# ------------------------------------------------------------------ fingerprint
@functools.lru_cache(maxsize=1)
def build_id() -> str:
    """The product's identity: version and the sizes of its modules (a rebuild changes it)."""
    import hpc_cli

    root = Path(hpc_cli.__file__).parent
    h = hashlib.sha256(hpc_cli.__version__.encode())
    for p in sorted(root.rglob("*.py")):
        try:
            h.update(f"{p.relative_to(root)}:{p.stat().st_size};".encode())
        except OSError:
            pass
    return f"{hpc_cli.__version__}+{h.hexdigest()[:16]}"


def _checkpoint(engine: Any) -> dict[str, Any]:
    s = getattr(engine, "settings", None)
    name = None
    if s is not None and getattr(s, "settings", None) is not None:
        name = str(s.settings.model.name)
    name = name or getattr(engine.model, "source", None) or engine.model.config.name
    name = str(name)
    if name.startswith("builtin:"):
        return {"name": name, "files": _packaged_files(name)}
    p = Path(name).expanduser()
    if not p.exists():
        return {"name": name, "files": []}
    p = p.resolve()
    return {"name": str(p), "files": _files(p)}


def _packaged_files(source: str) -> list[list[Any]]:
    """``[name, size, sha256 prefix]`` of each file the package ships behind a built-in name
    (``builtin:tiny``, its drafters ``builtin:tiny/KIND``; none for a seeded built-in, whose
    weights the code makes): they can change between releases without a module changing size
    (``build_id``), and an install sets its own mtimes, so the content is what tells them apart."""
    from hpc_cli.model import builtin

    base, _, kind = source.partition("/")
    d = builtin.TINY_DIR / kind if kind else builtin.TINY_DIR
    if base.split("@")[0] != "builtin:tiny" or not d.is_dir():
        return []
    return [[f.name, f.stat().st_size, hashlib.sha256(f.read_bytes()).hexdigest()[:16]]
            for f in sorted(d.iterdir()) if f.is_file()]


def _files(p: Path) -> list[list[Any]]:
    """``[name, size, mtime]`` of a checkpoint file or of each file in a checkpoint directory."""
    files = []
    for f in sorted(p.iterdir()) if p.is_dir() else [p]:
        if f.is_file():
            st = f.stat()
            files.append([f.name, st.st_size, st.st_mtime_ns])
    return files


def _drafter(engine: Any) -> dict[str, Any] | None:
    """Where a drafter's own weights came from (DFlash, DFlash2: their K/V pages and rings live in
    the cache): a checkpoint directory with its files, a built-in one, or a seed; None for a
    drafter whose weights are the checkpoint's (MTP) or no speculation."""
    drafter = getattr(getattr(engine, "spec", None), "drafter", None)
    source = getattr(drafter, "source", None)
    if not source:
        return None
    if source.startswith("builtin:"):
        return {"source": source, "files": _packaged_files(source)}
    p = Path(source).expanduser()
    if source.startswith("seeded:") or not p.exists():
        return {"source": source, "files": []}
    p = p.resolve()
    return {"source": str(p), "files": _files(p)}


def engine_fingerprint(engine: Any) -> dict[str, Any]:
    cfg = engine.model.config
    cd = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(vars(cfg))
    cd.pop("num_assistant_tokens", None)  # a serving default (k), not what the K/V and states hold
    cd_json = json.dumps(cd, sort_keys=True, default=str)
    dtype = str(engine.model.dtype).replace("torch.", "")
    # the projections merged or apart round differently (hpc_cli.model.merged): K/V and states
    # written one way are not what a cold pass the other way computes
    from hpc_cli.model.merged import is_merged

    merged = is_merged(engine.model)
    sig = hashlib.sha256(f"{cd_json}|{dtype}|{engine.model.device.type}|chunk={engine.chunk}|merged={merged}"
                         .encode()).hexdigest()[:24]
    scales = getattr(engine.storage, "global_scales", None)
    uses = getattr(engine.kv_profile, "uses_global_scale", False)
    runtime = getattr(engine, "spec", None)
    spec = runtime.name if runtime is not None else "none"
    rope = {k: v for k, v in sorted(cd.items()) if "rope" in k or "rotary" in k or "position" in k}
    ck = _checkpoint(engine)
    return {
        "checkpoint": ck["name"], "checkpoint_files": ck["files"],
        "prefill_signature": f"{dtype}/chunk{engine.chunk}/{sig}",
        "kv_profile": engine.kv_profile.name,
        "kv_global_scales": [[float(x) for x in row] for row in scales.tolist()] if (uses and scales is not None) else [],
        "speculative_backend": spec,
        "speculative_drafter": _drafter(engine),
        "rope": json.loads(json.dumps(rope, default=str)),
        "product": build_id(),
    }


def engine_geometry(engine: Any) -> Geometry:
    c = engine.cache
    return Geometry(c.host.slab_bytes, c.image_bytes, c.index.block_bytes)


def _need(cf: CacheFile, slabs: int) -> str:
    b = slabs * cf.geometry.slab_bytes
    return f"{-(-b // MiB)} MiB (--host-cache-mib {-(-b // MiB) + 1})"


# ------------------------------------------------------------------ load
def load_cache_file(engine: Any, path: str | Path, *, progress: bool = True) -> LoadReport:
    """Load ``path`` into the engine's host tier. Raises CacheFileError on a damaged file (nothing
    is loaded then); returns a report with status ``mismatch`` when the file is for another engine."""
    path = Path(path)
    cache = engine.cache
    index = cache.index
    report = LoadReport(path, LoadStatus.MISSING)
    t0 = time.perf_counter()
    cf = open_cache_file(path)
    diff = fingerprint_diff(cf.fingerprint, engine_fingerprint(engine))
    gdiff = geometry_diff(cf.geometry, engine_geometry(engine))
    report.saved_snapshots = len(cf.snapshots)
    if diff or gdiff:
        report.status = LoadStatus.MISMATCH
        report.reason = ("fingerprint differs in " + ", ".join(diff)) if diff else \
            ("host geometry differs in " + ", ".join(gdiff))
        return report
    assert not index.snapshots and index.tree.size == 0, "load into a cache that already holds entries"
    # The host tier may still be pinning in the background: plan with every slab it will hold,
    # wait for the chunks the plan needs, and plan again with what is there if it stopped short.
    free = index.host.free_slabs + index.host.pending_slabs
    plan = plan_host_restore(cf, free, index.cost)
    if plan.snapshots and cache.wait_host(plan.slabs) < plan.slabs:
        free = index.host.free_slabs
        plan = plan_host_restore(cf, free, index.cost)
    report.need_host_bytes = plan.total_slabs * cf.geometry.slab_bytes
    if not plan.snapshots:
        report.status = LoadStatus.NOT_RESTORED
        report.reason = f"the host tier ({free} slabs) holds none of the snapshots; the file needs {_need(cf, plan.total_slabs)}"
        return report
    host = cache.host
    slabs = index.host.alloc(plan.slabs, SlabUse.NODE, "loading")
    assert slabs is not None
    total = plan.slabs * cf.geometry.slab_bytes
    bar = None
    try:
        if progress:
            from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

            bar = Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                           TransferSpeedColumn(), transient=True)
            bar.start()
            task = bar.add_task("loading prefix cache", total=total)
            on_bytes = lambda n: bar.advance(task, n)  # noqa: E731
        else:
            on_bytes = None
        mapping = read_plan_slabs(cf, plan, lambda s: host.slab_view(s).numpy(), slabs, on_bytes=on_bytes)
    except BaseException:
        index.host.free(slabs)
        raise
    finally:
        if bar is not None:
            bar.stop()
    report.blocks, report.snapshots = adopt_plan(index, cf, plan, mapping)
    report.bytes_read = total
    report.seconds = time.perf_counter() - t0
    report.status = LoadStatus.RESTORED if plan.complete else LoadStatus.PARTIAL
    if not plan.complete:
        report.reason = (f"kept {report.snapshots} of {report.saved_snapshots} snapshots; "
                         f"the file needs {_need(cf, plan.total_slabs)}")
    return report


def attach_cache_file(engine: Any, path: str | Path, *, progress: bool = True,
                      control: SaveControl | None = None, save: bool = True) -> LoadReport:
    """Load ``path`` (when it matches) before ``engine.start()`` and register the save at the
    engine's orderly stop. A file that is not a prefix cache file at all raises CacheFileError
    (:func:`check_cache_file_path`); for a mismatched, damaged or unrestorable one the report says
    what happened, and the save keeps that file aside (:func:`aside_path`) before writing its own:
    a file is never destroyed."""
    if getattr(engine, "_thread", None) is not None:
        raise EngineError("attach_cache_file must run before engine.start()",
                          hint="attach the prefix cache file right after building the engine")
    path = Path(path).expanduser().absolute()
    check_cache_file_path(path)
    control = control or SaveControl()
    cache = engine.cache
    if cache.reuse and not cache.persistent:  # a mode that keeps no prefix cache file (docs/cache-modes.md)
        raise ConfigError(f"cache mode {cache.mode!r} keeps no prefix cache file",
                          hint="remove cache.prefix_cache_file, or set cache.mode = 'hybrid'")
    if not cache.reuse or cache.host.num_slabs == 0:
        report = LoadReport(path, LoadStatus.DISABLED, reason="no host tier (cache.host_cache_mib is 0 or reuse is off)",
                            control=control)
        log.warning("prefix cache file %s not used: %s", path, report.reason)
        return report
    try:
        if path.exists():
            report = load_cache_file(engine, path, progress=progress)
        else:
            report = LoadReport(path, LoadStatus.MISSING, reason="no file yet; the orderly stop writes it")
    except CacheFileError as exc:
        report = LoadReport(path, LoadStatus.DAMAGED, reason=exc.message, error=exc)
    report.control = control
    _log_load(report)
    if save:
        aside = aside_path(path) if report.status in KEEP_ASIDE and path.stat().st_size > 0 else None
        if aside is not None:
            log.warning("prefix cache file %s is not this engine's cache (%s): the save at the orderly stop keeps "
                        "it as %s and writes a new %s", path, report.status, aside.name, path.name)
        engine.on_stop.append(functools.partial(_save_hook, path=path, control=control, aside=aside))
    return report


def _log_load(r: LoadReport) -> None:
    if r.loaded:
        log.info("prefix cache read | %d MiB | %.2f s | %s", r.bytes_read // MiB, r.seconds,
                 _rate(r.bytes_read, r.seconds))
    if r.status == LoadStatus.RESTORED:
        log.info("prefix cache restored: %d snapshots, %d blocks from %s", r.snapshots, r.blocks, r.path)
    elif r.status == LoadStatus.PARTIAL:
        log.warning("prefix cache partly restored: %s", r.reason)
    elif r.status == LoadStatus.NOT_RESTORED:
        log.warning("prefix cache not restored: %s; the save at shutdown keeps the file aside", r.reason)
    elif r.status in (LoadStatus.MISMATCH, LoadStatus.DAMAGED):
        log.warning("prefix cache not restored from %s: %s; the save at shutdown keeps the file aside",
                    r.path, r.reason)
        if r.error is not None and r.error.hint:
            log.warning("hint: %s", r.error.hint)
    else:
        log.info("prefix cache file %s: %s", r.path, r.reason)


# ------------------------------------------------------------------ save
def save_engine_cache(engine: Any, path: str | Path, *, control: SaveControl | None = None) -> int:
    """Write the engine's saveable host content to ``path`` (temporary file, then rename). Call
    only after the worker stopped or from its stop hook (every transfer landed)."""
    control = control or SaveControl()
    cache = engine.cache
    cache.drain()
    assert not cache.index.writes, "a host write is still in flight"
    plan = export_saveable(cache.index)
    host = cache.host
    t0 = time.perf_counter()
    size = save_cache_file(path, engine_fingerprint(engine), engine_geometry(engine), plan,
                           lambda s: host.slab_view(s).numpy(), abandon=control.abandon)
    dt = time.perf_counter() - t0
    control.saved_bytes = size
    log.info("prefix cache saved | %d snapshots, %d blocks | %d MiB | %.2f s | %s -> %s",
             len(plan.snapshots), len(plan.blocks), size // MiB, dt, _rate(size, dt), path)
    return size


def _save_hook(engine: Any, *, path: Path, control: SaveControl, aside: Path | None = None) -> None:
    moved = False
    try:
        if engine.fatal:
            control.result = f"skipped: the engine stopped on an error ({engine.fatal})"
            log.warning("prefix cache not saved: %s", control.result)
            return
        if control.abandon.is_set():
            control.result = "abandoned"
            return
        if aside is not None and path.exists():
            os.replace(path, aside)
            moved = True
            log.warning("prefix cache file %s kept as %s (it is not this engine's cache)", path, aside)
        save_engine_cache(engine, path, control=control)
        control.result = "saved"
    except SaveAbandoned:
        control.result = "abandoned"
        log.warning("prefix cache save abandoned; the previous file %s stays", path)
    except Exception as exc:  # never let the save break the stop
        control.result = f"failed: {exc}"
        log.error("prefix cache save failed (%s); the previous file %s stays", exc, path)
    finally:
        if moved and control.result != "saved" and not path.exists():
            os.replace(aside, path)  # nothing new was written: the old file goes back
        control.finished.set()


# ------------------------------------------------------------------ files that are not ours
#: load outcomes whose file the save keeps aside instead of replacing (another fingerprint or
#: geometry, a damaged or other-format file, a cache none of which fitted the host tier)
KEEP_ASIDE = (LoadStatus.MISMATCH, LoadStatus.DAMAGED, LoadStatus.NOT_RESTORED)


def holds_other_data(path: Path) -> bool:
    """True when ``path`` is a non-empty file that does not start like a prefix cache file."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(MAGIC))
    except (FileNotFoundError, IsADirectoryError):
        return False
    except OSError:
        return False  # unreadable: open_cache_file reports it
    return bool(head) and head != MAGIC


def check_cache_file_path(path: str | Path) -> None:
    """Refuse (CacheFileError) a ``--prefix-cache-file`` that holds other data: the save would
    replace it. A missing, empty or prefix cache file (any fingerprint) is fine."""
    path = Path(path).expanduser()
    if holds_other_data(path):
        raise CacheFileError(f"--prefix-cache-file {path} holds other data (it is not a prefix cache file); "
                             "the orderly stop would replace it",
                             hint="point --prefix-cache-file at a new path (or an hpc-cli prefix cache file), "
                                  "or move that file away")


def file_tag(path: Path) -> str:
    """A short name for a prefix cache file's fingerprint (12 hex digits of its hash), read from
    its header without trusting the rest; ``damaged`` when the header cannot be read."""
    try:
        with open(path, "rb") as f:
            magic, version, meta_len = PREAMBLE.unpack(f.read(PREAMBLE.size))
            if magic != MAGIC or meta_len > (64 << 20):
                return "damaged"
            fp = json.loads(f.read(meta_len))["fingerprint"]
        digest = hashlib.sha256(json.dumps(fp, sort_keys=True, default=str).encode()).hexdigest()[:12]
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError, struct.error):
        return "damaged"
    return digest if version == FORMAT_VERSION else f"format{version}-{digest}"


def aside_path(path: Path) -> Path:
    """Where a file the engine cannot use is kept: ``prefix.bin.old-<fingerprint>`` beside it
    (``.1``, ``.2`` ... when that name is taken)."""
    base = path.with_name(f"{path.name}.old-{file_tag(path)}")
    candidate, k = base, 0
    while candidate.exists():
        k += 1
        candidate = base.with_name(f"{base.name}.{k}")
    return candidate
