"""The bench report: per mode the reuse share (sum of cached tokens over sum of prompt tokens),
the prefill tokens, the time to first token (p50, p95, mean, max), the whole request's p50 and
the wall time; one JSON document with every request and residency sample, and a table."""

from __future__ import annotations

import json
import math
import platform
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

from hpc_cli.bench.replay import ModeRun


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass(frozen=True, slots=True)
class ModeSummary:
    mode: str
    requests: int
    errors: int
    prompt_tokens: int
    cached_tokens: int
    prefill_tokens: int
    reuse_share: float
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    ttft_mean_s: float | None
    ttft_max_s: float | None
    total_p50_s: float | None
    wall_s: float
    peak_device_bytes: int
    peak_host_bytes: int

    @classmethod
    def of(cls, run: ModeRun) -> "ModeSummary":
        ok = [r for r in run.results if r.error is None]
        prompt = sum(r.prompt_tokens for r in ok)
        cached = sum(r.cached_tokens for r in ok)
        ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
        return cls(run.mode, len(run.results), len(run.results) - len(ok), prompt, cached, prompt - cached,
                   cached / prompt if prompt else 0.0, percentile(ttft, 0.5), percentile(ttft, 0.95),
                   sum(ttft) / len(ttft) if ttft else None, max(ttft, default=None),
                   percentile([r.total_s for r in ok], 0.5), run.wall_s,
                   max((s.device_kv_bytes + s.device_state_bytes for s in run.residency), default=0),
                   max((s.host_bytes for s in run.residency), default=0))


def report(runs: Sequence[ModeRun], *, trace: str, meta: dict[str, object], settings: dict[str, object],
           plots: dict[str, str]) -> dict[str, object]:
    """The JSON document: what ran, a summary per mode, every request and residency sample."""
    return {
        "benchmark": "hpc-cli bench", "trace": trace, "trace_meta": meta, "settings": settings,
        "machine": {"python": platform.python_version(), "platform": platform.platform(),
                    "processor": platform.processor() or platform.machine()},
        "summary": {r.mode: asdict(ModeSummary.of(r)) for r in runs},
        "runs": {r.mode: {"wall_s": r.wall_s, "setup_s": r.setup_s,
                          "requests": [asdict(x) for x in r.results],
                          "residency": [asdict(s) for s in r.residency],
                          "cache_stats": r.cache_stats} for r in runs},
        "plots": plots,
    }


def write_report(doc: dict[str, object], path: Path) -> None:
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1000 * x:.0f}"


def table_rows(runs: Sequence[ModeRun]) -> tuple[list[str], list[list[str]]]:
    """The table's header and rows (one per mode), for rich or Markdown."""
    head = ["mode", "requests", "reuse", "cached tok", "prefill tok", "TTFT p50 ms", "TTFT p95 ms",
            "TTFT mean ms", "wall s"]
    rows = []
    for run in runs:
        s = ModeSummary.of(run)
        rows.append([s.mode, f"{s.requests}" + (f" ({s.errors} failed)" if s.errors else ""),
                     f"{100 * s.reuse_share:.1f}%", f"{s.cached_tokens}", f"{s.prefill_tokens}",
                     _ms(s.ttft_p50_s), _ms(s.ttft_p95_s), _ms(s.ttft_mean_s), f"{s.wall_s:.1f}"])
    return head, rows


def markdown_table(runs: Sequence[ModeRun]) -> str:
    head, rows = table_rows(runs)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)
