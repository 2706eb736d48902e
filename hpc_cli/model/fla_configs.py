"""Pinned launch configurations for fla's kernels, so a cold warm-up compiles each kernel once
instead of benchmarking every candidate configuration.

fla's autotuned kernels can take their configuration from ``$FLA_CONFIG_DIR/<kernel>.json``
(``FLA_CACHE_MODE``: ``strict`` looks up the exact autotune key, which holds the head counts,
head dims and dtypes, and tunes as before when it is not there). The package ships the
configurations measured on a GPU model under ``hpc_cli/model/fla_launch_configs/<GPU name>/``
(written by :func:`dump` after a warm-up, ``python scripts/fla_configs.py OUT``);
:func:`pin` points fla at them before fla is imported, unless the user set either variable.
A GPU model with no directory, or a model whose widths were not measured, tunes as before.
"""

from __future__ import annotations

import gc
import json
import os
import re
import sys
from pathlib import Path

HERE = Path(__file__).parent / "fla_launch_configs"


def gpu_dir(name: str) -> Path:
    """The shipped directory of a GPU model (fla's own name sanitising)."""
    return HERE / (re.sub(r"[^0-9A-Za-z]+", "_", name).strip("_") or "unknown_gpu")


def pin() -> Path | None:
    """Point fla at the shipped configurations of this machine's GPU (before fla is imported;
    nothing where the user set ``FLA_CACHE_MODE`` or ``FLA_CONFIG_DIR``, or fla is already
    imported). Returns the directory used, or None."""
    if "FLA_CACHE_MODE" in os.environ or "FLA_CONFIG_DIR" in os.environ or "fla" in sys.modules:
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    d = gpu_dir(torch.cuda.get_device_name(0))
    if not d.is_dir():
        return None
    os.environ["FLA_CACHE_MODE"] = "strict"
    os.environ["FLA_CONFIG_DIR"] = str(d)
    return d


def dump(out: Path) -> int:
    """Write every fla autotuner's chosen configurations in this process to ``out/<kernel>.json``
    (fla's config-file layout); returns the number of entries written."""
    from fla.ops.utils.cache import AutotuneKey, CachedAutotuner

    out.mkdir(parents=True, exist_ok=True)
    written = 0
    tuners = [o for o in gc.get_objects() if isinstance(o, CachedAutotuner) and o.cache]
    for tuner in tuners:
        entries = {}
        for key, cfg in tuner.cache.items():
            entries[AutotuneKey.key_hash(key)] = {
                "autotune_key": AutotuneKey.normalize_autotune_key(key),
                "config": {"kwargs": dict(cfg.kwargs), "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
                           "num_ctas": getattr(cfg, "num_ctas", 1), "maxnreg": getattr(cfg, "maxnreg", None)},
            }
        path = out / f"{tuner.kernel_name}.json"
        old = json.loads(path.read_text())["autotune_entries"] if path.exists() else {}
        path.write_text(json.dumps({"kernel_name": tuner.kernel_name, "autotune_entries": {**old, **entries}},
                                   indent=1, sort_keys=True))
        written += len(entries)
    return written
