"""Train the embedded default model ``builtin:tiny``, its MTP head and its DFlash / DFlash2 drafters.

    python scripts/tiny_corpus.py --out .tiny-data                      # corpus + BPE tokenizer (CPU, seconds)
    python scripts/train_tiny.py --data .tiny-data --out /tmp/tiny      # train (GPU: a few minutes)

The model is a Qwen3.5 dense text model (``qwen3_5_text``): 8 layers in the 3:1 pattern (three
Gated DeltaNet layers, then one gated full-attention layer), hidden 256, tied embeddings, a
6144-token byte-level BPE vocabulary and one MTP layer. It is built from the runtime's own
modules (:class:`hpc_cli.model.model.HybridModel`) and trained through a batched forward over
those same parameters (:func:`forward`), which :func:`check_against_runtime` compares with the
runtime's prefill on the exported checkpoint.

Phase 1 trains the model (next-token loss, AdamW, cosine schedule; bf16 autocast on CUDA). Phase
2 freezes it and trains the MTP head and the two block drafters on its own greedy predictions
(self-distillation: the label of a draft is the model's argmax at that column), which is what
speculative decoding accepts. Writes to ``--out``: ``tiny/`` (config.json, tokenizer.json,
tokenizer_config.json, model.safetensors, dflash/, dflash2/ in the formats ``--drafter`` reads)
and ``report.json`` (losses, curve, seed, data hashes, timings).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import math
import os
import random
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hpc_cli.model.config import ModelConfig  # noqa: E402
from hpc_cli.model.gdn import chunk_rule  # noqa: E402
from hpc_cli.model.layers import Rotary  # noqa: E402
from hpc_cli.model.model import HybridModel  # noqa: E402
from hpc_cli.model.tokenizer import BYTE_CHAT_TEMPLATE  # noqa: E402
from hpc_cli.speculative.dflash import DFlashNet, default_config, save_drafter  # noqa: E402

SEED = 20260511
_THINK_BRANCH = """  {%- if enable_thinking is defined and not enable_thinking -%}
    {{- '<think>\\n\\n</think>\\n\\n' -}}
  {%- else -%}
    {{- '<think>\\n' -}}
  {%- endif -%}"""
#: the shipped chat template: the Qwen3.5 template whose generation prompt always closes the
#: reasoning block (the model never learnt to reason; its training text has the empty block
#: ``<think>\n\n</think>\n\n`` before every answer, tokenized as the prompt ends here)
TINY_CHAT_TEMPLATE = BYTE_CHAT_TEMPLATE.replace(_THINK_BRANCH, """  {{- '<think>\\n\\n</think>\\n\\n' -}}""")
assert TINY_CHAT_TEMPLATE != BYTE_CHAT_TEMPLATE


def tiny_config(vocab: int, eos: list[int]) -> ModelConfig:
    return ModelConfig(
        name="builtin:tiny", model_type="qwen3_5", vocab_size=vocab, hidden_size=256, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=512,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
        max_position_embeddings=32768, eos_token_id=eos, mtp_num_hidden_layers=1, tie_word_embeddings=True)


def hf_config(cfg: ModelConfig) -> dict:
    """config.json as ``Qwen3_5ForCausalLM.save_pretrained`` lays it out (flat text config)."""
    return {
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "intermediate_size": cfg.intermediate_size, "rms_norm_eps": cfg.rms_norm_eps,
        "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": True,
        "max_position_embeddings": cfg.max_position_embeddings, "layer_types": list(cfg.layer_types),
        "full_attention_interval": 4, "linear_conv_kernel_dim": cfg.linear_conv_kernel_dim,
        "linear_key_head_dim": cfg.linear_key_head_dim, "linear_value_head_dim": cfg.linear_value_head_dim,
        "linear_num_key_heads": cfg.linear_num_key_heads, "linear_num_value_heads": cfg.linear_num_value_heads,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta,
                            "partial_rotary_factor": cfg.partial_rotary_factor},
        "mtp_num_hidden_layers": cfg.mtp_num_hidden_layers, "eos_token_id": list(cfg.eos_token_id),
        "bos_token_id": None, "pad_token_id": cfg.eos_token_id[-1], "torch_dtype": "bfloat16",
    }


# ---------------------------------------------------------------------------------------- data
def load_data(data: Path, seq: int, chat_only: bool = False, tokenizer: Path | None = None,
              hold_out: tuple[str, ...] = ()):
    """The corpus packed into rows; ``tokenizer`` (default: the data's own) encodes it; chat
    examples that contain a ``hold_out`` question, and every other chat example about the same
    objects, are left out (:func:`held_out`)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer or data / "tokenizer.json"))
    records = [json.loads(line) for line in gzip.open(data / "corpus.jsonl.gz")]
    if hold_out:
        names = held_out(records, hold_out)
        records = [r for r in records if not (r["kind"] == "chat" and r["name"] in names)]
    if chat_only:
        records = [r for r in records if r["kind"] == "chat"]
    eot = tok.token_to_id("<|endoftext|>")
    out = {}
    for split in ("train", "val"):
        texts = [r["text"] for r in records if r["split"] == split]
        rng = random.Random(SEED + (split == "val"))
        rng.shuffle(texts)
        ids = [e.ids + [eot] for e in tok.encode_batch(texts, add_special_tokens=False)]
        out[split] = pack(ids, seq)
    return tok, out, records


def benchmark_questions() -> tuple[str, ...]:
    """The chat questions benchmarks/spec_decode.py measures acceptance on (its CHAT_QUESTIONS)."""
    import ast

    src = (Path(__file__).resolve().parents[1] / "benchmarks" / "spec_decode.py").read_text()
    for node in ast.parse(src).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "CHAT_QUESTIONS" for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    raise LookupError("CHAT_QUESTIONS not found in benchmarks/spec_decode.py")


def records_all(data: Path) -> list[dict]:
    return [json.loads(line) for line in gzip.open(data / "corpus.jsonl.gz")]


def held_out(records: list[dict], questions: tuple[str, ...]) -> set[str]:
    """The objects some chat example asks one of ``questions`` about (its user turn is the
    question), and the objects the questions name."""
    import re

    turns = {f"<|im_start|>user\n{q}<|im_end|>" for q in questions}
    names = {r["name"] for r in records if r["kind"] == "chat" and any(t in r["text"] for t in turns)}
    known = {r["name"] for r in records}  # and every object a question names (json.dumps, base64)
    return names | {w for q in questions for w in re.findall(r"[A-Za-z_][\w.]*\w", q) if w in known}


#: where a chat example's first answer starts: the generation prompt with the closed reasoning block
_ANSWER = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
#: the draw of the chat prompts the model answers (--chat-answers, --val-answers); benchmarks/
#: spec_decode.py --chat-data draws the validation split's with it, so both ask the same prompts
CHAT_PROMPT_SEED = SEED + 13


def chat_prompts(records: list[dict], split: str, n: int, seed: int) -> list[str]:
    """``n`` distinct first-turn chat prompts of ``split`` (system prompt kept where there is one),
    each ending in the generation prompt the shipped template renders (thinking closed), as a chat
    request to the model starts; drawn in a seeded order."""
    seen, out = set(), []
    for r in records:
        if r["kind"] != "chat" or r["split"] != split:
            continue
        text = r["text"].replace("<|im_start|>assistant\n<think>\n</think>\n\n", _ANSWER)
        text = text.replace("<|im_start|>assistant\n<think>\n\n</think>\n\n", _ANSWER)
        i = text.find(_ANSWER)
        if i < 0:
            continue
        prompt = text[:i + len(_ANSWER)]
        if prompt not in seen:
            seen.add(prompt)
            out.append(prompt)
    random.Random(seed).shuffle(out)
    return out[:n]


def greedy_answers(model_dir: Path, prompts: list[list[int]], max_new: int, lanes: int = 8,
                   device: str = "cpu") -> list[list[int]]:
    """The model's greedy answer to each prompt, decoded by the serving engine (the checkpoint in
    ``model_dir`` loaded as ``hpc-cli serve --model`` loads it, fp32, on ``device``, ``lanes``
    requests at a time): the answer up to its end-of-turn token (included) or ``max_new`` tokens,
    the tokens a chat request's draft rounds see."""
    from hpc_cli.engine.api import GenerationRequest, SamplingParams
    from hpc_cli.engine.engine import Engine

    m = HybridModel.from_name_or_path(str(model_dir), dtype=torch.float32, device=device)
    longest = max(len(p) for p in prompts) + max_new
    e = Engine(m, kv_pages=lanes * (-(-(longest + 64) // 64)) + 8, prefill_chunk=512, max_concurrency=lanes,
               reuse=False).start()
    sp = SamplingParams(max_tokens=max_new, temperature=0.0)
    out = []
    try:
        for i in range(0, len(prompts), lanes):
            handles = [e.submit(GenerationRequest(list(p), sp)) for p in prompts[i:i + lanes]]
            for h in handles:
                toks, fin = h.result(timeout=3600)
                assert fin.reason in ("stop", "length"), (fin.reason, fin.error)
                out.append([t.token_id for t in toks])
    finally:
        e.stop()
    return out


def answer_rows(prompts: list[list[int]], answers: list[list[int]], seq: int):
    """One conversation per row (position 0 is its first token, as in a served request): ``[B,
    seq + 1]`` tokens (the end repeats the last token) and ``[B, 2]`` spans: the position of the
    answer's first token and the row's length."""
    rows, spans = [], []
    for p, a in zip(prompts, answers):
        t = (p + a)[:seq + 1]
        if len(t) - len(p) < 2:  # a draft block needs an answer token to draft from and one to draft
            continue
        rows.append(t + [t[-1]] * (seq + 1 - len(t)))
        spans.append([len(p), len(t)])
    return torch.tensor(rows, dtype=torch.long), torch.tensor(spans, dtype=torch.long)


def pack(docs: list[list[int]], seq: int) -> torch.Tensor:
    """Rows of ``seq + 1`` tokens, each starting at a document start (a conversation begins at
    position 0, as served traffic does); a document longer than a row fills rows of its own; a
    row's unused end repeats the end-of-text token."""
    n = seq + 1
    rows, cur = [], []
    for d in docs:
        if cur and len(cur) + len(d) > n:
            rows.append(cur)
            cur = []
        while len(d) > n:
            rows.append(d[:n])
            d = d[n:]
        cur = cur + d
    if cur:
        rows.append(cur)
    return torch.tensor([r + [r[-1]] * (n - len(r)) for r in rows], dtype=torch.long)


# ---------------------------------------------------------------------------------------- model
def init_weights(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    n_layers = model.config.num_hidden_layers if hasattr(model, "config") else len(model.layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(1.0, 16.0, generator=gen).log())
            elif name.endswith("dt_bias"):
                p.fill_(1.0)
            elif name.endswith("linear_attn.norm.weight"):
                p.fill_(1.0)  # plain-weight gated norm
            elif name.endswith("norm.weight") or "norm_" in name.rsplit(".", 2)[-2]:
                p.zero_()  # zero-centred (1 + w) norms
            elif name.endswith("conv1d.weight"):
                p.copy_(torch.empty(p.shape).uniform_(-1, 1, generator=gen) / math.sqrt(p.shape[-1]))
            else:
                std = 0.02
                if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
                    std /= math.sqrt(2 * n_layers)
                p.copy_(torch.randn(p.shape, generator=gen) * std)


_FLA = None


def _fla_chunk():
    """fla's chunk kernel when it imports and its backward runs here, else None (torch chunk rule)."""
    global _FLA
    if _FLA is not None:
        return _FLA or None
    _FLA = False
    if not torch.cuda.is_available():
        return None
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        q, k, v = (torch.randn(2, 128, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for _ in range(3))
        g = (-torch.rand(2, 128, 4, device="cuda")).requires_grad_()
        b = torch.rand(2, 128, 4, device="cuda", dtype=torch.bfloat16).requires_grad_()
        o, _ = chunk_gated_delta_rule(q=q, k=k, v=v, g=g, beta=b, use_qk_l2norm_in_kernel=True)
        ref, _ = chunk_rule(q, k, v, g, b, None)
        err = (o.float() - ref.float()).abs().max().item()
        o.float().sum().backward()
        assert err < 0.05, err
        _FLA = chunk_gated_delta_rule
        print(f"gdn: fla chunk kernel (max diff vs torch {err:.4f})", flush=True)
    except Exception as exc:  # noqa: BLE001
        print(f"gdn: torch chunk rule ({type(exc).__name__}: {exc})", flush=True)
    return _FLA or None


def gdn_forward(la, x: torch.Tensor) -> torch.Tensor:
    """A GatedDeltaNet layer over ``x`` ``[B, T, H]`` from a zero state (training form of ``prefill``)."""
    B, T, _ = x.shape
    mixed, z, b, a = la._project(x)
    w = la.conv1d.weight
    conv = F.conv1d(F.pad(mixed.transpose(1, 2), (la.kernel - 1, 0)).to(w.dtype), w, groups=la.conv_dim)
    mixed = F.silu(conv).to(mixed.dtype).transpose(1, 2)
    q, k, v, g, beta = la._heads(mixed, b, a, (B, T))
    fla = _fla_chunk() if x.is_cuda else None
    if fla is not None:
        rep = la.n_v // la.n_k
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
        dt = torch.bfloat16
        core, _ = fla(q=q.to(dt).contiguous(), k=k.to(dt).contiguous(), v=v.to(dt).contiguous(), g=g.float(),
                      beta=beta.to(dt), use_qk_l2norm_in_kernel=True)
    else:
        core, _ = chunk_rule(q, k, v, g, beta, None)
    return la._finish(core.to(z.dtype), z)


#: round K and V to bf16 as the runtime's bf16 KV pages store them (the runtime check sets it)
ROUND_KV = False


def attn_forward(attn, x: torch.Tensor, cos, sin) -> torch.Tensor:
    """Gated causal attention over ``x`` ``[B, T, H]``; ``cos, sin`` ``[B*T, r]``."""
    B, T, H = x.shape
    q, gate, k, v = attn.qkv(x.reshape(B * T, H), cos, sin)
    if ROUND_KV:
        k, v = k.to(torch.bfloat16).to(k.dtype), v.to(torch.bfloat16).to(v.dtype)
    q = q.view(B, T, attn.n_heads, attn.head_dim).transpose(1, 2)
    k = k.view(B, T, attn.n_kv, attn.head_dim).transpose(1, 2)
    v = v.view(B, T, attn.n_kv, attn.head_dim).transpose(1, 2)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=attn.scale,
                                       enable_gqa=attn.n_heads != attn.n_kv)
    return attn.finish(o.transpose(1, 2).reshape(B * T, attn.n_heads, attn.head_dim), gate).view(B, T, H)


def forward(model: HybridModel, tokens: torch.Tensor, capture=()):
    """``tokens`` ``[B, T]`` -> final-norm hidden ``[B, T, H]`` and the residual stream after each
    layer in ``capture`` (concatenated, DFlash's features)."""
    B, T = tokens.shape
    pos = torch.arange(T, device=tokens.device).repeat(B)
    cos, sin = model.rotary.cos_sin(pos, torch.float32)
    x = F.embedding(tokens, model.embed_tokens.weight)
    feats = []
    for i, layer in enumerate(model.layers):
        h = layer.input_layernorm(x)
        if layer.kind == "linear_attention":
            x = x + gdn_forward(layer.linear_attn, h)
        else:
            x = x + attn_forward(layer.self_attn, h, cos.to(h.dtype), sin.to(h.dtype))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        if i in capture:
            feats.append(x)
    return model.norm(x), (torch.cat(feats, dim=-1) if feats else None)


def mtp_forward(model: HybridModel, next_tokens: torch.Tensor, hidden: torch.Tensor, start: int):
    """The MTP layer over positions ``start ..`` (``next_tokens`` ``[B, T]``: the token after each
    position; ``hidden`` ``[B, T, H]``) -> its final-norm hidden ``[B, T, H]``."""
    mtp = model.mtp
    B, T = next_tokens.shape
    x = mtp.combine(F.embedding(next_tokens, model.embed_tokens.weight), hidden)
    pos = torch.arange(start, start + T, device=x.device).repeat(B)
    cos, sin = model.rotary.cos_sin(pos, x.dtype)
    for layer in mtp.layers:
        x = x + attn_forward(layer.self_attn, layer.input_layernorm(x), cos, sin)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return mtp.norm(x)


def drafter_forward(net: DFlashNet, model: HybridModel, rotary: Rotary, feats: torch.Tensor,
                    tokens: torch.Tensor, anchors: torch.Tensor, k: int,
                    hidden: torch.Tensor | None = None) -> torch.Tensor:
    """DFlash/DFlash2 training forward: ``feats`` ``[B, T, F]``, ``tokens`` ``[B, T]``, ``anchors``
    ``[B, A]`` block starts. Each block is ``[token[p], MASK x k]`` at positions ``p .. p+k`` and
    reads, as ``DFlashDrafter.propose`` does, the context K/V of positions ``< p`` and its own block
    without a causal mask. Returns the final-norm hidden of block columns 1..k ``[B, A, k, H]``.
    With ``anchor_drafts`` the block is ``[token[p], MASK x (k - 1)]``, its first column also reads
    ``hidden`` (the model's final-norm hidden ``[B, T, H]``) at ``p - 1``, and all ``k`` columns
    draft."""
    cfg = net.cfg
    B, T, _ = feats.shape
    A = anchors.shape[1]
    dev = feats.device
    C = k if cfg.anchor_drafts else k + 1  # block columns
    ctx = net.hidden_norm(net.fc(feats))  # [B, T, H]
    pos_c = torch.arange(T, device=dev).repeat(B)
    cos_c, sin_c = rotary.cos_sin(pos_c, ctx.dtype)
    bpos = (anchors[:, :, None] + torch.arange(C, device=dev)).reshape(B, A * C)
    cos_b, sin_b = rotary.cos_sin(bpos.reshape(-1), ctx.dtype)
    btok = torch.full((B, A, C), cfg.mask_token_id, dtype=torch.long, device=dev)
    btok[:, :, 0] = tokens.gather(1, anchors)
    x = F.embedding(btok, model.embed_tokens.weight).to(ctx.dtype)  # [B, A, C, H]
    if cfg.anchor_drafts:
        assert hidden is not None, "an anchor-drafting block reads the model's hidden before it"
        last = hidden.detach().gather(1, (anchors - 1).clamp(min=0)[:, :, None].expand(-1, -1, hidden.shape[-1]))
        first = net.anchor_input(x[:, :, 0], last)
        x = torch.cat([first[:, :, None], x[:, :, 1:]], 2)
    x = x.reshape(B, A * C, -1)
    # mask [B, 1, Q, T + Q]: context j < p; keys of the same block
    ctx_ok = torch.arange(T, device=dev)[None, None, :] < anchors.repeat_interleave(C, dim=1)[:, :, None]
    blk = torch.arange(A, device=dev).repeat_interleave(C)
    blk_ok = (blk[:, None] == blk[None, :]).expand(B, -1, -1)
    mask = torch.cat([ctx_ok, blk_ok], dim=-1)[:, None]
    Q = A * C
    for layer in net.layers:
        if cfg.kind == "dflash2":
            x = x + layer.dconv(layer.conv_norm(x).view(B * A, C, -1)).reshape(B, Q, -1)
        h = layer.input_layernorm(x)
        attn = layer.self_attn
        kc, vc = attn.kv(ctx.reshape(B * T, -1), cos_c, sin_c)
        q, kb, vb = attn.qkv(h.reshape(B * Q, -1), cos_b, sin_b)
        q = q.view(B, Q, attn.n_heads, attn.head_dim).transpose(1, 2)
        keys = torch.cat([kc.view(B, T, attn.n_kv, -1), kb.view(B, Q, attn.n_kv, -1)], dim=1).transpose(1, 2)
        vals = torch.cat([vc.view(B, T, attn.n_kv, -1), vb.view(B, Q, attn.n_kv, -1)], dim=1).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, keys.to(q.dtype), vals.to(q.dtype), attn_mask=mask,
                                           enable_gqa=attn.n_heads != attn.n_kv)
        x = x + attn.o_proj(o.transpose(1, 2).reshape(B, Q, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return net.norm(x).view(B, A, C, -1)[:, :, C - k:]


@torch.no_grad()
def init_anchor_from_mtp(net: DFlashNet, model: HybridModel) -> None:
    """Start an anchor-drafting block from the model's MTP head: the first column's input from its
    combining projection and norms, the final norm, and, where the shapes match, the first layer's
    norms, MLP and attention (the query half of MTP's gated query projection; ``o_proj`` halved for
    the gate the block does not have, about ``sigmoid(0)``). At the start the first column is then
    MTP's step but for its attention's keys, which come from the block's context."""
    mtp = model.mtp
    net.anchor_fc.weight.copy_(mtp.fc.weight)
    net.anchor_embed_norm.weight.copy_(mtp.pre_fc_norm_embedding.weight)
    net.anchor_hidden_norm.weight.copy_(mtp.pre_fc_norm_hidden.weight)
    net.norm.weight.copy_(mtp.norm.weight)
    src, dst = mtp.layers[0], net.layers[0]
    for name in ("input_layernorm", "post_attention_layernorm"):
        getattr(dst, name).weight.copy_(getattr(src, name).weight)
    for name in ("gate_proj", "up_proj", "down_proj"):
        if getattr(dst.mlp, name).weight.shape == getattr(src.mlp, name).weight.shape:
            getattr(dst.mlp, name).weight.copy_(getattr(src.mlp, name).weight)
    a, d = src.self_attn, dst.self_attn
    if (d.n_heads, d.n_kv, d.head_dim) == (a.n_heads, a.n_kv, a.head_dim):
        q = a.q_proj.weight.view(a.n_heads, 2 * a.head_dim, -1)[:, :a.head_dim]
        d.q_proj.weight.copy_(q.reshape(d.q_proj.weight.shape))
        for name in ("k_proj", "v_proj", "q_norm", "k_norm"):
            getattr(d, name).weight.copy_(getattr(a, name).weight)
        d.o_proj.weight.copy_(a.o_proj.weight * 0.5)
    if net.cfg.kind == "dflash2":
        for layer in net.layers:
            layer.dconv.o_proj.weight.zero_()  # the block's conv starts as nothing added


def selector_loss(net: DFlashNet, model: HybridModel, hid: torch.Tensor, logits: torch.Tensor,
                  labels: torch.Tensor) -> torch.Tensor:
    """DFlash2's candidate selector: cross-entropy over the ``lm_head`` top candidates rescored by
    ``(A h) . (B embed(c)) / sqrt(r)``, where the label is among them."""
    cfg = net.cfg
    top = logits.detach().float().topk(cfg.candidates, dim=-1)
    qa = net.selector_a(hid)
    emb = F.embedding(top.indices, model.embed_tokens.weight)
    score = top.values + (net.selector_b(emb) * qa[..., None, :]).sum(-1).float() / math.sqrt(cfg.selector_rank)
    hit = top.indices == labels[..., None]
    ok = hit.any(-1)
    if not ok.any():
        return score.sum() * 0
    return F.cross_entropy(score[ok], hit[ok].float().argmax(-1))


# ---------------------------------------------------------------------------------------- training
def cosine(step: int, total: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))


def adamw(params, lr: float, fused: bool):
    decay = [p for p in params if p.dim() >= 2]
    plain = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": plain, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)


def batches(rows: torch.Tensor, bsz: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    while True:
        perm = torch.randperm(rows.shape[0], generator=gen)
        for i in range(0, rows.shape[0] - bsz + 1, bsz):
            yield rows[perm[i:i + bsz]]


def autocast(dev: torch.device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else torch.autocast("cpu", enabled=False)


@torch.no_grad()
def evaluate(model: HybridModel, rows: torch.Tensor, dev, bsz: int, limit: int) -> float:
    total, n = 0.0, 0
    for i in range(0, min(limit, rows.shape[0]), bsz):
        b = rows[i:i + bsz].to(dev)
        with autocast(dev):
            h, _ = forward(model, b[:, :-1])
            logits = model.lm_head(h).float()
        total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), b[:, 1:].reshape(-1), reduction="sum").item()
        n += b[:, 1:].numel()
    return total / max(1, n)


def train_main(model, data, args, dev, report):
    params = [p for p in model.parameters()]
    opt = adamw(params, args.lr, dev.type == "cuda")
    it = batches(data["train"], args.batch, SEED)
    curve, t0, step = [], time.time(), 0
    total = args.steps
    if total <= 0:  # calibrate: as many steps as fit the time budget
        for _ in range(5):
            _main_step(model, opt, next(it), dev, 0.0)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t1 = time.time()
        for _ in range(10):
            _main_step(model, opt, next(it), dev, 0.0)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        per = (time.time() - t1) / 10
        total = max(50, int((args.main_seconds - (time.time() - t0)) / per))
        init_weights(model, SEED)  # start over from the seed: the calibration steps only timed
        opt = adamw(params, args.lr, dev.type == "cuda")
        it = batches(data["train"], args.batch, SEED)
        print(f"main: {per * 1000:.1f} ms/step -> {total} steps", flush=True)
    t0 = time.time()
    for step in range(total):
        if args.steps <= 0 and time.time() - t0 > 1.25 * args.main_seconds:
            print(f"main: stopped at step {step} of {total} (time)", flush=True)
            total = step
            break
        lr = args.lr * cosine(step, total, args.warmup)
        loss = _main_step(model, opt, next(it), dev, lr)
        if step % args.log_every == 0 or step == total - 1:
            loss = loss.item()
            entry = {"step": step, "tokens": (step + 1) * args.batch * args.seq, "train_loss": loss,
                     "lr": lr, "s": time.time() - t0}
            if step % (args.log_every * 5) == 0 or step == total - 1:
                entry["val_loss"] = evaluate(model, data["val"], dev, args.batch, args.val_rows)
            curve.append(entry)
            print(json.dumps(entry), flush=True)
    report["main"] = {"steps": total, "planned_steps": args.steps or None, "batch": args.batch, "seq": args.seq,
                      "lr": args.lr, "seconds": time.time() - t0,
                      "curve": curve, "final_train_loss": curve[-1]["train_loss"],
                      "val_loss": evaluate(model, data["val"], dev, args.batch, args.final_val_rows),
                      "train_loss_eval": evaluate(model, data["train"], dev, args.batch,
                                                  min(args.final_val_rows, data["val"].shape[0]))}
    print("main done", json.dumps({k: v for k, v in report["main"].items() if k != "curve"}), flush=True)


def _main_step(model, opt, rows, dev, lr):
    for g in opt.param_groups:
        g["lr"] = lr
    b = rows.to(dev, non_blocking=True)
    with autocast(dev):
        h, _ = forward(model, b[:, :-1])
        logits = model.lm_head(h)
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), b[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss.detach()


def train_drafters(model, nets, data, args, dev, report, checkpoint=None):
    """Phase 2: the MTP head (unless ``args.no_mtp``) and the block drafters ``nets`` on the frozen
    model's greedy token at every position. With ``data["answers"]`` (rows of one conversation and
    their answer spans: the model's own answers to chat prompts) the block drafters' anchors lie in
    the answers, where a chat request's draft rounds start, and columns past the answer's end weigh
    nothing. ``checkpoint(step)``, if given, is called every ``args.checkpoint_every`` seconds of
    training (a long run leaves usable drafters behind it as it goes)."""
    for p in model.parameters():
        p.requires_grad_(False)
    mtp_params = [] if args.no_mtp else list(model.mtp.parameters())
    for p in mtp_params:
        p.requires_grad_(True)
    params = mtp_params + [p for n in nets.values() for p in n.parameters()]
    for p in params:
        p.requires_grad_(True)
    opt = adamw(params, args.draft_lr, dev.type == "cuda")
    capture = tuple(nets["dflash"].cfg.target_layers)
    rotaries = {k: Rotary(n.cfg.head_dim, n.cfg.rope_theta, device=dev) for k, n in nets.items()}
    answers = data.get("answers")
    corpus = batches(data["train"], args.batch, SEED + 7)
    if answers is not None:
        rows_all, spans_all = answers
        it = batches(torch.cat([rows_all, spans_all], dim=1), args.batch, SEED + 7)
    else:
        it = corpus
    every = args.corpus_every
    gen = torch.Generator().manual_seed(SEED + 11)
    t0, curve, total = time.time(), [], args.draft_steps
    step, saved = 0, time.time()
    while True:
        if total > 0 and step >= total:
            break
        if total <= 0 and time.time() - t0 > args.draft_seconds:
            break
        if checkpoint is not None and step and args.checkpoint_every and time.time() - saved > args.checkpoint_every:
            checkpoint(step)  # the drafters after `step` steps (the last ones are exported after the loop)
            saved = time.time()
        frac = (time.time() - t0) / args.draft_seconds if total <= 0 else step / total
        lr = args.draft_lr * (min(1.0, (step + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1, frac)))))
        for g in opt.param_groups:
            g["lr"] = lr
        spans = None
        if answers is not None and not (every and step % every == every - 1):
            b = next(it)
            b, spans = b[:, :-2], b[:, -2:]
        else:  # corpus rows (every --corpus-every'th step with answers: the drafters keep the corpus)
            b = next(corpus)
        b = b.to(dev)
        tokens = b[:, :-1]
        B, T = tokens.shape
        with torch.no_grad(), autocast(dev):
            h, feats = forward(model, tokens, capture)
            labels = model.lm_head(h).argmax(-1)  # the model's greedy next token at every position
        losses = {}
        with autocast(dev):
            # MTP: position p reads (token p+1, h[p]) and predicts the model's token at p+2; the second
            # step reads (token p+2, its own hidden at p) at position p+1
            if not args.no_mtp:
                g1 = mtp_forward(model, tokens[:, 1:], h[:, :-1].detach(), 0)
                l1 = model.lm_head(g1).float()
                losses["mtp"] = F.cross_entropy(l1.reshape(-1, l1.shape[-1]), labels[:, 1:].reshape(-1))
                g2 = mtp_forward(model, tokens[:, 2:], g1[:, :-1], 1)
                l2 = model.lm_head(g2).float()
                losses["mtp2"] = 0.5 * F.cross_entropy(l2.reshape(-1, l2.shape[-1]), labels[:, 2:].reshape(-1))
            k = args.block_sizes[step % len(args.block_sizes)]
            if spans is None:
                anchors = torch.stack([torch.randperm(T - k - 1, generator=gen)[:args.anchors] + 1
                                       for _ in range(B)]).to(dev)
            else:  # anywhere from the answer's first token to its last but one (with repeats)
                lo, hi = spans[:, :1], spans[:, 1:] - 1
                u = torch.rand(B, args.anchors, generator=gen)
                anchors = (lo + (u * (hi - lo)).long()).clamp(max=T - k).to(dev)
            # column i (1..k) drafts the token at p+i: the model's argmax at position p+i-1
            idx = anchors[:, :, None] + torch.arange(k, device=dev)
            lab = labels.gather(1, idx.reshape(B, -1)).view(B, -1, k)
            wts = (0.85 ** torch.arange(k, device=dev, dtype=torch.float32)).expand_as(lab)
            if spans is not None:  # a draft of the token after the answer's last one is not a draft
                wts = wts * (idx + 1 < spans[:, 1:].to(dev)[:, :, None]).float()
            for name, net in nets.items():
                hid = drafter_forward(net, model, rotaries[name], feats.detach(), tokens, anchors, k, h)
                logits = model.lm_head(hid).float()
                ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), lab.reshape(-1), reduction="none")
                losses[name] = (ce * wts.reshape(-1)).sum() / wts.sum()
                if net.cfg.kind == "dflash2":
                    if spans is None:
                        losses["selector"] = 0.1 * selector_loss(net, model, hid, logits, lab)
                    else:
                        keep = wts > 0
                        losses["selector"] = 0.1 * selector_loss(net, model, hid[keep], logits[keep], lab[keep])
        loss = sum(losses.values())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % args.log_every == 0:
            entry = {"step": step, "lr": lr, "s": time.time() - t0, **{k_: v.item() for k_, v in losses.items()}}
            curve.append(entry)
            print(json.dumps(entry), flush=True)
        step += 1
    report["drafters"] = {"steps": step, "seconds": time.time() - t0, "curve": curve,
                          "block_sizes": args.block_sizes, "anchors": args.anchors,
                          "val_first_draft_accuracy": draft_accuracy(model, nets, rotaries, data["val"], dev, args)}
    if data.get("val_answers") is not None:
        report["drafters"]["val_chat_answer_accuracy"] = answer_accuracy(model, nets, data["val_answers"], dev)
        print("chat answers (validation objects)", json.dumps(report["drafters"]["val_chat_answer_accuracy"]),
              flush=True)
    print("drafters done", json.dumps(report["drafters"]["val_first_draft_accuracy"]), flush=True)
    for p in params:
        p.requires_grad_(False)


@torch.no_grad()
def draft_accuracy(model, nets, rotaries, rows, dev, args) -> dict:
    """On validation rows: how often each drafter's first draft equals the model's greedy token."""
    capture = tuple(nets["dflash"].cfg.target_layers)
    b = rows[:args.batch].to(dev)
    tokens = b[:, :-1]
    B, T = tokens.shape
    with autocast(dev):
        h, feats = forward(model, tokens, capture)
        labels = model.lm_head(h).argmax(-1)
        g1 = mtp_forward(model, tokens[:, 1:], h[:, :-1], 0)
        out = {"mtp": (model.lm_head(g1).argmax(-1) == labels[:, 1:]).float().mean().item()}
        gen = torch.Generator().manual_seed(5)
        k = 3
        anchors = torch.stack([torch.randperm(T - k - 1, generator=gen)[:32] + 1 for _ in range(B)]).to(dev)
        lab = labels.gather(1, (anchors[:, :, None] + torch.arange(k, device=dev)).reshape(B, -1)).view(B, -1, k)
        for name, net in nets.items():
            pred = model.lm_head(drafter_forward(net, model, rotaries[name], feats, tokens, anchors, k, h)).argmax(-1)
            out[name] = (pred[..., 0] == lab[..., 0]).float().mean().item()
            out[name + "_all3"] = (pred == lab).all(-1).float().mean().item()
    return out


@torch.no_grad()
def answer_accuracy(model, nets, answers, dev, k: int = 3) -> dict:
    """On rows of the model's own answers to chat prompts: how often each drafter's first draft
    (and all ``k``) equals the model's greedy token, with a draft block at every answer position
    that has ``k`` answer tokens after it; MTP's first draft at the same positions."""
    rows, spans = answers
    capture = tuple(nets["dflash"].cfg.target_layers)
    rotaries = {n: Rotary(net.cfg.head_dim, net.cfg.rope_theta, device=dev) for n, net in nets.items()}
    hits = {n: 0 for n in ("mtp", *nets, *(x + "_all3" for x in nets), *(x + "_round" for x in nets))}
    count = 0
    for i in range(rows.shape[0]):
        s, L = (int(x) for x in spans[i])
        tokens = rows[i:i + 1, :L].to(dev)
        if L - s < k + 1:
            continue
        with autocast(dev):
            h, feats = forward(model, tokens, capture)
            labels = model.lm_head(h).argmax(-1)
            anchors = torch.arange(s, L - k, device=dev)[None]
            lab = labels.gather(1, (anchors[:, :, None] + torch.arange(k, device=dev)).reshape(1, -1)).view(1, -1, k)
            g1 = mtp_forward(model, tokens[:, 1:], h[:, :-1], 0)
            mtp = model.lm_head(g1).argmax(-1)  # at position p-1: the draft of the token at p+1
            hits["mtp"] += int((mtp[0, anchors[0] - 1] == lab[0, :, 0]).sum())
            for name, net in nets.items():
                pred = model.lm_head(drafter_forward(net, model, rotaries[name], feats, tokens, anchors, k, h)).argmax(-1)
                hits[name] += int((pred[..., 0] == lab[..., 0]).sum())
                hits[name + "_all3"] += int((pred == lab).all(-1).sum())
                # a verify round's tokens: the drafts accepted (the leading ones right) and one more
                hits[name + "_round"] += int((pred == lab).long().cumprod(-1).sum(-1).add(1).sum())
        count += anchors.shape[1]
    return {n: v / max(1, count) for n, v in hits.items()} | {"blocks": count}


# ---------------------------------------------------------------------------------------- export
def export(model: HybridModel, nets: dict, tok_file: Path, out: Path, tok) -> Path:
    from safetensors.torch import save_file

    d = out / "tiny"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(hf_config(model.config), indent=1) + "\n")
    shutil.copy(tok_file, d / "tokenizer.json")
    specials = {str(i): t for i, t in sorted(tok.get_added_tokens_decoder().items())}
    tcfg = {"tokenizer_class": "Qwen2Tokenizer", "model_max_length": model.config.max_position_embeddings,
            "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
            "added_tokens_decoder": {i: {"content": t.content, "special": t.special, "lstrip": False,
                                         "rstrip": False, "normalized": False, "single_word": False}
                                     for i, t in specials.items()},
            "chat_template": TINY_CHAT_TEMPLATE.strip("\n")}
    (d / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=1, ensure_ascii=False) + "\n")
    # HF's generation_config.json; num_assistant_tokens is the engine's k where the settings name
    # none: one draft a round was the fastest setting of all three drafters on the GPU and the CPU
    # (docs/speculative.md, "The recommended k")
    eos = model.config.eos_token_id
    gen = {"eos_token_id": eos, "pad_token_id": eos[-1] if eos else None, "num_assistant_tokens": 1}
    (d / "generation_config.json").write_text(json.dumps(gen, indent=1) + "\n")
    state = {}
    for name, p in model.named_parameters():  # tied: lm_head.weight is embed_tokens.weight, named once
        key = name if name.startswith("mtp.") else "model." + name
        state[key] = p.detach().to(torch.bfloat16).contiguous().cpu()
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    for name, net in nets.items():
        cpu = DFlashNet(net.cfg, dtype=torch.bfloat16)
        cpu.load_state_dict({k: v.detach().to(torch.bfloat16).cpu() for k, v in net.state_dict().items()})
        save_drafter(cpu, str(d / name))
    return d


@torch.no_grad()
def check_against_runtime(d: Path, sample: torch.Tensor, capture) -> dict:
    """Load the exported directory through the HF-checkpoint loader (fp32, CPU) and compare the
    runtime's prefill logits with this script's training forward on the same weights (K and V
    rounded to bf16 in both: the runtime's bf16 KV pages hold them so)."""
    global ROUND_KV
    from hpc_cli.model.loader import load_checkpoint

    m = load_checkpoint(d, dtype=torch.float32, device="cpu", progress=False)
    toks = sample[:1, :200].cpu()
    ref = m.forward_tokens(toks[0]).float()
    ROUND_KV = True
    try:
        h, _ = forward(m, toks)
    finally:
        ROUND_KV = False
    got = m.lm_head(h)[0].float()
    diff = (got - ref).abs().max().item()
    same_argmax = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    out = {"max_abs_logit_diff": diff, "argmax_agreement": same_argmax, "logit_scale": ref.abs().max().item()}
    print("runtime check", json.dumps(out), flush=True)
    assert diff < 1e-3 * max(1.0, out["logit_scale"]), out
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=".tiny-data")
    ap.add_argument("--out", default="/tmp/tiny-train")
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--steps", type=int, default=0, help="main steps (0: as many as --main-seconds allow)")
    ap.add_argument("--main-seconds", type=float, default=180)
    ap.add_argument("--draft-steps", type=int, default=0, help="drafter steps (0: --draft-seconds)")
    ap.add_argument("--draft-seconds", type=float, default=90)
    ap.add_argument("--draft-lr", type=float, default=2e-3)
    ap.add_argument("--anchors", type=int, default=32, help="draft blocks per row")
    ap.add_argument("--block-sizes", default="3,8", help="draft lengths k trained, alternating")
    ap.add_argument("--val-rows", type=int, default=256)
    ap.add_argument("--final-val-rows", type=int, default=10 ** 9, help="rows of the final validation loss")
    ap.add_argument("--log-every", type=int, default=20)
    ap.add_argument("--checkpoint-every", type=float, default=0,
                    help="seconds of drafter training between exports to OUT/step-N/tiny (0: at the end only)")
    ap.add_argument("--init-from", default=None,
                    help="a trained checkpoint directory: skip phase 1, train the MTP head and drafters")
    ap.add_argument("--init-drafters", default=None, help="start the drafters from this directory's dflash/, dflash2/")
    ap.add_argument("--chat-only", action="store_true", help="train on the chat examples only")
    ap.add_argument("--chat-answers", type=int, default=0,
                    help="train the drafters on the model's own greedy answers to this many chat prompts of the "
                         "training split (one conversation per row of --seq tokens), anchors in the answers")
    ap.add_argument("--answer-tokens", type=int, default=96, help="longest generated answer (--chat-answers)")
    ap.add_argument("--answer-lanes", type=int, default=8, help="requests answered at a time (--chat-answers)")
    ap.add_argument("--answer-device", default=None,
                    help="where the engine answers (--chat-answers; default --device; CPU and CUDA greedy "
                         "answers may differ where two tokens nearly tie)")
    ap.add_argument("--val-answers", type=int, default=None,
                    help="chat prompts of the validation split answered to measure drafts (default 64 with "
                         "--chat-answers, else 0; needs --init-from)")
    ap.add_argument("--hold-out", default="benchmark",
                    help="'benchmark': leave out the chat examples about the objects benchmarks/spec_decode.py "
                         "asks about (its CHAT_QUESTIONS); 'none': keep every example")
    ap.add_argument("--no-mtp", action="store_true", help="phase 2 leaves the MTP head as it is")
    ap.add_argument("--draft-layers", type=int, default=1,
                    help="layers of new block drafters (the served pool and rings follow the checkpoint)")
    ap.add_argument("--target-layers", default=None,
                    help="the layers whose residual stream the block drafters read, e.g. 1,3,5,6,7 "
                         "(default: hpc_cli.speculative.dflash.default_config's)")
    ap.add_argument("--anchor-drafts", action="store_true",
                    help="new block drafters draft from the block's first column too, which reads the model's "
                         "hidden beside the token as MTP does (started from the MTP head; docs/speculative.md)")
    ap.add_argument("--corpus-every", type=int, default=0,
                    help="with --chat-answers: every N-th drafter step trains on corpus rows instead of answers")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    args.block_sizes = [int(x) for x in args.block_sizes.split(",")]
    if args.val_answers is None:
        args.val_answers = 64 if args.chat_answers else 0
    if (args.chat_answers or args.val_answers) and not args.init_from:
        ap.error("--chat-answers and --val-answers answer with a trained model: give --init-from DIR")
    if args.corpus_every and not args.chat_answers:
        ap.error("--corpus-every mixes corpus rows into --chat-answers training; give --chat-answers N too")
    if args.target_layers and args.init_drafters:
        ap.error("--init-drafters continues drafters with their own target layers; leave out --target-layers")
    if args.draft_layers != 1 and args.init_drafters:
        ap.error("--init-drafters continues drafters with their own layers; leave out --draft-layers")
    if args.draft_layers < 1:
        ap.error("--draft-layers must be at least 1")
    if args.anchor_drafts and args.init_drafters:
        ap.error("--init-drafters continues drafters of their own design; leave out --anchor-drafts")
    target_layers = [int(x) for x in args.target_layers.split(",")] if args.target_layers else None
    torch.manual_seed(SEED)
    dev = torch.device(args.device)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    data_dir, out = Path(args.data), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    # a trained model keeps its own tokenizer (a rebuilt corpus's tokenizer may differ from it)
    tok_file = Path(args.init_from) / "tokenizer.json" if args.init_from else data_dir / "tokenizer.json"
    hold = benchmark_questions() if args.hold_out == "benchmark" else ()
    tok, data, records = load_data(data_dir, args.seq, args.chat_only, tok_file, hold)
    manifest = json.loads((data_dir / "manifest.json").read_text())
    eos = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    cfg = tiny_config(manifest["vocab_size"], eos)
    report = {"seed": SEED, "data": manifest, "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
              "torch": torch.__version__, "args": {k: v for k, v in vars(args).items()},
              "train_rows": data["train"].shape[0], "val_rows": data["val"].shape[0],
              "train_tokens": data["train"].numel(), "val_tokens": data["val"].numel(),
              "data_s": time.time() - t0, "tokenizer_sha256": hashlib.sha256(tok_file.read_bytes()).hexdigest(),
              "corpus_sha256": hashlib.sha256((data_dir / "corpus.jsonl.gz").read_bytes()).hexdigest(),
              "held_out_objects": sorted(held_out(records_all(data_dir), hold)) if hold else []}
    print(json.dumps({k: v for k, v in report.items() if k != "data"}), flush=True)
    if args.init_from:  # a trained model: train its MTP head and the drafters only
        from hpc_cli.model.loader import load_checkpoint

        model = load_checkpoint(args.init_from, dtype=torch.float32, device=dev, progress=False)
        report["init_from"] = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                               for p in sorted(Path(args.init_from).glob("*")) if p.is_file()}
        report["main"] = {"val_loss": evaluate(model, data["val"], dev, args.batch, args.final_val_rows)}
        print("loaded", args.init_from, json.dumps(report["main"]), flush=True)
    else:
        model = HybridModel(cfg, device=dev, dtype=torch.float32, with_mtp=True)
        init_weights(model, SEED)
        for p in model.parameters():
            p.requires_grad_(True)
        model.train()
        train_main(model, data, args, dev, report)
    report["parameters"] = sum(p.numel() for p in model.parameters())
    if args.chat_answers or args.val_answers:  # self-distillation on chat traffic: the model answers greedily
        t1 = time.time()
        for split, n, key in (("train", args.chat_answers, "answers"), ("val", args.val_answers, "val_answers")):
            if not n:
                continue
            prompts = [e.ids for e in tok.encode_batch(chat_prompts(records, split, n, CHAT_PROMPT_SEED),
                                                       add_special_tokens=False)]
            answers = greedy_answers(Path(args.init_from), prompts, args.answer_tokens, args.answer_lanes,
                                     args.answer_device or dev.type)
            data[key] = answer_rows(prompts, answers, args.seq)
            report[key] = {"prompts": len(prompts), "rows": int(data[key][0].shape[0]),
                           "answer_tokens": int((data[key][1][:, 1] - data[key][1][:, 0]).sum()),
                           "sha256": hashlib.sha256(data[key][0].numpy().tobytes()).hexdigest()}
            print(key, json.dumps(report[key]), f"{time.time() - t1:.0f} s", flush=True)
        report["answers_s"] = time.time() - t1
    nets = {}
    gen_seed = SEED + 3
    for kind in ("dflash", "dflash2"):
        c = default_config(kind, model, args.draft_layers)
        c.anchor_drafts = args.anchor_drafts
        if target_layers:
            c.target_layers = target_layers
        if args.init_drafters:  # continue from trained drafters
            from hpc_cli.speculative.dflash import load_drafter

            nets[kind] = load_drafter(str(Path(args.init_drafters) / kind), kind, dev, torch.float32).train()
            continue
        net = DFlashNet(c, device=dev, dtype=torch.float32)
        init_weights(net, gen_seed)
        if kind == "dflash2":
            with torch.no_grad():
                net.selector_b.weight.zero_()  # the selector starts as the plain argmax
        if c.anchor_drafts:
            init_anchor_from_mtp(net, model)
        nets[kind] = net
        gen_seed += 1
    d = export(model, nets, tok_file, out, tok)  # the model alone first: usable if the drafters do not finish
    if data.get("val_answers") is not None:
        report["val_chat_answer_accuracy_before"] = answer_accuracy(model, nets, data["val_answers"], dev)
        print("chat answers before (validation objects)", json.dumps(report["val_chat_answer_accuracy_before"]),
              flush=True)
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    def checkpoint(step: int) -> None:
        print("checkpoint", export(model, nets, tok_file, out / f"step-{step}", tok), flush=True)

    train_drafters(model, nets, data, args, dev, report, checkpoint)
    d = export(model, nets, tok_file, out, tok)
    report["runtime_check"] = check_against_runtime(d, data["val"], ())
    report["files"] = {p.relative_to(d).as_posix(): {"bytes": p.stat().st_size,
                                                    "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
                       for p in sorted(d.rglob("*")) if p.is_file()}
    report["total_s"] = time.time() - t0
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    print("done", report["total_s"], flush=True)
    return report


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
