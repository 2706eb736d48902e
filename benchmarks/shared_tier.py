"""When the shared cache tier pays: restoring a prefix from Redis against prefilling it, on this
machine (CPU, builtin:tiny by default), with a real redis-server on a free loopback port.

Per prompt length: engine A serves the prompt (its blocks and endpoint snapshot go to Redis);
a fresh engine B then serves the prompt plus a short suffix, once with the shared tier (the
history comes from Redis) and once without (a cold prefill). Printed per length: time to first
token both ways, the bytes fetched, the lookup and fetch time (store round trips, checks, copies
into host slabs), and the effective restore rate. Also the store's raw GET rate for values of the
27B block size (2 MiB) and of a 27B snapshot (~147 MiB), and the worker's copy rate out of and
into host slabs. One JSON document on stdout.

    python benchmarks/shared_tier.py                  # 1k, 4k, 16k tokens
    python benchmarks/shared_tier.py --lengths 2048,8192 --model builtin:tiny
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MiB = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Redis:
    def __init__(self, maxmemory_mib: int) -> None:
        binary = shutil.which("redis-server") or shutil.which("valkey-server")
        if binary is None:
            raise SystemExit("shared_tier: no redis-server on PATH (apt-get install redis-server)")
        self.dir = tempfile.mkdtemp(prefix="shared-tier-")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen([binary, "--bind", "127.0.0.1", "--port", str(self.port), "--dir", self.dir,
                                      "--save", "", "--appendonly", "no", "--maxmemory", f"{maxmemory_mib}mb",
                                      "--maxmemory-policy", "allkeys-lru"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise SystemExit("shared_tier: redis-server did not start")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


def store_rates(url: str, reps: int) -> dict[str, float]:
    """The store's own GET and SET rates for 2 MiB and 147 MiB values (MB/s, medians)."""
    from hpc_cli import plugins
    from hpc_cli.shared_store import StoreKey

    store = plugins.shared_store("redis").open(url, timeout_s=30.0)
    out: dict[str, float] = {}
    try:
        for name, size in (("block_2MiB", 2 * MiB), ("image_147MiB", 153_954_304)):
            value = os.urandom(size)
            gets, sets = [], []
            for i in range(reps):
                key = StoreKey(f"bench:{name}:{i}")
                t0 = time.perf_counter()
                store.put([(key, value)])
                sets.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                got = store.get([key])[0]
                gets.append(time.perf_counter() - t0)
                assert got is not None and len(got) == size
            out[f"get_{name}_MBps"] = round(size / sorted(gets)[len(gets) // 2] / 1e6, 1)
            out[f"set_{name}_MBps"] = round(size / sorted(sets)[len(sets) // 2] / 1e6, 1)
    finally:
        store.close()
    return out


def copy_rate(nbytes: int = 256 * MiB) -> float:
    """bytes -> numpy slab view -> bytes on this CPU (MB/s), the worker's copies."""
    import numpy as np

    src = np.frombuffer(os.urandom(nbytes), dtype=np.uint8)
    dst = np.empty(nbytes, dtype=np.uint8)
    t0 = time.perf_counter()
    dst[:] = src
    out = bytes(dst)
    dt = time.perf_counter() - t0
    assert len(out) == nbytes
    return round(2 * nbytes / dt / 1e6, 1)


def measure(model_name: str, lengths: list[int], suffix: int, url: str) -> list[dict[str, object]]:
    import torch

    from hpc_cli.engine.api import GenerationRequest, SamplingParams
    from hpc_cli.engine.engine import Engine
    from hpc_cli.engine.shared import attach_shared_cache
    from hpc_cli.model.model import HybridModel

    model = HybridModel.from_name_or_path(model_name, dtype=torch.float32, progress=False)
    rows = []
    for n in lengths:
        rng = random.Random(n)
        prompt = [rng.randrange(1, 250) for _ in range(n)]
        more = [rng.randrange(1, 250) for _ in range(suffix)]
        pages = 2 * (n + suffix + 64) // 64 + 16
        host_mib = max(64, 4 * (n + suffix) * 65536 // (64 * MiB) + 16)

        def engine(shared: bool) -> Engine:
            e = Engine(model, kv_pages=pages, prefill_chunk=512, max_concurrency=2, host_cache_mib=host_mib,
                       max_model_len=n + suffix + 64)
            if shared:
                attach_shared_cache(e, url, timeout_ms=30_000)
            return e.start()

        def ttft(e: Engine, toks: list[int]) -> tuple[float, int]:
            sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
            t0 = time.perf_counter()
            _, fin = e.generate(GenerationRequest(list(toks), sp), timeout=600)
            return time.perf_counter() - t0, fin.usage.reuse_tokens

        a = engine(True)
        ttft(a, prompt)
        a.cache.shared.flush(60)
        a.stop()
        b = engine(True)
        hit_s, reused = ttft(b, prompt + more)
        st = b.cache.shared.stats()
        b.cache.shared.flush(60)
        b.stop()
        cold = engine(False)
        cold_s, _ = ttft(cold, prompt + more)
        cold.stop()
        fetched = int(st.get("fetched_bytes", 0))
        look = float(st["lookup_seconds"])
        rows.append({"prompt_tokens": n + suffix, "reused_tokens": reused, "ttft_shared_s": round(hit_s, 4),
                     "ttft_cold_s": round(cold_s, 4), "speedup": round(cold_s / hit_s, 2),
                     "fetched_bytes": fetched, "lookup_and_fetch_s": round(look, 4),
                     "restore_MBps": round(fetched / look / 1e6, 1) if look else None,
                     "prefill_tok_s": round((n + suffix) / cold_s, 1)})
        print(f"shared_tier: {n + suffix} tokens: shared {hit_s:.3f} s vs cold {cold_s:.3f} s", file=sys.stderr)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--model", default="builtin:tiny")
    ap.add_argument("--lengths", default="1024,4096,16384", help="comma list of history lengths (tokens)")
    ap.add_argument("--suffix", type=int, default=64, help="new tokens after the history")
    ap.add_argument("--store-reps", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",") if x]
    redis = Redis(maxmemory_mib=2048)
    try:
        doc = {"benchmark": "shared_tier", "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                                                      "python": platform.python_version()},
               "model": args.model, "redis": redis.url,
               "store": store_rates(redis.url, args.store_reps), "copy_MBps": copy_rate(),
               "turns": measure(args.model, lengths, args.suffix, redis.url)}
    finally:
        redis.stop()
    text = json.dumps(doc, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
