"""§13.1 BlockTree."""

from hpc_cli.cache import PrefixIndex, SnapshotKind, MediaItem, prepare_prompt, token_bytes

from .sim import BLOCK, TOKEN_COST, Sim, blocks_of, geometry


def make(**kw):
    ix = PrefixIndex(geometry(**kw), TOKEN_COST)
    return ix, Sim(ix)


def test_insert_and_match_with_exact_tokens_and_extra_keys():
    ix, sim = make()
    sim.run(blocks_of(1, 2, 3, 4) + [5])
    m = ix.match(prepare_prompt(blocks_of(1, 2, 3, 4) + [5]))
    assert m.k == 4 and m.cached_prefix_tokens == 256
    m = ix.match(prepare_prompt(blocks_of(1, 2, 9, 4) + [5]))
    assert m.k == 2  # stops at the first differing block
    toks = blocks_of(1, 2)
    toks[100] += 1
    assert ix.match(prepare_prompt(toks + [1])).k == 1
    ix.check_invariants()


def test_forced_constant_lookup_hash_never_gives_a_false_hit():
    ix, sim = make()
    p1 = prepare_prompt(blocks_of(1, 2, 3) + [0], hashes=[7, 7, 7])
    p2 = prepare_prompt(blocks_of(1, 5, 6) + [0], hashes=[7, 7, 7])
    seq = ix.begin_sequence()
    for b in range(3):
        ix.commit_block(seq, p1.blocks[b], sim.mem.alloc(), h=7)
    seq2 = ix.begin_sequence()
    for b in range(3):
        out = ix.commit_block(seq2, p2.blocks[b], sim.mem.alloc(), h=7)
        assert out.value == ("duplicate" if b == 0 else "inserted")
    root = ix.tree.root
    n1 = root.children[7]
    assert len(list(n1.iter_children())) == 2  # two siblings chained under one hash
    assert ix.match(p1).k == 3 and ix.match(p2).k == 3
    assert [n.tokens for n in ix.match(p2).path] == p2.blocks
    p3 = prepare_prompt(blocks_of(1, 7, 3) + [0], hashes=[7, 7, 7])
    assert ix.match(p3).k == 1
    ix.release(seq)
    ix.release(seq2)
    ix.check_invariants()


def test_different_media_digest_with_same_tokens_misses():
    ix, sim = make()
    toks = blocks_of(1, 2, 3) + [0]
    img_a = MediaItem(b"a" * 32, 1, (1, 2, 2), 64, 64)
    img_b = MediaItem(b"b" * 32, 1, (1, 2, 2), 64, 64)
    pa, pb = prepare_prompt(toks, [img_a]), prepare_prompt(toks, [img_b])
    seq = ix.begin_sequence()
    for b in range(3):
        ix.commit_block(seq, pa.blocks[b], sim.mem.alloc(), extra=pa.extras[b])
    assert ix.match(pa).k == 3
    assert ix.match(pb).k == 1  # block 1 carries the image: different extra
    # identical hash but different extra must still miss
    forced = prepare_prompt(toks, [img_b], hashes=pa.hashes)
    assert ix.match(forced).k == 1
    ix.release(seq)
    ix.check_invariants()


def test_tail_snapshot_matches_on_exact_tail_tokens_only():
    ix, sim = make()
    toks = blocks_of(1, 2) + list(range(5000, 5030))
    sim.run(toks, endpoint=128 + 20)
    m = ix.match(prepare_prompt(toks + [1]))
    assert [s.frontier for s in m.candidates] == [148]
    other = list(toks)
    other[128 + 19] += 1  # last tail token differs
    assert ix.match(prepare_prompt(other + [1])).candidates == []
    other = list(toks)
    other[128 + 25] += 1  # beyond the tail: still a hit
    assert [s.frontier for s in ix.match(prepare_prompt(other + [1])).candidates] == [148]


def test_frontier_at_most_n_minus_1_is_enforced():
    ix, sim = make()
    toks = blocks_of(1, 2, 3)
    sim.run(toks + [1, 2], taps=[128])
    # prompt of exactly 128 tokens: the 128 snapshot would leave nothing to prefill
    m = ix.match(prepare_prompt(toks[:128]))
    assert m.k == 1 and m.candidates == []
    m = ix.match(prepare_prompt(toks[:129]))
    assert [s.frontier for s in m.candidates] == [128]
    assert m.k == 2
    # an empty and a one-token prompt match nothing
    assert ix.match(prepare_prompt([])).k == 0
    assert ix.match(prepare_prompt(toks[:1])).candidates == []


def test_duplicate_snapshot_publication_is_a_noop():
    ix, sim = make()
    toks = blocks_of(1, 2, 3) + [1]
    _, (s1,) = sim.run(toks, taps=[128])
    before = (len(ix.snapshots), ix.host.free_slabs, sim.mem.n_free)
    lane, _ = sim.admit(blocks_of(1, 2, 4) + [1])  # shares the first 128 tokens, resumes at 128
    sim.commit(lane, 192)
    g = ix.acquire_snapshot_slot(None, SnapshotKind.TAP, 128)
    pr = ix.publish(lane.seq, SnapshotKind.TAP, 128, slot=g.slot)
    assert pr.duplicate and pr.snapshot is s1 and pr.write is None
    assert ix.slot_owner[g.slot] is None  # the staged slot went back
    sim.finish(lane)
    assert len(ix.snapshots) == before[0]
    # a tailed duplicate hands its tail pages back
    lane, _ = sim.admit(toks)
    sim.commit(lane, 130)
    g = ix.acquire_snapshot_slot(None, SnapshotKind.TAP, 130)
    pages = sim.mem.alloc()
    pr = ix.publish(lane.seq, SnapshotKind.TAP, 130, slot=g.slot, tail_tokens=token_bytes(toks[128:130]), tail_pages=pages)
    assert not pr.duplicate
    g2 = ix.acquire_snapshot_slot(None, SnapshotKind.TAP, 130)
    pages2 = sim.mem.alloc()
    pr2 = ix.publish(lane.seq, SnapshotKind.TAP, 130, slot=g2.slot, tail_tokens=token_bytes(toks[128:130]), tail_pages=pages2)
    assert pr2.duplicate and pr2.snapshot is pr.snapshot and pr2.freed.pages == [pages2]
    sim.mem.give_back(pr2.freed.pages)
    ix.land_write(pr.write)
    sim.finish(lane)
    ix.check_invariants()
