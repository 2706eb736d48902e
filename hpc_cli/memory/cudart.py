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
