"""Hybrid prefix cache index: model-agnostic, pure Python (no torch), spec §5, §6.1-6.4, §7.1,
§9 and §10. It records page, slab and slot ids; the memory layer owns the bytes."""

from hpc_cli.cache.cost import PRESETS, CacheCostModel, preset
from hpc_cli.cache.host import HostSlabPool, SlabUse, image_slabs
from hpc_cli.cache.index import PrefixIndex
from hpc_cli.cache.records import (
    CacheGeometry,
    CommitOutcome,
    Freed,
    PublishResult,
    Quote,
    Readiness,
    Release,
    RestoreBatch,
    SequencePath,
    SlotGrant,
    Staged,
    StaleQuote,
    WriteBatch,
)
from hpc_cli.cache.invariants import check_invariants
from hpc_cli.cache.keys import (
    BLOCK_TOKENS,
    HASH_SEED,
    BlockKey,
    MediaItem,
    PreparedPrompt,
    block_hashes,
    lookup_hash,
    media_key,
    prepare_prompt,
    token_bytes,
)
from hpc_cli.cache.lru import LruList
from hpc_cli.cache.snapshot import Snapshot, SnapshotKind
from hpc_cli.cache.taps import Placement, Tap, TapHint, TapPlanner, TapSource
from hpc_cli.cache.tree import BlockNode, BlockTree, MatchResult, Residency

__all__ = [
    "BLOCK_TOKENS", "HASH_SEED", "PRESETS", "BlockKey", "BlockNode", "BlockTree", "CacheCostModel",
    "CacheGeometry", "CommitOutcome", "Freed", "HostSlabPool", "LruList", "MatchResult", "MediaItem",
    "Placement", "PrefixIndex", "PreparedPrompt", "PublishResult", "Quote", "Readiness", "Release",
    "Residency", "RestoreBatch", "SequencePath", "SlabUse", "SlotGrant", "Snapshot", "SnapshotKind",
    "Staged", "StaleQuote", "Tap", "TapHint", "TapPlanner", "TapSource", "WriteBatch",
    "block_hashes", "check_invariants", "image_slabs", "lookup_hash", "media_key", "prepare_prompt",
    "preset", "token_bytes",
]
