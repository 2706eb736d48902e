"""The decode round (hpc_cli.engine.decode_step): while the device runs a step, the host builds
the next step's index for the same lanes one position on (``model.prepare_decode``), and the next
step hands it to ``model.decode``, which uses it only for exactly the inputs it was built from
(``PreparedDecode.matches``). On the CPU no graph replays it; these tests check that what the
engine builds ahead is what the next step asks for, so that on CUDA steps take it."""

from __future__ import annotations

import torch

from hpc_cli.engine.api import GenerationRequest, SamplingParams
from hpc_cli.engine.engine import Engine
from hpc_cli.model.graphs import PreparedDecode


def _watch(model, monkeypatch) -> dict[str, int]:
    """Counts of decode steps, of steps handed an index built ahead, and of those whose index was
    built for exactly their inputs; the decode itself runs as usual."""
    counts = {"steps": 0, "handed": 0, "matched": 0}
    decode = model.decode

    def prepare(positions, tables, slots, kv, states, rope_offsets=None):
        return PreparedDecode(key=(), entry=None, packed=torch.zeros(0, dtype=torch.long),  # type: ignore[arg-type]
                              positions=list(positions), tables=[list(t) for t in tables], slots=list(slots),
                              rope_offsets=None if rope_offsets is None else list(rope_offsets))

    def watched(tokens, positions, tables, slots, kv, states, rope_offsets=None, prepared=None):
        counts["steps"] += 1
        counts["handed"] += prepared is not None
        counts["matched"] += prepared is not None and prepared.matches(positions, tables, slots, rope_offsets)
        return decode(tokens, positions, tables, slots, kv, states, rope_offsets=rope_offsets)

    monkeypatch.setattr(model, "prepare_decode", prepare)
    monkeypatch.setattr(model, "decode", watched)
    return counts


def test_a_lane_decoding_on_takes_the_index_built_during_its_previous_step(model, monkeypatch):
    counts = _watch(model, monkeypatch)
    eng = Engine(model, kv_profile="bf16", prefill_chunk=256, max_model_len=1024).start()
    try:
        # 70 prompt tokens and 150 generated: positions 70..218 cross pages at 128 and 192
        toks, _ = eng.generate(GenerationRequest([(5 * i) % 200 + 1 for i in range(70)],
                                                 SamplingParams(max_tokens=150, temperature=0, ignore_eos=True)))
    finally:
        eng.stop()
    assert eng.fatal is None and len(toks) == 150
    # 149 steps (the first token comes from the prefill); the first step's index was built while
    # the last prefill pass ran, every other step's during the step before, each for exactly its
    # inputs
    assert counts["steps"] == 149, counts
    assert counts["handed"] == counts["matched"] == 149, counts


def test_a_lane_joining_decoding_lanes_takes_an_index_built_during_its_last_pass(model, monkeypatch):
    """A lane whose prompt ends joins the lanes decoding: the step after its last pass runs them
    all, at their positions, and takes the index built while that pass ran."""
    counts = _watch(model, monkeypatch)
    eng = Engine(model, kv_profile="bf16", prefill_chunk=64, max_model_len=1024).start()
    try:
        first = eng.submit(GenerationRequest([(7 * i) % 200 + 1 for i in range(40)],
                                             SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)))
        second = eng.submit(GenerationRequest([(11 * i) % 200 + 1 for i in range(300)],
                                              SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)))
        a = [ev.token_id for ev in first.result(timeout=120)[0]]
        b = [ev.token_id for ev in second.result(timeout=120)[0]]
    finally:
        eng.stop()
    assert eng.fatal is None and len(a) == 60 and len(b) == 20
    # steps whose lanes changed because one ended get an index built for other inputs; the step
    # where the second lane joins after its 5 passes does not
    assert counts["handed"] - counts["matched"] <= 1, counts


def test_lanes_joining_and_ending_fall_back_to_an_index_built_in_turn(model, monkeypatch):
    counts = _watch(model, monkeypatch)
    eng = Engine(model, kv_profile="bf16", prefill_chunk=256, max_model_len=1024).start()
    lengths, news = (30, 90, 150), (60, 25, 40)
    try:
        alone = [eng.generate(GenerationRequest([(3 * i + n) % 200 + 1 for i in range(length)],
                                                SamplingParams(max_tokens=m, temperature=0, ignore_eos=True)))[0]
                 for n, (length, m) in enumerate(zip(lengths, news))]
        handles = [eng.submit(GenerationRequest([(3 * i + n) % 200 + 1 for i in range(length)],
                                                SamplingParams(max_tokens=m, temperature=0, ignore_eos=True)))
                   for n, (length, m) in enumerate(zip(lengths, news))]
        together = [[ev.token_id for ev in h.result(timeout=120)[0]] for h in handles]
    finally:
        eng.stop()
    assert eng.fatal is None
    assert together == alone  # greedy: the same tokens whatever ran beside them
    # a step whose lanes changed (one joined or ended) gets an index built for other inputs and
    # builds its own; most steps keep their lanes
    assert counts["handed"] - counts["matched"] >= 1, counts
    assert counts["matched"] >= counts["steps"] - 12, counts


def test_decode_ahead_off_builds_every_step_in_turn(model, monkeypatch):
    counts = _watch(model, monkeypatch)
    eng = Engine(model, kv_profile="bf16", prefill_chunk=256, max_model_len=1024, decode_ahead=False).start()
    try:
        toks, _ = eng.generate(GenerationRequest(list(range(1, 71)),
                                                 SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)))
    finally:
        eng.stop()
    assert eng.fatal is None and len(toks) == 20
    assert counts["steps"] == 19 and counts["handed"] == 0, counts


def _puts(model, monkeypatch, **config) -> tuple[list[str], list[list[int]]]:
    """What reached the server and when: each event's kind as the worker handed it over, "step"
    as each decode step returned (launched, on CUDA), for a lone request and then two together;
    and the tokens of each request."""
    from hpc_cli.engine.api import RequestHandle

    log: list[str] = []
    decode, put = model.decode, RequestHandle.put

    def watched(*args, **kwargs):
        out = decode(*args, **kwargs)
        log.append("step")
        return out

    monkeypatch.setattr(model, "decode", watched)
    monkeypatch.setattr(RequestHandle, "put", lambda self, ev: (log.append(type(ev).__name__), put(self, ev))[1])
    eng = Engine(model, kv_profile="bf16", prefill_chunk=256, max_model_len=1024, **config).start()
    try:
        lone = eng.generate(GenerationRequest(list(range(1, 71)),
                                              SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)))[0]
        handles = [eng.submit(GenerationRequest([(7 * i + n) % 200 + 1 for i in range(40 + 30 * n)],
                                                SamplingParams(max_tokens=12 + 9 * n, temperature=0, ignore_eos=True)))
                   for n in range(2)]
        both = [[ev.token_id for ev in h.result(timeout=120)[0]] for h in handles]
    finally:
        eng.stop()
    assert eng.fatal is None
    return log, [lone, *both]


def test_held_tokens_go_to_the_server_once_the_next_step_is_launched(model, monkeypatch):
    """``send_after_launch`` (on by default where launches are asynchronous, CUDA; forced here):
    a decode step's tokens are handed over after the next step's launch, not between reading them
    back and that launch (a prompt's first token goes at once); every token still arrives, in
    order, before its request's end, the same tokens as handed over at once."""
    held, held_tokens = _puts(model, monkeypatch, send_after_launch=True)
    monkeypatch.undo()
    plain, plain_tokens = _puts(model, monkeypatch, send_after_launch=False)
    assert held_tokens == plain_tokens and [len(t) for t in held_tokens] == [6, 12, 21]
    assert held.count("TokenEvent") == plain.count("TokenEvent") == 39
    # the lone request: admitted, its first token (chosen by the prefill pass) out at once, each
    # decode step's token after the next step's launch, the last one before the end
    lone = held[:held.index("FinishEvent") + 1]
    assert lone == ["AdmittedEvent", "TokenEvent", "step"] + ["step", "TokenEvent"] * 4 + ["TokenEvent", "FinishEvent"], lone
    plain_lone = plain[:plain.index("FinishEvent") + 1]
    assert plain_lone == ["AdmittedEvent", "TokenEvent"] + ["step", "TokenEvent"] * 5 + ["FinishEvent"], plain_lone


def test_tokens_are_handed_over_at_once_on_the_cpu_by_default(model):
    """A CPU step runs in the call itself, so holding its tokens would only delay them: the
    default holds them where launches are asynchronous; ``[engine] send_after_launch = false``
    never does."""
    from hpc_cli.engine.config import EngineConfig
    from hpc_cli.settings import load_settings

    def config(**keys) -> EngineConfig:
        return EngineConfig.from_settings(load_settings(None, {"model.name": "builtin:random", **keys}, environ={}))

    assert config().send_after_launch is None
    assert config(**{"engine.send_after_launch": False}).send_after_launch is False
    eng = Engine(model, kv_profile="bf16", prefill_chunk=256, max_model_len=1024)
    assert eng.model.device.type == "cpu" and not eng.hold_tokens


def _round_puts(model, monkeypatch, **config) -> tuple[list[int], list[int], list[int]]:
    """A speculative engine's lone request: for each of its tokens, how many verify passes had
    been launched when the round chose it and when the server got it; and the tokens."""
    import hpc_cli.speculative.runtime as runtime
    from hpc_cli.engine.api import RequestHandle, TokenEvent

    verifies = [0]
    chosen: list[int] = []
    got: list[int] = []
    verify, put, emit = runtime.verify_pass, RequestHandle.put, Engine._emit

    def counted(*args, **kwargs):
        out = verify(*args, **kwargs)
        verifies[0] += 1
        return out

    def emitted(self, lane, ev, hold=False):
        if ev.token_id not in self.eos:
            chosen.append(verifies[0])
        return emit(self, lane, ev, hold)

    def taken(self, ev):
        if isinstance(ev, TokenEvent):
            got.append(verifies[0])
        return put(self, ev)

    monkeypatch.setattr(runtime, "verify_pass", counted)
    monkeypatch.setattr(Engine, "_emit", emitted)
    monkeypatch.setattr(RequestHandle, "put", taken)
    eng = Engine(model, kv_profile="bf16", prefill_chunk=256, max_model_len=1024, speculative="mtp", **config).start()
    try:
        toks, _ = eng.generate(GenerationRequest(list(range(1, 71)),
                                                 SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)))
    finally:
        eng.stop()
    assert eng.fatal is None
    return chosen, got, toks


def test_a_rounds_tokens_go_to_the_server_once_the_next_verify_is_launched(model, monkeypatch):
    """Held, a speculative round's tokens reach the server after the next round's verify pass is
    launched (one verify later than they were chosen), the first token (the prompt's) and the last
    round's at once; the same tokens as sent at once."""
    chosen, got, held_tokens = _round_puts(model, monkeypatch, send_after_launch=True)
    monkeypatch.undo()
    chosen_at_once, got_at_once, tokens = _round_puts(model, monkeypatch, send_after_launch=False)
    assert held_tokens == tokens and len(tokens) == 24
    assert got_at_once == chosen_at_once  # each token out in the round that chose it
    assert len(got) == len(chosen) == 24
    last_round = chosen[-1]
    lag = [g - c for c, g in zip(chosen, got)]
    assert lag[0] == 0, "the prompt's first token is not held"
    assert all(d == 1 for c, d in zip(chosen[1:], lag[1:]) if c < last_round), lag
    assert all(d == 0 for c, d in zip(chosen, lag) if c == last_round), lag  # sent before the end


def test_a_request_ending_at_its_first_token_leaves_the_decoding_lanes_their_index(model, monkeypatch):
    """A one-token request (scoring, a classifier's label) prefilled beside a decoding lane ends at
    its first token: the index built during the decoding lane's step stays theirs."""
    counts = _watch(model, monkeypatch)
    eng = Engine(model, kv_profile="bf16", prefill_chunk=64, max_model_len=1024).start()
    try:
        long = eng.submit(GenerationRequest([(7 * i) % 200 + 1 for i in range(40)],
                                            SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)))
        ones = [eng.submit(GenerationRequest([(11 * i + n) % 200 + 1 for i in range(100)],
                                             SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)))
                for n in range(4)]
        assert len(long.result(timeout=120)[0]) == 60
        assert all(len(h.result(timeout=120)[0]) == 1 for h in ones)
    finally:
        eng.stop()
    assert eng.fatal is None
    assert counts["handed"] == counts["matched"] == counts["steps"], counts


def test_the_last_passs_commits_run_once_the_first_rounds_verify_is_launched(model, monkeypatch):
    """With speculation, a prompt's last prefill pass leaves its block commits and taps to the
    first round, which runs them once its verify pass is launched (as a decode step does once it
    is launched), not between the first token and that launch; the prompt's blocks are committed
    all the same, and the answer is the same."""
    import hpc_cli.speculative.runtime as runtime

    verifies = [0]
    verify = runtime.verify_pass

    def counted(*args, **kwargs):
        out = verify(*args, **kwargs)
        verifies[0] += 1
        return out

    monkeypatch.setattr(runtime, "verify_pass", counted)
    eng = Engine(model, kv_profile="bf16", prefill_chunk=256, max_model_len=1024, speculative="mtp").start()
    commits: list[tuple[int, int]] = []  # (lane position, verify passes launched) at each pass's commits
    after_pass = eng.cache.after_pass

    def watched(lane, *images):
        commits.append((lane.pos, verifies[0]))
        return after_pass(lane, *images)

    eng.cache.after_pass = watched
    prompt = list(range(1, 200))  # 3 full blocks, one pass
    try:
        sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        toks, _ = eng.generate(GenerationRequest(prompt, sp))
        first = list(commits)
        again, fin = eng.generate(GenerationRequest(prompt + [7], sp))
    finally:
        eng.stop()
    assert eng.fatal is None and len(toks) == 12
    assert first == [(len(prompt), 1)], first  # after the first verify, before the round moved the lane
    assert fin.usage.reuse_tokens >= 192, "the prompt's blocks were not committed"
