"""Prefix cache file save/load throughput vs a plain sequential write/read of the same size on the
same disk in the same run (spec §5.5; goal: ratio >= 0.8). Prints JSON.

    python benchmarks/py [--small] [--dir DIR] [--bytes N] [--repeat 5] [--no-fsync]

Like with like: both sides write from the same host storage's memory and have the same
durability (a temporary file, fsync, rename over the previous file, fsync of the directory; with
--no-fsync neither fsyncs); both reads go straight into host storage after a page-cache drop
attempt (posix_fadvise DONTNEED). The four steps run interleaved, their order alternating, for
--repeat rounds; the JSON reports the median and the best of each, the ratios of both, and the
disk (device, file system, mount options). ``ok`` is the medians' ratios against the goal.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from hpc_cli.cache.cachefile.format import Geometry, open_cache_file
from hpc_cli.cache.cachefile.plan import adopt_plan, export_saveable, plan_host_restore
from hpc_cli.cache.cachefile.slab_io import read_plan_slabs, save_cache_file
from hpc_cli.cache.host import SlabUse
from hpc_cli.cache.index import PrefixIndex
from hpc_cli.cache.records import CacheGeometry
from hpc_cli.cache.keys import BLOCK_TOKENS
from hpc_cli.cache.snapshot import SnapshotKind
from hpc_cli.memory.host_slabs import HostSlabStorage

SLAB = 2 << 20  # a 27B-class block bundle
IMAGE = 48 << 20  # a state image


def _drop(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    except (AttributeError, OSError):
        pass


def build(total: int):
    """An index whose host tier holds ``total`` bytes of saveable chains (blocks + snapshots)."""
    num = total // SLAB
    ix = PrefixIndex(CacheGeometry(block_bytes=SLAB, image_bytes=IMAGE, device_snapshot_slots=0,
                                   host_bytes=num * SLAB, slab_bytes=SLAB))
    host = HostSlabStorage(SLAB, num, pin=False)
    for c in host.chunks:
        c.random_(0, 256)
    isl = ix.image_slabs
    conv = 0
    while ix.host.free_slabs >= isl + 8:
        parent = ix.tree.root
        for b in range(min(32, ix.host.free_slabs - isl - 1)):
            toks = (conv * 1000 + b).to_bytes(4, "little") * BLOCK_TOKENS
            (s,) = ix.host.alloc(1, SlabUse.NODE, "bench")
            parent = ix.adopt_host_node(parent, toks, 0, s)
        slabs = tuple(ix.host.alloc(isl, SlabUse.IMAGE, "bench"))
        ix.adopt_host_snapshot(parent, parent.end, SnapshotKind.ENDPOINT, image_slabs=slabs)
        conv += 1
    return ix, host


def _disk(d: Path) -> dict:
    """The file system that holds ``d`` (from /proc/mounts where there is one) and its free space."""
    out: dict = {"dir": str(d)}
    try:
        best = ""
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mnt, fs, opts = line.split()[:4]
            if (str(d.resolve()) + "/").startswith(mnt.rstrip("/") + "/") and len(mnt) >= len(best):
                best = mnt
                out.update(device=dev, mount=mnt, fs=fs, options=opts)
    except OSError:
        pass
    st = os.statvfs(d)
    out["free_bytes"] = st.f_bavail * st.f_frsize
    return out


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def plain_write(host: HostSlabStorage, path: Path, size: int, fsync: bool) -> None:
    """The reference: ``size`` bytes from the host storage's memory, a few large writes, the same
    durability as the cache file's save (a temporary file, fsync, rename into place, fsync of the
    directory), so both sides pay for replacing the previous file."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb", buffering=0) as f:
        left = size
        for c in host.chunks:
            mv = memoryview(c.numpy())[:left]
            while len(mv):
                n = f.write(mv)
                mv = mv[n:]
                left -= n
            if left <= 0:
                break
        if left > 0:
            f.write(b"\0" * left)
        if fsync:
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if fsync:
        _fsync_dir(path.parent)


def plain_read(host: HostSlabStorage, path: Path, size: int) -> None:
    """The reference: the file's bytes straight into the host storage, one large read a chunk."""
    with open(path, "rb", buffering=0) as f:
        left = size
        for c in host.chunks:
            mv = memoryview(c.numpy())[:left]
            while len(mv):
                n = f.readinto(mv)
                if not n:
                    return
                mv = mv[n:]
                left -= n
            if left <= 0:
                break


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true", help="200 MB instead of 2 GB")
    ap.add_argument("--bytes", type=int, default=None)
    ap.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--no-fsync", dest="fsync", action="store_false",
                    help="neither side fsyncs (page-cache speed; ext4 still flushes on a rename over a file)")
    a = ap.parse_args()
    total = a.bytes or (200_000_000 if a.small else 2_000_000_000)
    ix, host = build(total)
    plan = export_saveable(ix)
    geom = Geometry(SLAB, IMAGE, SLAB)
    fp = {"checkpoint": "bench", "product": "bench"}
    d = Path(a.dir or tempfile.mkdtemp(prefix="hpc-persist-bench-"))
    path, plain = d / "prefix.bin", d / "plain.bin"
    view = lambda s: host.slab_view(s).numpy()  # noqa: E731
    # the load's destination: a second host storage (the bytes are not checked against the first)
    dest = HostSlabStorage(SLAB, host.num_slabs, pin=False)
    for c in dest.chunks:
        c.zero_()  # touched once, so neither side pays its page faults
    dview = lambda s: dest.slab_view(s).numpy()  # noqa: E731
    res = {"save_s": [], "plain_write_s": [], "load_s": [], "plain_read_s": []}
    size = save_cache_file(path, fp, geom, plan, view, fsync=a.fsync)  # warm-up: both files exist
    plain_write(host, plain, size, a.fsync)

    def save() -> None:
        t = time.perf_counter()
        save_cache_file(path, fp, geom, plan, view, fsync=a.fsync)
        res["save_s"].append(time.perf_counter() - t)

    def write() -> None:
        t = time.perf_counter()
        plain_write(host, plain, size, a.fsync)
        res["plain_write_s"].append(time.perf_counter() - t)

    def load() -> None:  # into a fresh index: full restore, every checksum
        fresh = PrefixIndex(CacheGeometry(block_bytes=SLAB, image_bytes=IMAGE, device_snapshot_slots=0,
                                          host_bytes=host.num_slabs * SLAB, slab_bytes=SLAB))
        _drop(path)
        t = time.perf_counter()
        cf = open_cache_file(path)
        rp = plan_host_restore(cf, fresh.host.free_slabs)
        slabs = fresh.host.alloc(rp.slabs, SlabUse.NODE, "loading")
        mapping = read_plan_slabs(cf, rp, dview, slabs)
        adopt_plan(fresh, cf, rp, mapping)
        res["load_s"].append(time.perf_counter() - t)

    def read() -> None:
        _drop(plain)
        t = time.perf_counter()
        plain_read(dest, plain, size)
        res["plain_read_s"].append(time.perf_counter() - t)

    for r in range(a.repeat):  # interleaved, the order alternating, so drift hits both sides alike
        for step in ((save, write, load, read) if r % 2 == 0 else (write, save, read, load)):
            step()
    best = {k: min(v) for k, v in res.items()}
    med = {k: statistics.median(v) for k, v in res.items()}
    gib = size / (1 << 30)
    out = {
        "bytes": size, "slab_bytes": SLAB, "image_bytes": IMAGE, "blocks": len(plan.blocks),
        "snapshots": len(plan.snapshots), "disk": _disk(d), "repeat": a.repeat, "fsync": a.fsync,
        "save_gib_s": {"median": gib / med["save_s"], "best": gib / best["save_s"]},
        "plain_write_gib_s": {"median": gib / med["plain_write_s"], "best": gib / best["plain_write_s"]},
        "load_gib_s": {"median": gib / med["load_s"], "best": gib / best["load_s"]},
        "plain_read_gib_s": {"median": gib / med["plain_read_s"], "best": gib / best["plain_read_s"]},
        "save_ratio": {"median": med["plain_write_s"] / med["save_s"], "best": best["plain_write_s"] / best["save_s"]},
        "load_ratio": {"median": med["plain_read_s"] / med["load_s"], "best": best["plain_read_s"] / best["load_s"]},
        "goal": 0.8, "seconds": res,
    }
    out["ok"] = out["save_ratio"]["median"] >= 0.8 and out["load_ratio"]["median"] >= 0.8
    for p in (path, plain):
        p.unlink(missing_ok=True)
    if a.dir is None:
        d.rmdir()
    json.dump(out, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
