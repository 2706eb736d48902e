"""The keys of every section of the engine's stats as JSON (``to_json(engine.detailed_stats())``,
what ``/v1/cache/stats``, ``/metrics`` and ``hpc-cli top`` read), pinned per cache mode, with a
speculative backend and with the MoE expert tier: a change of the types behind them must write
the same document."""

from __future__ import annotations

import json

import pytest
import torch

from hpc_cli.cache.stats import RESIDENCY
from hpc_cli.engine.api import GenerationRequest, SamplingParams, to_json
from hpc_cli.engine.engine import Engine

KW = dict(kv_pages=64, prefill_chunk=128, max_concurrency=2, host_cache_mib=8)
PROMPT = list(range(10, 250)) * 2

TOP = {"model", "kv_profile", "max_concurrency", "prefill_chunk", "uptime_s", "requests", "counters", "cache",
       "ttft_recent_s", "fatal", "compilations", "kernel_compilations", "settings"}
KERNEL_COMPILATIONS = {"after_warmup", "total", "autotunes", "warm", "after_warmup_by_kernel"}
RESIDENCY_KEYS = {"device_kv_bytes", "device_state_bytes", "host_bytes", "entries"}
HOST_TIER = {"state", "ready_bytes", "total_bytes", "ready_slabs", "ready_chunks", "chunks", "seconds", "error"}
CACHE = {"pool", "pages", "lanes_free", "host_slabs", "slab_bytes", "page_bytes", "image_bytes",
         "transfers_pending", "residency"}
HYBRID_COUNTERS = {"restored_host_bytes", "taps", "taps_in_pass", "taps_skipped", "endpoints", "transfer_failures", "blocked",
                   "coalesce_waits", "prefetched_blocks", "prefetched_bytes"}
LEGACY_COUNTERS = {"taps", "taps_skipped", "endpoints", "blocked", "restored_host_bytes", "demoted_bytes",
                   "transfer_failures", "prefill_splits"}
INDEX_SNAPSHOTS = {"total", "by_kind", "by_residency", "with_tail", "superseded"}
INDEX_DEVICE = {"cached_page_bundles", "lru_backed", "lru_unbacked", "snapshot_slots", "snapshot_slots_used",
                "block_bytes_cached", "image_bytes_cached"}
INDEX_HOST = {"slabs", "ready_slabs", "free_slabs", "slab_bytes", "slabs_by_use", "bytes_by_use", "dead_kv_nodes"}
INDEX_COUNTERS = {"quotes", "stages", "reuse_tokens", "restores", "restored_bytes", "prefetches",
                  "prefetched_blocks", "commits", "published", "publish_duplicates", "snapshot_hits", "superseded",
                  "retained_again", "image_writes_refused", "block_writes_refused", "writes_landed",
                  "device_evictions_backed", "device_evictions_unbacked", "dead_kv_reclaimed",
                  "host_superseded_evictions", "host_gdsf_evictions", "slot_value_evictions",
                  "taps_skipped_no_slot", "nodes_deleted", "snapshots_deleted"}
CATALOG = {"private_continuations", "shared_prefixes", "checkpoints", "counters"}
CATALOG_COUNTERS = {"matches", "misses", "published_endpoints", "published_anchors", "published_shared",
                    "replaced", "evicted", "demoted"}
SNAPSHOT_ROW = {"id", "frontier", "kind", "residency", "tail", "hits", "gdsf", "superseded"}
SPECULATIVE = {"backend", "k", "rollback", "rounds", "draft_tokens", "accepted_draft_tokens", "acceptance_rate",
               "mean_acceptance_length", "accepted_histogram", "propose_s", "verify_s", "rollback_s",
               "catch_up_s", "recomputed_columns", "proposals_ahead", "proposals_ahead_used", "verify_chained",
               "verify_ahead_used", "verify_ahead_round_s"}
EXPERTS = {"offload", "admission", "slots", "resident", "slot_bytes", "fills", "expert_bytes", "hit_rate",
           "hit_rate_per_layer", "tokens", "host_bytes", "host_bytes_per_token", "recording", "syncs", "miss_calls"}


@pytest.fixture(scope="module")
def model():
    from hpc_cli.model.model import HybridModel

    torch.manual_seed(0)
    return HybridModel.from_name_or_path("builtin:random", dtype=torch.float32)


def _served(e: Engine) -> dict:
    """Three requests sharing a prefix, then the detailed stats as JSON text would carry them."""
    try:
        for extra in ([], [1, 2, 3], [4, 5, 6, 7] * 20):
            e.generate(GenerationRequest(PROMPT + extra, SamplingParams(max_tokens=6, temperature=0)), timeout=300)
        doc = to_json(e.detailed_stats(timeout=30))
    finally:
        e.stop()
    assert isinstance(doc, dict)
    assert json.loads(json.dumps(doc)) == doc  # plain JSON: nothing but dicts, lists and scalars
    return doc


def _common(doc: dict, mode_keys: set[str]) -> dict:
    assert set(doc) == TOP, sorted(doc)
    assert set(doc["kernel_compilations"]) == KERNEL_COMPILATIONS
    assert set(doc["requests"]) == {"running", "waiting", "prefilling"}
    assert set(doc["settings"]) == {"kv_profile", "speculative_backend", "cache_mode", "profile_path"}
    assert {"requests", "prompt_tokens", "reuse_tokens", "prefill_tokens", "generated_tokens"} <= set(doc["counters"])
    cache = doc["cache"]
    assert set(cache) == CACHE | mode_keys, sorted(cache)
    assert list(cache["pool"]) == ["free", "active", "cached", "filling"]
    assert sum(cache["pool"].values()) == cache["pages"]
    assert set(cache["residency"]) == RESIDENCY_KEYS
    assert all(set(r) == SNAPSHOT_ROW for r in cache.get("top_snapshots", []))
    return cache


def test_hybrid_sections(model):
    doc = _served(Engine(model, cache_mode="hybrid", **KW).start())
    cache = _common(doc, HYBRID_COUNTERS | {"top_snapshots", "index", "snapshot_slots", "host_tier", "inflight"})
    assert set(cache["host_tier"]) == HOST_TIER and set(cache["inflight"]) == {"restore_bytes", "write_bytes"}
    assert cache["top_snapshots"]
    index = cache["index"]
    assert list(index) == ["nodes", "snapshots", "device", "host", "gdsf_L", "epoch", "sequences", "transfers",
                           "counters"]
    nodes = index["nodes"]  # residencies with no node are left out
    assert {"total", "filling", "pinned"} <= set(nodes) <= {"total", "filling", "pinned", *RESIDENCY}
    assert set(nodes["filling"]) <= {"device", "host"} and nodes["total"] > 0
    assert set(index["snapshots"]) == INDEX_SNAPSHOTS
    assert set(index["snapshots"]["by_residency"]) <= set(RESIDENCY) and index["snapshots"]["by_kind"]
    assert set(index["device"]) == INDEX_DEVICE
    assert set(index["host"]) == INDEX_HOST
    assert set(index["host"]["bytes_by_use"]) == set(index["host"]["slabs_by_use"]) >= {"free", "node"}
    assert set(index["transfers"]) == {"restores", "writes"}
    assert set(index["counters"]) == INDEX_COUNTERS
    assert index["counters"]["commits"] and index["counters"]["published"]
    assert "experts" not in doc and "speculative" not in doc


def test_legacy_sections(model):
    doc = _served(Engine(model, cache_mode="legacy", **KW).start())
    cache = _common(doc, LEGACY_COUNTERS | {"top_snapshots", "mode", "catalog", "device_state_slots", "device_state_slots_used",
                                            "host_kv_slabs", "host_kv_slabs_used", "host_state_slots",
                                            "host_state_slots_used", "host_tier"})
    assert cache["mode"] == "legacy" and set(cache["host_tier"]) == HOST_TIER
    catalog = cache["catalog"]
    assert list(catalog) == ["private_continuations", "shared_prefixes", "checkpoints", "counters"]
    assert set(catalog["checkpoints"]) == {"total", "by_kind", "by_residency"}
    assert catalog["checkpoints"]["total"] == sum(catalog["checkpoints"]["by_kind"].values()) > 0
    assert list(catalog["counters"]) == ["matches", "misses", "published_endpoints", "published_anchors",
                                         "published_shared", "replaced", "evicted", "demoted"]


def test_off_sections(model):
    doc = _served(Engine(model, cache_mode="off", **KW).start())
    cache = _common(doc, {"mode", "taps", "blocked"})
    assert cache["mode"] == "off"  # no snapshot table


def test_speculative_section(model):
    doc = _served(Engine(model, cache_mode="hybrid", speculative="mtp", **KW).start())
    spec = doc["speculative"]
    assert set(doc) == TOP | {"speculative"}
    assert list(spec) == ["backend", "k", "rollback", "rounds", "draft_tokens", "accepted_draft_tokens",
                          "acceptance_rate", "mean_acceptance_length", "accepted_histogram", "propose_s", "verify_s",
                          "rollback_s", "catch_up_s", "recomputed_columns", "proposals_ahead",
                          "proposals_ahead_used", "verify_chained", "verify_ahead_used", "verify_ahead_round_s"]
    assert spec["backend"] == "mtp" and spec["rounds"] > 0
    assert all(k.isdigit() for k in spec["accepted_histogram"])


def test_experts_section():
    from hpc_cli.settings import load_settings

    r = load_settings(None, {"model.name": "builtin:tiny-moe", "cache.host_cache_mib": 16, "experts.offload": True,
                             "experts.budget_slots": 24, "experts.admission": "first-routed"}, environ={})
    doc = _served(Engine.from_settings(r).start())
    ex = doc["experts"]
    assert list(ex) == ["offload", "admission", "slots", "resident", "slot_bytes", "fills", "expert_bytes",
                        "hit_rate", "hit_rate_per_layer", "tokens", "host_bytes", "host_bytes_per_token",
                        "recording", "syncs", "miss_calls"]
    assert set(ex) == EXPERTS and ex["offload"] is True and ex["slots"] == 24
    assert len(ex["hit_rate_per_layer"]) > 0 and ex["tokens"] > 0
