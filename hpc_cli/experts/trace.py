"""Routing traces while serving: one forward's routed experts per MoE layer, written as STRP
trace records (:class:`hpc_cli.model.expert_profile.TraceWriter`)."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np


class Recorder:
    """Collects one forward's routing per layer and writes it as trace records."""

    def __init__(self, path: Path, layers: list[int], n_expert: int, top_k: int) -> None:
        from hpc_cli.model.expert_profile import TraceWriter

        self.writer = TraceWriter(path, len(layers), n_expert, top_k)
        self.pos = {layer: i for i, layer in enumerate(layers)}
        self.buf: list[np.ndarray | None] = [None] * len(layers)
        self.lock = threading.Lock()

    def add(self, layer: int, index: np.ndarray) -> None:
        i = self.pos[layer]
        self.buf[i] = index
        if i == len(self.buf) - 1:
            parts = self.buf
            self.buf = [None] * len(parts)
            if any(p is None or p.shape != index.shape for p in parts):
                return  # a partial forward (a layer skipped): not a token record
            with self.lock:
                self.writer.write(np.stack(parts, axis=1))
                self.writer.flush()

    def close(self) -> None:
        with self.lock:
            self.writer.close()
