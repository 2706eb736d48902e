"""Pinned host buffers for the small host-to-device copies of every decode step and speculative
round (a column pass's packed index, a proposal's inputs, a round's accepted counts), reused.

``tensor.pin_memory()`` takes a new block from torch's caching host allocator for every copy and
records an event on it; a round makes three such copies. A :class:`HostStaging` keeps a ring of
pinned buffers instead and writes a buffer again only once the copy that last read it has run (a
CUDA event per buffer, recorded by :meth:`HostStaging.send`): the wait is never taken in a round,
whose copies ran long before it reads the device. On the CPU the buffers are plain tensors and
:meth:`~HostStaging.send` returns them as they are.

A ring serves one thread's copies on one stream: the stream current when it first sends (the
engine thread's), on which its events are recorded without asking torch for the current stream
at every copy (that lookup costs more host time than the copy's own launch).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

#: buffers in a ring: one copy in flight per pass queued ahead, with room to spare
RING = 4


class HostStaging:
    """A ring of int64 host buffers (pinned on CUDA) for copies to ``device``."""

    def __init__(self, device: torch.device, ring: int = RING) -> None:
        assert ring >= 1, f"a staging ring needs a buffer, got {ring}"
        self.device = device
        self.cuda = device.type == "cuda"
        self._bufs: list[torch.Tensor | None] = [None] * ring
        self._events: list[torch.cuda.Event | None] = [None] * ring  # made once a buffer is first sent
        self._pending = [False] * ring  # a copy reading the buffer was queued since its last wait
        self._views: list[np.ndarray | None] = [None] * ring  # each buffer's numpy view
        self._stream: torch.cuda.Stream | None = None  # where the copies are queued (the first send's)
        self._at = 0

    def stage(self, values: Sequence[int] | np.ndarray) -> torch.Tensor:
        """``values`` in the next buffer of the ring, as an int64 host tensor of their length
        (pinned on CUDA): hand it to :meth:`send` or :meth:`send_into`, which record when its copy
        has run, before the next :meth:`stage`. Waits for the copy that last read that buffer where it
        has not run yet."""
        n = len(values)
        self._at = (self._at + 1) % len(self._bufs)
        if self._pending[self._at]:
            self._events[self._at].synchronize()
            self._pending[self._at] = False
        buf = self._bufs[self._at]
        if buf is None or buf.numel() < n:
            size = max(64, 1 << max(n - 1, 0).bit_length())
            buf = torch.empty(size, dtype=torch.int64, pin_memory=self.cuda)
            self._bufs[self._at] = buf
            self._views[self._at] = buf.numpy()
        self._views[self._at][:n] = values
        return buf[:n]

    def record(self, event: torch.cuda.Event) -> None:
        """Record ``event`` on the ring's stream (CUDA): where its copies are queued."""
        if self._stream is None:
            self._stream = torch.cuda.current_stream(self.device)
        event.record(self._stream)

    def _sent(self) -> None:
        if self.cuda:
            if self._events[self._at] is None:
                self._events[self._at] = torch.cuda.Event()
            self.record(self._events[self._at])
            self._pending[self._at] = True

    def send(self, staged: torch.Tensor) -> torch.Tensor:
        """The last staged buffer on the device (a new tensor; copied without waiting)."""
        if not self.cuda:
            return staged.clone()  # the ring writes the buffer again
        out = staged.to(self.device, non_blocking=True)
        self._sent()
        return out

    def send_into(self, staged: torch.Tensor, dst: torch.Tensor) -> None:
        """The last staged buffer copied into ``dst`` (a graph's static input) without waiting."""
        dst.copy_(staged, non_blocking=self.cuda)
        self._sent()
