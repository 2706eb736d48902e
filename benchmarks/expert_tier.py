"""Decode throughput of a Qwen3.5-MoE with its experts all on the device (the plain MoE layer) vs
in host memory behind a slot tier holding 0%, 25%, 50% and 100% of the (layer, expert) pairs, in
one run.

Routing is replayed from a synthetic trace of documented skew, so the hit rate is set by the trace
rather than by seeded random router weights (which route near-uniformly): each layer's experts get
Zipf popularity ``rank ** -skew`` (default skew 1.0, a random rank permutation per layer), each
token takes ``top_k`` distinct experts sampled without replacement by popularity
(``hpc_cli.model.expert_profile.synthetic_trace``). The first ``--train-tokens`` of the trace build
the residency profile (counts + 1, so every pair is ranked and 100% means all resident); decode
steps replay the held-out rest (kept on the device, so the replay itself reads nothing back). The
router still runs on the device every layer (its logits set the combine weights of the replayed
experts).

Per configuration: decode tokens/s (``--batch`` lanes, ``--steps`` steps after a warm-up) and its
ratio to the all-on-device model, the tier's hit rate (and the trace's expected one), bytes read
from host per token, the tier's device->host reads per token (0 when every pair is resident), and
the host bytes per token next to the header's 663.6 MB per token (its 48-layer model) scaled to
this model's layer count, with the time each takes at the header's ~40 GB/s.

    python benchmarks/expert_tier.py --model builtin:qwen3.5-35b-a3b-shape@4 --out expert_tier.json
    python benchmarks/expert_tier.py --small --steps 8          # CPU: a small MoE config
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np
import torch

from hpc_cli.model import HybridModel
from hpc_cli.model import expert_profile as ep
from hpc_cli.experts.tier import ExpertTier

HEADER_BYTES_PER_TOKEN = 663.6e6  # expert-cache.hpp: CPU expert bytes per token, full model
HEADER_BW = 40e9  # ~40 GB/s host read bandwidth
HEADER_LAYERS = 48  # the header's model: 48 layers x 512 experts
FULL_LAYERS_35B = 40


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def small_model(dtype, device):
    from hpc_cli.model.builtin import init_seeded
    from hpc_cli.model.config import ModelConfig

    cfg = ModelConfig(name="small-moe@4", model_type="qwen3_5_moe", vocab_size=4096, hidden_size=512,
                      num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                      linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
                      linear_value_head_dim=64, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=256,
                      shared_expert_intermediate_size=256, mtp_num_hidden_layers=0)
    m = HybridModel(cfg, device=device, dtype=dtype)
    init_seeded(m)
    m.eval()
    return m


class Replay:
    """Each MoE layer's router returns the trace's experts for the current step."""

    def __init__(self, model, records: np.ndarray) -> None:
        # [T, L, k] on the device: a step's rows are a view, no copy from the host per layer
        self.records = torch.from_numpy(records.astype(np.int64)).to(model.device)
        self.rows = slice(0, 0)
        for i, layer in enumerate(model.layers):
            mlp = layer.mlp
            mlp.route = self._route(mlp, i)

    def _route(self, mlp, layer: int):
        def route(x):
            logits = torch.nn.functional.linear(x, mlp.gate.weight)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
            index = self.records[self.rows, layer]
            top = probs.gather(1, index)
            top = top / top.sum(dim=-1, keepdim=True)
            return top.to(logits.dtype), index
        return route


def decode_rate(model, replay: Replay, records_at: int, batch: int, steps: int, warmup: int, context: int) -> float:
    pages_per = (context + warmup + steps) // 64 + 2
    kv = model.new_kv_storage("bf16", batch * pages_per, name="bench")
    states = model.new_state_slots(batch)
    tables = [list(range(b * pages_per, (b + 1) * pages_per)) for b in range(batch)]
    tok = torch.zeros(batch, dtype=torch.long, device=model.device)
    pos = context
    cursor = records_at
    start = None
    for step in range(warmup + steps):
        if step == warmup:
            _sync(model.device)
            if model.expert_tier is not None:
                model.expert_tier.reset_stats()
            start = time.perf_counter()
        replay.rows = slice(cursor, cursor + batch)
        cursor += batch
        logits = model.decode(tok, [pos] * batch, tables, list(range(batch)), kv, states)
        tok = logits.argmax(-1)
        pos += 1
    _sync(model.device)
    return batch * steps / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="builtin:qwen3.5-35b-a3b-shape@4")
    ap.add_argument("--small", action="store_true", help="a small MoE config (CPU)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--context", type=int, default=64, help="decode positions start here (KV is uninitialised)")
    ap.add_argument("--skew", type=float, default=1.0)
    ap.add_argument("--train-tokens", type=int, default=4000)
    ap.add_argument("--fractions", default="0,0.25,0.5,1.0")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", action="store_true", help="print the JSON instead of the table")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device("cuda" if a.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if a.device == "auto" else a.device))
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32, "bf16": torch.bfloat16,
             "fp32": torch.float32}[a.dtype]
    t0 = time.perf_counter()
    model = small_model(dtype, device) if a.small else HybridModel.from_name_or_path(a.model, dtype=dtype,
                                                                                     device=device)
    cfg = model.config
    L, E, k = cfg.num_hidden_layers, cfg.num_experts, cfg.num_experts_per_tok
    per_config = (a.warmup + a.steps) * a.batch
    fractions = [float(f) for f in a.fractions.split(",")]
    trace = ep.synthetic_trace(a.train_tokens + per_config, L, E, k, skew=a.skew, seed=1)
    train, held = trace[:a.train_tokens], trace[a.train_tokens:]
    profile = ep.build_profile(ep.trace_counts(train, E) + 1, L * E)
    replay = Replay(model, held)
    saved = {i: (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj) for i, layer in enumerate(model.layers)}
    blob = 3 * cfg.hidden_size * cfg.moe_intermediate_size * (torch.finfo(dtype).bits // 8)
    result = {
        "machine": {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor()
                    or platform.machine(), "torch": torch.__version__, "threads": torch.get_num_threads()},
        "model": cfg.name, "dtype": str(dtype).removeprefix("torch."), "layers": L, "experts": E, "top_k": k,
        "hidden": cfg.hidden_size, "moe_intermediate": cfg.moe_intermediate_size, "expert_bytes": blob,
        "batch": a.batch, "steps": a.steps,
        "trace": {"skew": a.skew, "train_tokens": a.train_tokens, "kind": "zipf rank**-skew per layer, "
                  "random rank permutation per layer, top_k without replacement (Gumbel top-k)"},
        "build_s": round(time.perf_counter() - t0, 1), "configs": [],
    }
    model.expert_tier = None
    rate = decode_rate(model, replay, 0, a.batch, a.steps, a.warmup, a.context)
    base = rate
    result["configs"].append({"config": "all experts on the device (plain MoE)", "slots": None,
                              "tokens_per_s": rate, "vs_all_resident": 1.0})
    print(json.dumps(result["configs"][-1]), flush=True)
    header_scaled = HEADER_BYTES_PER_TOKEN * L / HEADER_LAYERS
    for frac in fractions:
        slots = int(round(frac * L * E))
        for i, layer in enumerate(model.layers):  # give the tier the experts back to take
            ex = layer.mlp.experts
            ex.gate_up_proj, ex.down_proj = saved[i]
            layer.mlp.expert_tier = None
        t1 = time.perf_counter()
        tier = ExpertTier(model, slots=slots, admission="profile", profile=profile)
        fill_s = time.perf_counter() - t1
        exp_h, exp_hl, _ = ep.hit_rates(held[a.warmup * a.batch:], profile.resident_mask(slots))
        rate = decode_rate(model, replay, 0, a.batch, a.steps, a.warmup, a.context)
        st = tier.stats()
        bpt = st.host_bytes_per_token or 0.0
        steps = a.steps  # stats were reset after the warm-up
        row = {"config": f"offloaded, {frac:.0%} of slots", "slots": slots, "tokens_per_s": rate,
               "vs_all_resident": rate / base,
               "hit_rate": st.hit_rate, "trace_h_expert": exp_h, "trace_h_layer": exp_hl,
               "hit_rate_per_layer": st.hit_rate_per_layer,
               "host_bytes_per_token": bpt,
               "host_bytes_per_token_vs_header_scaled": bpt / header_scaled,
               "host_ms_per_token_at_40GBps": bpt / HEADER_BW * 1e3,
               "host_bytes_per_token_full_model": bpt * FULL_LAYERS_35B / L if "35b" in cfg.name else None,
               "device_reads_per_step": st.syncs / steps, "miss_layer_calls_per_step": st.miss_calls / steps,
               "slot_gib": tier.cache.gib, "tier_build_s": round(fill_s, 2)}
        result["configs"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "hit_rate_per_layer"}), flush=True)
        tier.close()
        model.expert_tier = None
        del tier
        if device.type == "cuda":
            torch.cuda.empty_cache()
    result["header"] = {
        "bytes_per_token": HEADER_BYTES_PER_TOKEN, "ms_at_40GBps": HEADER_BYTES_PER_TOKEN / HEADER_BW * 1e3,
        "layers": HEADER_LAYERS, "scaled_to_this_model_bytes_per_token": header_scaled,
        "scaled_ms_at_40GBps": header_scaled / HEADER_BW * 1e3,
        "note": "the header's model: 48 layers x 512 experts, top 10, quantised blobs; scaled by layers "
                f"({L}/{HEADER_LAYERS})"}
    result["all_miss_bytes_per_token_expected"] = L * k * blob
    result["full_35b_a3b_all_miss_bytes_per_token"] = FULL_LAYERS_35B * k * blob
    text = json.dumps(result, indent=2)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(text if a.json else _table(result))


def _table(result: dict) -> str:
    h = result["header"]
    lines = [f"{result['model']} {result['dtype']} on {result['machine']['device']}: {result['layers']} layers x "
             f"{result['experts']} experts, top {result['top_k']}, expert {result['expert_bytes'] / 2**20:.2f} MiB; "
             f"batch {result['batch']}, {result['steps']} steps; trace skew {result['trace']['skew']}",
             f"header: {h['bytes_per_token'] / 1e6:.1f} MB/token for {h['layers']} layers -> "
             f"{h['scaled_to_this_model_bytes_per_token'] / 1e6:.1f} MB/token for {result['layers']} "
             f"({h['scaled_ms_at_40GBps']:.2f} ms at 40 GB/s); all-miss here: "
             f"{result['all_miss_bytes_per_token_expected'] / 1e6:.1f} MB/token", "",
             f"{'config':<40} {'slots':>6} {'tok/s':>9} {'x plain':>8} {'hit':>6} {'trace h':>8} "
             f"{'host MB/tok':>11} {'x header':>8} {'ms@40GB/s':>9} {'reads/step':>10}"]
    for c in result["configs"]:
        def f(key, fmt, scale=1.0):
            v = c.get(key)
            if not isinstance(v, (int, float)):
                return "-"
            return format(v, fmt) if scale == 1.0 else format(v * scale, fmt)
        lines.append(f"{c['config']:<40} {f('slots', '6d'):>6} {f('tokens_per_s', '9.2f'):>9} "
                     f"{f('vs_all_resident', '8.3f'):>8} {f('hit_rate', '6.3f'):>6} {f('trace_h_expert', '8.3f'):>8} "
                     f"{f('host_bytes_per_token', '11.2f', 1e-6):>11} "
                     f"{f('host_bytes_per_token_vs_header_scaled', '8.3f'):>8} "
                     f"{f('host_ms_per_token_at_40GBps', '9.2f'):>9} {f('device_reads_per_step', '10.1f'):>10}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
