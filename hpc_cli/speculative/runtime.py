"""The engine's speculative decode round: propose, verify in one pass, accept, roll back.

Acceptance (docs/speculative.md):

* temperature 0: accept drafts while each equals the target's argmax at its column; the first
  mismatch emits the target's argmax instead (so greedy output is the non-speculative output);
  after k accepted drafts the last column's argmax is a bonus token.
* temperature > 0: standard speculative rejection sampling for a deterministic drafter (its
  proposal distribution is a point mass q = delta(d)): accept d with probability p(d), where p is
  the target's distribution after temperature/top-k/top-p; on rejection sample from the residual
  max(0, p - q) / Z, which is p with d removed; after k accepts sample the bonus from the last
  column. Every emitted token is distributed exactly as plain sampling (not the same tokens for a
  seed: the generator is consumed differently).

The committed frontier after a round is ``pos + 1 + accepted``; KV written at rejected columns
is simply overwritten by later rounds (it sits beyond every committed frontier).
"""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from hpc_cli.engine.sampling import event_for, target_probs
from hpc_cli.kv_profile import PAGE_TOKENS
from hpc_cli.speculative.ops import Snapshot, chained_verify, commit_columns, commit_states, verify_pass
from hpc_cli.speculative.round_tail import RoundTails

if TYPE_CHECKING:
    from hpc_cli.engine.api import TokenEvent
    from hpc_cli.memory.kv_pool import PagedKVStorage
    from hpc_cli.model.columns import ColumnsOut
    from hpc_cli.spec_backend import BackendPoolSpec

ROLLBACKS = ("per_token", "recompute")
#: what a greedy round launches of the next one before the host has read it (:class:`SpecRuntime`'s
#: ``look_ahead``): nothing, the proposal, or the proposal and the verify pass
AHEAD = ("off", "propose", "round")


@dataclass(frozen=True, slots=True)
class SpeculativeStats:
    """The runtime's figures since it started (:meth:`SpecRuntime.stats`); its JSON is
    ``speculative`` of the engine's stats."""

    backend: str
    k: int  # drafts per round
    rollback: str
    rounds: int
    draft_tokens: int
    accepted_draft_tokens: int
    acceptance_rate: float  # accepted / drafted
    mean_acceptance_length: float  # tokens committed per lane-round
    #: lane-rounds by drafts accepted ("0", "1", ...): one key per count seen, so a mapping
    accepted_histogram: dict[str, int]
    propose_s: float
    verify_s: float
    #: MTP and DFlash leave their drafts on the device: propose_s and verify_s are the launches, and the
    #: wait for both is in rollback_s
    rollback_s: float  # reading the logits (the wait for the verify pass), accepting, the rollback
    catch_up_s: float  # the drafter's catch-up on the committed tokens and the block commits
    recomputed_columns: int
    #: proposals launched ahead, behind the round before's verify pass (:meth:`SpecRuntime._round`),
    #: and those a round used (the rest: a lane finished, or the lanes changed)
    proposals_ahead: int
    proposals_ahead_used: int
    #: verify passes launched behind a proposal ahead before the host read the round
    #: (:meth:`SpecRuntime._verify_chained`); those a round used are within proposals_ahead_used
    verify_chained: int = 0
    #: rounds whose verify pass the round before launched (chained, or after accepting), and their
    #: wall time on the engine thread: set against the other rounds' (a request's first round,
    #: rounds after a lane joined or left) it shows what a round costs the host with the device
    #: ahead and without
    verify_ahead_used: int = 0
    verify_ahead_round_s: float = 0.0


@dataclass(frozen=True)
class RoundHost:
    """What a speculative round needs of the engine, and no more: its page pool, the cache
    binding's block commit, the token hand-off (usage, stop conditions, the lane's event; the
    engine may hold the events), the inter-token latency record, and the hand-over of held events,
    which a round calls once its verify pass is launched (the last round's tokens then go to the
    server, and the engine runs what host work waited for a launch, while the device computes)."""

    storage: "PagedKVStorage"
    commit_blocks: Callable[[Any], None]  # (lane)
    emit: Callable[[Any, "TokenEvent"], None]  # (lane, event)
    record_itl: Callable[[float], None]
    send_held: Callable[[], None]


@dataclass
class _Ahead:
    """A proposal made ahead (:meth:`SpecRuntime._propose_ahead`): the lanes and ``k`` it was
    made for, its drafts on the device (a graph's static buffer, read by the next verify pass
    before the next proposal of its shape), the lanes' state slots and, once the host has
    accepted the round, their positions, and the verify pass launched for it."""

    lanes: list
    k: int
    drafts: torch.Tensor
    slots: list[int]
    positions: list[int] | None = None
    #: the next round's verify pass of these drafts, launched once the host had accepted the
    #: round (``look_ahead`` "round"): its outputs are the graph's static ones, read next round
    verify: "ColumnsOut | None" = None

    def made_for(self, lanes) -> "_Ahead":
        self.positions = [l.pos for l in lanes]
        return self

    def serves(self, lanes, k: int) -> bool:
        """Whether it is the proposal of a round of ``lanes`` drafting ``k``: the same lanes in the
        same order, each where the round that made it left it, in the same slot."""
        return (k == self.k and len(lanes) == len(self.lanes) and all(a is b for a, b in zip(lanes, self.lanes))
                and self.positions == [l.pos for l in lanes] and self.slots == [l.state_slot for l in lanes])


def verify_tables(lanes, starts: list[int], T: int) -> list[list[int]]:
    """Each lane's pages covering a verify pass of ``T`` columns from ``starts[b]``."""
    return [l.pages[:math.ceil((s + T) / PAGE_TOKENS)] for l, s in zip(lanes, starts)]


class SpecRuntime:
    def __init__(self, backend, model, *, k: int = 3, rollback: str = "per_token", drafter_path: str | None = None,
                 seed: int | None = None) -> None:
        assert rollback in ROLLBACKS, f"rollback must be one of {ROLLBACKS}, got {rollback!r}"
        self.backend = backend
        self.model = model
        self.k = int(k)
        self.rollback = rollback
        self.drafter = backend.build_drafter(model, drafter_path, seed)
        self.counters = collections.Counter()
        self.accept_hist = collections.Counter()  # accepted drafts per lane-round
        #: rounds whose lanes are all greedy count their accepted drafts on the device, in a tail
        #: launched before the host reads the verify pass (where tails run for every lane at once:
        #: ``RoundTails.batched``)
        self.count_on_device = True
        #: such a round, where its tail catches the drafter up and is captured, also launches the
        #: next round's proposal before the host reads it (:meth:`_propose_ahead`) and ("round")
        #: the next round's verify pass behind it, chosen by the device's counts
        #: (:meth:`_verify_chained`; where it cannot be, once the host has accepted and every
        #: lane goes on); one of :data:`AHEAD`
        self.look_ahead = "round"
        self._ahead: _Ahead | None = None

    @property
    def name(self) -> str:
        return self.backend.name

    # ------------------------------------------------------------------ geometry
    def state_parts(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The parts the backend adds to every state image: sized after the drafter where it knows
        its own geometry (a DFlash2 checkpoint's rings), else the backend's default for the shape."""
        own = getattr(self.drafter, "state_parts", None)
        return own() if own is not None else self.backend.state_extra_parts(self.model)

    def pool_spec(self) -> "BackendPoolSpec | None":
        """The backend's own BF16 pool: the drafter's (a DFlash checkpoint's layers, KV heads and
        head dim) where it knows it, else the backend's default for the model's shape."""
        own = getattr(self.drafter, "pool_spec", None)
        return own() if own is not None else self.backend.backend_pool(self.model.shape())

    def bind(self, storage, backend_storage, states) -> None:
        self.storage, self.states = storage, states
        self._ahead = None
        self.drafter.bind(storage, backend_storage, states)
        self.tails = RoundTails(self.model.device, self.model.column_graphs(storage) is not None)
        if self.model.device.type == "cpu" and getattr(self.drafter, "bridges_in_tail", False):
            # one eager call for every lane, with MTP's next bridge in the catch-up's pass: fewer ops
            # than the lane-by-lane catch-up and the bridge's own step (docs/speculative.md)
            self.tails.batched = True

    # ------------------------------------------------------------------ prefill side
    def prefill_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {}
        if self.drafter.needs_hidden:
            kw["all_hidden"] = True
        if self.drafter.capture:
            kw["capture"] = self.drafter.capture
        return kw

    def pre_hidden(self, lane) -> torch.Tensor | None:
        return self.states.hidden[lane.state_slot].clone() if self.drafter.needs_hidden and lane.pos else None

    def after_prefill(self, lane, start: int, end: int, out, pre_hidden) -> None:
        if out.taps and getattr(self.drafter, "taps_its_parts", False):
            self.drafter.tap_parts(lane, start, out.features, out.taps)  # before observe moves the lane's parts on
        self.drafter.observe(lane, start, end - start, out.hidden, out.features, pre_hidden, extend=True)

    def admitted(self, lane) -> None:
        self.drafter.admitted(lane)

    def before_finish(self, lane) -> None:
        """Bring the backend to the text frontier where the next token is known (MTP's last
        position) so that the endpoint's blocks commit (spec §7.7)."""
        if self.drafter.needs_hidden and lane.pos and lane.state_slot >= 0 and lane.seq is not None \
                and (lane.backend_frontier or 0) < lane.pos and len(lane.tokens) > lane.pos:
            hid = self.states.hidden[lane.state_slot][None]
            self.drafter.observe(lane, lane.pos - 1, 1, hid, None, None, extend=True)

    # ------------------------------------------------------------------ decode rounds
    def round(self, engine: "RoundHost", lanes) -> None:
        """One speculative decode round over ``lanes`` (grouped by draft length)."""
        groups: dict[int, list] = collections.defaultdict(list)
        for lane in lanes:
            left = lane.request.sampling.max_tokens - len(lane.generated)
            groups[max(0, min(self.k, left - 1))].append(lane)
        for k, group in sorted(groups.items()):
            self._round(engine, group, k)

    def _round(self, engine: "RoundHost", lanes, k: int) -> None:
        t0 = time.monotonic()
        model, states = self.model, self.states
        keep_all = self.rollback == "per_token"
        # drafts left on the device where the drafter can (MTP, DFlash): the proposal and the verify pass
        # queue without a wait, and the host reads drafts and verdicts at once
        on_device = k > 0 and keep_all and hasattr(self.drafter, "propose_device")
        ahead, self._ahead = self._ahead, None
        if ahead is not None and not (on_device and ahead.serves(lanes, k)):
            self.counters["proposals_ahead_dropped"] += 1
            ahead = None
        if ahead is not None:  # proposed (and maybe verified) by the last round, behind its verify pass
            dev_drafts = ahead.drafts
            self.drafter.took_ahead(lanes)
            self.counters["proposals_ahead_used"] += 1
            drafts = None
        elif on_device:
            dev_drafts = self.drafter.propose_device(lanes, k, states)
            drafts = None
        else:
            drafts = self.drafter.propose(lanes, k, states) if k else [[] for _ in lanes]
        t1 = time.monotonic()
        T = k + 1
        starts = [l.pos for l in lanes]
        slots = [l.state_slot for l in lanes]
        verified = ahead.verify if ahead is not None else None  # the verify pass launched last round
        if verified is None or not keep_all:
            # drafts left on the device are placeholders here: the verify pass reads them there
            tokens = torch.tensor([[l.next_token] + (list(drafts[b]) if drafts is not None else [0] * k)
                                   for b, l in enumerate(lanes)], dtype=torch.long)
            tables = verify_tables(lanes, starts, T)
        snap = Snapshot(states, slots) if not keep_all and k else None
        # the catch-up runs with the commit in the tail (a graph on CUDA; one eager call on the
        # CPU for MTP) where the drafter can and every lane's frontier is the round's start; else
        # (where the lane-by-lane catch-up skips the lanes that accepted nothing and costs less)
        # lane by lane
        tail_catch_up = (keep_all and k > 0 and self.tails.batched
                         and getattr(self.drafter, "catches_up_columns", False)
                         and all(l.backend_frontier == l.pos for l in lanes))
        pre_hid = (states.hidden.index_select(0, torch.tensor(slots, device=states.hidden.device))
                   if self.drafter.needs_hidden and not tail_catch_up else None)
        if verified is not None:
            out = verified
            self.counters["verify_ahead_used"] += 1
        else:
            out = verify_pass(model, tokens, starts, tables, slots, engine.storage, states, keep_all=keep_all,
                              capture=self.drafter.capture, drafts=dev_drafts if on_device else None)
        greedy_lanes = sum(l.request.sampling.temperature == 0.0 for l in lanes)
        any_greedy = greedy_lanes > 0
        # every lane greedy: the tail counts the accepted drafts on the device and is launched
        # right behind the verify pass, before the host reads it (round_tail's greedy counts)
        device_tail = (self.count_on_device and keep_all and k > 0 and self.tails.batched and out.verdict is not None
                       and greedy_lanes == len(lanes))
        saved = self._run_tail(out, None, tail_catch_up) if device_tail else None
        bridge = device_tail and self._bridges(tail_catch_up, None)  # the tail made the next first drafts
        # and, where that tail caught the drafter up too, the next round's proposal behind it: the
        # verdict's copy to the host is queued first, so the host waits for that alone
        read = None
        pending = None
        if device_tail and tail_catch_up and self._looks_ahead(lanes, k):
            read = self.tails.read_later(out.verdict)
            pending = self._propose_ahead(lanes, k, out.verdict, slots)
            if pending is not None and self.look_ahead == "round":
                # and the next round's verify pass of those drafts behind it, chosen by the same
                # counts: the device runs round after round while the host accepts behind it
                pending.verify = self._verify_chained(lanes, k, out, pending.drafts, engine.storage, slots)
        t2 = time.monotonic()
        engine.send_held()  # the last round's tokens, while the device verifies (in rollback_s's wait)
        logits = out.logits  # in place: event_for and target_probs take float32 of what they read
        # every column's greedy token in one read of the device (not one per column), with the
        # drafts when they were left there
        greedy = None
        if read is not None:
            rows = read()
        else:
            rows = out.verdict.tolist() if out.verdict is not None and (on_device or any_greedy) else None
        if on_device:
            drafts = [r[:k] for r in rows]  # the drafts the pass read and every column's argmax
            greedy = [r[k:] for r in rows] if any_greedy else None
        elif any_greedy:
            greedy = [r[k:] for r in rows] if rows is not None else out.logits.argmax(-1).tolist()
        accepted = []
        for b, lane in enumerate(lanes):
            acc = self._accept(engine, lane, logits[b], drafts[b], greedy[b] if greedy is not None else None)
            accepted.append(acc)
            lane.usage.draft_tokens += k
            lane.usage.accepted_draft_tokens += acc
            self.accept_hist[acc] += 1
        # roll the GDN state to the last accepted column
        if device_tail:
            if self._settle_device_tail(out, drafts, greedy, accepted, slots, saved):
                pending = None  # proposed from the device's counts, which this round did not keep
                bridge = False
        elif keep_all and k:
            self._run_tail(out, accepted, tail_catch_up)
        elif keep_all:
            commit_states(states, out, slots, accepted)
        elif snap is not None:
            redo = [b for b, a in enumerate(accepted) if a < k]
            if redo:
                snap.restore(states, redo)
                by_len: dict[int, list[int]] = collections.defaultdict(list)
                for b in redo:
                    by_len[accepted[b] + 1].append(b)
                for n, bs in by_len.items():
                    verify_pass(model, tokens[bs, :n], [starts[b] for b in bs], [tables[b] for b in bs],
                                [slots[b] for b in bs], engine.storage, states, keep_all=False)
                self.counters["recomputed_columns"] += sum(accepted[b] + 1 for b in redo)
        if pending is not None and any(lane.finish_reason for lane in lanes):
            self.counters["proposals_ahead_dropped"] += 1
            pending = None
        if pending is not None and self.look_ahead == "round" and pending.verify is None:
            # every lane goes on and it could not be chained: the next round's verify pass of the
            # drafts proposed ahead, launched now (behind that proposal, while the host finishes)
            starts_next = [s + a + 1 for s, a in zip(starts, accepted)]
            pending.verify = verify_pass(
                model, [[l.next_token] + [0] * k for l in lanes], starts_next,
                verify_tables(lanes, starts_next, T), slots,
                engine.storage, states, keep_all=True, capture=self.drafter.capture, drafts=pending.drafts)
            engine.send_held()  # this round's tokens, while the device verifies the next round's drafts
        t3 = time.monotonic()
        for b, lane in enumerate(lanes):
            n = accepted[b] + 1
            lane.pos += n
            if tail_catch_up:  # the drafter's K/V of the committed positions were written in the tail
                lane.backend_frontier = max(lane.backend_frontier, starts[b] + n - self.drafter.columns_behind)
            else:
                feats = out.features[b] if out.features is not None else None
                pre = pre_hid[b] if pre_hid is not None else None
                self.drafter.observe(lane, starts[b], n, out.hidden[b], feats, pre, extend=False)
            engine.commit_blocks(lane)
        first_drafts = getattr(self.drafter, "first_drafts", None)
        if first_drafts is not None:
            first_drafts(lanes, bridge)
        if pending is not None:
            self._ahead = pending.made_for(lanes)
        t4 = time.monotonic()
        dt = t4 - t0
        emitted = sum(a + 1 for a in accepted)
        for lane in lanes:
            engine.record_itl(dt / max(1, emitted / len(lanes)))
        c = self.counters
        c["rounds"] += 1
        c["lane_rounds"] += len(lanes)
        c["draft_tokens"] += k * len(lanes)
        c["accepted_draft_tokens"] += sum(accepted)
        c["committed_tokens"] += emitted
        c["propose_us"] += int((t1 - t0) * 1e6)
        c["verify_us"] += int((t2 - t1) * 1e6)
        c["rollback_us"] += int((t3 - t2) * 1e6)
        c["catch_up_us"] += int((t4 - t3) * 1e6)
        if verified is not None:
            c["verify_ahead_round_us"] += int(dt * 1e6)

    def _bridges(self, catch_up: bool, accepted: list[int] | None) -> bool:
        """Whether a tail catching up (``catch_up``) with ``accepted`` (None: the greedy counts, on
        the device) also computes the next round's bridge and first draft: a drafter that can
        (MTP's ``catch_up_and_bridge``), the counts greedy (the bonus is the argmax)."""
        return catch_up and accepted is None and getattr(self.drafter, "bridges_in_tail", False)

    def _run_tail(self, out, accepted: list[int] | None, catch_up: bool) -> object:
        """The round's tail after the verify pass ``out`` (:mod:`~hpc_cli.speculative.round_tail`):
        each lane's state after its last accepted column into its slot and, with ``catch_up``,
        the drafter's K/V of the accepted positions (and, :meth:`_bridges`, the next round's
        bridge and first draft). ``accepted`` None: the greedy counts, on the device. Returns what
        the drafter's catch-up saved (for :meth:`_settle_device_tail`)."""
        states = self.states
        bridge = self._bridges(catch_up, accepted)
        step = (self.drafter.catch_up_and_bridge if bridge else self.drafter.catch_up_columns) if catch_up else None

        def tail(o, acc):
            commit_columns(states, o, o.index.slots, acc)
            return step(o, acc) if step is not None else None

        variant = ("commit+catch-up+bridge" if bridge else "commit+catch-up") if catch_up else "commit"
        return self.tails.run(out, accepted, variant, tail)

    def _looks_ahead(self, lanes, k: int) -> bool:
        """Whether a round of ``lanes`` drafting ``k`` proposes the next round ahead: its tail is
        captured (the device runs behind the host: on the CPU the work ahead would only hold the
        round's tokens back), the drafter can, and every lane drafts ``k`` again next round
        whatever it accepts now."""
        return (k > 0 and self._may_look_ahead()
                and all(l.request.sampling.max_tokens - len(l.generated) >= 2 * k + 2 for l in lanes))

    def _verify_chained(self, lanes, k: int, out: "ColumnsOut", drafts: torch.Tensor, storage,
                        slots: list[int]) -> "ColumnsOut | None":
        """The next round's verify pass of ``drafts`` (proposed ahead), launched behind them before
        the host reads this round's verdict (:func:`~hpc_cli.speculative.ops.chained_verify`: each
        lane's next start, table and first token chosen on the device by its count); None where
        a lane lacks the pages of a round after k accepted drafts, or it cannot be chained."""
        T = k + 1
        if any(len(l.pages) * PAGE_TOKENS <= l.pos + 2 * k + 1 for l in lanes):
            return None
        starts = [[l.pos + c + 1 for l in lanes] for c in range(T)]
        tables = [verify_tables(lanes, row, T) for row in starts]
        verify = chained_verify(self.model, storage, self.states, starts, tables, slots, capture=self.drafter.capture,
                                verdict=out.verdict, drafts=drafts, avoid=out.static)
        if verify is not None:
            self.counters["verify_chained"] += 1
        return verify

    def chains(self, T: int) -> bool:
        """Whether rounds of ``T`` columns may chain their verify passes (:meth:`_verify_chained`),
        so the warm-up captures a second graph of each such verify shape."""
        return (self.look_ahead == "round" and self._may_look_ahead() and self.rollback == "per_token"
                and T == self.k + 1 > 1 and self.tails.batched and getattr(self.drafter, "catches_up_columns", False))

    def _may_look_ahead(self) -> bool:
        """Whether rounds may make anything ahead at all: asked to, their tails captured (the
        device runs behind the host), a drafter that proposes ahead."""
        return self.look_ahead != "off" and self.tails.use_graphs and hasattr(self.drafter, "propose_ahead")

    def _propose_ahead(self, lanes, k: int, verdict: torch.Tensor, slots: list[int]) -> "_Ahead | None":
        """The next round's proposal, launched behind this round's verify pass and tail from the
        device's counts (the drafter's ``propose_ahead``); None where the drafter cannot."""
        drafts = self.drafter.propose_ahead(lanes, k, verdict, self.states)
        if drafts is None:
            return None
        self.counters["proposals_ahead"] += 1
        return _Ahead(list(lanes), k, drafts, list(slots))

    def _settle_device_tail(self, out, drafts: list[list[int]], greedy: list[list[int]], accepted: list[int],
                            slots: list[int], saved: object) -> bool:
        """After a tail that counted on the device, which counts every draft equal to its column's
        argmax up to the first that is not: a lane the host stopped on such a draft (a stop token
        inside its accepted drafts) accepted fewer, so each lane's state after its own last
        accepted column is committed again (from the pass's kept states, which the tail only
        read), and the drafter's catch-up past the host's counts is undone where it saved what it
        overwrote (``saved``, for its ``undo_catch_up``: DFlash2's rings; K/V written past a
        lane's frontier needs nothing, as a rejected column's does not). Returns whether any
        lane did."""
        if not any(a < len(d) and d[a] == g[a] for d, g, a in zip(drafts, greedy, accepted)):
            return False  # every lane stopped where the device's count did
        self.counters["device_tail_fixes"] += 1
        commit_states(self.states, out, slots, accepted)
        if saved is not None:
            self.drafter.undo_catch_up(out, saved, accepted)
        return True

    def warm_tails(self, out) -> int:
        """The tails a round can run after the verify pass ``out`` (a warm-up shape: its slots
        are reset afterwards), eager then captured where ``out`` is a graph's: the commit alone,
        and with the drafter's catch-up where it has one. Returns the tails run."""
        if self.rollback != "per_token" or out.index is None or out.index.T < 2:
            return 0
        variants = [False, True] if self.tails.batched and getattr(self.drafter, "catches_up_columns", False) \
            else [False]
        # and each with the greedy counts on the device, where rounds take that tail
        counted = [None] if self.tails.batched and out.verdict is not None else []
        for catch_up in variants:
            for accepted in [[0] * out.index.B] + counted:
                for _ in range(2 if out.static else 1):
                    self._run_tail(out, accepted, catch_up)
        return len(variants) * (1 + len(counted))

    def _accept(self, engine: "RoundHost", lane, logits: torch.Tensor, drafts: list[int],
                greedy: list[int] | None = None) -> int:
        """Emit tokens column by column; returns the drafts accepted and continued past (the
        columns beyond the first that stay committed). ``greedy``: each column's argmax, read
        already (temperature 0)."""
        sp = lane.request.sampling
        k = len(drafts)
        acc = 0
        for i in range(k + 1):
            d = drafts[i] if i < k else None
            if sp.temperature == 0.0:
                tok = greedy[i] if greedy is not None else int(torch.argmax(logits[i]))
            else:
                p = target_probs(logits[i], sp)
                if d is not None and float(torch.rand((), generator=lane.generator)) < float(p[d]):
                    tok = d
                else:
                    if d is not None:
                        p = p.clone()
                        p[d] = 0.0
                        if float(p.sum()) <= 0.0:  # p was a point mass on d: d is the only choice
                            p[d] = 1.0
                    tok = int(torch.multinomial(p / p.sum(), 1, generator=lane.generator))
            engine.emit(lane, event_for(logits[i], tok, sp))
            if lane.finish_reason or d is None or tok != d:
                return acc
            acc += 1
        return acc

    # ------------------------------------------------------------------ stats
    def stats(self) -> SpeculativeStats:
        c = self.counters
        lr = max(1, c["lane_rounds"])
        return SpeculativeStats(
            backend=self.name, k=self.k, rollback=self.rollback, rounds=c["rounds"],
            draft_tokens=c["draft_tokens"], accepted_draft_tokens=c["accepted_draft_tokens"],
            acceptance_rate=c["accepted_draft_tokens"] / max(1, c["draft_tokens"]),
            mean_acceptance_length=c["committed_tokens"] / lr,
            accepted_histogram={str(a): n for a, n in sorted(self.accept_hist.items())},
            propose_s=c["propose_us"] / 1e6, verify_s=c["verify_us"] / 1e6,
            rollback_s=c["rollback_us"] / 1e6, catch_up_s=c["catch_up_us"] / 1e6,
            recomputed_columns=c["recomputed_columns"], proposals_ahead=c["proposals_ahead"],
            proposals_ahead_used=c["proposals_ahead_used"], verify_chained=c["verify_chained"],
            verify_ahead_used=c["verify_ahead_used"], verify_ahead_round_s=c["verify_ahead_round_us"] / 1e6)
