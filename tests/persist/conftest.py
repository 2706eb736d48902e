"""Shared helpers for the prefix cache file tests (spec §5.5)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from hpc_cli.cache.cachefile.format import Geometry, open_cache_file
from hpc_cli.cache.cachefile.plan import adopt_plan, export_saveable, plan_host_restore
from hpc_cli.cache.cachefile.slab_io import read_plan_slabs, save_cache_file
from hpc_cli.cache.index import PrefixIndex
from hpc_cli.cache.records import CacheGeometry
from hpc_cli.cache.keys import BLOCK_TOKENS, prepare_prompt, token_bytes
from hpc_cli.cache.snapshot import SnapshotKind
from hpc_cli.errors import CacheFileError

SLAB = 4096
IMAGE = 2 * SLAB + 100  # 3 slabs
FP = {"checkpoint": "builtin:test", "prefill_signature": "x", "kv_profile": "bf16", "product": "t"}


class FakeHost:
    """Bytes of the host tier for pure-index tests: one bytearray of ``num_slabs`` slabs."""

    def __init__(self, num_slabs: int) -> None:
        self.buf = bytearray(num_slabs * SLAB)

    def view(self, slab: int) -> memoryview:
        return memoryview(self.buf)[slab * SLAB:(slab + 1) * SLAB]


def make_index(num_slabs: int, slots: int = 64) -> tuple[PrefixIndex, FakeHost]:
    ix = PrefixIndex(CacheGeometry(block_bytes=SLAB, image_bytes=IMAGE, device_snapshot_slots=slots,
                                   host_bytes=num_slabs * SLAB, slab_bytes=SLAB))
    return ix, FakeHost(num_slabs)


def geom() -> Geometry:
    return Geometry(SLAB, IMAGE, SLAB)


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 250) for _ in range(n)]


def run_prompt(ix: PrefixIndex, host: FakeHost, toks: list[int], frontiers: list[int], *,
               kind=SnapshotKind.TAP, hits: int = 0, page=[0]) -> list:
    """Commit the blocks of ``toks`` (no reuse) and publish snapshots at ``frontiers``, write
    everything through and land it; slab bytes are filled with a pattern of the owner."""
    seq = ix.begin_sequence()
    prepared = prepare_prompt(toks)
    published = []
    for f in sorted(frontiers):
        d = f // BLOCK_TOKENS
        while len(seq.nodes) < d:
            b = len(seq.nodes)
            page[0] += 1
            ix.commit_block(seq, prepared.blocks[b], (page[0],), h=prepared.hashes[b])
        tail = f - d * BLOCK_TOKENS
        g = ix.acquire_snapshot_slot(seq, kind, f, tail)
        assert g is not None
        tp = None
        if tail:
            page[0] += 1
            tp = (page[0],)
        pr = ix.publish(seq, kind, f, slot=g.slot, tail_tokens=token_bytes(toks[d * BLOCK_TOKENS:f]),
                        tail_pages=tp)
        fill(ix, host, pr.write)
        ix.land_write(pr.write)
        pr.snapshot.hits += hits
        published.append(pr.snapshot)
    rel = ix.release(seq)
    fill(ix, host, rel.write)
    ix.land_write(rel.write)
    return published


def fill(ix, host: FakeHost, batch) -> None:
    if batch is None:
        return
    for bt in batch.blocks:
        host.view(bt.slab)[:] = pattern(b"N" + bt.node.tokens[:8])
    for st in batch.snapshots:
        for k, s in enumerate(st.slabs):
            host.view(s)[:] = pattern(b"I%d" % k + st.snapshot.tail_tokens[:4] + st.snapshot.frontier.to_bytes(4, "little"))
        if st.tail_slab >= 0:
            host.view(st.tail_slab)[:] = pattern(b"T" + st.snapshot.frontier.to_bytes(4, "little"))


def pattern(seed: bytes) -> bytes:
    return (seed * (SLAB // max(1, len(seed)) + 1))[:SLAB]


# ------------------------------------------------------------------ a populated index, saved and loaded
def populated():
    ix, host = make_index(400)
    base = tokens(64 * 6, 1)
    run_prompt(ix, host, base, [200])                         # one conversation prefix
    run_prompt(ix, host, base[:128] + tokens(200, 2), [300])  # shares 2 blocks, diverges
    run_prompt(ix, host, tokens(150, 3), [64, 130], hits=5)   # tap (superseded by 130) and endpoint
    run_prompt(ix, host, tokens(40, 4), [40])                 # anchored on the root
    ix.check_invariants()
    return ix, host, base


def save_file(tmp_path: Path, ix, host, fp=FP, g=None) -> Path:
    path = tmp_path / "prefix.bin"
    plan = export_saveable(ix)
    save_cache_file(path, fp, g or geom(), plan, host.view, fsync=False)
    return path


def load_file(path: Path, num_slabs: int):
    ix, host = make_index(num_slabs)
    cf = open_cache_file(path)
    plan = plan_host_restore(cf, ix.host.free_slabs)
    slabs = ix.host.alloc(plan.slabs, 1, "loading")
    mapping = read_plan_slabs(cf, plan, host.view, slabs)
    adopt_plan(ix, cf, plan, mapping)
    ix.check_invariants()
    return ix, host, cf, plan


@pytest.fixture(scope="module")
def sound_file(tmp_path_factory):
    ix, host, _ = populated()
    return save_file(tmp_path_factory.mktemp("fuzz"), ix, host).read_bytes()


def try_load(data: bytes, tmp: Path) -> bool:
    p = tmp / "f.bin"
    p.write_bytes(data)
    ix, host = make_index(400)
    try:
        cf = open_cache_file(p)
        plan = plan_host_restore(cf, ix.host.free_slabs)
        slabs = ix.host.alloc(plan.slabs, 1, "loading")
        try:
            mapping = read_plan_slabs(cf, plan, host.view, slabs)
        except CacheFileError:
            ix.host.free(slabs)
            raise
        adopt_plan(ix, cf, plan, mapping)
        return True
    except CacheFileError:
        assert ix.tree.size == 0 and not ix.snapshots and ix.host.free_slabs == 400
        ix.check_invariants()
        return False
