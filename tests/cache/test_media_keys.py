"""Media-keyed cache identity on a pure index (spec §5.1, §7.1): blocks and snapshot tails that
hold an image's placeholder tokens are keyed by its content, so identical tokens with another
image miss and with the same image hit."""

from __future__ import annotations

import hashlib

from hpc_cli.cache.index import PrefixIndex
from hpc_cli.cache.records import CacheGeometry
from hpc_cli.cache.keys import BLOCK_TOKENS, MediaItem, prepare_prompt, tail_media_key, token_bytes
from hpc_cli.cache.snapshot import SnapshotKind

PAD = 265


def _digest(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


def _prompt(n: int, spans: list[tuple[int, int, str]]):
    toks = [1 + (i * 7) % 200 for i in range(n)]
    items = []
    for begin, length, name in spans:
        toks[begin:begin + length] = [PAD] * length
        items.append(MediaItem(_digest(name), 1, (1, 4, 4), begin, length))
    return toks, prepare_prompt(toks, items)


def _index() -> PrefixIndex:
    return PrefixIndex(CacheGeometry(block_bytes=4096, image_bytes=8192, device_snapshot_slots=16))


def _publish(ix: PrefixIndex, toks, prepared, frontiers, page=[0]):
    seq = ix.begin_sequence()
    for f in sorted(frontiers):
        d = f // BLOCK_TOKENS
        while len(seq.nodes) < d:
            b = len(seq.nodes)
            page[0] += 1
            ix.commit_block(seq, prepared.blocks[b], (page[0],), extra=prepared.extras[b], h=prepared.hashes[b],
                            media=prepared.block_media(b))
        tail = f - d * BLOCK_TOKENS
        g = ix.acquire_snapshot_slot(seq, SnapshotKind.TAP, f, tail)
        page[0] += 1
        ix.publish(seq, SnapshotKind.TAP, f, slot=g.slot, tail_tokens=token_bytes(toks[d * BLOCK_TOKENS:f]),
                   tail_pages=(page[0],) if tail else None, tail_extra=prepared.tail_extra(d * BLOCK_TOKENS, f))
    ix.release(seq)
    ix.check_invariants()


def _frontiers(ix, prepared):
    return sorted(s.frontier for s in ix.match(prepared).candidates)


def test_a_tail_holding_an_image_is_keyed_by_it():
    ix = _index()
    toks, a = _prompt(100, [(10, 16, "cat")])
    _publish(ix, toks, a, [40])  # anchored at the root: the tail [0, 40) holds the whole image
    same_tokens, other = _prompt(100, [(10, 16, "dog")])
    assert same_tokens == toks
    assert _frontiers(ix, a) == [40]
    assert _frontiers(ix, other) == []  # identical tokens, another image: no hit
    assert _frontiers(ix, _prompt(100, [(10, 16, "cat")])[1]) == [40]
    assert a.tail_extra(0, 40) == tail_media_key(0, 40, a.media) != 0 and a.tail_extra(30, 40) == 0


def test_a_block_holding_an_image_is_keyed_by_it():
    ix = _index()
    toks, a = _prompt(300, [(70, 30, "cat")])  # the image lies in block 1
    _publish(ix, toks, a, [64, 200])
    _, other = _prompt(300, [(70, 30, "dog")])
    assert _frontiers(ix, a) == [64, 200]
    assert _frontiers(ix, other) == [64]  # the lookup misses at the block holding the span start
    m = ix.match(other)
    assert m.cached_prefix_tokens == 64
    node = ix.match(a).path[1]
    assert node.media == a.block_media(1) and node.media[0].content_digest == _digest("cat")
    # a later block holds none of the image: extra 0, its parent chain carries the image
    assert a.extras[1] != 0 and a.extras[2] == 0


def test_same_tail_tokens_with_other_images_are_two_snapshots():
    ix = _index()
    toks, a = _prompt(100, [(10, 16, "cat")])
    _, b = _prompt(100, [(10, 16, "dog")])
    _publish(ix, toks, a, [20, 40])
    _publish(ix, toks, b, [20, 40])
    assert len(ix.tree.root.snapshots) == 4  # one per (anchor, tail tokens, tail media key)
    ix.check_invariants()  # ancestors: a snapshot covers only tails with its own images
    for p in (a, b):
        got = {s.tail_extra for s in ix.match(p).candidates}
        assert got == {p.tail_extra(0, 20), p.tail_extra(0, 40)}


def test_generated_block_after_an_image_keeps_its_key():
    _, a = _prompt(100, [(70, 20, "cat")])  # one full block; block 1 holds the image and ends in output
    assert len(a.extras) == 1
    assert a.block_extra(1) != 0 and a.block_media(1)[0].content_digest == _digest("cat")
    assert a.block_extra(2) == 0
    salted = prepare_prompt(_prompt(100, [(70, 20, "cat")])[0], a.media, cache_salt="tenant")
    assert salted.block_extra(1) not in (0, a.block_extra(1))


def test_generated_block_keys_match_the_next_turns_prompt_under_a_salt():
    """A block that ends in generated tokens is committed with the key the next turn's prompt gives
    the same tokens (salted too), so a salted conversation reuses past its first answer."""
    tokens = [(7 * i) % 250 + 1 for i in range(200)]
    for salt in (None, "tenant"):
        turn1 = prepare_prompt(tokens[:100], cache_salt=salt)
        turn2 = prepare_prompt(tokens, cache_salt=salt)
        assert [turn1.block_extra(b) for b in range(3)] == turn2.extras[:3], f"salt {salt!r}"
