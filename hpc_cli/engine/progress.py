"""Progress lines of a long prefill (logger ``hpc_cli.engine``, INFO), from the worker thread.

A prompt of tens of thousands of tokens prefills for many seconds before its first token; a line
every :data:`PERIOD_S` seconds says how far it got, and one when its prefill ends:

    hpc-cli: req-7 prefill 8192/32761 prompt tokens (25%), 10.4 s, 788 tok/s
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hpc_cli.engine.lane import Lane

log = logging.getLogger("hpc_cli.engine")
PERIOD_S = 5.0  # seconds between progress lines of one prefill


def after_prefill_pass(lane: "Lane", started: float, now: float) -> None:
    """Call after each prefill pass of ``lane`` with the pass's start and end (one clock): logs
    when :data:`PERIOD_S` passed since its prefill began or since its last line, and at the end
    of a prefill that logged."""
    if lane.prefill_started_at is None:
        lane.prefill_started_at = started
    started = lane.prefill_started_at
    done = lane.pos >= lane.n_prompt
    last = lane.prefill_logged_at if lane.prefill_logged_at is not None else started
    if done and lane.prefill_logged_at is None:
        return
    if not done and now - last < PERIOD_S:
        return
    lane.prefill_logged_at = now
    if log.isEnabledFor(logging.INFO):
        log.info("%s", progress_line(lane, now - started))


def progress_line(lane: "Lane", seconds: float) -> str:
    prefilled = lane.usage.prefill_tokens
    rate = f", {prefilled / seconds:.0f} tok/s" if seconds > 0 else ""
    what = "prefill done" if lane.pos >= lane.n_prompt else "prefill"
    return (f"{lane.request.request_id} {what} {lane.pos}/{lane.n_prompt} prompt tokens "
            f"({100 * lane.pos // max(1, lane.n_prompt)}%), {seconds:.1f} s{rate}")
