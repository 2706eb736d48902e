"""The checkpoint catalog of cache mode legacy (hpc_cli.cache.catalog): reuse only at an owned
checkpoint, shared stable prefixes where two sessions meet, long anchors, bounded catalogs."""

from __future__ import annotations

from hpc_cli.cache.catalog import (CatalogLimits, Checkpoint, CheckpointCatalog, CheckpointKind, Residency,
                                   common_prefix)

END, SHARED, ANCHOR = CheckpointKind.SESSION_ENDPOINT, CheckpointKind.SHARED_PREFIX, CheckpointKind.LONG_ANCHOR


def catalog(private=4, shared=2, anchors=2, spacing=128) -> CheckpointCatalog:
    return CheckpointCatalog(CatalogLimits(private, shared, anchors, spacing))


def seq(n: int, start: int = 1) -> tuple[int, ...]:
    return tuple(range(start, start + n))


def continuation(cat, tokens, *frontiers, shared=False, salt=0):
    kinds = [ANCHOR] * (len(frontiers) - 1) + [SHARED if shared else END]
    cps = [Checkpoint(k, f, slot=i) for i, (k, f) in enumerate(zip(kinds, frontiers))]
    return cat.new_owner(shared=shared, salt=salt, tokens=tokens[:max(frontiers)], checkpoints=cps,
                         pages=list(range(-(-max(frontiers) // 64))))


def test_common_prefix():
    a = seq(300)
    assert common_prefix(a, a) == 300
    assert common_prefix(a, a[:130] + (0,) + a[131:]) == 130
    assert common_prefix(a, ()) == 0


def test_match_takes_the_deepest_owned_checkpoint_never_a_bare_prefix():
    cat = catalog()
    base = seq(400)
    owner = continuation(cat, base, 128, 256, 400)
    prompt = base[:300] + (9999,) * 50  # leaves the continuation at 300: the anchor at 256 serves
    m = cat.match(prompt, 0, len(prompt) - 1)
    assert m.owner is owner and m.checkpoint.frontier == 256 and m.cached_prefix_tokens == 300
    m = cat.match(base + (1, 2), 0, 401)  # extends the whole path: the endpoint
    assert m.checkpoint.kind is END and m.frontier == 400
    assert cat.match(base, 0, 399).frontier == 256  # a prompt must leave a token to prefill
    assert cat.match((7,) + base, 0, 400).owner is None


def test_salt_separates_tenants():
    cat = catalog()
    continuation(cat, seq(200), 200, salt=5)
    assert cat.match(seq(200) + (1,), 0, 200).owner is None
    assert cat.match(seq(200) + (1,), 5, 200).frontier == 200


def test_shared_frontier_is_where_another_session_is_left_block_aligned():
    cat = catalog()
    a = continuation(cat, seq(500), 500)
    prompt = seq(300) + (0,) * 100
    assert cat.shared_frontier(prompt, 0, len(prompt) - 1, 0, None) == 256
    assert cat.shared_frontier(prompt, 0, len(prompt) - 1, 256, None) == 0  # resumes there already
    assert cat.shared_frontier(prompt, 0, len(prompt) - 1, 0, a) == 0  # its own session is no second one
    assert catalog(shared=0).shared_frontier(prompt, 0, 399, 0, None) == 0


def test_anchor_positions_keep_the_deepest():
    cat = catalog(anchors=2, spacing=128)
    assert cat.anchor_positions(700, 0) == [512, 640]
    assert cat.anchor_positions(700, 600) == [640]
    assert cat.anchor_positions(640, 0) == [384, 512]  # strictly inside the prompt
    assert catalog(anchors=0).anchor_positions(700, 0) == []


def test_trim_anchors_keeps_endpoint_and_deepest_anchors():
    cat = catalog(anchors=2)
    cps = [Checkpoint(ANCHOR, f) for f in (128, 256, 384)] + [Checkpoint(END, 400)]
    kept, dropped = cat.trim_anchors(cps)
    assert [c.frontier for c in kept] == [256, 384, 400] and [c.frontier for c in dropped] == [128]


def test_over_limit_is_lru_and_spares_readers():
    cat = catalog(private=2, shared=1)
    owners = [continuation(cat, seq(100, start=1000 * i), 100) for i in range(4)]
    s1 = continuation(cat, seq(64), 64, shared=True)
    s2 = continuation(cat, seq(64, start=5), 64, shared=True)
    cat.touch(owners[0])
    owners[1].readers = 1
    over = cat.over_limit()
    assert owners[2] in over and owners[3] in over and owners[0] not in over and owners[1] not in over
    assert s1 in over and s2 not in over
    owners[1].readers = 0
    assert [o.id for o in cat.lru(Residency.DEVICE)][:2] == [owners[1].id, owners[2].id]


def test_counts_and_invariants():
    cat = catalog()
    continuation(cat, seq(300), 128, 300)
    continuation(cat, seq(64), 64, shared=True)
    c = cat.counts()
    assert c.private_continuations == 1 and c.shared_prefixes == 1
    assert c.checkpoints.by_kind == {"long_anchor": 1, "session_endpoint": 1, "shared_prefix": 1}
    cat.check_invariants()
