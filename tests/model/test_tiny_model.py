"""The trained embedded default ``builtin:tiny`` (docs/tiny-model.md): shipped inside the package as
a HF checkpoint directory, loaded offline through the checkpoint loader, answering in printable
text, with trained MTP / DFlash / DFlash2 drafters that accept drafts and keep greedy output."""

from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from hpc_cli.engine.api import GenerationRequest, SamplingParams
from hpc_cli.engine.engine import Engine
from hpc_cli.model.builtin import TINY_DIR, builtin_config
from hpc_cli.model.loader import load_checkpoint
from hpc_cli.model.model import HybridModel
from hpc_cli.model.tokenizer import HFTokenizer

ROOT = Path(__file__).resolve().parents[2]
QUESTION = "What does json.dumps do?"


@pytest.fixture(scope="module")
def tiny():
    return HybridModel.from_name_or_path("builtin:tiny", dtype=torch.float32, device="cpu", progress=False)


def _prompt(model, question: str = QUESTION) -> list[int]:
    text = model.tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                               enable_thinking=False)
    return model.tokenizer.encode(text)


def _generate(model, spec: str | None, prompt: list[int], max_tokens: int = 40):
    e = Engine(model, kv_pages=16, max_concurrency=1, reuse=False, speculative=spec, num_draft_tokens=3).start()
    try:
        toks, fin = e.generate(GenerationRequest(list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0)))
    finally:
        e.stop()
    return [getattr(t, "token_id", t) for t in toks], fin


def test_shipped_files_are_a_hf_checkpoint_directory():
    names = {p.relative_to(TINY_DIR).as_posix() for p in TINY_DIR.rglob("*") if p.is_file()}
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors",
            "dflash/config.json", "dflash/model.safetensors", "dflash2/config.json",
            "dflash2/model.safetensors"} <= names
    assert (TINY_DIR / "model.safetensors").stat().st_size <= 20 << 20
    cfg = json.loads((TINY_DIR / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5_text" and cfg["mtp_num_hidden_layers"] == 1
    assert cfg["layer_types"] == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 \
        + ["full_attention"]
    assert "chat_template" in json.loads((TINY_DIR / "tokenizer_config.json").read_text())


def test_package_data_carries_the_model():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["hpc_cli.model"]
    for f in TINY_DIR.rglob("*"):
        if f.is_file():
            rel = f.relative_to(TINY_DIR.parent).as_posix()
            assert any(Path(rel).match(p) for p in data), f"{rel} is not package data"


def test_loads_offline_through_the_checkpoint_loader(tiny, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    direct = load_checkpoint(TINY_DIR, dtype=torch.float32, progress=False)
    assert tiny.config.name == builtin_config("builtin:tiny").name == "builtin:tiny"
    assert isinstance(tiny.tokenizer, HFTokenizer) and tiny.mtp is not None
    assert tiny.lm_head.weight is tiny.embed_tokens.weight  # tied, as config.json says
    for (n, a), (_, b) in zip(tiny.state_dict().items(), direct.state_dict().items()):
        assert torch.equal(a, b), n
    tok = tiny.tokenizer
    for special in ("<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|endoftext|>"):
        assert tok.encode(special) == [tok.token_to_id(special)]
    assert tok.token_to_id("<|im_end|>") in tok.eos_token_ids
    with pytest.raises(Exception, match="takes no layer count"):
        builtin_config("builtin:tiny@4")


def test_answers_in_printable_text(tiny):
    ids, fin = _generate(tiny, None, _prompt(tiny))
    text = tiny.tokenizer.decode(ids, skip_special=True).strip()
    assert fin.reason == "stop"
    assert text.isprintable() and len(text.split()) >= 4, text
    assert "JSON" in text, text


def test_training_forward_matches_the_runtime(tiny):
    sys.path.insert(0, str(ROOT / "scripts"))
    import train_tiny

    toks = torch.tensor([_prompt(tiny) + _prompt(tiny, "What is the base64 module for?")])
    ref = tiny.forward_tokens(toks[0]).float()
    train_tiny.ROUND_KV = True  # the runtime's bf16 KV pages round K and V
    try:
        with torch.no_grad():
            h, _ = train_tiny.forward(tiny, toks)
    finally:
        train_tiny.ROUND_KV = False
    assert (tiny.lm_head(h)[0].float() - ref).abs().max().item() < 1e-3


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
@pytest.mark.parametrize("anchor", [False, True], ids=["shipped", "anchor-drafts"])
def test_block_drafter_training_forward_matches_the_runtime(tiny, kind, anchor):
    """The block drafters' training forward (scripts/train_tiny.py) drafts what the runtime's
    proposal drafts, every drafting column: the shipped drafters, and an anchor-drafting one (its
    block one column shorter, its first column reading the hidden before the block) started from
    the MTP head as the training script starts it. The runtime keeps the context K/V in bf16."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import _check_drafters
    import train_tiny

    from hpc_cli.speculative.dflash import DFlashNet, default_config, load_drafter, seed_weights

    if anchor:
        cfg = default_config(kind, tiny, 1)
        cfg.anchor_drafts = True
        net = DFlashNet(cfg, dtype=torch.float32)
        seed_weights(net, 5)
        train_tiny.init_anchor_from_mtp(net, tiny)
    else:
        net = load_drafter(str(TINY_DIR / kind), kind, "cpu", torch.float32)
    toks = torch.tensor([_prompt(tiny) + _prompt(tiny, "What is the base64 module for?")])
    p = toks.shape[1] - 9
    diff, scale = _check_drafters.block_against_runtime(tiny, net, toks, p, 3)
    assert diff < 0.01 * scale, (diff, scale)


@pytest.mark.parametrize("spec", ["mtp", "dflash", "dflash2"])
def test_trained_drafters_accept_and_keep_greedy_output(tiny, spec):
    prompt = _prompt(tiny)
    ref, _ = _generate(tiny, None, prompt)
    got, fin = _generate(tiny, spec, prompt)
    assert got == ref
    assert fin.usage.accepted_draft_tokens > 0, fin.usage


def test_drafter_chat_data_holds_out_the_benchmark_questions():
    """The drafters' chat data (scripts/train_tiny.py --chat-answers) leaves out every conversation
    about an object the speculative benchmark asks about; a prompt ends where the answer starts
    (the generation prompt with the closed reasoning block) and an answer row starts at position 0."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import train_tiny

    questions = train_tiny.benchmark_questions()
    assert "What does json.dumps do?" in questions
    tpl = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n{}<|im_end|>\n"
    chats = [("json.dumps", "What does json.dumps do?"), ("json.dumps", "Explain json.dumps."),
             ("base64", "Tell me about base64."), ("json.loads", "Explain json.loads.")]
    records = [{"kind": "chat", "name": n, "split": "train", "text": tpl.format(q, "a")} for n, q in chats]
    records.append({"kind": "doc", "name": "json.loads", "split": "train", "text": "json.loads\n\nDeserialize."})
    held = train_tiny.held_out(records, questions)
    assert held == {"json.dumps", "base64"}
    kept = [r for r in records if not (r["kind"] == "chat" and r["name"] in held)]
    prompts = train_tiny.chat_prompts(kept, "train", 10, 0)
    assert prompts == ["<|im_start|>user\nExplain json.loads.<|im_end|>\n"
                       "<|im_start|>assistant\n<think>\n\n</think>\n\n"]
    rows, spans = train_tiny.answer_rows([[1, 2, 3], [4, 5], [6]], [[7, 8, 9], [10], [11, 12]], 4)
    assert rows.tolist() == [[1, 2, 3, 7, 8], [6, 11, 12, 12, 12]]  # [4, 5] + [10]: nothing to draft
    assert spans.tolist() == [[3, 5], [1, 3]]


@pytest.mark.parametrize("every", [0.0, 1e-9])
def test_drafter_training_exports_checkpoints_as_it_goes(tiny, every):
    """``scripts/train_tiny.py --checkpoint-every S``: the drafter phase hands its step to the
    checkpoint callback every S seconds (here: between every two steps), and never with 0."""
    from types import SimpleNamespace

    from hpc_cli.speculative.dflash import DFlashNet, default_config

    sys.path.insert(0, str(ROOT / "scripts"))
    import train_tiny

    nets = {}
    for kind in ("dflash", "dflash2"):
        nets[kind] = DFlashNet(default_config(kind, tiny, 1), dtype=torch.float32)
        train_tiny.init_weights(nets[kind], 1)
    rows = torch.randint(0, 6000, (4, 65), generator=torch.Generator().manual_seed(0))
    args = SimpleNamespace(no_mtp=True, draft_lr=1e-3, draft_steps=3, draft_seconds=1e9, block_sizes=[3],
                           anchors=4, batch=2, log_every=100, corpus_every=0, checkpoint_every=every)
    steps: list[int] = []
    report: dict = {}
    try:
        train_tiny.train_drafters(tiny, nets, {"train": rows, "val": rows}, args, torch.device("cpu"), report,
                                  steps.append)
    finally:
        for p in tiny.parameters():
            p.requires_grad_(False)
    assert report["drafters"]["steps"] == 3
    assert steps == ([] if every == 0 else [1, 2]), steps


def test_validation_answers_need_a_trained_model(tmp_path):
    """``train_tiny.py --val-answers N`` (the drafters measured on the model's own answers, also
    without ``--chat-answers``) answers with the ``--init-from`` model: without one it is a usage
    error before any data is read."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import train_tiny

    with pytest.raises(SystemExit) as err:
        train_tiny.main(["--val-answers", "4", "--data", str(tmp_path / "none"), "--out", str(tmp_path / "out")])
    assert err.value.code == 2
    assert not (tmp_path / "out").exists()
