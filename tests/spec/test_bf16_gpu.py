"""On CUDA in bf16 (fla's kernels when importable): every verify column is bit-identical to
one-token decode, and greedy output with the oracle drafter is plain greedy output with every
draft accepted, on builtin:random and on the 27B-shaped model (docs/speculative.md)."""

from __future__ import annotations

import pytest
import torch

from hpc_cli.engine.api import GenerationRequest
from hpc_cli.model.model import HybridModel

from helpers import anchor_drafter, backend, greedy, make, record_proposals, run, settle, tokens
from test_bf16 import check_columns, wide_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module", params=["builtin:random", "builtin:qwen3.5-27b-shape@4"])
def cuda_model(request):
    m = HybridModel.from_name_or_path(request.param, dtype=torch.bfloat16, device="cuda")
    yield m
    del m
    torch.cuda.empty_cache()


@pytest.mark.parametrize("B,T", [(1, 4), (2, 4), (4, 4), (3, 2)])
def test_cuda_verify_columns_bit_identical(cuda_model, B, T):
    check_columns(cuda_model, B, T, seed=B * 10 + T)


def test_cuda_wide_columns_bit_identical():
    from hpc_cli.model.builtin import init_seeded

    m = HybridModel(wide_config(), dtype=torch.bfloat16, device="cuda", with_mtp=False)
    init_seeded(m)
    check_columns(m.eval(), 2, 4, seed=3)


def test_cuda_oracle_greedy_equals_plain(cuda_model):
    prompts = [tokens(300, 21), tokens(120, 22), tokens(200, 23), tokens(64, 24)]
    n = 32
    off = make(cuda_model, reuse=False, kv_pages=48, max_concurrency=4)
    refs = {tuple(p): run(off, p, n)[0] for p in prompts}  # one lane at a time
    settle(off)
    e = make(cuda_model, backend("oracle", refs), kv_pages=48, max_concurrency=4)
    handles = [e.submit(GenerationRequest(list(p), greedy(n))) for p in prompts]  # four lanes together
    for p, h in zip(prompts, handles):
        toks, fin = h.result(timeout=600)
        assert [t.token_id for t in toks] == refs[tuple(p)], p[:4]
        assert fin.usage.accepted_draft_tokens == fin.usage.draft_tokens > 0, fin.usage
    settle(e)


def test_cuda_spec_warmup_covers_serving():
    """After the warm-up, speculative rounds of one and two lanes, rounds that draft fewer than k
    near max_tokens, and contexts of several table widths compile nothing and capture no graph;
    and a second engine on the same model (other pools) captures its own graphs."""
    from hpc_cli.model.compile_watch import watch

    m = HybridModel.from_name_or_path("builtin:random", dtype=torch.bfloat16, device="cuda")
    for name in ("mtp", "dflash", "dflash2"):
        e = make(m, name, kv_pages=64, max_concurrency=2, max_model_len=1024, prefill_chunk=256)
        try:
            e.warmup()
            graphs, prefill = m.column_graphs(e.storage), m.prefill_graphs(e.storage)
            assert graphs is not None and graphs.disabled is None, f"{name}: verify passes run without graphs"
            assert prefill is not None and prefill.disabled is None, f"{name}: prefill passes run without graphs"
            counts = watch()
            before, captures = counts.compilations + counts.autotunes, graphs.captures
            drafts = e.spec.drafter.graphs  # MTP's k steps, DFlash's block: captured at the warm-up
            assert drafts is not None and drafts.captures > 0, f"{name}: draft graphs"
            draft_captures = drafts.captures if drafts is not None else 0
            tails = e.spec.tails  # the rounds' commit (and MTP's catch-up): captured at the warm-up
            assert tails.captures > 0 and tails.disabled is None, f"{name}: round tails {tails.disabled}"
            tail_captures = tails.captures
            prefill_captures = prefill.captures  # passes returning the hidden / features: captured too
            for n in (30, 700):  # 1 and 11+ pages of context: two table widths
                run(e, tokens(n, n), 6)  # 6 tokens, k = 3: a last round drafting fewer
            handles = [e.submit(GenerationRequest(tokens(n, n + 1), greedy(7))) for n in (100, 520)]
            for h in handles:
                h.result(timeout=300)
            assert counts.compilations + counts.autotunes == before, f"{name}: a speculative round compiled a kernel"
            assert graphs.captures == captures, f"{name}: {graphs.captures - captures} verify graphs captured while serving"
            if drafts is not None:
                assert drafts.disabled is None and drafts.replays > 0, drafts.disabled
                assert drafts.captures == draft_captures, f"{name}: draft graphs captured while serving"
            assert graphs.disabled is None, graphs.disabled
            assert tails.replays > 0 and tails.captures == tail_captures, \
                f"{name}: {tails.captures - tail_captures} round tails captured while serving"
            assert prefill.replays > 0 and prefill.captures == prefill_captures, \
                f"{name}: {prefill.captures - prefill_captures} prefill graphs captured while serving"
        finally:
            settle(e)


def test_cuda_engines_taking_turns_on_one_model_keep_their_graphs():
    """Two engines on one model (a benchmark's backends side by side), each warmed up, then
    serving in turn: neither captures a graph while serving (each one's column, prefill and
    second verify graphs are kept under its pools' serials, not dropped when the other runs), and
    their rounds chain their verify passes."""
    m = HybridModel.from_name_or_path("builtin:tiny", dtype=torch.bfloat16, device="cuda")
    engines = [make(m, "mtp", max_model_len=1024) for _ in range(2)]
    try:
        for e in engines:
            e.warmup()
        graphs = [m.column_graphs(e.storage) for e in engines]
        assert graphs[0] is graphs[1], "one model, one set of column graphs"
        captures, prefill = graphs[0].captures, m.prefill_graphs(engines[0].storage).captures
        prompt = tokens(90, 7)
        answers = [run(e, prompt, 24)[0] for e in engines + engines]
        assert all(a == answers[0] for a in answers), "engines taking turns answer alike"
        assert graphs[0].captures == captures, f"{graphs[0].captures - captures} column graphs captured while serving"
        assert m.prefill_graphs(engines[0].storage).captures == prefill, "prefill graphs captured while serving"
        assert all(e.spec.counters["verify_chained"] > 0 for e in engines), [dict(e.spec.counters) for e in engines]
    finally:
        for e in engines:
            settle(e)


@pytest.mark.parametrize("name", ["mtp", "dflash", "dflash2", "dflash+anchor", "dflash2+anchor"])
def test_cuda_graph_drafts_equal_eager_drafts(name, tmp_path):
    """A drafter's proposal replayed from a CUDA graph (MTP's k draft steps, DFlash's block
    forward; ``+anchor``: an anchor-drafting block, whose first column reads the lanes' last
    hidden through their slots) proposes what the same steps run eagerly propose, token for
    token, round by round (rounds near max_tokens drafting fewer; one and eleven pages of
    context), and the output is plain greedy output either way."""
    m = HybridModel.from_name_or_path("builtin:random", dtype=torch.bfloat16, device="cuda")
    name, _, anchor = name.partition("+")
    kw = {"drafter": anchor_drafter(m, name, tmp_path)} if anchor else {}
    prompts = [tokens(150, 31), tokens(700, 32)]
    off = make(m, reuse=False, kv_pages=64, max_concurrency=2, max_model_len=1024, prefill_chunk=256)
    refs = [run(off, p, 13)[0] for p in prompts]
    settle(off)
    proposed: dict[str, list] = {}
    for mode in ("graphs", "eager"):
        e = make(m, name, kv_pages=64, max_concurrency=2, max_model_len=1024, prefill_chunk=256, **kw)
        drafter = e.spec.drafter
        assert bool(anchor) == (name != "mtp" and drafter.cfg.anchor_drafts)
        e.warmup()
        assert drafter.graphs is not None and drafter.graphs.captures > 0, f"{name} proposes without graphs"
        if mode == "eager":  # the same packed steps, run eagerly every round: no graph kept or captured
            drafter.graphs.graphs.clear()
            drafter.graphs.disabled = "off for the test"
        proposed[mode] = record_proposals(drafter)
        try:
            for p, ref in zip(prompts, refs):  # one at a time: the same rounds in both engines
                assert run(e, p, 13)[0] == ref, mode
            if mode == "graphs":
                assert drafter.graphs.replays > 0 and drafter.graphs.disabled is None, drafter.graphs.disabled
        finally:
            settle(e)
    assert proposed["graphs"] and proposed["graphs"] == proposed["eager"]


@pytest.mark.parametrize("name", ["mtp", "dflash", "dflash2"])
def test_cuda_rounds_made_ahead_equal_the_rounds_own(name):
    """With graphs, a greedy round launches the next round's proposal behind its verify pass and
    tail (from the device's counts) and, once accepted, the next round's verify pass: two lanes
    decoding together, one ending before the other, verify the drafts that rounds proposing for
    themselves verify, round by round, and answer with plain greedy output; the proposals ahead
    replay from graphs the warm-up captured."""
    m = HybridModel.from_name_or_path("builtin:random", dtype=torch.bfloat16, device="cuda")
    prompts, lengths = [tokens(150, 41), tokens(700, 42)], (21, 34)
    off = make(m, reuse=False, kv_pages=64, max_concurrency=2, max_model_len=1024, prefill_chunk=256)
    refs = [run(off, p, n)[0] for p, n in zip(prompts, lengths)]
    settle(off)
    proposed: dict[str, list] = {}
    for ahead in ("round", "propose", "off"):
        e = make(m, name, kv_pages=64, max_concurrency=2, max_model_len=1024, prefill_chunk=256)
        e.warmup()
        e.spec.look_ahead = ahead
        drafter = e.spec.drafter
        captures, verify_captures = drafter.graphs.captures, m.column_graphs(e.storage).captures
        proposed[ahead] = record_proposals(drafter)
        try:
            handles = [e.submit(GenerationRequest(list(p), greedy(n))) for p, n in zip(prompts, lengths)]
            assert [[t.token_id for t in h.result(timeout=300)[0]] for h in handles] == refs, ahead
            st = e.spec.stats()
            # MTP's rounds after a greedy tail start from the first drafts that tail computed
            assert getattr(drafter, "proposals_from_first", 1) > 0, f"{name}: no round started from first drafts"
            if ahead != "off":
                assert 0 < st.proposals_ahead_used < st.proposals_ahead, st
                assert drafter.graphs.captures == captures, f"{name}: proposals ahead captured while serving"
                assert m.column_graphs(e.storage).captures == verify_captures, f"{name}: verify graphs captured"
                assert (e.spec.counters["verify_ahead_used"] > 0) == (ahead == "round"), e.spec.counters
                # "round" chains the verify pass behind the proposal, before the host reads the round
                assert (e.spec.counters["verify_chained"] > 0) == (ahead == "round"), e.spec.counters
            else:
                assert st.proposals_ahead == 0, st
        finally:
            settle(e)
    assert proposed["off"] and sorted(proposed["round"]) == sorted(proposed["propose"]) == sorted(proposed["off"])


@pytest.mark.parametrize("name", ["mtp", "dflash", "dflash2"])
def test_cuda_chained_rounds_of_lanes_stopping_inside_their_drafts(name):
    """With graphs, rounds chain their verify passes (the next round's launched before the host
    reads this one's, chosen by the device's counts, from the shape's second graph). Requests that
    stop on a token inside their accepted drafts (the chained pass is dropped, the lane's state
    committed again at the host's count from the verify pass the chained one must not overwrite)
    answer as with nothing made ahead, and end with the same state image in their slot, bit for
    bit; nothing is captured while serving."""
    from helpers import chat_prompts, record_end_images, stopping_cases

    from hpc_cli.engine.api import SamplingParams

    m = HybridModel.from_name_or_path("builtin:tiny", dtype=torch.bfloat16, device="cuda")
    prompts = chat_prompts(m)
    off = make(m, reuse=False)
    answers = [off.generate(GenerationRequest(p, SamplingParams(max_tokens=24, temperature=0.0)), timeout=300)[0]
               for p in prompts]
    settle(off)
    prompts, answers, stops = stopping_cases(prompts, answers)
    results = {}
    for ahead in ("round", "off"):
        e = make(m, name, max_model_len=1024)
        e.warmup()
        e.spec.look_ahead = ahead
        captures, fills = m.column_graphs(e.storage).captures, m.column_graphs(e.storage).fill_replays
        images = record_end_images(e, lambda lane: (tuple(lane.request.prompt_tokens),
                                                    lane.request.sampling.stop_token_ids))
        try:
            firsts = []
            for p, s in zip(prompts, stops):  # one at a time: every round greedy, one lane
                h = e.submit(GenerationRequest(p, SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=(s,))))
                firsts.append([t.token_id for t in h.result(timeout=300)[0]])
            results[ahead] = (firsts, images, dict(e.spec.counters))
            assert m.column_graphs(e.storage).captures == captures, f"{name}: verify graphs captured while serving"
            # every chained pass's index was filled by a graph the warm-up captured
            filled = m.column_graphs(e.storage).fill_replays - fills
            assert filled == e.spec.counters.get("verify_chained", 0), (filled, e.spec.counters)
        finally:
            settle(e)
    chained, plain = results["round"], results["off"]
    assert chained[2]["verify_chained"] > 0 and chained[2].get("device_tail_fixes", 0) > 0, chained[2]
    for first, answer, stop in zip(chained[0], answers, stops):
        assert first == answer[:answer.index(stop)], "a stopped answer is not greedy decoding's up to its stop"
    assert chained[0] == plain[0]
    assert chained[1].keys() == plain[1].keys() and len(chained[1]) == len(prompts)
    for key, image in chained[1].items():
        assert all(torch.equal(a, b) for a, b in zip(image, plain[1][key])), "a lane's state at its end differs"


def test_cuda_backend_passes_take_their_taps_from_warm_graphs():
    """With MTP, DFlash or DFlash2 a prefill pass takes its exact taps itself (no split; DFlash2's
    drafter fills the taps' rings) from a graph the warm-up captured with the backend's outputs
    (every position's hidden, captured features):
    nothing compiles or is captured while serving, and a request resumed from a tap answers as a
    cold one."""
    from hpc_cli.engine.api import TapHint
    from hpc_cli.model.compile_watch import watch

    m = HybridModel.from_name_or_path("builtin:random", dtype=torch.bfloat16, device="cuda")
    prompt = tokens(300, seed=21)
    hints = [TapHint(37, 3), TapHint(150, 1), TapHint(291, 2)]
    second = prompt[:200] + [7, 8, 9]
    off = make(m, reuse=False, prefill_chunk=256, kv_pages=64, max_concurrency=1)
    refs = [off.generate(GenerationRequest(p, greedy(6)), timeout=120)[0] for p in (prompt, second)]
    settle(off)
    for name in ("mtp", "dflash", "dflash2"):
        e = make(m, name, host_cache_mib=16, prefill_chunk=256, max_concurrency=1, kv_pages=64)
        try:
            e.warmup()
            graphs = m.prefill_graphs(e.storage)
            counts = watch()
            compiled, captures = counts.compilations + counts.autotunes, graphs.captures
            out, fin = e.generate(GenerationRequest(prompt, greedy(6), tap_hints=hints), timeout=120)
            assert e.cache.counters["taps_in_pass"] == 3, e.cache.counters
            assert [p.tokens for p in fin.usage.timing.passes] == [256, 44]
            again, fin2 = e.generate(GenerationRequest(second, greedy(6)), timeout=120)
            assert fin2.usage.reuse_tokens == 150, fin2.usage
            assert (out, again) == tuple(refs), name
            assert counts.compilations + counts.autotunes == compiled, f"{name}: compiled while serving"
            assert graphs.captures == captures and graphs.replays > 0, f"{name}: prefill graphs captured while serving"
        finally:
            settle(e)
