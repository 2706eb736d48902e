"""Keys and records of the shared tier (hpc_cli.cache.shared): a value is used only when it is
exactly the entry asked for, whole; anything else is a miss with its reason."""

from __future__ import annotations

import random

import pytest

from hpc_cli.cache import shared as rec
from hpc_cli.cache.keys import BLOCK_TOKENS, HASH_SEED, prepare_prompt
from hpc_cli.cache.shared import BlockEntry, Miss, RecordError, SnapshotEntry
from hpc_cli.cache.snapshot import SnapshotKind

FP = {"checkpoint": "builtin:random", "kv_profile": "bf16", "product": "1+abc"}
GEOM = {"slab_bytes": 4096, "image_bytes": 10000, "block_bytes": 3000}
NS = rec.namespace(FP, GEOM)


def _prompt(n=300, seed=1):
    rng = random.Random(seed)
    return prepare_prompt([rng.randrange(1, 250) for _ in range(n)])


def _block(p, b, payload=b""):
    payload = payload or bytes(random.Random(b).randrange(256) for _ in range(GEOM["block_bytes"]))
    digests = rec.path_digests(p, b + 1)
    return BlockEntry(p.hashes[b], p.hashes[b - 1] if b else HASH_SEED, p.extras[b], p.blocks[b], digests[b], payload)


def _verify_block(p, b, raw, ns=NS):
    return rec.verify_block(ns, raw, lookup_hash=p.hashes[b], parent_hash=p.hashes[b - 1] if b else HASH_SEED,
                            tokens=p.blocks[b], extra=p.extras[b], path=rec.path_digests(p, b + 1)[b],
                            payload_bytes=GEOM["block_bytes"])


def test_namespace_follows_every_fingerprint_field_and_the_geometry():
    assert rec.namespace(FP, GEOM) == NS and NS.startswith("hpc1:") and len(NS) == 5 + 32
    for key, value in (("kv_profile", "int8-g64"), ("checkpoint", "builtin:random@4"), ("product", "1+abd")):
        assert rec.namespace({**FP, key: value}, GEOM) != NS
    assert rec.namespace(FP, {**GEOM, "image_bytes": 10001}) != NS


def test_keys_and_members():
    assert rec.block_key(NS, 0xAB) == f"{NS}:b:00000000000000ab"
    assert rec.snapshot_key(NS, 1, 130, 2) == f"{NS}:s:0000000000000001:130:0000000000000002"
    assert rec.anchor_key(NS, 1).endswith(":a:0000000000000001")
    assert rec.parse_member(rec.anchor_member(130, 0xFF)) == (130, 0xFF)
    assert rec.parse_member(b"junk") is None and rec.parse_member(b"1:zz") is None


def test_path_digest_chain_stands_for_the_whole_path():
    a, b = _prompt(300, 1), _prompt(300, 2)
    da, db = rec.path_digests(a, 4), rec.path_digests(b, 4)
    assert len(da) == 4 and len(set(da)) == 4 and not set(da) & set(db)
    # the same last block under another path has another digest
    assert rec.path_digest(da[0], a.blocks[1], 0) != rec.path_digest(db[0], a.blocks[1], 0)


def test_block_round_trip_and_every_damage_is_a_miss():
    p = _prompt()
    e = _block(p, 2)
    raw = rec.encode_block(NS, e)
    assert len(raw) == rec.record_bytes(BLOCK_TOKENS, [GEOM["block_bytes"]])
    assert bytes(_verify_block(p, 2, raw)) == e.payload
    rng = random.Random(0)
    for pos in [0, 7, 20, rec.HEADER_BYTES, rec.HEADER_BYTES + 300, len(raw) - 9, len(raw) - 1] + \
            [rng.randrange(len(raw)) for _ in range(40)]:
        bad = bytearray(raw)
        bad[pos] ^= 0x40
        with pytest.raises(RecordError) as exc:
            _verify_block(p, 2, bytes(bad))
        assert exc.value.miss in (Miss.DAMAGED, Miss.STALE)
    for cut in (raw[:-1], raw[:40], raw + b"\0", b""):
        with pytest.raises(RecordError) as exc:
            _verify_block(p, 2, cut)
        assert exc.value.miss is Miss.DAMAGED
    with pytest.raises(RecordError) as exc:
        _verify_block(p, 2, None)
    assert exc.value.miss is Miss.MISSING


def test_another_namespace_another_block_or_a_collision_is_never_data():
    p = _prompt()
    raw = rec.encode_block(NS, _block(p, 2))
    other = rec.namespace({**FP, "kv_profile": "int8-g64"}, GEOM)
    with pytest.raises(RecordError) as exc:
        _verify_block(p, 2, raw, ns=other)
    assert exc.value.miss is Miss.STALE
    with pytest.raises(RecordError) as exc:
        _verify_block(p, 3, raw)  # the value of block 2 under block 3's key
    assert exc.value.miss is Miss.STALE
    # a forced collision: a record with this block's hash but other tokens (or another path)
    q = _prompt(300, 9)
    forged = BlockEntry(p.hashes[2], p.hashes[1], 0, q.blocks[2], rec.path_digests(p, 3)[2], b"\1" * 3000)
    with pytest.raises(RecordError) as exc:
        _verify_block(p, 2, rec.encode_block(NS, forged))
    assert exc.value.miss is Miss.COLLISION
    forged = BlockEntry(p.hashes[2], p.hashes[1], 0, p.blocks[2], rec.path_digests(q, 3)[2], b"\1" * 3000)
    with pytest.raises(RecordError) as exc:
        _verify_block(p, 2, rec.encode_block(NS, forged))
    assert exc.value.miss is Miss.COLLISION
    wrong_size = BlockEntry(*[getattr(_block(p, 2), f) for f in ("lookup_hash", "parent_hash", "extra", "tokens",
                                                                  "path")], b"\0" * 100)
    with pytest.raises(RecordError) as exc:
        _verify_block(p, 2, rec.encode_block(NS, wrong_size))
    assert exc.value.miss is Miss.DAMAGED


def test_snapshot_round_trip_with_and_without_tail():
    p = _prompt()
    d = rec.path_digests(p, 4)
    for frontier in (192, 200):
        a = frontier // BLOCK_TOKENS - 1
        tail_tokens = p.tail_tokens(BLOCK_TOKENS * (a + 1), frontier)
        image, tail = bytes(range(256)) * 39 + b"x" * 16, (b"t" * 3000 if tail_tokens else b"")
        e = SnapshotEntry(p.hashes[a], d[a], frontier, SnapshotKind.ENDPOINT, 3, tail_tokens, image, tail)
        raw = rec.encode_snapshot(NS, e)
        got = rec.verify_snapshot(NS, raw, anchor_hash=p.hashes[a], anchor_path=d[a], frontier=frontier,
                                  tail_tokens=tail_tokens, image_bytes=10000, tail_bytes=3000)
        assert got.kind is SnapshotKind.ENDPOINT and bytes(got.image) == image and bytes(got.tail) == tail
        assert e.tail_key == rec.tail_digest(tail_tokens)
        if tail_tokens:
            with pytest.raises(RecordError) as exc:  # another tail under the same anchor and frontier
                rec.verify_snapshot(NS, raw, anchor_hash=p.hashes[a], anchor_path=d[a], frontier=frontier,
                                    tail_tokens=b"\0" * len(tail_tokens), image_bytes=10000, tail_bytes=3000)
            assert exc.value.miss is Miss.COLLISION
        with pytest.raises(RecordError) as exc:  # another path above the same anchor hash
            rec.verify_snapshot(NS, raw, anchor_hash=p.hashes[a], anchor_path=d[a - 1], frontier=frontier,
                                tail_tokens=tail_tokens, image_bytes=10000, tail_bytes=3000)
        assert exc.value.miss is Miss.COLLISION
        with pytest.raises(RecordError) as exc:  # another engine's image size
            rec.verify_snapshot(NS, raw, anchor_hash=p.hashes[a], anchor_path=d[a], frontier=frontier,
                                tail_tokens=tail_tokens, image_bytes=9999, tail_bytes=3000)
        assert exc.value.miss is Miss.DAMAGED
    # a frontier inside a block with a tail of other length is refused when encoding
    with pytest.raises(AssertionError):
        rec.encode_snapshot(NS, SnapshotEntry(p.hashes[2], d[2], 200, SnapshotKind.TAP, 0, b"", b"i", b""))
