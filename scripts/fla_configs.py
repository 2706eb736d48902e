"""Warm a model's engine on this GPU with fla tuning its kernels, then write the chosen launch
configurations in fla's layout (``hpc_cli/model/fla_configs.py`` ships them per GPU model):

    python scripts/fla_configs.py OUT [MODEL]      # MODEL default builtin:qwen3.5-27b-shape@8
    cp OUT/*.json hpc_cli/model/fla_launch_configs/<GPU name>/
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from hpc_cli.engine.engine import Engine
from hpc_cli.model.fla_configs import dump
from hpc_cli.model.model import HybridModel


def main() -> None:
    target = Path(sys.argv[1])
    name = sys.argv[2] if len(sys.argv) > 2 else "builtin:qwen3.5-27b-shape@8"
    model = HybridModel.from_name_or_path(name, dtype=torch.bfloat16, device="cuda")
    engine = Engine(model, kv_pages=512, prefill_chunk=2048, max_concurrency=8, host_cache_mib=0)
    try:
        print(f"warm-up {engine.warmup():.1f} s")
    finally:
        engine.stop()
    print(f"{dump(target)} configurations written to {target}")


if __name__ == "__main__":
    main()
