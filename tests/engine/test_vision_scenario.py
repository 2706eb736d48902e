"""Spec §13.3 "Vision" on the engine (CPU, a tiny multimodal checkpoint written by transformers):
same image vs different image with identical tokens hit vs miss, no resume inside a span, and
resumed output equal to output computed from the root (greedy)."""

from __future__ import annotations

import io
import random

import pytest
import torch

from hpc_cli.cache.keys import BLOCK_TOKENS
from hpc_cli.engine.api import GenerationRequest, SamplingParams, TapHint
from hpc_cli.engine.engine import Engine
from hpc_cli.engine.hybrid import common_prefix
from hpc_cli.engine.media import PromptImage, check_images
from hpc_cli.engine.persistence import attach_cache_file
from hpc_cli.errors import RequestError
from hpc_cli.model.image_processor import preprocess
from model.vision_checkpoint import make_image, write_vision_checkpoint

KW = dict(kv_pages=64, prefill_chunk=64, max_concurrency=2, host_cache_mib=16)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from hpc_cli.model.model import HybridModel

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    ck = write_vision_checkpoint(tmp_path_factory.mktemp("vision"))
    yield HybridModel.from_name_or_path(str(ck.path), dtype=torch.float32, progress=False)
    torch.set_num_threads(before)  # later modules' tests (a CPU engine's thread team) see the machine's


def _text(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 250) for _ in range(n)]


def _image(model, seed: int, size=(60, 44)):
    from PIL import Image

    return preprocess(Image.open(io.BytesIO(make_image(*size, seed))), model.image_processor)


def prompt(model, pieces) -> tuple[list[int], list[PromptImage], list[TapHint]]:
    """Tokens from pieces (token lists, or preprocessed images between vision start/end), the
    images, and a structural hint at the end of the first piece plus the opener hint."""
    mm = model.multimodal
    toks: list[int] = []
    images = []
    for p in pieces:
        if isinstance(p, list):
            toks += p
            continue
        toks.append(mm.vision_start_token_id)
        n = model.vision.tokens_of(p.grid)
        images.append(PromptImage(p.pixels, p.grid, p.digest, len(toks), n))
        toks += [mm.image_token_id] * n
        toks.append(mm.vision_end_token_id)
    hints = [TapHint(len(pieces[0]), 3), TapHint(len(toks) - 4, 2)]
    return toks, images, hints


def run(engine, toks, images, hints=(), n=6):
    req = GenerationRequest(list(toks), SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
                            tap_hints=list(hints), media=list(images))
    out, fin = engine.generate(req, timeout=120)
    assert fin.reason == "length", (fin.reason, fin.error)
    return list(out), fin.usage


def settle(engine) -> None:
    engine.stop()
    engine.check_invariants()
    st = engine.cache.index.stats()
    assert st.nodes.pinned == 0 and st.sequences == 0, st


def _no_frontier_inside(engine, images) -> None:
    for s in engine.cache.index.snapshots.values():
        for im in images:
            assert not im.begin < s.frontier < im.end, f"snapshot at {s.frontier} inside [{im.begin}, {im.end})"


def test_same_image_hits_past_it_other_image_misses_at_the_span_start(model):
    head, tail = _text(100, 1), _text(80, 2)  # the opener is a tap of its own, >64 tokens past the head
    cat, dog = _image(model, 1), _image(model, 2)
    toks, images, hints = prompt(model, [head, cat, tail])
    toks2, images2, _ = prompt(model, [head, dog, tail])
    assert toks2 == toks and images2[0].digest != images[0].digest
    (im,) = images
    ref = Engine(model, reuse=False, **KW).start()  # every answer computed from the root
    want_cat, _ = run(ref, toks, images)
    want_dog, _ = run(ref, toks2, images2)
    ref.stop()

    e = Engine(model, **KW).start()
    first, u1 = run(e, toks, images, hints)
    again, u2 = run(e, toks, images, hints)
    other, u3 = run(e, toks2, images2, hints)
    _no_frontier_inside(e, images)
    settle(e)
    assert u1.reuse_tokens == 0
    assert u2.reuse_tokens > im.end, u2  # the same image: a hit past it
    assert u3.reuse_tokens == len(head) <= im.begin, u3  # another image: the miss starts at the span
    assert u3.cached_prefix_tokens == BLOCK_TOKENS * (im.begin // BLOCK_TOKENS)
    assert first == again == want_cat
    assert other == want_dog


def test_no_tap_or_resume_inside_a_span(model):
    head = _text(70, 3)
    toks, images, hints = prompt(model, [head, _image(model, 3, size=(64, 64)), _text(150, 4)])
    (im,) = images
    inside = im.begin + im.length // 2
    hints = hints + [TapHint(inside, 1)]  # a client breakpoint inside the image moves to its start
    e = Engine(model, **{**KW, "tap_ladder_tokens": 64, "tap_min_gap_tokens": 64}).start()
    run(e, toks, images, hints)
    frontiers = sorted(s.frontier for s in e.cache.index.snapshots.values())
    assert im.begin in frontiers, frontiers
    _no_frontier_inside(e, images)
    _, u = run(e, toks, images)  # the same prompt again resumes past the image, never inside
    settle(e)
    assert u.reuse_tokens >= im.end


def test_next_turn_resumes_at_the_endpoint_with_the_image(model):
    toks, images, hints = prompt(model, [_text(80, 5), _image(model, 5), _text(30, 6)])
    e = Engine(model, **KW).start()
    out1, _ = run(e, toks, images, hints, n=70)  # >= 64 tokens past the deepest tap (the opener): an endpoint
    turn2 = toks + out1 + _text(20, 7)
    out2, u = run(e, turn2, images, n=6)
    settle(e)
    ref = Engine(model, reuse=False, **KW).start()
    want, _ = run(ref, turn2, images, n=6)
    ref.stop()
    assert u.reuse_tokens >= len(toks) + len(out1) - 1, u  # the endpoint, past the image
    assert out2 == want


def test_cache_file_keeps_media_keys_across_a_restart(model, tmp_path):
    toks, images, hints = prompt(model, [_text(100, 8), _image(model, 8), _text(80, 9)])
    toks2, images2, _ = prompt(model, [_text(100, 8), _image(model, 9), _text(80, 9)])
    path = tmp_path / "prefix.bin"
    a = Engine(model, **KW)
    attach_cache_file(a, path, progress=False)
    a.start()
    want, _ = run(a, toks, images, hints)
    a.stop()
    b = Engine(model, **KW)
    report = attach_cache_file(b, path, progress=False, save=False)
    assert report.status == "restored", report
    b.start()
    got, u = run(b, toks, images)
    _, u2 = run(b, toks2, images2)
    settle(b)
    assert got == want and u.reuse_tokens > images[0].end and u.restored_host_bytes > 0
    assert u2.reuse_tokens <= images2[0].begin


def test_images_are_checked_before_they_reach_the_worker(model):
    toks, images, _ = prompt(model, [_text(10, 1), _image(model, 1), _text(5, 2)])
    ok = GenerationRequest(toks, media=images)
    check_images(model, ok)
    with pytest.raises(RequestError, match="speculative"):
        check_images(model, ok, speculative=True)
    stray = GenerationRequest(toks + [model.multimodal.image_token_id], media=images)
    with pytest.raises(RequestError, match="placeholder"):
        check_images(model, stray)
    from hpc_cli.model.model import HybridModel

    text_only = HybridModel.from_name_or_path("builtin:random", dtype=torch.float32)
    with pytest.raises(RequestError, match="does not take images"):
        check_images(text_only, ok)


def test_vision_prompts_do_not_coalesce(model):
    from hpc_cli.cache.keys import prepare_prompt
    from hpc_cli.engine.media import media_items

    toks, images, _ = prompt(model, [_text(200, 1), _image(model, 1), _text(5, 2)])

    class _L:
        def __init__(self, media):
            self.prepared = prepare_prompt(toks, media_items(media))
            self.tokens, self.n_prompt = toks, len(toks)

    assert common_prefix(_L(images), _L(images)) == 0
    assert common_prefix(_L([]), _L([])) == len(toks)
