"""Prefill and decode throughput of our Qwen3.5 runtime vs transformers' own, same config and weights.

Prints one JSON document (and writes it to --out): the machine, the model, prefill tokens/s
(one lane, --prefill tokens from position 0) and decode tokens/s at each batch size (each lane
with a --context-token prefix, --steps decode steps), for ours and for transformers'
Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM built from the same config and loaded with the same
weights, and the ratio ours/theirs. It also records agreement figures on the device: last-token
logits ours vs transformers (bf16), a prefill split with the state carried vs unsplit, and
decode vs a full forward.

    python benchmarks/model_throughput.py --model builtin:qwen3.5-27b-shape@8 --batches 1,4,8
"""

from __future__ import annotations

import argparse
import inspect
import json
import platform
import statistics
import time

import torch

from hpc_cli.model import HybridModel


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _time(fn, repeat: int, warmup: int = 2) -> float:
    # On CUDA a prefill shape's first pass runs eagerly and its second captures its graph
    # (hpc_cli.model.prefill_graphs); the engine does both at its warm-up, so timing starts after
    for _ in range(warmup):
        fn()
    _sync()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def build_hf(model: HybridModel):
    """transformers' model for our config, holding a copy of our weights."""
    c = model.config
    common = dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_hidden_layers,
                  num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                  head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, layer_types=list(c.layer_types),
                  linear_conv_kernel_dim=c.linear_conv_kernel_dim, linear_key_head_dim=c.linear_key_head_dim,
                  linear_value_head_dim=c.linear_value_head_dim, linear_num_key_heads=c.linear_num_key_heads,
                  linear_num_value_heads=c.linear_num_value_heads, tie_word_embeddings=c.tie_word_embeddings,
                  rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta,
                                   "partial_rotary_factor": c.partial_rotary_factor})
    if c.is_moe:
        from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM as Cls, Qwen3_5MoeTextConfig as Cfg

        cfg = Cfg(**common, num_experts=c.num_experts, num_experts_per_tok=c.num_experts_per_tok,
                  moe_intermediate_size=c.moe_intermediate_size,
                  shared_expert_intermediate_size=c.shared_expert_intermediate_size)
    else:
        from transformers import Qwen3_5ForCausalLM as Cls, Qwen3_5TextConfig as Cfg

        cfg = Cfg(**common, intermediate_size=c.intermediate_size)
    cfg._attn_implementation = "sdpa"
    old = torch.get_default_dtype()
    torch.set_default_dtype(model.dtype)
    try:
        with torch.device(model.device):
            hf = Cls(cfg)
    finally:
        torch.set_default_dtype(old)
    ours = {("lm_head.weight" if n == "lm_head.weight" else "model." + n): p
            for n, p in model.named_parameters() if not n.startswith("mtp.")}
    missing, unexpected = hf.load_state_dict(ours, strict=False)
    missing = [m for m in missing if not (c.tie_word_embeddings and m == "lm_head.weight")]
    assert not missing and not unexpected, f"weight names differ: missing {missing[:3]}, unexpected {unexpected[:3]}"
    return hf.eval()


def _hf_cache_kw(hf) -> str:
    return "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin:qwen3.5-27b-shape@8")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--kv-profile", default="bf16")
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--quantized-weights", default="auto", choices=["auto", "held", "dequantized"],
                    help="a quantized checkpoint's Linear weights on CUDA (serve --quantized-weights)")
    ap.add_argument("--no-merge", action="store_true",
                    help="multiply each projection alone (the projections that read one input are merged by default)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    device = torch.device(args.device)

    t0 = time.perf_counter()
    model = HybridModel.from_name_or_path(args.model, dtype=args.dtype, device=device,
                                          quantized_weights=args.quantized_weights, merge=not args.no_merge)
    build_s = time.perf_counter() - t0
    from hpc_cli.model.gdn import fla_available

    result: dict = {
        "benchmark": "model_throughput",
        "machine": {"platform": platform.platform(), "torch": torch.__version__,
                    "device": torch.cuda.get_device_name(0) if device.type == "cuda" else platform.processor(),
                    "fla": fla_available()},
        "model": model.config.name, "dtype": str(model.dtype), "kv_profile": args.kv_profile,
        "quantized_weights": args.quantized_weights, "merged": not args.no_merge,
        "layers": model.config.num_hidden_layers, "build_s": round(build_s, 2),
        "prefill_tokens": args.prefill, "decode_context": args.context, "decode_steps": args.steps,
    }
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (args.prefill,), generator=gen).to(device)
    max_b = max(batches)
    ctx = torch.randint(0, vocab, (max_b, args.context + args.steps + 1), generator=gen).to(device)
    pages_per_lane = (max(args.prefill, args.context + args.steps + 1) + 63) // 64
    lanes = max(max_b, 2)  # lane 1 also holds the decode-vs-forward check's prompt
    kv = model.new_kv_storage(args.kv_profile, pages_per_lane * lanes)
    states = model.new_state_slots(lanes)
    tables = [list(range(b * pages_per_lane, (b + 1) * pages_per_lane)) for b in range(lanes)]

    def ours_prefill():
        states.reset(0)
        return model.prefill(prompt, 0, tables[0], 0, kv, states)

    ours = {"prefill_tok_s": args.prefill / _time(ours_prefill, args.repeat)}
    ref_last = ours_prefill().logits.float()
    print(json.dumps({"ours_prefill_tok_s": round(ours["prefill_tok_s"], 1)}), flush=True)

    # agreement on the device: split with the state carried, and decode vs full forward
    states.reset(0)
    half = args.prefill // 2 + 7
    model.prefill(prompt[:half], 0, tables[0], 0, kv, states)
    split_last = model.prefill(prompt[half:], half, tables[0], 0, kv, states).logits.float()
    states.reset(1)
    model.prefill(prompt[:-1], 0, tables[1], 1, kv, states)
    dec_last = model.decode(prompt[-1:], [args.prefill - 1], [tables[1]], [1], kv, states)[0].float()
    agreement = {"split_vs_unsplit_rel": _rel(split_last, ref_last), "decode_vs_forward_rel": _rel(dec_last, ref_last),
                 "split_top1_equal": bool(split_last.argmax() == ref_last.argmax())}

    if fla_available() and device.type == "cuda":
        gdn = [layer.linear_attn for layer in model.layers if layer.kind == "linear_attention"]
        for g in gdn:
            g.use_fla = False
        torch_last = ours_prefill().logits.float()
        for g in gdn:
            g.use_fla = None
        agreement["fla_vs_torch_gdn_rel"] = _rel(ref_last, torch_last)

    def ours_decode(b):
        for lane in range(b):
            states.reset(lane)
            model.prefill(ctx[lane, :args.context], 0, tables[lane], lane, kv, states)
        _sync()
        t = time.perf_counter()
        for s in range(args.steps):
            p = args.context + s
            model.decode(ctx[:b, p], [p] * b, tables[:b], list(range(b)), kv, states)
        _sync()
        return time.perf_counter() - t

    for b in batches:
        ours_decode(b)  # warm-up
        ours[f"decode_tok_s_b{b}"] = b * args.steps / min(ours_decode(b) for _ in range(args.repeat))
    result["ours"] = {k: round(v, 1) for k, v in ours.items()}

    if not args.no_hf:
        del kv, states
        torch.cuda.empty_cache() if device.type == "cuda" else None
        hf = build_hf(model)
        kw = _hf_cache_kw(hf)
        theirs = {}
        with torch.inference_mode():
            hf_last = hf(prompt[None]).logits[0, -1].float()
            agreement["ours_vs_transformers_last_logits_rel"] = _rel(ref_last, hf_last)
            agreement["ours_vs_transformers_top1_equal"] = bool(ref_last.argmax() == hf_last.argmax())
            theirs["prefill_tok_s"] = args.prefill / _time(lambda: hf(prompt[None], use_cache=False), args.repeat)

            def hf_decode(b):
                out = hf(ctx[:b, :args.context], use_cache=True)
                cache = getattr(out, "cache", None) or out.past_key_values
                _sync()
                t = time.perf_counter()
                for s in range(args.steps):
                    out = hf(ctx[:b, args.context + s:args.context + s + 1], use_cache=True, **{kw: cache})
                    cache = getattr(out, "cache", None) or out.past_key_values
                _sync()
                return time.perf_counter() - t

            for b in batches:
                hf_decode(b)
                theirs[f"decode_tok_s_b{b}"] = b * args.steps / min(hf_decode(b) for _ in range(args.repeat))
        result["transformers"] = {k: round(v, 1) for k, v in theirs.items()}
        result["ratio_ours_over_transformers"] = {k: round(ours[k] / theirs[k], 3) for k in theirs}
    result["agreement"] = {k: (float(f"{v:.3g}") if isinstance(v, float) else v) for k, v in agreement.items()}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
