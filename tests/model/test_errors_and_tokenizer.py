"""Clear ModelErrors for bad checkpoints; the byte and HF tokenizers and chat templates."""

from __future__ import annotations

import json

import pytest
import torch

from hpc_cli.errors import HpcError, ModelError
from hpc_cli.model import HybridModel
from hpc_cli.model.tokenizer import ByteTokenizer, HFTokenizer, IncrementalDecoder

from .helpers import rewrite_checkpoint


def _load(path):
    return HybridModel.from_name_or_path(str(path), dtype=torch.float32, progress=False)


def test_not_a_directory(tmp_path):
    with pytest.raises(ModelError, match="not a directory") as info:
        _load(tmp_path / "nope")
    assert isinstance(info.value, HpcError) and info.value.hint


def test_no_config(tmp_path):
    with pytest.raises(ModelError, match="no config.json"):
        _load(tmp_path)


def test_bad_json(tmp_path):
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(ModelError, match="cannot read JSON"):
        _load(tmp_path)


def test_unknown_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    with pytest.raises(ModelError, match="unknown model_type 'llama'"):
        _load(tmp_path)


def test_no_weights(hf_dense, tmp_path):
    _, src = hf_dense
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    with pytest.raises(ModelError, match="no \\*.safetensors"):
        _load(tmp_path)


def test_missing_tensor_is_named(hf_dense, tmp_path):
    _, src = hf_dense
    path = rewrite_checkpoint(src, tmp_path / "c", drop="model.layers.2.linear_attn.in_proj_z.weight")
    with pytest.raises(ModelError, match=r"layers\.2\.linear_attn\.in_proj_z\.weight.* is missing"):
        _load(path)


def test_mis_shaped_tensor_is_named(hf_dense, tmp_path):
    _, src = hf_dense
    path = rewrite_checkpoint(src, tmp_path / "c", reshape="model.layers.1.self_attn.k_proj.weight")
    with pytest.raises(ModelError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight .*shape \(64, 63\).*\(64, 64\)"):
        _load(path)


def test_missing_expert_is_named(hf_moe, tmp_path):
    _, src = hf_moe
    path = rewrite_checkpoint(src, tmp_path / "c", drop="model.layers.3.mlp.experts.5.up_proj.weight")
    with pytest.raises(ModelError, match=r"layers\.3\.mlp\.experts\.5\.up_proj\.weight is missing"):
        _load(path)


def test_unknown_builtin():
    with pytest.raises(ModelError, match="unknown built-in model"):
        HybridModel.from_name_or_path("builtin:huge")


def test_builtin_shapes_have_real_widths():
    from hpc_cli.model.builtin import builtin_config
    from hpc_cli.shapes import PRESETS

    for name, preset in (("qwen3.5-27b-shape", "qwen3.5-27b"), ("qwen3.5-35b-a3b-shape", "qwen3.5-35b-a3b")):
        cfg = builtin_config(f"builtin:{name}@{PRESETS[preset].num_layers}")
        shape = cfg.shape()
        ref = PRESETS[preset]
        assert shape.state_image_bytes() == ref.state_image_bytes(), name
        assert (shape.num_kv_heads, shape.head_dim, shape.hidden_size) == (ref.num_kv_heads, ref.head_dim, ref.hidden_size)
    assert builtin_config("builtin:qwen3.5-27b-shape").num_hidden_layers == 8


def test_byte_tokenizer_round_trip_and_specials():
    tok = ByteTokenizer()
    text = "héllo <think>x</think><|im_end|>"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.special_tokens["<|im_end|>"] in ids and tok.special_tokens["<think>"] in ids
    assert tok.decode(ids, skip_special=True) == "héllo x"
    assert set(tok.eos_token_ids) == {tok.special_tokens["<|im_end|>"], tok.special_tokens["<|endoftext|>"]}
    dec = IncrementalDecoder(tok)
    assert "".join(dec.push(i) for i in ids) == text


def test_byte_chat_template_thinking():
    tok = ByteTokenizer()
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "<think>\nr1\n</think>\n\nb"},
            {"role": "user", "content": "c"}]
    out = tok.apply_chat_template(msgs)
    assert out == ("<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\nb<|im_end|>\n"
                   "<|im_start|>user\nc<|im_end|>\n<|im_start|>assistant\n<think>\n")
    assert tok.apply_chat_template(msgs[:1], enable_thinking=False).endswith("<think>\n\n</think>\n\n")
    last = tok.apply_chat_template(msgs[:2], add_generation_prompt=False)
    assert last.endswith("<|im_start|>assistant\n<think>\nr1\n</think>\n\nb<|im_end|>\n")


def test_hf_tokenizer_and_template_files(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "<|im_start|>": 3, "<|im_end|>": 4, "user": 5}
    t = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    t.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "chat_template": "{% for m in messages %}<|im_start|>{{ m.role }} "
                                                    "{{ m.content }}<|im_end|>{% endfor %}"}))
    tok = HFTokenizer(tmp_path)
    assert tok.encode("hello world") == [1, 2]
    assert tok.eos_token_ids == [4]
    assert tok.apply_chat_template([{"role": "user", "content": "hello"}]) == "<|im_start|>user hello<|im_end|>"
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0].content }}!")
    assert HFTokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "x"}]) == "x!"


def _bpe_dir(tmp_path, marker_opts=None):
    """A byte-level BPE trained on a little text, ChatML specials added (as Qwen's tokenizers)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    t.train_from_iterator(["the quick brown fox jumps over the lazy dog\n\n" * 20, "héllo wörld, 123 (x)"], trainer)
    t.add_special_tokens([AddedToken("<|im_start|>", **(marker_opts or {})), "<|im_end|>"])
    t.save(str(tmp_path / "tokenizer.json"))
    return tmp_path


def test_hf_tokenizer_segments_equal_whole_encoding(tmp_path):
    """A prompt tokenized in pieces cut at each message start (pieces kept by their text) gives the
    ids and character spans of the one-piece tokenization; a repeated history hits the kept pieces."""
    import random

    tok = HFTokenizer(_bpe_dir(tmp_path))
    assert tok._segments is not None, "ChatML start marker not used to cut prompts"
    rng = random.Random(3)
    words = ["the", "quick", " brown", "fox\n\n", "  ", "héllo", "wörld,", "<|im_start|>", "<|im_end|>", "\n",
             "123", "(x)", "\t", "dog"]
    for _ in range(300):
        text = "".join(rng.choice(words) for _ in range(rng.randint(0, 120)))
        whole = tok._tok.encode(text, add_special_tokens=False)
        assert tok.encode_offsets(text) == (whole.ids, whole.offsets), repr(text)
    history = "<|im_start|>system\n" + "the quick brown fox " * 30 + "<|im_end|>\n"
    tok.encode(history + "<|im_start|>user\nhello<|im_end|>\n")
    hits = tok._segments.hits
    tok.encode(history + "<|im_start|>user\nhello<|im_end|>\n<|im_start|>user\nmore dogs please<|im_end|>\n")
    assert tok._segments.hits >= hits + 2, "the repeated history was tokenized again"


def test_token_spans_by_piece_answer_as_the_whole_spans(tmp_path):
    """Where a token starts (every earlier one ended) and how many end by an offset: looked up in
    the kept pieces, the answers equal those over the whole tokenization's spans, at every
    character of random prompts."""
    import bisect
    import itertools
    import random

    tok = HFTokenizer(_bpe_dir(tmp_path))
    rng = random.Random(5)
    words = ["the", " quick", "fox\n\n", "  ", "héllo", "<|im_start|>", "<|im_end|>", "\n", "123", "dog"]
    for _ in range(60):
        text = "".join(rng.choice(words) for _ in range(rng.randint(1, 80)))
        ids, spans = tok.encode_spans(text)
        whole = tok._tok.encode(text, add_special_tokens=False)
        assert ids == whole.ids
        starts = [a for a, _ in whole.offsets]
        ends = list(itertools.accumulate((b for _, b in whole.offsets), max))
        for c in range(len(text) + 1):
            i = bisect.bisect_left(starts, c)
            expect = i if i < len(starts) and starts[i] == c and (i == 0 or ends[i - 1] <= c) else None
            assert spans.token_at(c) == expect, (text, c)
            assert spans.tokens_ending_by(c) == bisect.bisect_right(ends, c), (text, c)


def test_hf_tokenizer_no_segments_when_marker_strips(tmp_path):
    """A start marker that strips whitespace around it changes its neighbours' tokens: no pieces."""
    tok = HFTokenizer(_bpe_dir(tmp_path, {"lstrip": True}))
    assert tok._segments is None
    assert tok.encode("a  <|im_start|>b") == tok._tok.encode("a  <|im_start|>b", add_special_tokens=False).ids


def test_byte_tokenizer_spans():
    """encode_offsets: the ids of encode, each byte spanning its character, a special its text."""
    tok = ByteTokenizer()
    text = "aé<|im_start|>b\u20ac\n"
    ids, spans = tok.encode_offsets(text)
    assert ids == tok.encode(text)
    assert spans == [(0, 1), (1, 2), (1, 2), (2, 14), (14, 15), (15, 16), (15, 16), (15, 16), (16, 17)]
    assert all(text[a:b] for a, b in spans)
