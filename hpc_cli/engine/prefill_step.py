"""One prefill pass of a lane: up to a chunk of prompt tokens, split at the binding's stops,
with the taps the pass takes itself (spec §7.1-7.3), prompt logprobs when asked, and the first
token sampled once the prompt is in."""

from __future__ import annotations

import math
import time

from hpc_cli.cache.keys import BLOCK_TOKENS
from hpc_cli.engine.api import FinishReason, PrefillPass
from hpc_cli.engine.core import EngineCore
from hpc_cli.engine.lane import Lane, PassCommit
from hpc_cli.engine.media import prefill_media
from hpc_cli.engine.sampling import prompt_logprobs


class PrefillStep(EngineCore):
    """Runs one prefill pass (mixed into the engine)."""

    def _prefill(self, lane: Lane) -> None:
        self.commit_passes()  # a pass overwrites the tap images a waiting commit holds
        timing = lane.usage.timing  # phase seconds (RequestTiming): host time, no device syncs
        t_start = time.perf_counter()
        waited = timing.restore_wait
        start = lane.pos
        end = self.cache.next_stop(lane, min(lane.n_prompt, start + self.chunk))
        taps, t = self.cache.counters.get("taps", 0), time.perf_counter()
        self.cache.before_pass(lane, end)
        tapped = timing.add_taps(time.perf_counter() - t, self.cache.counters.get("taps", 0) - taps)
        sp = lane.request.sampling
        want_all = sp.prompt_logprobs
        spec_kw = self.spec.prefill_kwargs() if self.spec is not None else {}
        pre_hidden = self.spec.pre_hidden(lane) if self.spec is not None else None
        ready = self.cache.layer_ready(lane)
        in_pass = self.cache.pass_taps(lane, end)  # exact taps the pass takes itself (no split)
        out = self.model.prefill(lane.tokens[start:end], start, lane.pages[:math.ceil(end / BLOCK_TOKENS)],
                                 lane.state_slot, self.storage, self.states,
                                 layer_ready=timing.timed_wait(ready) if ready is not None else None,
                                 all_logits=want_all, **spec_kw, **prefill_media(self.model, lane, start, end),
                                 **({"taps": in_pass} if in_pass else {}))
        if self.spec is not None:
            self.spec.after_prefill(lane, start, end, out, pre_hidden)
        lane.pos = end
        lane.usage.prefill_tokens += end - start
        self.counters["prefill_tokens"] += end - start
        logits = out.logits
        if want_all:  # prompt_logprobs requests always prefill from the root (see HybridBinding.admit)
            if lane.prompt_logprobs is None:
                lane.prompt_logprobs, lane.prompt_top_logprobs = [None], [None]
            lps, tops = prompt_logprobs(logits, lane.tokens[:lane.n_prompt], start, top=sp.logprobs or 0)
            lane.prompt_logprobs += lps
            lane.prompt_top_logprobs += tops
            logits = logits[-1]
        # the first token goes out before the pass's commits and taps (host work that nothing
        # in the token waits for: they cover positions up to lane.pos, the token comes after)
        if lane.pos == lane.n_prompt and not lane.finish_reason:
            if sp.max_tokens == 0:
                lane.finish_reason = FinishReason.LENGTH
            else:
                self._prepare_first_decode(lane)  # while the device runs the pass
                self._sample(lane, logits)
        if lane.pos == lane.n_prompt and lane.next_token is not None:
            # the last pass's commits and taps run while the device computes the first decode
            # step or the first speculative round's verify pass (DecodeStep.commit_passes): nothing
            # in it reads them
            lane.pass_commit = PassCommit(tuple(out.taps) if in_pass else None)
            self._pass_commits.append(lane)
        else:
            tapped += self._after_pass(lane, tuple(out.taps) if in_pass else None)
        t_end = time.perf_counter()
        timing.passes.append(PrefillPass(t_end - t_start - tapped - (timing.restore_wait - waited), end - start))
        if lane.pos == lane.n_prompt:
            timing.decode_from = t_end
        lane.prefill_pass_done(t_start, t_end)  # progress lines of a long prefill

    def _after_pass(self, lane: Lane, images: tuple | None) -> float:
        """The binding's commits and taps after a pass (``images``: the taps the pass took
        itself, None where it took none); returns the seconds charged to taps."""
        taps, t = self.cache.counters.get("taps", 0), time.perf_counter()
        if images is not None:
            self.cache.after_pass(lane, images)
        else:
            self.cache.after_pass(lane)
        return lane.usage.timing.add_taps(time.perf_counter() - t, self.cache.counters.get("taps", 0) - taps)

    def commit_passes(self) -> None:
        """Run the commits and taps that last prefill passes left (:class:`PassCommit`); a
        failure ends that request alone."""
        while self._pass_commits:
            lane = self._pass_commits.pop(0)
            commit, lane.pass_commit = lane.pass_commit, None
            if commit is None:
                continue
            try:
                lane.usage.timing.tap_in_decode += self._after_pass(lane, commit.images)
            except Exception as exc:  # this request's commits failed: it alone ends
                self._fail_lane(lane, exc)
