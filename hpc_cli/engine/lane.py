"""A lane: one admitted request's execution state (pages, state slot, position, taps)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from hpc_cli.cache.ids import StateSlot
from hpc_cli.engine.api import FinishReason, GenerationRequest, RequestHandle, Usage
from hpc_cli.engine.progress import after_prefill_pass


@dataclass(frozen=True, slots=True)
class PassCommit:
    """A lane's last prefill pass's block commits and taps, left for the host to run while the
    device computes the lane's first decode step (:meth:`hpc_cli.engine.decode_step.DecodeStep.
    commit_passes`): ``images`` are the taps the pass took itself (valid until the next prefill
    pass), None where it took none."""

    images: tuple[Any, ...] | None


@dataclass(eq=False)
class Lane:
    request: GenerationRequest
    handle: RequestHandle
    prepared: Any  # hpc_cli.cache.keys.PreparedPrompt
    index: int  # submission order, seeds unseeded sampling
    tokens: list[int] = field(default_factory=list)  # prompt + generated
    n_prompt: int = 0
    pos: int = 0  # tokens whose KV and state are in the lane (processed)
    state_slot: StateSlot = StateSlot(-1)  # its own recurrent-state slot; -1 before admission
    pages: list[int] = field(default_factory=list)  # block table: page of block b
    owned: list[bool] = field(default_factory=list)  # the lane frees page b at finish
    seq: Any = None  # hpc_cli.cache.records.SequencePath, or None for a disabled/off lane
    taps: list[Any] = field(default_factory=list)  # planned taps not yet taken (hpc_cli.cache.taps.Tap)
    ticket: Any = None  # restore ticket until the first prefill pass
    restore_batch: Any = None
    generated: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    text: str = ""  # decoded generated text (for stop strings)
    decoder: Any = None
    usage: Usage = field(default_factory=Usage)
    admitted_at: float = 0.0
    first_token_at: float | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list | None = None
    next_token: int | None = None  # sampled but not yet processed
    pass_commit: PassCommit | None = None  # its last pass's commits and taps, not yet run
    backend_frontier: int | None = None  # speculative backend's committed frontier (MTP K/V), None: pos
    vision: Any = None  # hpc_cli.engine.media.LaneVision of a request with images (at its first pass)
    finish_reason: FinishReason | None = None
    error: str | None = None
    stop_text: str | None = None
    prefill_started_at: float | None = None  # perf_counter at its first prefill pass (progress lines)
    prefill_logged_at: float | None = None  # perf_counter at its last prefill progress line

    @property
    def prefilling(self) -> bool:
        return self.pos < self.n_prompt

    @property
    def decoding(self) -> bool:
        """Its prompt is in and its next token chosen: it takes a column of the next decode round."""
        return not self.prefilling and self.next_token is not None and not self.finish_reason

    @property
    def max_tokens(self) -> int:
        return self.request.sampling.max_tokens

    def prefill_pass_done(self, started: float, ended: float) -> None:
        """A prefill pass of this lane ran from ``started`` to ``ended`` (perf_counter): the
        progress lines of a long prefill (hpc_cli.engine.progress)."""
        after_prefill_pass(self, started, ended)

    def elapsed(self) -> float:
        return time.monotonic() - self.handle.submitted_at
