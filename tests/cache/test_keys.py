import xxhash
import pytest

from hpc_cli.cache import (BLOCK_TOKENS, HASH_SEED, MediaItem, block_hashes, lookup_hash,
                           media_key, prepare_prompt, token_bytes)


def test_a_block_is_one_kv_page():
    from hpc_cli.kv_profile import PAGE_TOKENS
    assert BLOCK_TOKENS == PAGE_TOKENS == 64


def test_hash_seed_is_documented_value():
    assert HASH_SEED == int.from_bytes(b"HPC-BLK1", "little")


def test_lookup_hash_is_xxh3_over_parent_tokens_extra():
    toks = list(range(64))
    tb = token_bytes(toks)
    assert len(tb) == 256
    want = xxhash.xxh3_64_intdigest(HASH_SEED.to_bytes(8, "little") + tb + (7).to_bytes(8, "little"))
    assert lookup_hash(HASH_SEED, tb, 7) == want


def test_block_hashes_chain_equals_stepwise_and_ignores_partial_block():
    toks = list(range(64 * 5 + 17))
    hs = block_hashes(toks)
    assert len(hs) == 5
    h = HASH_SEED
    for b in range(5):
        h = lookup_hash(h, token_bytes(toks[64 * b:64 * b + 64]))
        assert hs[b] == h
    extras = [0, 3, 0, 9, 1]
    hx = block_hashes(toks, extras)
    assert hx[0] == hs[0] and hx[1] != hs[1]


def test_media_key_zero_without_overlap_and_covers_earlier_items():
    img = MediaItem(b"a" * 32, 1, (1, 2, 2), begin=70, length=100)
    assert media_key(0, [img]) == 0  # block 0 is [0, 64): no overlap
    k1, k2 = media_key(1, [img]), media_key(2, [img])
    assert k1 and k2 and k1 == k2  # same single item
    assert media_key(3, [img]) == 0  # [192, 256) after the span
    other = MediaItem(b"b" * 32, 1, (1, 2, 2), begin=70, length=100)
    assert media_key(1, [other]) != k1
    with pytest.raises(ValueError):
        media_key(1, [MediaItem(b"x", 1, (1,), 64, 10)])


def test_prepare_prompt_blocks_and_vision_spans():
    img = MediaItem(b"c" * 32, 1, (1, 4, 4), begin=10, length=60)
    p = prepare_prompt(list(range(200)), [img])
    assert p.n == 200 and len(p.blocks) == 3 == len(p.hashes)
    assert p.extras[0] != 0 and p.extras[1] != 0 and p.extras[2] == 0
    assert p.inside_vision(11) and not p.inside_vision(10) and not p.inside_vision(70)
    assert p.tail_tokens(64, 70) == token_bytes(range(64, 70))
    assert BLOCK_TOKENS == 64
