"""Transfer engine bandwidth against one contiguous pinned copy of the same bytes (spec §11.2).

Prints one JSON document. For runs of 1, 8, 64 and 256 blocks of a 27B INT8 bundle (16 attention
layers x 4 KV heads x 528 B/token/head, 2.06 MiB a page) and for a 27B state image (147 MiB; 187
MiB with DFlash2 rings): restore (H2D) and write-through (D2H) time, each as a ratio to one
contiguous pinned copy of the same number of bytes in the same run. Two clocks:

* ``wall``: host clock from the call to the stream's completion, enqueue included (what a lane sees);
* ``engine``: device events around the copies while a sleep kernel holds the stream until every
  copy is enqueued (what the copy engines take).

Also the tap (device copy of one image between state slots) against image bytes x 2 over the
measured device-to-device bandwidth, and torch's copy of a strided pinned view (the fallback
without cuda-python) against cudaMemcpy2DAsync.

Usage: python benchmarks/transfer.py [--reps N] [--out FILE]
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
from hpc_cli.memory.host_slabs import BundleLayout, HostSlabStorage, MiB, image_slab_count
from hpc_cli.memory.kv_pool import PagedKVStorage
from hpc_cli.memory.state_pool import StateSlots
from hpc_cli.memory.transfer import RestoreBatch, TransferEngine, layer_order_for_shape
from hpc_cli.shapes import preset

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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
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
    engines = {k: TransferEngine(main, host, state=st, layer_order=order) for k, st in states.items()}
    eng = engines["image"]
    result["cuda_python"] = eng.uses_2d_copies
    result["max_pitch"] = eng.max_pitch
    rstream, wstream = eng._streams["restore"], eng._streams["write"]

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

    def compare(name, nbytes, h2d, fn, stream, engine=eng):
        c = Clock(stream)
        base = contiguous(nbytes, h2d, stream)
        row = {"bytes": nbytes}
        for clock in ("wall", "engine"):
            tb = getattr(c, clock)(base, reps)
            te = getattr(c, clock)(fn, reps)
            row[clock] = {"contiguous_GBps": round(nbytes / tb / 1e9, 2), "engine_GBps": round(nbytes / te / 1e9, 2),
                          "ratio": round(tb / te, 3)}
        engine.drain()
        result.setdefault("rows", {})[name] = row

    for n in (1, 8, 64, 256):
        blocks = [(p, p) for p in range(n)]
        compare(f"restore_{n}_blocks", n * sb, True, lambda b=blocks: eng.restore(RestoreBatch(blocks=b)), rstream)
        compare(f"write_{n}_blocks", n * sb, False, lambda b=blocks: eng.write_through(blocks=b), wstream)
    # scattered slabs: every other slab (stride 2: still one 2-D copy a plane) and reversed (one copy a page a plane)
    blocks = [(p, 2 * p) for p in range(64)]
    compare("restore_64_blocks_stride2", 64 * sb, True, lambda: eng.restore(RestoreBatch(blocks=blocks)), rstream)
    blocks_rev = [(p, 63 - p) for p in range(64)]
    compare("restore_64_blocks_reversed", 64 * sb, True, lambda: eng.restore(RestoreBatch(blocks=blocks_rev)), rstream)

    for key, e in engines.items():
        st = e.state
        k = image_slab_count(st.image_bytes, sb)
        slabs = list(range(max_blocks, max_blocks + k))
        rs, ws = e._streams["restore"], e._streams["write"]
        compare(f"restore_{key}", st.image_bytes, True, lambda e=e, s=slabs: e.restore(RestoreBatch(image=(0, s))), rs, e)
        compare(f"write_{key}", st.image_bytes, False, lambda e=e, s=slabs: e.write_through(images=[(1, s)]), ws, e)
        scattered = slabs[::-1]
        compare(f"restore_{key}_scattered_slabs", st.image_bytes, True,
                lambda e=e, s=scattered: e.restore(RestoreBatch(image=(0, s))), rs, e)

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
        for method in ("memcpy2d", "torch", "per_layer"):
            if method == "memcpy2d" and eng.cudart is None:
                continue
            t_tap = Clock(cur).engine(lambda st=st, m=method: st.copy_slot(0, 1, m), reps)
            t_wall = Clock(cur).wall(lambda st=st, m=method: st.copy_slot(0, 1, m), reps)
            row[method] = {"engine_ms": round(t_tap * 1e3, 4), "wall_ms": round(t_wall * 1e3, 4),
                           "engine_over_ideal": round(t_tap / ideal, 3)}
        result.setdefault("tap", {})[key] = row

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
    fallback = TransferEngine(main, host, state=states["image"], layer_order=order, use_cuda_python=False)
    blocks = [(p, p) for p in range(64)]
    compare("restore_64_blocks_torch_fallback", 64 * sb, True,
            lambda: fallback.restore(RestoreBatch(blocks=blocks)), fallback._streams["restore"], fallback)

    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
