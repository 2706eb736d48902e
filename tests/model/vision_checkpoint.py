"""A tiny multimodal Qwen3.5 checkpoint written by transformers itself (the vision oracle).

``write_vision_checkpoint(path)`` builds a ``Qwen3_5ForConditionalGeneration`` from
transformers' own config classes (tiny ``text_config`` and ``vision_config``), a byte-level
tokenizer with the Qwen vision specials and a Qwen3-VL-style chat template, and the
``Qwen3VLProcessor`` over them (``Qwen2VLImageProcessorPil`` + that tokenizer), and
``save_pretrained``s model and processor into ``path``. Images are made in code
(:func:`make_image`); nothing is downloaded.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
            "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]

#: Qwen3-VL's way of rendering content parts (an image part becomes the vision placeholder)
CHAT_TEMPLATE = r"""
{%- macro render(content) -%}
  {%- if content is string -%}{{- content -}}
  {%- else -%}
    {%- for item in content -%}
      {%- if item.type == 'image' or 'image' in item or 'image_url' in item -%}
        {{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
      {%- elif 'text' in item -%}{{- item.text -}}
      {%- endif -%}
    {%- endfor -%}
  {%- endif -%}
{%- endmacro -%}
{%- for m in messages -%}
  {{- '<|im_start|>' + m.role + '\n' + render(m.content) + '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\n' -}}
  {%- if enable_thinking is defined and not enable_thinking -%}{{- '<think>\n\n</think>\n\n' -}}
  {%- else -%}{{- '<think>\n' -}}{%- endif -%}
{%- endif -%}"""

#: the image processor's pixel bounds: images land on small grids (patch 8, merge 2)
MIN_PIXELS = 16 * 16
MAX_PIXELS = 64 * 64


@dataclass
class VisionCheckpoint:
    path: Path
    model: Any  # transformers Qwen3_5ForConditionalGeneration (eval, fp32)
    processor: Any  # transformers Qwen3VLProcessor

    def token_id(self, token: str) -> int:
        return self.processor.tokenizer.convert_tokens_to_ids(token)


def _tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(byte_chars))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _processor_class():
    from transformers import Qwen3VLProcessor

    class ImageTextProcessor(Qwen3VLProcessor):
        """Qwen3VLProcessor without its video processor (that one needs torchvision)."""

        @classmethod
        def get_attributes(cls):
            return ["image_processor", "tokenizer"]

    return ImageTextProcessor


def _processor(**kwargs):
    return _processor_class()(**kwargs)


def _perturb(model) -> None:
    # HF initialises the (1 + w) norms at zero and the layer norms at one; perturb them so the
    # norm forms are actually tested, and give the vision position table some scale.
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or "dt_bias" in n or "pos_embed" in n:
                p.add_(torch.randn(p.shape, generator=g) * 0.2)


def write_vision_checkpoint(path: Path) -> VisionCheckpoint:
    from transformers import Qwen2VLImageProcessorPil, Qwen3_5Config, Qwen3_5ForConditionalGeneration

    path = Path(path)
    tokenizer = _tokenizer()
    ids = {s: tokenizer.convert_tokens_to_ids(s) for s in SPECIALS}
    text = dict(vocab_size=300, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                head_dim=64, intermediate_size=96, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=16, linear_value_head_dim=16,
                layer_types=["linear_attention", "full_attention"] * 2,
                rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.25,
                                 "mrope_section": [3, 3, 2], "mrope_interleaved": True},
                eos_token_id=ids["<|im_end|>"])
    vision = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, patch_size=8, temporal_patch_size=2,
                  spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=36)
    cfg = Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                        vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(0)
    model = Qwen3_5ForConditionalGeneration(cfg).eval()
    _perturb(model)
    images = Qwen2VLImageProcessorPil(patch_size=8, temporal_patch_size=2, merge_size=2,
                                      size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS})
    processor = _processor(image_processor=images, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return VisionCheckpoint(path, model, processor)


def make_image(width: int, height: int, seed: int, fmt: str = "PNG", mode: str = "RGB") -> bytes:
    """An image with structure (gradients plus seeded noise), encoded as ``fmt``."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([(x * 255 // max(1, width - 1)), (y * 255 // max(1, height - 1)),
                     ((x + y) * 127 // max(1, width + height - 2))], axis=-1)
    noise = rng.integers(0, 64, size=(height, width, 3))
    arr = np.clip(base + noise, 0, 255).astype("uint8")
    img = Image.fromarray(arr, "RGB")
    if mode != "RGB":
        img = img.convert(mode)
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()
