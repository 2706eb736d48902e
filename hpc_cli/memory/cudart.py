"""Optional cuda-python runtime bindings (``cuda.bindings.runtime``, or the older ``cuda.cudart``)."""

from __future__ import annotations

from functools import lru_cache
from typing import Any


@lru_cache(maxsize=1)
def load_cudart() -> Any | None:
    """cuda-python's runtime module, or None when cuda-python is not installed."""
    try:
        from cuda.bindings import runtime  # cuda-python >= 12.6
        return runtime
    except ImportError:
        pass
    try:
        from cuda import cudart  # older cuda-python
        return cudart
    except ImportError:
        return None


def mapped_device_pointer(host_ptr: int) -> int | None:
    """The device address of pinned, mapped host memory at ``host_ptr``: cuda-python's
    ``cudaHostGetDevicePointer`` when installed (None when it reports the memory unmapped), else
    ``host_ptr`` itself (unified addressing: registered host memory has the same address on the
    device on x86-64 Linux)."""
    rt = load_cudart()
    if rt is None:
        return host_ptr
    err, dev = rt.cudaHostGetDevicePointer(host_ptr, 0)
    return int(dev) if int(err) == 0 else None
