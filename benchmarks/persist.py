"""Prefix cache file save/load throughput vs a plain sequential write/read of the same size on the
same disk in the same run (spec §5.5; goal: ratio >= 0.8). Prints JSON.

    python benchmarks/persist.py [--small] [--dir DIR] [--bytes N]

Both sides fsync their writes. Reads follow a page-cache drop attempt (posix_fadvise DONTNEED)
on both sides, so they compare like with like.
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

import torch

from hpc_cli.cache import persist
from hpc_cli.cache.host import SlabUse
from hpc_cli.cache.index import CacheGeometry, PrefixIndex
from hpc_cli.cache.keys import BLOCK_TOKENS, HASH_SEED, lookup_hash
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true", help="200 MB instead of 2 GB")
    ap.add_argument("--bytes", type=int, default=None)
    ap.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir)")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    total = a.bytes or (200_000_000 if a.small else 2_000_000_000)
    ix, host = build(total)
    plan = persist.export_saveable(ix)
    geom = persist.Geometry(SLAB, IMAGE, SLAB)
    fp = {"checkpoint": "bench", "product": "bench"}
    d = Path(a.dir or tempfile.mkdtemp(prefix="hpc-persist-bench-"))
    path, plain = d / "prefix.bin", d / "plain.bin"
    view = lambda s: host.slab_view(s).numpy()  # noqa: E731
    res = {"save_s": [], "plain_write_s": [], "load_s": [], "plain_read_s": []}
    size = 0
    for _ in range(a.repeat):
        t = time.perf_counter()
        size = persist.save_cache_file(path, fp, geom, plan, view)
        res["save_s"].append(time.perf_counter() - t)
        # plain: the same bytes, one sequential buffered write + fsync
        t = time.perf_counter()
        with open(plain, "wb", buffering=8 << 20) as f:
            left = size
            for c in host.chunks:
                mv = memoryview(c.numpy())[:left]
                f.write(mv)
                left -= len(mv)
                if left <= 0:
                    break
            if left > 0:
                f.write(b"\0" * left)
            f.flush()
            os.fsync(f.fileno())
        res["plain_write_s"].append(time.perf_counter() - t)
        # load into a fresh index (full restore, every checksum)
        fresh = PrefixIndex(CacheGeometry(block_bytes=SLAB, image_bytes=IMAGE, device_snapshot_slots=0,
                                          host_bytes=host.num_slabs * SLAB, slab_bytes=SLAB))
        _drop(path)
        t = time.perf_counter()
        cf = persist.open_cache_file(path)
        rp = persist.plan_host_restore(cf, fresh.host.free_slabs)
        slabs = fresh.host.alloc(rp.slabs, SlabUse.NODE, "loading")
        mapping = persist.read_plan_slabs(cf, rp, view, slabs)
        persist.adopt_plan(fresh, cf, rp, mapping)
        res["load_s"].append(time.perf_counter() - t)
        _drop(plain)
        t = time.perf_counter()
        with open(plain, "rb", buffering=0) as f:
            left = size
            for c in host.chunks:
                mv = memoryview(c.numpy())[:left]
                n = f.readinto(mv)
                left -= n
                if left <= 0:
                    break
        res["plain_read_s"].append(time.perf_counter() - t)
    best = {k: min(v) for k, v in res.items()}
    gib = size / (1 << 30)
    out = {
        "bytes": size, "slab_bytes": SLAB, "image_bytes": IMAGE, "blocks": len(plan.blocks),
        "snapshots": len(plan.snapshots), "dir": str(d), "repeat": a.repeat,
        "save_gib_s": gib / best["save_s"], "plain_write_gib_s": gib / best["plain_write_s"],
        "load_gib_s": gib / best["load_s"], "plain_read_gib_s": gib / best["plain_read_s"],
        "save_ratio": best["plain_write_s"] / best["save_s"], "load_ratio": best["plain_read_s"] / best["load_s"],
        "save_ratio_median": statistics.median(res["plain_write_s"]) / statistics.median(res["save_s"]),
        "load_ratio_median": statistics.median(res["plain_read_s"]) / statistics.median(res["load_s"]),
        "goal": 0.8, "seconds": res,
    }
    out["ok"] = out["save_ratio"] >= 0.8 and out["load_ratio"] >= 0.8
    for p in (path, plain):
        p.unlink(missing_ok=True)
    json.dump(out, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
