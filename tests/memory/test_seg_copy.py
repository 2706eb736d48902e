"""The batched segment copy on CPU: row planning, the engine's row tables replayed with the
kernel's reference twin (memmove), method choice, and the kernel itself under Triton's
interpreter (in a subprocess: TRITON_INTERPRET must be set before Triton is imported)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from hpc_cli.errors import EngineError
from hpc_cli.memory.transfer.kernel_plan import copy_method_from_env
from hpc_cli.memory.transfer.records import CopyOp, Mark, RestoreBatch
from hpc_kernels import seg_copy

from transfer_rig import PROFILES, fill_random, rig, snapshot, zero

CHUNK = seg_copy.CHUNK_BYTES


def _byte_map(src, dst, nbytes):
    """{dst byte address: src byte address} of segments."""
    out = {}
    for s, d, n in zip(src, dst, nbytes):
        for k in range(n):
            out[d + k] = s + k
    return out


def test_plan_rows_splits_into_aligned_wide_rows_and_narrow_tails():
    src = [0, 1 << 20, 3 << 20, (5 << 20) + 3, 7 << 20]
    dst = [1 << 30, (1 << 30) + (1 << 20), (1 << 30) + (3 << 20), (1 << 30) + (5 << 20), (1 << 30) + (9 << 20)]
    nb = [3 * CHUNK + 100, 16, 0, 2 * CHUNK + 5, 7]
    rows, n_wide = seg_copy.plan_rows(src, dst, nb)
    assert rows.dtype == np.int64 and rows.shape[1] == seg_copy.COLUMNS
    wide, narrow = rows[:n_wide], rows[n_wide:]
    assert (rows[:, 2] > 0).all() and (rows[:, 2] <= CHUNK).all() and not rows[:, 3].any()
    assert not (wide[:, :3] % 16).any(), "wide rows are 16-byte aligned and whole vectors"
    # segment 0: 3 full rows, a 96-byte row and a 4-byte tail; the unaligned one is all narrow
    assert n_wide == 3 + 1 + 1
    assert sorted(narrow[:, 2].tolist()) == sorted([4, CHUNK, CHUNK, 5, 7])
    got = _byte_map(rows[:, 0].tolist(), rows[:, 1].tolist(), rows[:, 2].tolist())
    assert got == _byte_map(src, dst, nb)


def test_plan_rows_stride_column_and_alignment():
    rows, n_wide = seg_copy.plan_rows([0, 64], [0, 64], [48, 32], stride=[48, 8])
    # the second segment's slot stride (8) is not a multiple of 16: its rows are narrow
    assert n_wide == 1 and rows[0].tolist() == [0, 0, 48, 48] and rows[1].tolist() == [64, 64, 32, 8]


def test_reference_twin_replays_random_segments():
    g = np.random.default_rng(0)
    buf = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    out = torch.zeros(1 << 20, dtype=torch.uint8)
    # disjoint destination ranges, arbitrary sources and alignments
    starts = np.sort(g.choice(np.arange(0, (1 << 20) - 70000, 70000), size=12, replace=False))
    nb = g.integers(0, 60000, size=12)
    srcs = g.integers(0, (1 << 20) - 60000, size=12)
    rows, n_wide = seg_copy.plan_rows(buf.data_ptr() + srcs, out.data_ptr() + starts, nb, chunk=4096)
    seg_copy.copy_rows_ref(rows, n_wide)
    for s, d, n in zip(srcs, starts, nb):
        assert torch.equal(out[d:d + n], buf[s:s + n])
    assert int(nb.sum()) >= int((out != 0).sum())


def _replay(eng, items, launch_bytes=None):
    plan = eng.plan_kernel(items, launch_bytes)
    for ln in plan.launches:
        seg_copy.copy_rows_ref(plan.table[ln.row0:ln.row1], ln.n_wide)
    return plan


def _host_bytes(eng):
    return [c.clone() for c in eng.host.chunks]


@pytest.mark.parametrize("profile", PROFILES)
def test_kernel_tables_move_what_the_copies_move(profile):
    """Write-through and restore replayed from the kernel's row table give the same bytes as the
    per-op copies, for every KV profile, blocks in runs and alone, tails, a backend pool, MTP's
    extra layer and an image in scattered slabs."""
    eng = rig(profile, pages=12, slabs=40, chunk_slabs=7, mtp=True, backend=True)
    fill_random(eng, 11)
    kv_ref, st_ref = snapshot(eng)
    need = -(-eng.state.image_bytes // eng.host.slab_bytes)
    img = [33, 2, 17, 9, 11, 25, 1, 14, 0, 38, 37][:need]
    assert len(img) == need, "test geometry: image needs more slabs than listed"
    blocks = [(0, 5), (1, 6), (2, 7), (3, 8), (4, 20, 4), (7, 21, 2)]
    items = eng.plan_write(blocks=blocks, images=[(2, img)], tails=[(5, 30)])
    _replay(eng, items)
    by_kernel = _host_bytes(eng)
    for c in eng.host.chunks:
        c.zero_()
    eng.write_through(blocks=blocks, images=[(2, img)], tails=[(5, 30)])
    assert all(c.ok for c in eng.poll())
    for a, b in zip(by_kernel, eng.host.chunks):
        assert torch.equal(a, b)
    batch = RestoreBatch(blocks=[(9, 5), (10, 6), (11, 7), (1, 8), (4, 20), (6, 21, 2)], tail=(5, 30), image=(0, img))
    zero(eng)
    _replay(eng, eng.plan_restore(batch), launch_bytes=0)
    kv_kernel, st_kernel = snapshot(eng)
    zero(eng)
    eng.restore(batch)
    assert eng.poll()[0].ok
    kv_dma, st_dma = snapshot(eng)
    for la, lb in zip(kv_kernel, kv_dma):
        for a, b in zip(la, lb):
            assert torch.equal(a, b)
    for a, b, r in zip(st_kernel, st_dma, st_ref):
        assert torch.equal(a, b) and torch.equal(a[0], r[2])
    main_ref = kv_ref[:eng.main.num_layers]
    for layer, rlayer in zip(eng.main.planes, main_ref):
        for plane, rp in zip(layer, rlayer):
            assert torch.equal(plane[9], rp[0]) and torch.equal(plane[1], rp[3]) and torch.equal(plane[5], rp[5])


def _stage_bytes(items):
    out = {}
    for it in items:
        if isinstance(it, CopyOp):
            out[it.stage] = out.get(it.stage, 0) + it.nbytes
    return out


def test_kernel_launches_keep_every_event_after_its_copies():
    eng = rig(mtp=True, backend=True)
    need = -(-eng.state.image_bytes // eng.host.slab_bytes)
    batch = RestoreBatch(blocks=[(0, 1), (1, 2), (2, 3, 7)], tail=(6, 10), image=(1, list(range(20, 20 + need))))
    items = eng.plan_restore(batch)
    marks = [it.stage for it in items if isinstance(it, Mark)]
    per_stage = _stage_bytes(items)
    # launch_bytes 0: one launch per stage, holding exactly that stage's bytes, then its event
    plan = eng.plan_kernel(items, launch_bytes=0)
    assert [ln.stages for ln in plan.launches] == [(s,) for s in marks]
    for ln in plan.launches:
        assert int(plan.table[ln.row0:ln.row1, 2].sum()) == per_stage[ln.stages[0]]
    # a small job in one launch: every event after it
    plan = eng.plan_kernel(items, launch_bytes=1 << 40)
    assert len(plan.launches) == 1 and plan.launches[0].stages == tuple(marks)
    assert int(plan.table[:, 2].sum()) == sum(per_stage.values())
    # in between: stages are joined until a launch holds the limit; events never precede copies
    limit = sum(per_stage.values()) // 3
    plan = eng.plan_kernel(items, launch_bytes=limit)
    assert 1 < len(plan.launches) <= 4
    assert [s for ln in plan.launches for s in ln.stages] == marks
    moved = 0
    for ln in plan.launches:
        moved += int(plan.table[ln.row0:ln.row1, 2].sum())
        assert moved == sum(per_stage[s] for s in marks if s <= ln.stages[-1])
        assert ln is plan.launches[-1] or moved >= limit
    assert [ln.row0 for ln in plan.launches[1:]] == [ln.row1 for ln in plan.launches[:-1]]


def test_write_job_with_nothing_to_copy_is_one_empty_launch():
    eng = rig()
    plan = eng.plan_kernel(eng.plan_write())
    assert len(plan.table) == 0 and [ln.stages for ln in plan.launches] == [(0,)]


def test_method_choice_by_bytes_per_call():
    eng = rig(pages=40, slabs=40, chunk_slabs=40)
    items = eng.plan_write(blocks=[(p, p) for p in range(20)])
    assert eng.choose_method(items) == "dma", "CPU never uses the kernel"
    eng.kernel_ok = True  # as on CUDA with Triton and mapped slabs
    ops = [it for it in items if isinstance(it, CopyOp)]
    nbytes = sum(op.nbytes for op in ops)
    # without cuda-python a copy strided on one side is one torch copy per row
    assert eng.cudart is None and all(op.rows == 20 and eng._dma_calls(op) == 20 for op in ops)
    eng.kernel_max_call_bytes = nbytes // (20 * len(ops)) + 1
    assert eng.choose_method(items) == "kernel"
    eng.kernel_max_call_bytes = nbytes // (20 * len(ops))
    assert eng.choose_method(items) == "dma"
    eng.cudart = object()  # with cuda-python: one 2-D copy per op
    eng.kernel_max_call_bytes = nbytes // len(ops) + 1
    assert eng.choose_method(items) == "kernel"
    eng.kernel_max_call_bytes = nbytes // len(ops)
    assert eng.choose_method(items) == "dma"
    eng.copy_method = "kernel"
    assert eng.choose_method(items) == "kernel" and eng.choose_method([Mark(0)]) == "kernel"
    eng.copy_method = "auto"
    assert eng.choose_method([Mark(0)]) == "dma"


def test_copy_method_setting(monkeypatch):
    monkeypatch.delenv("HPC_TRANSFER_COPY", raising=False)
    assert copy_method_from_env() == "auto"
    monkeypatch.setenv("HPC_TRANSFER_COPY", "Kernel")
    assert copy_method_from_env() == "kernel" and copy_method_from_env("dma") == "dma"
    monkeypatch.setenv("HPC_TRANSFER_COPY", "fast")
    with pytest.raises(EngineError, match="fast"):
        copy_method_from_env()
    with pytest.raises(EngineError, match="HPC_TRANSFER_COPY"):
        rig()
    monkeypatch.setenv("HPC_TRANSFER_COPY", "kernel")
    eng = rig()  # CPU: copies stay plain copies
    assert eng.copy_method == "kernel" and not eng.kernel_ok
    assert eng.host.device_ptrs == [None] * len(eng.host.chunks), "unpinned chunks have no device address"
    assert eng.write_through(blocks=[(0, 0)]).method == "dma"


def test_probe_refuses_cpu():
    assert "CUDA" in seg_copy.probe("cpu")


def test_tap_table_replays_copy_slot():
    eng = rig()
    fill_random(eng, 5)
    st = eng.state
    addrs, widths = st.tap_segments()
    assert sum(widths) == st.image_bytes
    rows, n_wide = seg_copy.plan_rows(addrs, addrs, widths, stride=widths, chunk=256)
    before = [t.clone() for t in st.parts()]
    seg_copy.copy_rows_ref(rows, n_wide, 1, 3)
    for t, b in zip(st.parts(), before):
        assert torch.equal(t[3], b[1]) and torch.equal(t[1], b[1])
        assert torch.equal(t[0], b[0]) and torch.equal(t[2], b[2])
    st.copy_slot(0, 2)  # CPU default: torch copies
    for t, b in zip(st.parts(), before):
        assert torch.equal(t[2], b[0])


INTERPRETED = textwrap.dedent("""
    import os
    os.environ["TRITON_INTERPRET"] = "1"
    import numpy as np
    import torch
    from hpc_kernels import seg_copy
    assert seg_copy.available()
    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, 256, (1 << 18,), dtype=torch.uint8, generator=g)
    b = torch.zeros_like(a)
    A, B = a.data_ptr(), b.data_ptr()
    # aligned, aligned with a tail, unaligned, one byte, empty, several rows long
    segs = [(0, 0, 4096), (8192, 16384, 5000), (20003, 30001, 3000), (40000, 40000, 1),
            (50000, 50000, 0), (65536, 65536, 3 * 16384 + 48)]
    seg_copy.copy_segments([A + s for s, _, _ in segs], [B + d for _, d, _ in segs], [n for _, _, n in segs], "cpu")
    for s, d, n in segs:
        assert torch.equal(b[d:d + n], a[s:s + n]), (s, d, n)
    # the same rows through two programs, each copying every other row (wide and narrow alike)
    rows, n_wide = seg_copy.plan_rows([A + s for s, _, _ in segs], [B + d for _, d, _ in segs],
                                      [n for _, _, n in segs])
    assert len(rows) > 4 and n_wide < len(rows)
    b.zero_()
    seg_copy.launch(torch.from_numpy(rows), n_wide, programs=2)
    for s, d, n in segs:
        assert torch.equal(b[d:d + n], a[s:s + n]), (s, d, n)
    mask = torch.zeros_like(a, dtype=torch.bool)
    for _, d, n in segs:
        mask[d:d + n] = True
    assert not b[~mask].any(), "bytes outside the segments stay untouched"
    # slot arguments: slot s of a piece at base + s * width (the tap)
    parts = torch.randint(0, 256, (4, 3, 4096 + 16), dtype=torch.uint8, generator=g)
    addrs = [parts[i].data_ptr() for i in range(4)]
    widths = [parts.shape[2]] * 4
    rows, n_wide = seg_copy.plan_rows(addrs, addrs, widths, stride=widths)
    before = parts.clone()
    seg_copy.launch(torch.from_numpy(rows), n_wide, 2, 0)
    assert torch.equal(parts[:, 0], before[:, 2]) and torch.equal(parts[:, 1:], before[:, 1:])
    # the engine's plans through the interpreted kernel (a write-through, then a restore)
    from transfer_rig import fill_random, rig, snapshot, zero
    from hpc_cli.memory.transfer.records import RestoreBatch
    eng = rig("int8-g64", mtp=True, backend=True)
    fill_random(eng, 2)
    kv_ref, st_ref = snapshot(eng)
    need = -(-eng.state.image_bytes // eng.host.slab_bytes)
    img = [33, 2, 17, 9, 11, 25, 1, 14, 0, 38, 37][:need]
    blocks = [(0, 5), (1, 6), (2, 7), (4, 20, 4)]
    def run(items, programs=None):
        plan = eng.plan_kernel(items, launch_bytes=0)
        for ln in plan.launches:
            seg_copy.launch(torch.from_numpy(plan.table[ln.row0:ln.row1].copy()), ln.n_wide, programs=programs)
    # the write-through with fewer programs than rows (HPC_SEG_WRITE_PROGRAMS): each program
    # copies every third row, and the restore below finds every byte
    run(eng.plan_write(blocks=blocks, images=[(2, img)]), programs=3)
    zero(eng)
    run(eng.plan_restore(RestoreBatch(blocks=[(8, 5), (9, 6), (10, 7), (3, 20, 3)], image=(0, img))))
    kv, st = snapshot(eng)
    for layer, ref in zip(kv, kv_ref):
        for plane, rp in zip(layer, ref):
            assert torch.equal(plane[8:11], rp[0:3])
    for layer, ref in zip(kv[:eng.main.num_layers], kv_ref):
        for plane, rp in zip(layer, ref):
            assert torch.equal(plane[3], rp[4])
    for t, r in zip(st, st_ref):
        assert torch.equal(t[0], r[2])
    print("interpreted ok")
""")


def test_kernel_under_the_triton_interpreter():
    if not seg_copy.available():
        pytest.skip("Triton does not import")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(
        [root, os.path.join(root, "tests", "memory"), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", INTERPRETED], capture_output=True, text=True, env=env,
                       cwd=root, timeout=300)
    assert r.returncode == 0 and "interpreted ok" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("value,want", [(None, None), ("", None), ("0", None), ("16", 16), ("1", 1)])
def test_write_programs_switch(value, want):
    from hpc_cli.memory.transfer.engine import write_programs_from_env

    assert write_programs_from_env(value) == want


@pytest.mark.parametrize("value", ["-2", "many", "1.5"])
def test_a_bad_write_programs_switch_is_an_error_with_a_hint(value):
    from hpc_cli.memory.transfer.engine import write_programs_from_env

    with pytest.raises(EngineError) as e:
        write_programs_from_env(value)
    assert "HPC_SEG_WRITE_PROGRAMS" in str(e.value) and e.value.hint
