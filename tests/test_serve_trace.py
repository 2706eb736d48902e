"""benchmarks/serve_trace.py on the CPU: a small trace against builtin:random in both cache modes
(real `hpc-cli serve` processes on 127.0.0.1), and the checkpoint writer's CPU shape loaded by the
project's loader, with the 27B shape's tensor names and shapes checked against our model's."""

from __future__ import annotations

import importlib.util
import json
import math
import socket
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "serve_trace.py"


def _module():
    spec = importlib.util.spec_from_file_location("serve_trace", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["serve_trace"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_trace_is_seeded_and_renders_history():
    st = _module()
    cfg = st.TraceConfig(seed=3, sessions=2, turns=4, preamble_tokens=300, user_tokens=(20, 80), edits=True,
                         edit_prob=0.5)
    counter = st.TokenCounter(None)
    a, b = st.build_trace(cfg, 2, counter), st.build_trace(cfg, 2, counter)
    assert a == b
    assert abs(counter.count(a.preamble) - 300) < 40
    assert len(set(a.headers)) == 2
    lengths = {counter.count(t.user_text) for s in a.sessions for t in s.turns}
    assert len(lengths) > 1 and all(15 <= n <= 100 for n in lengths)
    assert all(any(t.edit is not None for t in s.turns) for s in a.sessions)
    msgs = st.render("sys", ["u0", "u1", "u2"], ["a0", "a1"])
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert st.strip_thinking("<think>\nplan\n</think>\n\nanswer") == "answer"


def test_the_ratios_name_the_decode_gap_that_differs():
    st = _module()

    def run(mode, first_gap):
        recs = []
        for i in range(3):
            r = st.RequestRecord(session=i, turn=0, edited=False, sent_s=float(i), prompt_tokens=100,
                                 cached_tokens=80 if mode == "hybrid" else 0, completion_tokens=4, ttft_s=0.01,
                                 total_s=0.05, text="abcd")
            r.arrivals = [0.01, 0.01 + first_gap, 0.01 + first_gap + 0.002, 0.01 + first_gap + 0.004]
            recs.append(r)
        return st.RunResult(mode, 1, recs, 1.0, 0, 0)

    hybrid, off = run("hybrid", 0.004), run("off", 0.002)
    ratio = st.compare(hybrid, st.summarize(hybrid, 3), off, st.summarize(off, 3))
    assert ratio.itl_p50_by_gap == [2.0, 1.0, 1.0]
    assert ratio.decode_tok_s_p50 < 1 and ratio.answers_equal_share == 1.0


def test_quick_run_both_modes(tmp_path):
    out = tmp_path / "trace.json"
    cmd = [sys.executable, str(SCRIPT), "--quick", "--sessions", "2", "--turns", "2", "--preamble-tokens", "300",
           "--concurrency", "1,2", "--rounds", "2", "--port", str(_free_port()), "--serve-arg=--host-cache-mib=64",
           "--serve-args", "--device cpu --max-model-len 4096", "--log-dir", str(tmp_path), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert doc == json.loads(out.read_text())
    assert doc["benchmark"] == "serve_trace"
    for mode in ("hybrid", "off"):
        server = doc["servers"][mode]
        assert server["startup_s"] > 0 and server["exit_code"] is not None
        for c in ("1", "2"):
            r = doc["results"][mode][c]
            assert r["requests"] == 8 and r["errors"] == 0  # 2 sessions x 2 turns x 2 rounds
            for key in ("reuse_share", "prompt_tokens", "prefill_tokens", "ttft_s", "ttft_reuse80_s",
                        "ttft_first_turn_s", "itl_p50_s", "output_tok_s", "wall_s", "compilations"):
                assert key in r
            assert set(r["ttft_s"]) >= {"p50", "p95", "max"}
            assert r["ttft_first_turn_s"]["n"] == 4
            assert sorted({t["round"] for t in r["turns"]}) == [0, 1]
            assert r["prefill_tokens"] == r["prompt_tokens"] - r["cached_tokens"]
            # the client's own preparation of each request is split off the path outside the engine
            for turn in r["turns"]:
                assert 0 < turn["client_prepare_s"] < turn["ttft_s"]
                # the server's part after the engine's first token, per turn
                assert 0 <= turn["server_first_send_s"] < turn["ttft_s"] - turn["engine_ttft_s"]
            assert 0 < r["phases_p50"]["client_prepare"] < r["phases_p50"]["server_overhead"]
    for c in ("1", "2"):
        assert doc["results"]["hybrid"][c]["reuse_share"] > 0
        assert doc["results"]["off"][c]["reuse_share"] == 0
        ratio = doc["ratios"]["hybrid/off"][c]
        assert {"ttft_p50", "ttft_p95", "output_tok_s"} <= set(ratio)
        gaps = min(len(doc["results"][m][c]["itl_p50_by_gap_s"]) for m in ("hybrid", "off"))
        assert len(ratio["itl_p50_by_gap"]) == gaps
        # each round's own ratio
        per_round = doc["round_ttft_p50_ratios"]["hybrid/off"][c]
        assert len(per_round) == 2 and all(x > 0 for x in per_round)
    # one session at a time: a round's first request reuses nothing of the round before it (at
    # concurrency 2 the round's other session may have published the shared preamble first)
    first = {t["round"]: t["cached"] for t in doc["results"]["hybrid"]["1"]["turns"]
             if t["session"] == 0 and t["turn"] == 0}
    assert first == {0: 0, 1: 0}
    assert doc["rounds"] == 2
    assert "hybrid" in proc.stderr and "off" in proc.stderr  # the human table


def test_cpu_checkpoint_loads(tmp_path):
    st = _module()
    from hpc_cli.model.model import HybridModel

    info = st.write_checkpoint(tmp_path / "ckpt", "cpu", vocab=1024, shard_bytes=40 << 20)  # sharded, indexed
    assert info.shards == 3 and (tmp_path / "ckpt" / "model.safetensors.index.json").is_file()
    assert info.dtype == "float32" and info.bytes == 4 * info.parameters
    model = HybridModel.from_name_or_path(str(tmp_path / "ckpt"), progress=False)
    c = model.config
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (256, 1024, 4)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (24, 4, 256)
    assert (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
            c.linear_value_head_dim, c.linear_conv_kernel_dim) == (16, 48, 128, 128, 4)
    assert c.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert c.vocab_size == info.vocab_size == model.tokenizer.vocab_size
    tok = model.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], enable_thinking=False)
    ids = tok.encode(prompt)
    assert tok.token_to_id("<|im_start|>") in ids and tok.token_to_id("<|im_end|>") in tok.eos_token_ids
    assert tok.decode(ids) == prompt


def test_27b_names_and_shapes_match_ours():
    st = _module()
    import torch

    from hpc_cli.model.config import ModelConfig
    from hpc_cli.model.loader import our_name
    from hpc_cli.model.model import HybridModel

    cfg = st.hf_config(st.SHAPES["27b"], vocab_size=6144, eos=[2, 0], pad=0)
    theirs = {our_name(n): s for n, s in st.tensor_shapes(cfg).items()}
    ours = HybridModel(ModelConfig.from_hf_dict(cfg.to_dict(), name="27b"), device="meta", dtype=torch.bfloat16)
    assert theirs == {n: tuple(p.shape) for n, p in ours.named_parameters()}
    assert sum(math.prod(s) for s in theirs.values()) == pytest.approx(3.1e9, rel=0.03)
    assert len(st.plan_shards(st.tensor_shapes(cfg), 2)) == 2
