"""`hpc-cli expert` end to end on tiny files, `cache inspect` on STRP, and the engine's [experts] hook."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from hpc_cli.cli import cli
from hpc_cli.errors import ConfigError
from hpc_cli.settings import load_settings


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("expert")
    prompts = d / "prompts.txt"
    prompts.write_text("the quick brown fox\n\njumps over the lazy dog, twice over\nrouting traces of a tiny model\n")
    r = invoke("expert", "record", prompts, "-o", d / "t.bin", "--decode", "6", "--device", "cpu", "--json")
    assert r.exit_code == 0, r.output
    rec = json.loads(r.output)
    r = invoke("expert", "profile", d / "t.bin", "--slots", "40", "-o", d / "p.bin", "--json")
    assert r.exit_code == 0, r.output
    return d, rec, json.loads(r.output)


def test_record_profile_score_inspect(files):
    d, rec, prof = files
    assert rec["prompts"] == 3 and rec["n_layers"] == 8 and rec["n_expert"] == 32 and rec["top_k"] == 4
    assert rec["tokens"] == 19 + 35 + 30 + 3 * 6
    assert prof["slots"] == 40 and 0 < prof["h_expert_in_sample"] <= 1
    r = invoke("expert", "score", d / "p.bin", d / "t.bin", "--json")
    assert r.exit_code == 0, r.output
    sc = json.loads(r.output)
    assert sc["tokens"] == rec["tokens"] and sc["kfold"]["folds"] == 10
    assert sc["h_expert"] == pytest.approx(prof["h_expert_in_sample"])
    assert sc["kfold"]["h_expert_min"] <= sc["kfold"]["h_expert"] <= sc["kfold"]["h_expert_max"]
    r = invoke("expert", "score", d / "p.bin", d / "t.bin", "--slots", "80", "--folds", "4")
    assert r.exit_code == 0 and "held out (4-fold)" in r.output and "per-layer-first-routed" in r.output
    r = invoke("cache", "inspect", d / "p.bin", "--json", "--top", "3")
    assert r.exit_code == 0, r.output
    ins = json.loads(r.output)
    assert ins["format"] == "STRP" and ins["slots"] == 40 and len(ins["top"]) == 3 and len(ins["per_layer"]) == 8
    assert sum(x["resident"] for x in ins["per_layer"]) == 40
    r = invoke("cache", "inspect", d / "p.bin")
    assert r.exit_code == 0 and "expert residency profile" in r.output and "per-layer residency" in r.output


def test_cli_errors(files, tmp_path):
    d, _, _ = files
    r = invoke("expert", "score", d / "t.bin", d / "t.bin")  # a trace is no profile
    assert r.exit_code == 2 and "not an expert profile" in r.output
    (tmp_path / "p.bin").write_bytes(b"STRP" + b"\1\0\0\0")
    r = invoke("cache", "inspect", tmp_path / "p.bin")
    assert r.exit_code == 2 and "truncated" in r.output
    (tmp_path / "empty.txt").write_text("\n")
    r = invoke("expert", "record", tmp_path / "empty.txt", "-o", tmp_path / "x.bin", "--device", "cpu")
    assert r.exit_code == 2 and "no prompts" in r.output
    r = invoke("expert", "record", d / "prompts.txt", "-o", tmp_path / "x.bin", "--model", "builtin:random",
               "--device", "cpu")
    assert r.exit_code == 2 and "dense" in r.output


def test_settings_section_and_combinations(tmp_path):
    r = load_settings(None, environ={})
    assert r.settings.experts.offload is False and r.effective["experts.admission"] == "profile"
    r = load_settings(None, environ={"HPC_EXPERTS__OFFLOAD": "true", "HPC_EXPERTS__BUDGET_SLOTS": "12",
                                     "HPC_EXPERTS__ADMISSION": "first-routed"})
    assert r.settings.experts.budget_slots == 12 and r.source("experts.budget_slots") == "env"
    with pytest.raises(ConfigError, match="both set"):
        load_settings(None, {"experts.budget_slots": 1, "experts.budget_mib": 1}, environ={})
    with pytest.raises(ConfigError, match="needs experts.profile_file"):
        load_settings(None, {"experts.offload": True}, environ={})
    with pytest.raises(ConfigError, match="needs a budget"):
        load_settings(None, {"experts.offload": True, "experts.admission": "first-routed"}, environ={})
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings(None, {"experts.profile_file": str(tmp_path / "nope.bin")}, environ={})
    with pytest.raises(ConfigError, match="experts.admission"):
        load_settings(None, {"experts.admission": "lru"}, environ={})


def test_engine_serves_with_the_tier_and_records(files, tmp_path):
    from hpc_cli.engine.api import GenerationRequest, SamplingParams
    from hpc_cli.engine.engine import Engine
    from hpc_cli.model.expert_profile import read_trace

    d, _, _ = files
    base = {"model.name": "builtin:tiny-moe", "model.device": "cpu", "engine.kv_capacity": 32,
            "engine.max_concurrency": 1, "cache.host_cache_mib": 0}
    prompt = list(range(40, 90))
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    ref = Engine.from_settings(load_settings(None, base, environ={})).start()
    want, _ = ref.generate(GenerationRequest(prompt, greedy))
    ref.stop()
    assert "experts" not in ref.stats().to_json()
    flags = dict(base, **{"experts.offload": True, "experts.profile_file": str(d / "p.bin"),
                          "experts.verify": True, "experts.trace_file": str(tmp_path / "serve.bin")})
    e = Engine.from_settings(load_settings(None, flags, environ={})).start()
    got, _ = e.generate(GenerationRequest(prompt, SamplingParams(max_tokens=6, temperature=0.0)))
    e.stop()
    assert got == want
    # the experts were built in host memory and the tier adopted them (no device copy was made)
    assert e.model.offload_experts and all(h.adopted for h in e.model.expert_tier.host.values())
    st = e.stats().experts
    assert st.slots == 40 and st.resident == 40 and st.admission == "profile"
    assert 0 < st.hit_rate < 1 and st.host_bytes_per_token > 0 and len(st.hit_rate_per_layer) == 8
    assert read_trace(tmp_path / "serve.bin").tokens == st.tokens == len(prompt) + 5
