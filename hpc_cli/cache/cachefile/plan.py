"""What the prefix cache file carries across a restart (spec §5.5): what a save writes and what a
load adopts. Pure Python.

The saveable subset (:func:`export_saveable`): retained (not superseded) snapshots whose image (and
tail) is host Resident and whose anchor path is host Resident, and exactly those paths. A
smaller host tier restores whole snapshots greedily by density (:func:`plan_host_restore`);
:func:`adopt_plan` rebuilds what the plan read as host-only entries of the index.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from hpc_cli.cache.cachefile.format import CacheFile, FileBlock, FileSnapshot, SavePlan, block_depth
from hpc_cli.cache.cost import GENERIC, CacheCostModel
from hpc_cli.cache.tree import RESIDENT, BlockNode

if TYPE_CHECKING:
    from hpc_cli.cache.index import PrefixIndex


# ------------------------------------------------------------------ export (§5.5 save subset)
def export_saveable(index: "PrefixIndex") -> SavePlan:
    """The retained, host-resident snapshots whose anchor paths are host-resident, and exactly
    those paths, parents first. Dead KV, superseded and device-only content are left out."""
    chosen: dict[BlockNode, None] = {}
    snaps = []
    for s in index.snapshots.values():
        if not s.alive or s.superseded or s.host_state != RESIDENT:
            continue
        if s.tail_tokens and s.tail_host_state != RESIDENT:
            continue
        path = s.anchor.path()
        if any(n.host_state != RESIDENT for n in path):
            continue
        snaps.append(s)
        for n in path:
            chosen[n] = None
    nodes = sorted(chosen, key=lambda n: (n.depth, n.id))  # parents first
    pos = {n: i for i, n in enumerate(nodes)}
    blocks = [FileBlock(pos[n.parent] if not n.parent.is_root else -1, n.tokens, n.extra, n.hash, n.host_slab,
                        n.media) for n in nodes]
    out = []
    for s in sorted(snaps, key=lambda s: (s.frontier, s.id)):
        out.append(FileSnapshot(pos[s.anchor] if not s.anchor.is_root else -1, s.frontier, s.kind,
                                s.tail_tokens, s.hits, 0, tuple(s.host_slabs), s.tail_host_slab, s.tail_extra))
    return SavePlan(blocks, out)


# ------------------------------------------------------------------ restore planning
def density(cf: CacheFile, s: FileSnapshot, cost: CacheCostModel = GENERIC) -> float:
    """(1 + hits) x the prefill a restore saves from the root, per byte of image, tail and path."""
    g = cf.geometry
    path_bytes = g.block_bytes * (block_depth(cf.blocks, s.anchor) + 1)
    nbytes = g.image_bytes + (g.block_bytes if s.has_tail else 0) + path_bytes
    return (1 + s.hits) * cost.prefill_seconds(0, s.frontier) / max(1, nbytes)


@dataclass(slots=True)
class RestorePlan:
    snapshots: list[int]  # indices into cf.snapshots, file order
    blocks: list[int]  # indices into cf.blocks, parents first
    slabs: int  # host slabs the plan takes
    total_slabs: int  # what the whole file needs
    complete: bool


def plan_host_restore(cf: CacheFile, free_slabs: int, cost: CacheCostModel = GENERIC) -> RestorePlan:
    """Whole snapshots, greedily by :func:`density`, each with the path blocks it needs and no
    others, within ``free_slabs``."""
    per = {j: cf.snapshot_slabs(s) for j, s in enumerate(cf.snapshots)}
    used = len(cf.blocks) + sum(per.values())
    if used <= free_slabs:
        return RestorePlan(list(range(len(cf.snapshots))), list(range(len(cf.blocks))), used, used, True)
    order = sorted(range(len(cf.snapshots)),
                   key=lambda j: (-density(cf, cf.snapshots[j], cost), -cf.snapshots[j].frontier, j))
    have: set[int] = set()
    take: list[int] = []
    left = free_slabs
    for j in order:
        path = [i for i in cf.path_of(cf.snapshots[j]) if i not in have]
        need = per[j] + len(path)
        if need <= left:
            left -= need
            have.update(path)
            take.append(j)
    take.sort()
    return RestorePlan(take, sorted(have), free_slabs - left, used, len(take) == len(cf.snapshots))


# ------------------------------------------------------------------ adoption
def adopt_plan(index: "PrefixIndex", cf: CacheFile, plan: RestorePlan, mapping: dict[int, int]) -> tuple[int, int]:
    """Rebuild the plan's entries in ``index`` host-only, parents first (no eviction)."""
    nodes: dict[int, BlockNode] = {}
    root = index.tree.root
    for i in plan.blocks:
        b = cf.blocks[i]
        parent = nodes[b.parent] if b.parent >= 0 else root
        nodes[i] = index.adopt_host_node(parent, b.tokens, b.extra, mapping[i], h=b.hash, media=b.media)
    isl = cf.geometry.image_slabs
    for j in plan.snapshots:
        s = cf.snapshots[j]
        anchor = nodes[s.anchor] if s.anchor >= 0 else root
        image = tuple(mapping[s.first_slab + k] for k in range(isl))
        tail = mapping[s.first_slab + isl] if s.has_tail else -1
        index.adopt_host_snapshot(anchor, s.frontier, s.kind, tail_tokens=s.tail_tokens, hits=s.hits,
                                  image_slabs=image, tail_slab=tail, tail_extra=s.tail_extra)
    return len(plan.blocks), len(plan.snapshots)
