"""CacheCostModel: prefill and restore seconds (spec §6.2, §11.4).

``prefill_seconds(base=B, tokens=S)`` is the calibrated machine model: a fixed cost per prefill
chunk, a cost per token, and a cost per attention pair, where a prefill of ``S`` tokens after
``B`` cached tokens reads ``B*S + S*(S+1)/2`` pairs. ``restore_seconds(bytes)`` is the bytes
over the measured host-to-device bandwidth plus one per-batch latency.

Costs only rank choices and value snapshots (spec §10.10); capacity and validity never depend
on them. Coefficients are keyed by the artifact's ``prefill_signature``; uncalibrated terms keep
the generic defaults.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class CacheCostModel:
    prefill_signature: str = "generic"
    chunk_tokens: int = 2048
    chunk_seconds: float = 2.0e-3  # fixed cost of one prefill forward pass
    token_seconds: float = 1.0e-4  # per prefilled token (~10k tok/s cold)
    pair_seconds: float = 2.4e-9  # per attention pair
    h2d_bytes_per_second: float = 25.0e9
    restore_batch_seconds: float = 2.0e-4  # per restore batch (submission + events)

    def prefill_seconds(self, base: int, tokens: int) -> float:
        """Seconds to prefill ``tokens`` tokens after ``base`` cached ones."""
        if tokens <= 0:
            return 0.0
        chunks = -(-tokens // self.chunk_tokens)
        pairs = base * tokens + tokens * (tokens + 1) // 2
        return chunks * self.chunk_seconds + tokens * self.token_seconds + pairs * self.pair_seconds

    def restore_seconds(self, nbytes: int) -> float:
        """Seconds to restore ``nbytes`` from the host tier (0 when nothing moves)."""
        if nbytes <= 0:
            return 0.0
        return nbytes / self.h2d_bytes_per_second + self.restore_batch_seconds


#: Generic defaults (what an uncalibrated artifact uses).
GENERIC = CacheCostModel()

#: Presets by name. RTX 5090 figures are the spec's (§3.3: 10.2k tok/s cold, ~4.2k tok/s at
#: 121k context, restores 24-27 GB/s on PCIe 5.0 x8); H200 figures are ARCHITECTURE.md's
#: (pinned H2D 55.4 GB/s for large copies, 42-45 GB/s for 2 MiB copies).
PRESETS: dict[str, CacheCostModel] = {
    "generic": GENERIC,
    "rtx5090-27b": CacheCostModel(prefill_signature="rtx5090-27b", chunk_tokens=2048,
                                  chunk_seconds=2.0e-3, token_seconds=1.0 / 10200,
                                  pair_seconds=2.4e-9, h2d_bytes_per_second=25.5e9,
                                  restore_batch_seconds=2.0e-4),
    "h200-27b": CacheCostModel(prefill_signature="h200-27b", chunk_tokens=4096,
                               chunk_seconds=1.5e-3, token_seconds=1.0 / 25000,
                               pair_seconds=1.0e-9, h2d_bytes_per_second=44.0e9,
                               restore_batch_seconds=1.0e-4),
}


def preset(name: str) -> CacheCostModel:
    """A named preset; an unknown name raises ConfigError listing the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        from hpc_cli.errors import ConfigError
        raise ConfigError(f"unknown cache cost preset {name!r}",
                          hint="known presets: " + ", ".join(sorted(PRESETS))) from None
