"""The CPU fast paths of a speculative round: the MTP catch-up writes only K/V, DFlash2 reads only
the ring slots that hold positions, and the benchmark's interleaved repeats (docs/speculative.md)."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hpc_cli.memory.kv_pool import PagedKVStorage
from hpc_cli.plugins import kv_profile
from hpc_cli.speculative.dflash import RING_PART, DFlashDrafter, DFlashNet, DraftContext, default_config, seed_weights
from hpc_cli.speculative.mtp import MTPDrafter


def test_mtp_catch_up_writes_the_kv_its_full_step_writes(model):
    """``_write_kv`` (observe's K/V-only catch-up) stores the very bytes ``_run`` stores."""
    drafter = MTPDrafter(model)
    n, base = 70, len(model.config.attention_layers)
    g = torch.Generator().manual_seed(3)
    toks = torch.randint(1, 250, (1, n), generator=g)
    hid = torch.randn(1, n, model.config.hidden_size, generator=g)
    pos = torch.arange(n)[None]
    tables = [[0, 1]]
    pools = []
    for write_only in (False, True):
        c = model.config
        kv = PagedKVStorage(kv_profile("bf16"), base + len(model.mtp.layers), c.num_key_value_heads, c.head_dim, 4)
        drafter.bind(kv, None, None)
        (drafter._write_kv if write_only else drafter._run)(toks, hid, pos, [n - 1], tables)
        pools.append(kv)
    for l in range(len(model.mtp.layers)):
        full = pools[0].gather(base + l, [0, 1], n, torch.float32)
        only = pools[1].gather(base + l, [0, 1], n, torch.float32)
        assert all(torch.equal(a, b) for a, b in zip(full, only)), "catch-up K/V differs from the full step's"


def _dflash2(model, window: int):
    cfg = default_config("dflash2", model, 1, window=window)
    net = DFlashNet(cfg, dtype=model.dtype)
    seed_weights(net, 1)
    drafter = DFlashDrafter(model, net)
    ring = (cfg.num_layers, 2, window, cfg.num_kv_heads, cfg.head_dim)
    states = model.new_state_slots(3, extra_parts={RING_PART: (ring, torch.bfloat16)})
    states.extra[RING_PART].normal_()
    drafter.bind(None, None, states)
    return drafter, states


def test_dflash2_context_reads_only_held_ring_slots(model):
    drafter, states = _dflash2(model, window=16)
    ring = states.extra[RING_PART]
    lanes = [SimpleNamespace(pos=5, state_slot=2), SimpleNamespace(pos=9, state_slot=0)]
    k, v = drafter._context(lanes, 0).dense(torch.float32)
    assert k.shape[2] == v.shape[2] == 9, "a short context reads max(pos) slots, not the window"
    # the block's keys: the held context slots, then its own 2 columns
    valid = drafter._read_keys(9, 2, torch.tensor([5, 9]))
    assert valid.shape == (2, 1, 1, 11)
    assert valid[:, 0, 0].tolist() == [[True] * 5 + [False] * 4 + [True] * 2, [True] * 11]
    assert torch.equal(k[0], ring[2, 0, 0, :9].transpose(0, 1).float())
    assert torch.equal(v[1], ring[0, 0, 1, :9].transpose(0, 1).float())
    # a wrapped ring holds a position in every slot
    k, _ = drafter._context([SimpleNamespace(pos=40, state_slot=1)], 0).dense(torch.float32)
    assert k.shape[2] == 16 and bool(drafter._read_keys(16, 1, torch.tensor([40])).all())
    assert torch.equal(k[0], ring[1, 0, 0].transpose(0, 1).float())


def test_block_key_columns_are_held_only_for_graphed_shapes(model):
    """The keys' column index is kept per shape for the graphs' proposals (a bounded set of
    shapes, read by the graphs) and made in place for eager ones, whose context width follows the
    lanes' positions: eager proposals hold nothing, however many widths they meet."""
    drafter, states = _dflash2(model, window=64)
    for pos in (5, 9, 17, 40):
        drafter.propose([SimpleNamespace(pos=pos, state_slot=0, next_token=7)], 2, states)
    assert drafter._key_columns == {}
    first = drafter._read_keys(9, 1, torch.tensor([5, 12]), held=True)
    assert list(drafter._key_columns) == [(9, 1)]
    assert torch.equal(first, drafter._read_keys(9, 1, torch.tensor([5, 12]), held=True))
    assert torch.equal(first, drafter._read_keys(9, 1, torch.tensor([5, 12])))
    assert list(drafter._key_columns) == [(9, 1)]


def test_dflash_context_is_the_pools_pages():
    """DFlash's block reads its BF16 pool's pages through the lanes' page tables: the context
    gathered from the pages' BF16 views is what the pool's own gather returns, lane by lane; a
    pool in another format has no BF16 pages to read."""
    g = torch.Generator().manual_seed(6)
    pool = PagedKVStorage(kv_profile("bf16"), 2, 2, 16, 6)
    slots = torch.arange(6 * 64)
    pool.write(1, slots, torch.randn(6 * 64, 2, 16, generator=g), torch.randn(6 * 64, 2, 16, generator=g))
    table = torch.tensor([[4, 1, 3], [0, 5, 2]])
    k, v = DraftContext(*pool.bf16_pages(1), table, 3 * 64).dense(torch.float32)
    for b in range(2):
        want_k, want_v = pool.gather(1, table[b], 3 * 64, torch.float32)
        assert torch.equal(k[b], want_k.transpose(0, 1)) and torch.equal(v[b], want_v.transpose(0, 1))
    assert PagedKVStorage(kv_profile("int8-g64"), 1, 2, 64, 2).bf16_pages(0) is None


class _WholeWindow(DFlashDrafter):
    """The reference: attention over every slot of the ring, the empty ones masked (a slot is
    read where the position it holds, the latest below the block's equal to it modulo the window,
    is not negative)."""

    def _context(self, lanes, l: int) -> DraftContext:
        slots = torch.tensor([l_.state_slot for l_ in lanes], dtype=torch.long)
        rings = self.states.extra[RING_PART]
        return DraftContext(rings[:, l, 0], rings[:, l, 1], slots[:, None], self.cfg.window)

    def _read_keys(self, S: int, T: int, pos: torch.Tensor, held: bool = False) -> torch.Tensor:
        W = self.cfg.window
        assert S == W, "the reference reads the whole window"
        p = pos[:, None]
        held = p - 1 - torch.remainder(p - 1 - torch.arange(W)[None], W)
        return torch.cat([held >= 0, torch.ones(pos.shape[0], T, dtype=torch.bool)], 1)[:, None, None, :]


def test_dflash2_drafts_equal_with_and_without_the_empty_slots(model):
    """Attention over the held slots only drafts what attention over the whole window drafts."""
    drafter, states = _dflash2(model, window=2048)
    whole = _WholeWindow(model, drafter.net)
    whole.bind(None, None, states)
    lanes = [SimpleNamespace(pos=30, state_slot=0, next_token=7), SimpleNamespace(pos=44, state_slot=1, next_token=9)]
    short = drafter.propose(lanes, 3, states)
    assert len(short) == 2 and all(len(d) == 3 for d in short)
    assert whole.propose(lanes, 3, states) == short


def test_benchmark_repeats_interleaved_with_per_backend_k(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import spec_decode

    doc = spec_decode.main(["--model", "builtin:random", "--prompts", "2", "--prompt-len", "40", "--max-tokens", "6",
                            "--backends", "none,mtp,oracle", "--rollback", "per_token", "-k", "3",
                            "--k-for", "mtp=2", "--repeat", "2", "--out", str(tmp_path / "out.json")])
    runs = doc["runs"]
    assert doc["repeat"] == 2 and set(runs) == {"none", "mtp", "oracle"}
    assert runs["mtp"]["k"] == 2 and runs["oracle"]["k"] == 3
    assert runs["mtp"]["matches_none"] and runs["oracle"]["matches_none"]
    assert runs["oracle"]["mean_acceptance_length"] > 1.0
    assert math.isclose(runs["mtp"]["speedup"], runs["mtp"]["decode_tok_s"] / runs["none"]["decode_tok_s"])
    assert (tmp_path / "out.json").is_file()


def test_benchmark_chat_data_takes_the_validation_splits_prompts(tmp_path):
    """``spec_decode.py --traffic chat --chat-data DIR`` asks the corpus's validation chat prompts
    (the ones ``train_tiny.py --val-answers`` answers: same draw), tokenized by the model; the
    training split's prompts never come."""
    import gzip
    import json

    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root / "benchmarks"))
    sys.path.insert(0, str(root / "scripts"))
    import spec_decode
    import train_tiny

    tpl = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n{}<|im_end|>\n"
    records = [{"kind": "chat", "name": f"obj{i}", "split": "val" if i % 2 else "train",
                "text": tpl.format(f"What is obj{i}?", "An object.")} for i in range(12)]
    with gzip.open(tmp_path / "corpus.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    model = SimpleNamespace(tokenizer=SimpleNamespace(encode=lambda text: [len(text), text.count("obj")]))
    texts = train_tiny.chat_prompts(records, "val", 4, train_tiny.CHAT_PROMPT_SEED)
    assert len(texts) == 4 and all("What is obj" in t for t in texts)
    assert all(int(t.split("obj")[1].split("?")[0]) % 2 for t in texts)  # validation objects only
    assert spec_decode.held_out_prompts(model, str(tmp_path), 4) == [[len(t), 1] for t in texts]
    with pytest.raises(SystemExit):
        spec_decode.held_out_prompts(model, str(tmp_path), 7)  # 6 validation prompts exist
    with pytest.raises(SystemExit):
        spec_decode.main(["--chat-data", str(tmp_path)])  # chat prompts need --traffic chat

def test_draft_page_table_has_a_decode_graph_width():
    """Where the paged decode kernel reads the pages (one query per lane), the page table's width
    must be one the warm-up compiled that kernel for (a decode graph's: a power of two, >= 8), or
    a served draft step compiles a kernel (the GPU test test_cuda_spec_warmup_covers_serving); a
    gathered span keeps the pages it needs."""
    from types import SimpleNamespace

    from hpc_cli.speculative.ops import page_table

    class InPlacePool:
        page_tokens = 64

        def paged_attention_supported(self, num_heads: int) -> bool:
            return True

    attn = SimpleNamespace(n_heads=8)
    table, width = page_table(attn, InPlacePool(), [[5, 6, 7], [9]], [130, 10], 1, "cpu")
    assert width == 8 and table.shape == (2, 8)
    assert table[0].tolist() == [5, 6, 7, 5, 5, 5, 5, 5] and table[1].tolist() == [9] * 8
    _, width = page_table(attn, InPlacePool(), [list(range(20))], [64 * 9], 1, "cpu")
    assert width == 16
    table, width = page_table(attn, InPlacePool(), [[5, 6, 7], [9]], [130, 10], 4, "cpu")  # gathered
    assert width == 3 and table[1].tolist() == [9, 9, 9]


def test_mtp_round_catch_up_writes_what_observe_writes(model):
    """The round's tail catch-up (``catch_up_columns``: one call over every lane's verify
    columns, the columns past a lane's accepted count kept out by negative write slots) stores
    the K/V that observe's lane-by-lane catch-up stores, and nothing past each lane's count."""
    from hpc_cli.model.columns import ColumnIndex, ColumnsOut

    c = model.config
    base = len(c.attention_layers)
    B, T = 3, 4
    starts, accepted = [5, 70, 130], [0, 2, 3]
    tables = [[0, 1], [2, 3], [4, 5, 6]]
    g = torch.Generator().manual_seed(5)
    toks = torch.randint(1, 250, (B, T), generator=g)
    hidden = torch.randn(B, T, c.hidden_size, generator=g)
    pools = []
    for mode in ("tail", "observe"):
        kv = PagedKVStorage(kv_profile("bf16"), base + 1, c.num_key_value_heads, c.head_dim, 8)
        drafter = MTPDrafter(model)
        drafter.bind(kv, None, None)
        if mode == "tail":
            assert drafter.catches_up_columns
            idx = ColumnIndex.build(toks, starts, tables, list(range(B)), kv.page_tokens, model.device)
            drafter.catch_up_columns(ColumnsOut(None, hidden, None, None, None, index=idx), torch.tensor(accepted))
        else:
            for b, n in enumerate(accepted):
                if n:
                    pos = torch.arange(starts[b], starts[b] + n)[None]
                    drafter._write_kv(toks[b:b + 1, 1:1 + n], hidden[b:b + 1, :n], pos, [starts[b] + n - 1],
                                      [tables[b]])
        pools.append(kv)
    tail, observed = (kv.gather(base, list(range(7)), 7 * kv.page_tokens, torch.float32) for kv in pools)
    for a, b in zip(tail, observed):
        assert torch.count_nonzero(b) > 0, "observe wrote nothing"
        assert torch.equal(a != 0, b != 0), "the tail wrote other positions than observe"
        # the same K/V up to the projections' rounding: a CPU BLAS may sum the 12 rows of one call
        # otherwise than the few rows of each lane's (an AMD EPYC host: 2 of 57k values apart, by
        # 7.6e-6); a wrong column or position is off by the values' own size (about 1)
        torch.testing.assert_close(a, b, rtol=2 ** -7, atol=1e-4, msg="the tail wrote other K/V than observe")


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_dflash_round_catch_up_writes_what_observe_writes(model, kind):
    """DFlash's and DFlash2's catch-up of a round (``catch_up_columns``: one call over every lane's
    verify columns; DFlash's columns past a lane's count kept out by negative write slots,
    DFlash2's writing back what the ring holds) stores the context K/V that observe's lane-by-lane
    catch-up stores for the committed positions (each lane's accepted drafts and the column before
    them), to a bf16 rounding (the context projection runs over every lane's columns at once),
    and nothing past each lane's count."""
    from hpc_cli.model.columns import ColumnIndex, ColumnsOut
    from hpc_cli.speculative.dflash import ring_parts

    cfg = default_config(kind, model, 1, window=64)
    net = DFlashNet(cfg)
    seed_weights(net, 7)
    c = model.config
    B, T = 3, 4
    starts, accepted = [5, 70, 126], [0, 2, 3]  # the last lane's columns wrap round its 64-slot ring
    tables = [[0, 1], [2, 3], [4, 5, 6]]
    g = torch.Generator().manual_seed(5)
    toks = torch.randint(1, 250, (B, T), generator=g)
    feats = torch.randn(B, T, len(cfg.target_layers) * c.hidden_size, generator=g)
    before = torch.randn((B, *ring_parts(1, cfg.window, cfg.num_kv_heads, cfg.head_dim)[RING_PART][0]), generator=g)
    written = []
    for mode in ("tail", "observe"):
        drafter = DFlashDrafter(model, net)
        pool = PagedKVStorage(kv_profile("bf16"), cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 8)
        states = model.new_state_slots(B, ring_parts(1, cfg.window, cfg.num_kv_heads, cfg.head_dim)
                                       if kind == "dflash2" else None)
        if kind == "dflash2":  # rings that held something before the round
            states.extra[RING_PART].copy_(before)
        drafter.bind(None, pool if kind == "dflash" else None, states)
        if mode == "tail":
            assert drafter.catches_up_columns
            idx = ColumnIndex.build(toks, starts, tables, list(range(B)), pool.page_tokens, model.device)
            drafter.catch_up_columns(ColumnsOut(None, None, feats, None, None, index=idx), torch.tensor(accepted))
        else:
            for b, a in enumerate(accepted):
                lane = SimpleNamespace(pages=tables[b], state_slot=b, backend_frontier=starts[b])
                drafter.observe(lane, starts[b], a + 1, None, feats[b], None, extend=False)
        written.append(pool.gather(0, list(range(7)), 7 * pool.page_tokens, torch.float32) if kind == "dflash"
                       else (states.extra[RING_PART][:, 0, 0].float(), states.extra[RING_PART][:, 0, 1].float()))
    for a, b in zip(*written):
        if kind == "dflash":
            assert torch.count_nonzero(b) > 0, "observe wrote nothing"
            assert torch.equal(a != 0, b != 0), "the tail wrote other positions than observe"
        # the same rows through one product or per lane: equal to a bf16 rounding of the pool
        torch.testing.assert_close(a, b, rtol=8e-3, atol=1e-3)


@pytest.mark.parametrize("name", ["mtp", "dflash", "dflash2"])
def test_rounds_with_the_tail_catch_up_propose_what_lane_by_lane_rounds_propose(name):
    """With the round's tail catching the drafter up (every lane in one call, as the CUDA graph of
    the tail runs it; forced on the CPU, where the tail runs eagerly) an engine proposes what one
    catching up lane by lane proposes, round by round, two lanes at a time, and answers as plain
    greedy decoding does (builtin:tiny, whose drafters accept drafts)."""
    from helpers import greedy, make, record_proposals, settle

    from hpc_cli.engine.api import GenerationRequest
    from hpc_cli.model.model import HybridModel

    model = HybridModel.from_name_or_path("builtin:tiny", dtype=torch.float32)  # its drafters accept drafts
    tok = model.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                  enable_thinking=False))
               for q in ("What does json.dumps do?", "What is functools.partial?", "Explain datetime.timedelta.")]
    off = make(model, reuse=False)
    refs = [off.generate(GenerationRequest(p, greedy(13)), timeout=300)[0] for p in prompts]
    settle(off)
    proposed: dict[str, list] = {}
    for mode in ("tail", "lane by lane"):
        e = make(model, name)
        drafter = e.spec.drafter
        # on the CPU MTP's rounds take the tail by default (its bridge in the catch-up's pass)
        assert e.spec.tails.batched == (name == "mtp"), (name, e.spec.tails.batched)
        e.spec.tails.batched = mode == "tail"
        calls = []
        # MTP's greedy rounds catch up with the next round's bridge (catch_up_and_bridge)
        for step in ("catch_up_columns", "catch_up_and_bridge"):
            if hasattr(drafter, step):
                inner = getattr(drafter, step)
                setattr(drafter, step, lambda out, acc, inner=inner: (calls.append(acc.tolist()), inner(out, acc)))
        proposed[mode] = record_proposals(drafter)
        try:
            handles = [e.submit(GenerationRequest(p, greedy(13))) for p in prompts]
            assert [[t.token_id for t in h.result(timeout=300)[0]] for h in handles] == refs, mode
            assert bool(calls) == (mode == "tail"), mode
            if mode == "tail":
                assert any(len(c) == 2 for c in calls), "no round of two lanes"
                assert any(a > 0 for c in calls for a in c), "no round accepted a draft: nothing caught up"
                # MTP's rounds after a greedy tail start from the first drafts that tail computed
                assert getattr(drafter, "proposals_from_first", 1) > 0, "no round started from a tail's first drafts"
                # and nothing is made ahead where the tail is not captured (the CPU's tail is eager)
                assert e.spec.stats().proposals_ahead == 0 and e.spec.counters["verify_ahead_used"] == 0
        finally:
            settle(e)
    assert proposed["tail"] and proposed["tail"] == proposed["lane by lane"]


@pytest.mark.parametrize("name", ["mtp", "dflash", "dflash2", "dflash+anchor", "dflash2+anchor"])
def test_packed_steps_draft_what_the_eager_steps_draft(model, caplog, name, tmp_path):
    """The steps a CUDA graph captures (``_steps`` on one packed input: MTP's k steps, the bridge's
    K/V kept out by a negative write slot; DFlash's block forward over a page table of a decode
    graph's width or DFlash2's whole rings, masked; ``+anchor``: a checkpoint of an
    anchor-drafting block, whose first column reads the lanes' last hidden through their slots)
    propose what the eager steps propose, round by round, k drafts a round, and the output is
    plain greedy output; off CUDA their capture fails once, with a warning, and the packed steps
    run eagerly from then on."""
    from helpers import anchor_drafter, greedy, make, record_proposals, run, settle, tokens

    from hpc_cli.speculative.draft_graphs import DraftGraphs

    name, _, anchor = name.partition("+")
    kw = {"drafter": anchor_drafter(model, name, tmp_path)} if anchor else {}
    prompts = [tokens(150, 41), tokens(90, 42)]
    off = make(model, reuse=False)
    refs = [run(off, p, 11)[0] for p in prompts]
    settle(off)
    proposed: dict[str, list] = {}
    for mode in ("packed", "eager"):
        e = make(model, name, **kw)
        drafter = e.spec.drafter
        assert drafter.graphs is None  # the CPU drafts eagerly
        assert bool(anchor) == (name != "mtp" and drafter.cfg.anchor_drafts)  # loaded with its flag
        if mode == "packed":
            drafter.graphs = DraftGraphs(model.device)
        proposed[mode] = record_proposals(drafter)
        try:
            for p, ref in zip(prompts, refs):
                got, fin = run(e, p, 11, sampling=greedy(11))
                assert got == ref, mode
                assert fin.usage.draft_tokens > 0
            if mode == "packed":
                assert drafter.graphs.disabled is not None and drafter.graphs.captures == 0
        finally:
            settle(e)
    assert proposed["packed"] and proposed["packed"] == proposed["eager"]
    assert all(len(d) == k for k, drafts in proposed["eager"] for d in drafts)
    assert any("proposing without graphs" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("name,widths", [("mtp", 2), ("dflash", 2), ("dflash2", 1)])
def test_warm_runs_every_lanes_width_and_draft_count(model, name, widths):
    """The warm-up's proposal shapes: every lanes x table width (DFlash2 reads its rings, no
    table) x 1..k drafts (MTP's from the bridge and from a tail's first drafts), and the proposal
    ahead of every lanes x width at k, through the packed steps (forced on the CPU, where no graph
    is captured), on the worker thread of an engine whose pool holds nothing yet; the engine then
    answers as plain greedy decoding does."""
    from helpers import make, run, settle, tokens

    from hpc_cli.speculative.draft_graphs import DraftGraphs

    off = make(model, reuse=False)
    ref = run(off, tokens(120, 51), 9)[0]
    settle(off)
    e = make(model, name, max_model_len=1024)
    drafter = e.spec.drafter
    drafter.graphs = DraftGraphs(model.device)
    try:
        done = e.call(lambda: drafter.warm([1, 2], [8, 16], 3, e.states, e.storage.num_pages, 1024))
        # MTP twice: from the bridge, and from the first drafts a greedy round's tail computes
        shapes = 2 * widths * 3
        assert done == (2 * shapes if name == "mtp" else shapes)
        seen = drafter.graphs.seen
        plain = [key for key in seen if key[-1] != "ahead" and "first" not in key]
        first = [key for key in seen if key[-1] == "first"]
        ahead = [key for key in seen if key[-1] == "ahead"]
        # one key a shape; from the first drafts, 2..k drafts (one draft is a gather of them, no graph)
        assert len(plain) == shapes and len(first) == (2 * widths * 2 if name == "mtp" else 0)
        # and the next round's proposal made ahead: one key a lanes x width, at k drafts
        assert len(ahead) == 2 * widths and all(key[2] == 3 for key in ahead), sorted(ahead)
        assert len(seen) == len(plain) + len(first) + len(ahead)
        for s in range(2):
            e.states.reset(s)
        assert run(e, tokens(120, 51), 9)[0] == ref
    finally:
        settle(e)


def test_mtp_drafts_after_a_resume_from_an_in_pass_tap_match_a_split_tap():
    """A request resumed from a tap that a pass took inside itself drafts what one resumed from
    the same tap taken by splitting the pass drafts, round by round: the image's hidden (MTP's
    bridge) is the one a pass ending there leaves (builtin:tiny, whose MTP head accepts drafts)."""
    from helpers import greedy, record_proposals, tap_engine

    from hpc_cli.engine.api import GenerationRequest, TapHint
    from hpc_cli.model.model import HybridModel

    model = HybridModel.from_name_or_path("builtin:tiny", dtype=torch.float32)
    tok = model.tokenizer
    chat = [{"role": "user", "content": "What does json.dumps do?"},
            {"role": "assistant", "content": "Serialize obj to a JSON formatted str."},
            {"role": "user", "content": "What is functools.partial?"}]
    prompt = tok.encode(tok.apply_chat_template(chat, add_generation_prompt=True, enable_thinking=False))
    cut = len(prompt) - 12
    hints = [TapHint(cut, 1)]
    second = prompt[:cut] + tok.encode("What does os.makedirs do?<|im_end|>\n<|im_start|>assistant\n")
    proposed, outs = {}, {}
    for mode in ("split", "in pass"):
        e = tap_engine(model, "mtp", split=mode == "split")
        try:
            e.generate(GenerationRequest(prompt, greedy(4), tap_hints=hints), timeout=120)
            assert e.cache.counters["taps_in_pass"] == (0 if mode == "split" else 1), e.cache.counters
            proposed[mode] = record_proposals(e.spec.drafter)
            outs[mode], fin = e.generate(GenerationRequest(second, greedy(24)), timeout=120)
            assert fin.usage.reuse_tokens == cut, fin.usage
        finally:
            e.stop()
        e.check_invariants()
    assert outs["split"] == outs["in pass"]
    assert proposed["in pass"] and proposed["in pass"] == proposed["split"]
    assert any(d for _, drafts in proposed["split"] for d in drafts)


def test_round_kernels_busy_time_is_the_union_of_the_kernels_intervals():
    """``benchmarks/round_kernels.py`` counts the device busy while any kernel or copy runs:
    overlapping intervals once, gaps not at all."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import round_kernels

    assert round_kernels.busy_us([]) == 0
    assert round_kernels.busy_us([(0, 10)]) == 10
    assert round_kernels.busy_us([(20, 30), (0, 10), (5, 12)]) == 22  # [0, 12] and [20, 30]
    assert round_kernels.busy_us([(0, 10), (2, 4), (10, 15)]) == 15  # nested and touching


@pytest.mark.parametrize("name", ["mtp", "dflash", "dflash2"])
def test_a_lane_stopping_inside_its_accepted_drafts_keeps_the_state_of_its_last_token(name):
    """Rounds whose lanes are all greedy count the accepted drafts on the device, in the tail
    launched before the host reads the verify pass (forced on the CPU, where it runs eagerly). A
    lane that stops on a token inside its accepted drafts accepts fewer than that count: its
    state is committed again at the host's count and DFlash2's rings get back what the catch-up
    overwrote past it. Checked against rounds whose tail takes the host's counts: the same
    answers, the same drafts proposed round by round, and at each request's end (where the cache
    takes its endpoint snapshot) the same state image in the lane's slot, bit for bit."""
    from helpers import chat_prompts, make, record_end_images, record_proposals, settle, stopping_cases

    from hpc_cli.engine.api import GenerationRequest, SamplingParams
    from hpc_cli.model.model import HybridModel

    model = HybridModel.from_name_or_path("builtin:tiny", dtype=torch.float32)
    prompts = chat_prompts(model)
    off = make(model, reuse=False)
    until_eos = SamplingParams(max_tokens=24, temperature=0.0)
    answers = [off.generate(GenerationRequest(p, until_eos), timeout=300)[0] for p in prompts]
    settle(off)
    # requests that stop on their answer's 3rd, 5th, ... token: some of them drafted right
    prompts, answers, stops = stopping_cases(prompts, answers)
    results: dict[bool, tuple] = {}
    for on_device in (True, False):
        e = make(model, name)
        e.spec.tails.use_graphs = e.spec.tails.batched = True  # the tail catches the drafter up in both
        e.spec.count_on_device = on_device
        proposed = record_proposals(e.spec.drafter)
        images = record_end_images(e, lambda lane: (tuple(lane.request.prompt_tokens),
                                                    lane.request.sampling.stop_token_ids))
        try:
            handles = [e.submit(GenerationRequest(p, SamplingParams(max_tokens=24, temperature=0.0,
                                                                    stop_token_ids=(s,))))
                       for p, s in zip(prompts, stops)]
            firsts = [[t.token_id for t in h.result(timeout=300)[0]] for h in handles]
            results[on_device] = (firsts, list(proposed), images, e.spec.counters["device_tail_fixes"])
        finally:
            settle(e)
    dev, host = results[True], results[False]
    assert dev[3] > 0, "no lane stopped inside its accepted drafts: the case is not exercised"
    assert host[3] == 0
    for first, answer, stop in zip(dev[0], answers, stops):
        assert first == answer[:answer.index(stop)], "a stopped answer is not greedy decoding's up to its stop"
    assert dev[:2] == host[:2]
    assert dev[2].keys() == host[2].keys() and len(dev[2]) == len(prompts)
    for key, image in dev[2].items():
        assert all(torch.equal(a, b) for a, b in zip(image, host[2][key])), "a lane's state at its end differs"


@pytest.mark.parametrize("k", [1, 3])
def test_the_next_rounds_mtp_proposal_and_verify_pass_made_ahead_are_the_rounds_own(k):
    """A greedy round whose tail counts on the device and catches MTP up launches the next
    round's proposal behind it, before the host reads the verify pass, and (``round``) the next
    round's verify pass once the host has accepted it (forced on the CPU, where they run
    eagerly). Two lanes decoding together, requests of several lengths (some ending on end of
    turn, so a lane leaves mid-run and what was made for both is dropped): the answers are greedy
    decoding's, the drafts each round verifies are those of rounds that propose for themselves,
    round by round, and at each request's end the lane's state image is the same, bit for bit.
    And what is made ahead is used where the lanes go on, dropped where not."""
    from helpers import chat_prompts, make, record_end_images, record_proposals, settle

    from hpc_cli.engine.api import GenerationRequest, SamplingParams
    from hpc_cli.model.model import HybridModel

    model = HybridModel.from_name_or_path("builtin:tiny", dtype=torch.float32)
    prompts = chat_prompts(model)
    lengths = (40, 17, 29, 40)
    off = make(model, reuse=False)
    answers = [off.generate(GenerationRequest(p, SamplingParams(max_tokens=n, temperature=0.0)), timeout=300)[0]
               for p, n in zip(prompts, lengths)]
    settle(off)
    results: dict[str, tuple] = {}
    for ahead in ("round", "propose", "off"):
        e = make(model, "mtp", num_draft_tokens=k)
        assert e.spec.k == k
        e.spec.tails.use_graphs = e.spec.tails.batched = True  # the tail counts, catches MTP up, looks ahead
        e.spec.look_ahead = ahead
        proposed = record_proposals(e.spec.drafter)
        images = record_end_images(e)
        try:
            handles = []
            for i, (p, n) in enumerate(zip(prompts, lengths)):  # two at a time: the same batches both ways
                handles.append(e.submit(GenerationRequest(p, SamplingParams(max_tokens=n, temperature=0.0))))
                if i % 2:
                    outs = [[t.token_id for t in h.result(timeout=300)[0]] for h in handles[-2:]]
                    assert outs == answers[i - 1:i + 1], "speculative output is not greedy decoding's"
            results[ahead] = (sorted(proposed), images, e.spec.stats(), e.spec.counters["verify_ahead_used"])
            # every mode's rounds after a greedy tail start from the first drafts that tail computed
            assert e.spec.drafter.proposals_from_first > 0, ahead
        finally:
            settle(e)
    off_ = results["off"]
    assert off_[2].proposals_ahead == 0 and off_[3] == 0
    assert results["propose"][3] == 0
    assert 0 < results["round"][3] == results["round"][2].proposals_ahead_used, results["round"]
    for mode in ("round", "propose"):
        on = results[mode]
        assert on[2].proposals_ahead_used > 0, (mode, on[2])
        assert on[2].proposals_ahead > on[2].proposals_ahead_used, f"{mode}: nothing made ahead was dropped"
        assert on[0] == off_[0], f"{mode}: a round verified other drafts than it would have proposed itself"
        assert on[1].keys() == off_[1].keys() and len(on[1]) == len(prompts)
        for key, image in on[1].items():
            assert all(torch.equal(a, b) for a, b in zip(image, off_[1][key])), f"{mode}: a lane's state at its end differs"


def test_a_proposal_ahead_serves_only_the_round_it_was_made_for():
    """The proposal made ahead is used only by a round of the same lanes, in the same order, at
    the positions and slots the round that made it left them, drafting as many."""
    from hpc_cli.speculative.runtime import _Ahead

    lanes = [SimpleNamespace(pos=10, state_slot=0), SimpleNamespace(pos=20, state_slot=1)]
    ahead = _Ahead(list(lanes), 3, torch.zeros(2, 3, dtype=torch.long), [0, 1]).made_for(lanes)
    assert ahead.serves(lanes, 3)
    assert not ahead.serves(lanes, 2)
    assert not ahead.serves(lanes[::-1], 3)
    assert not ahead.serves(lanes[:1], 3)
    assert not ahead.serves([lanes[0], SimpleNamespace(pos=20, state_slot=1)], 3)
    lanes[1].pos += 1
    assert not ahead.serves(lanes, 3)
    lanes[1].pos -= 1
    lanes[0].state_slot = 5
    assert not ahead.serves(lanes, 3)


def test_ahead_inputs_take_each_lanes_next_token_and_position_from_the_verdict():
    """A proposal ahead's packed inputs: each lane's next token is the argmax at its count of
    accepted drafts, its position moves on by that count, the other columns stay."""
    from hpc_cli.speculative.draft_graphs import ahead_inputs, no_draft_accepted

    # k = 2: drafts, then 3 argmaxes; lane 0 accepts both (bonus 9), lane 1 one (then 6), lane 2 none
    verdict = torch.tensor([[4, 5, 4, 5, 9], [7, 8, 7, 6, 3], [1, 2, 3, 2, 2]])
    packed = torch.tensor([[0, 11, 100, 1, 7, 8], [0, 12, 200, 1, 9, 9], [0, 13, 300, 1, 4, 4]])
    got = ahead_inputs(packed, verdict)
    assert got.tolist() == [[9, 11, 102, 1, 7, 8], [6, 12, 201, 1, 9, 9], [3, 13, 300, 1, 4, 4]]
    none = no_draft_accepted(2, 3, torch.device("cpu"))
    assert ahead_inputs(packed[:2], none)[:, 2].tolist() == [100, 200]


def test_a_routed_mtp_head_bridges_in_its_own_step():
    """A head whose MLP routes tokens to experts (builtin:tiny-moe) does not run its bridge inside
    the round's tail, which may be captured while the routing depends on values: its rounds keep
    the lane-by-lane catch-up and the bridge step, and answer as plain greedy decoding does. The
    dense head of builtin:tiny does bridge there."""
    from helpers import make, run, settle, tokens

    from hpc_cli.model.model import HybridModel

    moe = HybridModel.from_name_or_path("builtin:tiny-moe", dtype=torch.float32)
    off = make(moe, reuse=False)
    ref = run(off, tokens(100, 3), 9)[0]
    settle(off)
    e = make(moe, "mtp")
    try:
        assert not e.spec.drafter.bridges_in_tail and not e.spec.tails.batched
        assert run(e, tokens(100, 3), 9)[0] == ref
        assert e.spec.drafter.proposals_from_first == 0
    finally:
        settle(e)
    dense = make(HybridModel.from_name_or_path("builtin:tiny", dtype=torch.float32), "mtp")
    try:
        assert dense.spec.drafter.bridges_in_tail and dense.spec.tails.batched
    finally:
        settle(dense)
