"""Copy runs between device pages and host slabs: :func:`plan_runs` groups ``(page, slab)``
pairs into runs that one ``cudaMemcpy2DAsync`` per plane can move: consecutive entries whose
pages and slabs each advance by one constant positive stride, inside one chunk, with both
pitches within the device's maximum copy pitch. Any two records form a candidate run, so records
in different chunks, or gigabytes apart in one, are split explicitly (a 52 GB host tier otherwise
produced an invalid 2-D copy: spec §5.4)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

#: cudaDevAttrMaxPitch of current NVIDIA GPUs (2^31 - 1); the CUDA engine reads the real value.
DEFAULT_MAX_PITCH = (1 << 31) - 1

# -- runs --------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Run:
    """``count`` pairs ``(page0 + i * page_stride, slab0 + i * slab_stride)``; strides are 1
    when ``count == 1``."""

    page0: int
    slab0: int
    count: int
    page_stride: int = 1
    slab_stride: int = 1

    def pairs(self) -> list[tuple[int, int]]:
        return [(self.page0 + i * self.page_stride, self.slab0 + i * self.slab_stride)
                for i in range(self.count)]


def plan_runs(pairs: Iterable[tuple[int, int]], *, slab_bytes: int, slabs_per_chunk: int,
              page_bytes: int, max_pitch: int = DEFAULT_MAX_PITCH, sort: bool = True) -> list[Run]:
    """Split ``(page_id, slab_id)`` pairs into runs that one 2-D copy per plane can move.

    A run grows while the next pair advances page and slab by the run's strides (set by its
    first two pairs; both must be positive), its slab stays in the run's chunk, and the host
    pitch ``slab_stride * slab_bytes`` and the device pitch ``page_stride * page_bytes`` (the
    largest plane's page bytes) stay within ``max_pitch``. With ``sort`` the pairs are ordered
    by page first (the order inside one layer does not matter to a copy).
    """
    items = sorted(pairs) if sort else list(pairs)
    runs: list[Run] = []
    i, n = 0, len(items)
    while i < n:
        p0, s0 = items[i]
        chunk = s0 // slabs_per_chunk
        count, dp, ds = 1, 1, 1
        if i + 1 < n:
            p1, s1 = items[i + 1]
            dp, ds = p1 - p0, s1 - s0
            if (dp > 0 and ds > 0 and s1 // slabs_per_chunk == chunk
                    and ds * slab_bytes <= max_pitch and dp * page_bytes <= max_pitch):
                count = 2
                while i + count < n:
                    p, s = items[i + count]
                    if p - p0 != count * dp or s - s0 != count * ds or s // slabs_per_chunk != chunk:
                        break
                    count += 1
        if count == 1:
            dp, ds = 1, 1
        runs.append(Run(p0, s0, count, dp, ds))
        i += count
    return runs

