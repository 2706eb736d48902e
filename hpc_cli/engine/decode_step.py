"""One decode round over the decoding lanes (one column each, or a speculative round through
:class:`~hpc_cli.speculative.runtime.RoundHost`), and a chosen token's way to its lane: usage,
stop conditions, the event, the next column's token."""

from __future__ import annotations

import math
import time

import torch

from hpc_cli.cache.keys import BLOCK_TOKENS
from hpc_cli.engine.api import FinishReason, TokenEvent
from hpc_cli.engine.core import EngineCore
from hpc_cli.engine.lane import Lane
from hpc_cli.engine.media import decode_offsets
from hpc_cli.engine.sampling import sample


class DecodeStep(EngineCore):
    """Runs one decode round and hands out its tokens (mixed into the engine)."""

    def _decode(self, lanes: list[Lane], finishing: list[Lane] = ()) -> None:
        """One round over the decoding ``lanes``; the lanes in ``finishing`` end during it."""
        if self.spec is not None:  # propose + verify per lane (docs/speculative.md)
            self._finish_lanes(list(finishing))
            self.spec.round(self._round_host, lanes)  # the last passes' commits: _round_launched
            self.counters["decode_rounds"] += 1
            return
        t0 = time.monotonic()
        tokens = [l.next_token for l in lanes]
        positions = [l.pos for l in lanes]
        tables = [l.pages[:math.ceil((l.pos + 1) / BLOCK_TOKENS)] for l in lanes]
        slots = [l.state_slot for l in lanes]
        offsets = decode_offsets(lanes)
        prepared, self._prepared_decode = self._prepared_decode, None
        logits = self.model.decode(tokens, positions, tables, slots, self.storage, self.states, prepared=prepared,
                                   **offsets)
        # while the device computes the step (CUDA runs it asynchronously; sampling waits for
        # it): the host runs the last prefill passes' commits and taps and ends the finished
        # lanes (their tokens sent first: the server sends the tokens just emitted, first
        # tokens, last tokens), builds the next step's index for these lanes should they all go
        # on (used only if they do), and then hands the server the tokens the step before chose
        # (held until now, so that nothing stood between reading them back and launching this
        # step): its event loop, which needs the interpreter, sends them while this thread waits
        # for the device, not in turns with the host work above
        if self._pass_commits or finishing:
            self._deliver([*self._pass_commits, *finishing])
        self.commit_passes()
        self._finish_lanes(list(finishing), deliver=False)
        self._prepare_next_decode(lanes, slots, offsets)
        self._send_held()
        dt = time.monotonic() - t0
        # greedy lanes' tokens in one argmax and one read of the device (a read per lane waits for
        # the device once per lane)
        greedy = [l.request.sampling.temperature == 0.0 for l in lanes]
        chosen = torch.argmax(logits, dim=-1).tolist() if sum(greedy) > 1 else None
        for i, lane in enumerate(lanes):
            lane.pos += 1
            lane.next_token = None
            self.cache.commit_blocks(lane)
            if not lane.finish_reason:
                self._sample(lane, logits[i], chosen[i] if chosen is not None and greedy[i] else None,
                             hold=self.hold_tokens)
            self.itl.append(dt)
        self.counters["decode_rounds"] += 1

    def _round_launched(self) -> None:
        """A speculative round's verify pass is launched (``RoundHost.send_held``): while the device
        computes it, the host runs the last prefill passes' commits and taps (a lane's first round
        thus follows its first token at once), then the server gets the tokens held until now
        (its event loop sends them while this thread waits for the device)."""
        self.commit_passes()
        self._send_held()

    def _prepare_next_decode(self, lanes: list[Lane], slots: list[int], offsets: dict[str, list[int]],
                             ahead: int = 1) -> None:
        """The host's part of the next decode step of ``lanes`` (each ``ahead`` positions on, its
        pages as they are now), built while the device runs this step (or, ``ahead=0``, a lane's
        last prefill pass); the next step uses it only if its inputs are exactly these
        (:meth:`PreparedDecode.matches`)."""
        if not self.decode_ahead:
            return
        positions = [l.pos + ahead for l in lanes]
        if any(len(l.pages) * BLOCK_TOKENS <= p for l, p in zip(lanes, positions)):
            return  # a lane needs a page it does not hold yet
        tables = [l.pages[:p // BLOCK_TOKENS + 1] for l, p in zip(lanes, positions)]
        self._prepared_decode = self.model.prepare_decode(positions, tables, slots, self.storage, self.states,
                                                          **offsets)

    def _prepare_first_decode(self, lane: Lane) -> None:
        """After ``lane``'s last prefill pass is launched, while the device computes it: the
        index of the decode step that follows, over the lanes decoding now and ``lane`` (which
        joins them once its first token is chosen), so that the step launches at once (used
        only if that step's lanes and positions are exactly these). Not for a lane that ends at
        its first token (``max_tokens`` 1): the lanes decoding now keep the index their last step
        built for them."""
        if self.spec is not None or lane.max_tokens <= 1:
            return
        lanes = [l for l in self._lanes if l is lane or l.decoding]  # lane: its token is still to come
        self._prepare_next_decode(lanes, [l.state_slot for l in lanes], decode_offsets(lanes), ahead=0)

    def _sample(self, lane: Lane, logits: torch.Tensor, greedy: int | None = None, hold: bool = False) -> None:
        """``greedy``: the token a greedy lane's ``logits`` choose, when taken already; ``hold``:
        the token waits for the next step's launch (a decode step's, not a prompt's first token,
        which goes at once: the next step's index is built in turn then, and the user waits for
        the first token)."""
        try:
            event = sample(logits, lane.request.sampling, lane.generator, token=greedy)
        except Exception as exc:  # this request's sampling failed: it alone ends
            self._fail_lane(lane, exc)
            return
        self._emit(lane, event, hold)

    def _emit_from_round(self, lane: Lane, ev: TokenEvent) -> None:
        """A speculative round's token: held where decode steps' are (``hold_tokens``), until the
        next round's verify pass is launched (:class:`~hpc_cli.speculative.runtime.RoundHost`)."""
        self._emit(lane, ev, self.hold_tokens)

    def _emit(self, lane: Lane, ev: TokenEvent, hold: bool = False) -> None:
        """Hand one chosen token to the lane: usage, stop conditions, the event (``hold``: kept
        for :meth:`Finish._send_held`), ``next_token``."""
        sp = lane.request.sampling
        now = time.monotonic()
        lane.usage.timing.last_token_at = time.perf_counter()
        if lane.first_token_at is None:
            lane.first_token_at = now
            lane.usage.time_to_first_token = now - lane.handle.submitted_at
            self.ttft.append((now, lane.usage.time_to_first_token))
        tok = ev.token_id
        lane.generated.append(tok)
        lane.usage.completion_tokens += 1
        self.counters["generated_tokens"] += 1
        if (tok in self.eos or tok in sp.stop_token_ids) and not sp.ignore_eos:
            lane.finish_reason = FinishReason.STOP
            return
        lane.tokens.append(tok)
        if hold:  # handed over once the next step is launched (Finish._send_held)
            self._held.append((lane, ev))
        else:
            lane.handle.put(ev)
        if lane.decoder is not None:
            lane.text += lane.decoder.push(tok)
            for s in sp.stop:
                if s and s in lane.text:
                    lane.finish_reason = FinishReason.STOP
                    lane.stop_text = s
                    return
        if len(lane.generated) >= sp.max_tokens:
            lane.finish_reason = FinishReason.LENGTH
            return
        lane.next_token = tok
