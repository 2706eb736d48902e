"""The vision tower, image preprocessing and mRoPE against transformers' own
Qwen3_5ForConditionalGeneration on a tiny multimodal checkpoint it wrote (fp32): logits of a
prompt with one and with two images, within the text parity bound."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from hpc_cli.engine.media import LaneVision, PromptImage
from hpc_cli.model import HybridModel
from hpc_cli.model.image_processor import ImageProcessorConfig, fit_size, preprocess
from hpc_cli.model.mrope import VisionSpan, frequency_axes, mrope_cos_sin, rope_positions
from hpc_cli.model.vision import PrefillMedia

from .helpers import F32, rel_err
from .test_hf_parity import BOUND
from .vision_checkpoint import make_image, write_vision_checkpoint

IMAGES = [(40, 30, 1), (70, 50, 2), (33, 61, 3)]  # (width, height, seed): grids 4x4, 6x8, 8x4 patches


@pytest.fixture(scope="module")
def vision_ckpt(tmp_path_factory):
    return write_vision_checkpoint(tmp_path_factory.mktemp("vision"))


@pytest.fixture(scope="module")
def ours(vision_ckpt):
    return HybridModel.from_name_or_path(str(vision_ckpt.path), dtype=torch.float32, progress=False)


def _pil(i: int):
    from PIL import Image

    w, h, seed = IMAGES[i]
    return Image.open(io.BytesIO(make_image(w, h, seed)))


def _hf_inputs(ck, k: int):
    content = [{"type": "text", "text": "Compare these: "}]
    for i in range(k):
        content += [{"type": "image"}, {"type": "text", "text": f" and picture {i} "}]
    text = ck.processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                            tokenize=False)
    return ck.processor(text=[text], images=[_pil(i) for i in range(k)], return_tensors="pt")


def _media(model, ids: list[int], k: int) -> tuple[list[PromptImage], PrefillMedia]:
    pad = model.multimodal.image_token_id
    images, at = [], 0
    for i in range(k):
        p = preprocess(_pil(i), model.image_processor)
        begin = ids.index(pad, at)
        images.append(PromptImage(p.pixels, p.grid, p.digest, begin, model.vision.tokens_of(p.grid)))
        at = images[-1].end
    m = model.vision.config.spatial_merge_size
    pos, _ = rope_positions(len(ids), [VisionSpan(im.begin, (1, im.grid[1] // m, im.grid[2] // m)) for im in images])
    embeds = model.vision.encode(torch.from_numpy(np.concatenate([im.pixels for im in images])),
                                 [im.grid for im in images])
    return images, PrefillMedia(pos, [(im.begin, e) for im, e in zip(images, embeds)])


@pytest.mark.parametrize("k", [1, 2])
def test_logits_with_images_match_transformers(vision_ckpt, ours, k):
    inputs = _hf_inputs(vision_ckpt, k)
    with torch.no_grad():
        ref = vision_ckpt.model(**inputs).logits[0]
    ids = inputs["input_ids"][0].tolist()
    images, media = _media(ours, ids, k)
    # our preprocessing is transformers' (pixel for pixel) and so is the placeholder count
    assert torch.equal(torch.from_numpy(np.concatenate([im.pixels for im in images])), inputs["pixel_values"])
    assert [list(im.grid) for im in images] == inputs["image_grid_thw"].tolist()
    assert sum(im.length for im in images) == ids.count(ours.multimodal.image_token_id)
    got = ours.forward_tokens(ids, kv_profile=F32, media=media)
    err = rel_err(got, ref)
    worst = ((got.double() - ref.double()).abs().max() / ref.double().abs().max()).item()
    print(f"{k} image(s): relative error vs transformers {err:.2e} (norm), {worst:.2e} (max abs / max |ref|)")
    assert err <= BOUND, f"logits with {k} image(s) differ from transformers by {err:.2e}"


def test_positions_match_transformers_rope_index(vision_ckpt, ours):
    inputs = _hf_inputs(vision_ckpt, 2)
    ref, delta_ref = vision_ckpt.model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                            image_grid_thw=inputs["image_grid_thw"])
    ids = inputs["input_ids"][0].tolist()
    images, media = _media(ours, ids, 2)
    assert torch.equal(media.positions, ref[:, 0])
    _, delta = rope_positions(len(ids), [VisionSpan(im.begin, (1, im.grid[1] // 2, im.grid[2] // 2)) for im in images])
    assert delta == int(delta_ref)


def test_equal_axes_are_the_text_rotary_bit_for_bit(ours):
    pos = torch.arange(0, 300)
    cos, sin = ours.rotary.cos_sin(pos, torch.float32)
    mcos, msin = mrope_cos_sin(ours.rotary, pos.expand(3, -1), ours.multimodal.mrope_section, torch.float32)
    assert torch.equal(cos, mcos) and torch.equal(sin, msin)
    assert frequency_axes(8, (3, 3, 2)).tolist() == [0, 1, 2, 0, 1, 2, 0, 1]


def test_split_prefill_through_an_image_equals_one_pass(ours, vision_ckpt):
    """Chunks may split an image span: each pass takes its rows of the embeddings and positions."""
    inputs = _hf_inputs(vision_ckpt, 2)
    ids = inputs["input_ids"][0].tolist()
    images, media = _media(ours, ids, 2)
    whole = ours.forward_tokens(ids, kv_profile=F32, media=media)[-1]

    class _Lane:  # what LaneVision reads of a lane
        pass

    lane = _Lane()
    lane.request = type("R", (), {"media": images})()
    lane.n_prompt, lane.pos = len(ids), 0
    vision = LaneVision.build(ours, lane)
    cut = images[1].begin + 3  # inside the second image
    n_pages = (len(ids) + 63) // 64
    kv = ours.new_kv_storage(F32, n_pages)
    states = ours.new_state_slots(1)
    ours.prefill(ids[:cut], 0, list(range(n_pages)), 0, kv, states, media=vision.pass_media(0, cut))
    out = ours.prefill(ids[cut:], cut, list(range(n_pages)), 0, kv, states, media=vision.pass_media(cut, len(ids)))
    assert rel_err(out.logits, whole) <= BOUND
    assert not vision.embeds  # dropped once the prompt is through


def test_fit_size_follows_the_pixel_bounds():
    cfg = ImageProcessorConfig(patch_size=8, merge_size=2, min_pixels=256, max_pixels=4096)
    assert fit_size(30, 40, cfg) == (32, 32)
    h, w = fit_size(1000, 3000, cfg)
    assert h % 16 == 0 and w % 16 == 0 and h * w <= 4096
    h, w = fit_size(5, 7, cfg)
    assert h * w >= 256


def test_text_only_prompt_on_the_multimodal_checkpoint(vision_ckpt, ours):
    """No images: the text path as before (1-D rotary, no tower), equal to transformers."""
    ids = torch.randint(0, 250, (90,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = vision_ckpt.model(input_ids=ids[None]).logits[0]
    assert rel_err(ours.forward_tokens(ids, kv_profile=F32), ref) <= BOUND
