"""What a save writes and what a load adopts: the saveable subset, partial restore by density
(spec §5.5; hpc_cli/cache/cachefile/plan.py)."""

from __future__ import annotations

from hpc_cli.cache.cachefile.format import open_cache_file
from hpc_cli.cache.cachefile.plan import density, export_saveable, plan_host_restore

from .conftest import load_file, populated, save_file


def test_export_subset_leaves_out_superseded_and_device_only():
    ix, host, _ = populated()
    plan = export_saveable(ix)
    sup = [s for s in ix.snapshots.values() if s.superseded]
    assert sup, "the scenario has a superseded snapshot"
    assert len(plan.snapshots) == len(ix.snapshots) - len(sup)
    assert all(s.kind is not None for s in plan.snapshots)
    # exactly the paths: every block is on some saved snapshot's path
    on_path = set()
    for s in plan.snapshots:
        i = s.anchor
        while i >= 0:
            on_path.add(i)
            i = plan.blocks[i].parent
    assert on_path == set(range(len(plan.blocks)))
    assert all(b.parent < i for i, b in enumerate(plan.blocks))


def test_partial_restore_keeps_densest(tmp_path):
    ix, host, _ = populated()
    path = save_file(tmp_path, ix, host)
    cf = open_cache_file(path)
    dens = sorted(((density(cf, s), j) for j, s in enumerate(cf.snapshots)), reverse=True)
    best = cf.snapshots[dens[0][1]]
    need_best = cf.snapshot_slabs(best) + len(cf.path_of(best))
    plan = plan_host_restore(cf, need_best)
    assert not plan.complete and plan.snapshots == [dens[0][1]]
    assert plan.blocks == cf.path_of(best)  # the path blocks it needs and no others
    if need_best >= cf.geometry.image_slabs + 1:
        ix2, _, _, plan2 = load_file(path, need_best)
        assert len(ix2.snapshots) == 1 and next(iter(ix2.snapshots.values())).frontier == best.frontier
        assert ix2.tree.size == len(cf.path_of(best))
    # too small for any snapshot: nothing
    plan3 = plan_host_restore(cf, cf.geometry.image_slabs - 1)
    assert not plan3.snapshots and not plan3.blocks and plan3.slabs == 0


def test_greedy_is_density_order(tmp_path):
    ix, host, _ = populated()
    cf = open_cache_file(save_file(tmp_path, ix, host))
    for free in range(0, 60, 3):
        plan = plan_host_restore(cf, free)
        assert plan.slabs <= free or plan.complete
        # a skipped snapshot denser than a taken one must not have fitted at its turn
        taken = set(plan.snapshots)
        assert all(i in plan.blocks for j in taken for i in cf.path_of(cf.snapshots[j]))
