"""Transfer engine bandwidth against one contiguous pinned copy of the same bytes (spec §11.2).

Prints one JSON document. For runs of 1, 8, 64 and 256 blocks of a 27B INT8 bundle (16 attention
layers x 4 KV heads x 528 B/token/head, 2.06 MiB a page) and for a 27B state image (147 MiB; 187
MiB with DFlash2 rings): restore (H2D) and write-through (D2H) time, each as a ratio to one
contiguous pinned copy of the same number of bytes in the same run. Two clocks:

* ``wall``: host clock from the call to the stream's completion, enqueue included (what a lane sees);
* ``engine``: device events around the copies while a sleep kernel holds the stream until every
  copy is enqueued (what the copy engines take).

Every row is measured, in the same run against the same contiguous baseline, for each copy
method of the transfer engine: ``dma`` (cudaMemcpy2DAsync per run per plane), ``kernel`` (the
batched segment copy kernel, hpc_kernels.seg_copy) and ``auto`` (the engine's per-job choice,
reported as ``chose``).

Also the tap (device copy of one image between state slots) against image bytes x 2 over the
measured device-to-device bandwidth (torch, memcpy2d, per-layer and kernel taps), the kernel's
row size on a 1-block restore, and torch's copy of a strided pinned view (the fallback without
cuda-python) against cudaMemcpy2DAsync.

Every row also reports, per method, ``plan_us``: the host time to plan one job as the engine
plans it (median, microseconds): the CopyOp plan, the method choice and, for the kernel, the row
table; a blocks-only kernel job is planned from the engine's block template instead.

Prints the JSON document (to --out when given) and then a compact summary table.

``--plan-only`` needs no GPU: it times planning alone (on CUDA when available, else on CPU with
small page counts) for 1, 8 and 64 blocks of the 27B INT8 bundle: the general kernel plan
(``plan_kernel(plan_restore(...))``) against the block template (``plan_kernel_blocks``).

Usage: python benchmarks/transfer.py [--reps N] [--out FILE] [--methods dma,kernel,auto] [--plan-only]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import torch

from hpc_cli import plugins
from hpc_cli.errors import EngineError
from hpc_cli.memory.bundle import BundleLayout, image_slab_count
from hpc_cli.memory.host_slabs import HostSlabStorage, MiB
from hpc_cli.memory.kv_pool import PagedKVStorage
from hpc_cli.memory.state_pool import StateSlots
from hpc_cli.memory.transfer.engine import TransferEngine
from hpc_cli.memory.transfer.plan import layer_order_for_shape
from hpc_cli.memory.transfer.records import CopyOp, RestoreBatch
from hpc_cli.shapes import preset
from hpc_kernels import seg_copy

SLEEP_CYCLES = 8_000_000  # ~4 ms at 1.98 GHz: longer than any enqueue below


def _median(xs):
    return statistics.median(xs)


class Clock:
    def __init__(self, stream):
        self.stream = stream

    def wall(self, fn, reps):
        out = []
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            self.stream.synchronize()
            torch.cuda.current_stream().synchronize()
            out.append(time.perf_counter() - t0)
        return _median(out)

    def engine(self, fn, reps):
        """Device time of fn's copies on self.stream, with the stream held until all are enqueued."""
        out = []
        for _ in range(reps):
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            cur = torch.cuda.current_stream()
            torch.cuda._sleep(SLEEP_CYCLES)
            start.record(cur)
            self.stream.wait_stream(cur)
            fn()
            end.record(self.stream)
            torch.cuda.synchronize()
            out.append(start.elapsed_time(end) / 1e3)
        return _median(out)


def plan_job(e: TransferEngine, kind: str, **kw) -> None:
    """Plan one job as restore()/write_through() do, without submitting it."""
    job = e._restore_job(kw["batch"]) if kind == "restore" else \
        e._write_job(kw.get("blocks", ()), kw.get("images", ()), kw.get("tails", ()))
    if job.plan is None and e.choose_method(job.items) == "kernel":
        e.plan_kernel(job.items)


def host_us(fn, reps: int) -> float:
    """Median host time of ``fn()`` in microseconds (after one warm-up call)."""
    fn()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return round(_median(out) * 1e6, 1)


def plan_only(reps: int) -> dict:
    """Planning time of blocks-only restores and write-throughs, general plan vs block template."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = preset("qwen3.5-27b")
    pages = 64
    main = PagedKVStorage(plugins.kv_profile("int8-g64"), shape.num_attention_layers, shape.num_kv_heads,
                          shape.head_dim, pages, device=dev)
    sb = BundleLayout.for_storage(main).slab_bytes
    host = HostSlabStorage(sb, pages, pin=dev.type == "cuda")
    state = StateSlots(shape.num_gdn_layers, shape.conv_dim, shape.linear_conv_kernel_dim - 1,
                       shape.linear_num_value_heads, shape.linear_key_head_dim, shape.linear_value_head_dim,
                       shape.hidden_size, 1, dtype=torch.bfloat16, device=dev)
    e = TransferEngine(main, host, state=state, layer_order=layer_order_for_shape(shape), copy_method="dma")
    out: dict = {"device": str(dev), "cpu": platform.processor() or platform.machine(), "slab_bytes": sb,
                 "reps": reps, "us_per_job": {}}
    for n in (1, 8, 64):
        blocks = [(p, p) for p in range(n)]
        batch = RestoreBatch(blocks=blocks)
        out["us_per_job"][f"{n}_blocks"] = {
            "restore_general": host_us(lambda: e.plan_kernel(e.plan_restore(batch)), reps),
            "restore_template": host_us(lambda: e.plan_kernel_blocks("restore", blocks), reps),
            "write_general": host_us(lambda: e.plan_kernel(e.plan_write(blocks=blocks)), reps),
            "write_template": host_us(lambda: e.plan_kernel_blocks("write", blocks), reps),
        }
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default=None)
    ap.add_argument("--methods", default="dma,kernel,auto", help="engine copy methods to measure")
    ap.add_argument("--plan-only", action="store_true", help="time host planning only (no GPU needed)")
    args = ap.parse_args()
    if args.plan_only:
        res = plan_only(max(args.reps, 200))
        print(json.dumps(res, indent=1))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)
        return 0
    assert torch.cuda.is_available(), "this benchmark needs CUDA"
    dev = torch.device("cuda")
    shape = preset("qwen3.5-27b")
    reps = args.reps
    result: dict = {"machine": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                "python": platform.python_version()}}

    # -- the pools ------------------------------------------------------------------------
    max_blocks = 256
    main = PagedKVStorage(plugins.kv_profile("int8-g64"), shape.num_attention_layers, shape.num_kv_heads,
                          shape.head_dim, max_blocks, device=dev)
    for layer in main.planes:
        for p in layer:
            p.copy_(torch.randint(0, 256, p.shape, dtype=torch.uint8, device=dev))
    layout = BundleLayout.for_storage(main)
    sb = layout.slab_bytes
    ring = plugins.spec_backend("dflash2")
    rl, rw, rh, rd = ring.ring_geometry(shape)
    states = {
        "image": StateSlots(shape.num_gdn_layers, shape.conv_dim, shape.linear_conv_kernel_dim - 1,
                            shape.linear_num_value_heads, shape.linear_key_head_dim, shape.linear_value_head_dim,
                            shape.hidden_size, 2, dtype=torch.bfloat16, device=dev),
        "image_dflash2": StateSlots(shape.num_gdn_layers, shape.conv_dim, shape.linear_conv_kernel_dim - 1,
                                    shape.linear_num_value_heads, shape.linear_key_head_dim,
                                    shape.linear_value_head_dim, shape.hidden_size, 2, dtype=torch.bfloat16,
                                    device=dev, extra_parts={"ring_k": ((rl, rw, rh, rd), torch.bfloat16),
                                                             "ring_v": ((rl, rw, rh, rd), torch.bfloat16)}),
    }
    for st in states.values():
        for t in st.parts():
            t.copy_(torch.randn(t.shape, device=dev).to(t.dtype))
    img_slabs = image_slab_count(states["image_dflash2"].image_bytes, sb)
    t0 = time.perf_counter()
    host = HostSlabStorage(sb, max_blocks + 2 * img_slabs, pin=True)
    result["host"] = {"slab_bytes": sb, "slabs": host.num_slabs, "chunks": len(host.chunks),
                      "pin_seconds": round(time.perf_counter() - t0, 3)}
    host.chunks[0].random_(0, 256) if host.chunks else None
    order = layer_order_for_shape(shape)
    methods = [m for m in args.methods.split(",") if m]
    # engines[state key][method]; they share the pools and slabs
    engines: dict = {k: {} for k in states}
    for m in list(methods):
        try:
            for k, st in states.items():
                engines[k][m] = TransferEngine(main, host, state=st, layer_order=order, copy_method=m)
        except EngineError as exc:  # the kernel cannot run here: measure the others
            result.setdefault("skipped_methods", {})[m] = str(exc)
            methods.remove(m)
            for per in engines.values():
                per.pop(m, None)
    eng = engines["image"][methods[0]]
    result["cuda_python"] = eng.uses_2d_copies
    result["max_pitch"] = eng.max_pitch
    result["methods"] = methods
    result["kernel_ok"] = any(e.kernel_ok for e in engines["image"].values())
    result["kernel_row_bytes"] = seg_copy.CHUNK_BYTES
    result["kernel_max_call_bytes"] = eng.kernel_max_call_bytes
    result["kernel_launch_bytes"] = eng.kernel_launch_bytes

    def save():  # after every section, so a run cut short still leaves what it measured
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)

    for per in engines.values():  # compile the kernel and fill the table pools before timing
        for e in per.values():
            e.write_through(blocks=[(0, 0)])
            e.restore(RestoreBatch(blocks=[(0, 0)]))
            e.drain()

    # contiguous baselines: one pinned buffer <-> one device buffer
    big = max(max_blocks * sb, states["image_dflash2"].image_bytes)
    hbuf = torch.empty(big, dtype=torch.uint8).pin_memory()
    dbuf = torch.empty(big, dtype=torch.uint8, device=dev)

    def contiguous(nbytes, h2d, stream):
        def fn():
            with torch.cuda.stream(stream):
                if h2d:
                    dbuf[:nbytes].copy_(hbuf[:nbytes], non_blocking=True)
                else:
                    hbuf[:nbytes].copy_(dbuf[:nbytes], non_blocking=True)
        return fn

    def timed(c, clock, fn, tb, nbytes):
        te = getattr(c, clock)(fn, reps)
        return {"GBps": round(nbytes / te / 1e9, 2), "ratio": round(tb / te, 3)}

    def compare(name, nbytes, h2d, submit, key="image", plan=None):
        """``submit(engine)`` enqueues one job; measured for every method against one baseline;
        ``plan(engine)`` plans the same job without submitting it (its host time: ``plan_us``)."""
        row: dict = {"bytes": nbytes, "contiguous_GBps": {}}
        side = "restore" if h2d else "write"
        for clock in ("wall", "engine"):
            s0 = engines[key][methods[0]]._streams[side]
            tb = getattr(Clock(s0), clock)(contiguous(nbytes, h2d, s0), reps)
            row["contiguous_GBps"][clock] = round(nbytes / tb / 1e9, 2)
            for m in methods:
                e = engines[key][m]
                c = Clock(e._streams[side])
                job = {}

                def fn(e=e):
                    job["j"] = submit(e)
                row.setdefault(m, {})[clock] = timed(c, clock, fn, tb, nbytes)
                row[m]["chose"] = job["j"].method
                e.drain()
        if plan is not None:
            for m in methods:
                row[m]["plan_us"] = host_us(lambda e=engines[key][m]: plan(e), max(reps, 50))
        result.setdefault("rows", {})[name] = row

    for n in (1, 8, 64, 256):
        blocks = [(p, p) for p in range(n)]
        compare(f"restore_{n}_blocks", n * sb, True, lambda e, b=blocks: e.restore(RestoreBatch(blocks=b)),
                plan=lambda e, b=blocks: plan_job(e, "restore", batch=RestoreBatch(blocks=b)))
        compare(f"write_{n}_blocks", n * sb, False, lambda e, b=blocks: e.write_through(blocks=b),
                plan=lambda e, b=blocks: plan_job(e, "write", blocks=b))
    # scattered slabs: every other slab (stride 2: still one 2-D copy a plane) and reversed (one copy a page a plane)
    blocks = [(p, 2 * p) for p in range(64)]
    compare("restore_64_blocks_stride2", 64 * sb, True, lambda e: e.restore(RestoreBatch(blocks=blocks)),
            plan=lambda e: plan_job(e, "restore", batch=RestoreBatch(blocks=blocks)))
    blocks_rev = [(p, 63 - p) for p in range(64)]
    compare("restore_64_blocks_reversed", 64 * sb, True, lambda e: e.restore(RestoreBatch(blocks=blocks_rev)),
            plan=lambda e: plan_job(e, "restore", batch=RestoreBatch(blocks=blocks_rev)))
    save()

    for key, st in states.items():
        k = image_slab_count(st.image_bytes, sb)
        slabs = list(range(max_blocks, max_blocks + k))
        compare(f"restore_{key}", st.image_bytes, True, lambda e, s=slabs: e.restore(RestoreBatch(image=(0, s))), key,
                plan=lambda e, s=slabs: plan_job(e, "restore", batch=RestoreBatch(image=(0, s))))
        compare(f"write_{key}", st.image_bytes, False, lambda e, s=slabs: e.write_through(images=[(1, s)]), key,
                plan=lambda e, s=slabs: plan_job(e, "write", images=[(1, s)]))
        scattered = slabs[::-1]
        compare(f"restore_{key}_scattered_slabs", st.image_bytes, True,
                lambda e, s=scattered: e.restore(RestoreBatch(image=(0, s))), key,
                plan=lambda e, s=scattered: plan_job(e, "restore", batch=RestoreBatch(image=(0, s))))
        save()

    # -- the kernel's row size on one block's planes (H2D, table upload included) -------------
    if "kernel" in methods:
        plan = engines["image"]["kernel"].plan_restore(RestoreBatch(blocks=[(0, 0)]))
        segs = engines["image"]["kernel"]._segments([op for op in plan if isinstance(op, CopyOp)])[:3]
        rs = engines["image"]["kernel"]._streams["restore"]
        c = Clock(rs)
        tb = c.engine(contiguous(sb, True, rs), reps)
        sweep = {}
        for chunk in (4096, 8192, 16384, 32768, 65536):
            def run(chunk=chunk):
                with torch.cuda.stream(rs):
                    keep.append(seg_copy.copy_segments(*segs, dev, chunk=chunk))
            keep: list = []
            run()
            torch.cuda.synchronize()
            sweep[str(chunk)] = timed(c, "engine", run, tb, sb)
            keep.clear()
        result["kernel_row_bytes_1_block_restore"] = sweep
        save()

    # -- tap: one image between slots vs bytes x 2 / D2D bandwidth -------------------------
    cur = torch.cuda.current_stream()
    a = torch.empty(1 << 31, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    c = Clock(cur)
    t_big = c.wall(lambda: b.copy_(a), 5)
    t_big = min(t_big, Clock(cur).engine(lambda: b.copy_(a), 5))
    d2d = 2 * a.numel() / t_big
    del a, b
    result["d2d_GBps_read_plus_write"] = round(d2d / 1e9, 1)
    for key, st in states.items():
        nb = st.image_bytes
        ideal = 2 * nb / d2d
        row = {"bytes": nb, "ideal_ms": round(ideal * 1e3, 4)}
        for method in ("memcpy2d", "torch", "per_layer", "kernel"):
            if (method == "memcpy2d" and eng.cudart is None) or (method == "kernel" and seg_copy.probe(dev)):
                continue
            st.copy_slot(0, 1, method)  # warm up (the kernel: compile, upload its table)
            t_tap = Clock(cur).engine(lambda st=st, m=method: st.copy_slot(0, 1, m), reps)
            t_wall = Clock(cur).wall(lambda st=st, m=method: st.copy_slot(0, 1, m), reps)
            row[method] = {"engine_ms": round(t_tap * 1e3, 4), "wall_ms": round(t_wall * 1e3, 4),
                           "engine_over_ideal": round(t_tap / ideal, 3)}
        result.setdefault("tap", {})[key] = row
    save()

    # -- torch's strided pinned copy vs one 2-D copy (64 rows of 64 KiB, pitch = slab) -------
    rows, width = 64, 65536
    hv = host.run_view(0, rows, 1, 0, width)
    dv = main.planes[0][0].view(main.num_pages, -1)[:rows]
    t_torch = Clock(cur).wall(lambda: dv.copy_(hv, non_blocking=True), reps)
    t_rows = Clock(cur).wall(lambda: [dv[r].copy_(hv[r], non_blocking=True) for r in range(rows)], reps)
    out = {"rows": rows, "width": width, "pitch": sb, "torch_strided_copy_ms": round(t_torch * 1e3, 4),
           "torch_per_row_ms": round(t_rows * 1e3, 4)}
    if eng.cudart is not None:
        rt = eng.cudart

        def two_d():
            rt.cudaMemcpy2DAsync(dv.data_ptr(), dv.stride(0), hv.data_ptr(), hv.stride(0), width, rows,
                                 rt.cudaMemcpyKind.cudaMemcpyDefault, cur.cuda_stream)
        out["cudaMemcpy2DAsync_ms"] = round(Clock(cur).wall(two_d, reps) * 1e3, 4)
    result["strided_fallback"] = out
    fallback = TransferEngine(main, host, state=states["image"], layer_order=order, use_cuda_python=False,
                              copy_method="dma")
    blocks = [(p, p) for p in range(64)]
    fb = Clock(fallback._streams["restore"])
    tb = fb.wall(contiguous(64 * sb, True, fallback._streams["restore"]), reps)
    result["restore_64_blocks_torch_fallback_wall"] = timed(
        fb, "wall", lambda: fallback.restore(RestoreBatch(blocks=blocks)), tb, 64 * sb)
    fallback.drain()

    if args.out:
        save()
    else:
        print(json.dumps(result, indent=1))
    print(summary(result))
    return 0


def summary(result: dict) -> str:
    """The rows as ratios to the contiguous copy (engine / wall clock), the tap and the row size."""
    methods = result.get("methods", [])
    lines = [f"{result['machine']['gpu']}; ratio to one contiguous pinned copy, engine/wall clock; "
             f"cuda-python {result.get('cuda_python')}, kernel {result.get('kernel_ok')}"]
    head = f"{'row':34} {'MiB':>8} {'contig GB/s':>11}" + "".join(f" {m:>22}" for m in methods)
    lines.append(head)
    for name, row in result.get("rows", {}).items():
        cells = ""
        for m in methods:
            r = row.get(m, {})
            cell = f"{r.get('engine', {}).get('ratio', '-')}/{r.get('wall', {}).get('ratio', '-')}"
            if m == "auto":
                cell += f" {str(r.get('chose', '?'))[0]}"
            cell += f" {r.get('plan_us', '-')}us"
            cells += f" {cell:>22}"
        contig = row.get("contiguous_GBps", {}).get("engine", "-")
        lines.append(f"{name:34} {row['bytes'] / MiB:8.2f} {contig:>11}" + cells)
    lines.append("  (cells: engine/wall ratio; auto's letter: k = chose the kernel, d = DMA; "
                 "host planning time per job, median)")
    lines.append(f"tap (engine time / (bytes x 2 / {result.get('d2d_GBps_read_plus_write')} GB/s)):")
    for key, row in result.get("tap", {}).items():
        parts = [f"{m} {v['engine_over_ideal']}x ({v['engine_ms']} ms)" for m, v in row.items() if isinstance(v, dict)]
        lines.append(f"  {key:14} {row['bytes'] / MiB:7.1f} MiB ideal {row['ideal_ms']} ms: " + ", ".join(parts))
    sweep = result.get("kernel_row_bytes_1_block_restore")
    if sweep:
        lines.append("kernel row bytes, 1-block restore (engine ratio): "
                     + ", ".join(f"{k}: {v['ratio']}" for k, v in sweep.items()))
    fb = result.get("restore_64_blocks_torch_fallback_wall")
    if fb:
        lines.append(f"restore 64 blocks without cuda-python (wall ratio): {fb['ratio']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
