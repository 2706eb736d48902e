"""The bench plots (matplotlib, Agg: no display needed), one PNG each:

- ``reuse.png``: the share of each request's prompt the cache served, in trace order, per mode;
- ``ttft.png``: the distribution of the time to first token per mode (empirical CDF);
- ``residency.png``: what the cache held over the run (device KV and state images, host tier).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from hpc_cli.bench.replay import ModeRun

MiB = float(1 << 20)
#: the same colour per mode in every plot
COLOURS = {"hybrid": "#1f77b4", "legacy": "#d62728", "off": "#7f7f7f"}
OTHERS = ("#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf")


def _colour(mode: str, k: int) -> str:
    return COLOURS.get(mode, OTHERS[k % len(OTHERS)])


def _figure(width: float = 7.0, height: float = 3.4):
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(width, height), dpi=100)
    ax.grid(True, alpha=0.3)
    return plt, fig, ax


def _save(plt, fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


def plot_reuse(runs: Sequence[ModeRun], path: Path, title: str) -> str:
    plt, fig, ax = _figure()
    for k, run in enumerate(runs):
        xs = [r.index for r in run.results if r.error is None]
        ys = [100 * r.reuse for r in run.results if r.error is None]
        ax.plot(xs, ys, marker="o", markersize=3.5, linewidth=1.2, label=run.mode, color=_colour(run.mode, k))
    ax.set_xlabel("request (trace order)")
    ax.set_ylabel("prompt served by the cache (%)")
    ax.set_ylim(-3, 103)
    ax.set_title(f"reuse per request: {title}", fontsize=10)
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def plot_ttft(runs: Sequence[ModeRun], path: Path, title: str) -> str:
    plt, fig, ax = _figure()
    for k, run in enumerate(runs):
        ttft = sorted(1000 * r.ttft_s for r in run.results if r.error is None and r.ttft_s is not None)
        if not ttft:
            continue
        ys = [(i + 1) / len(ttft) for i in range(len(ttft))]
        ax.step(ttft, ys, where="post", linewidth=1.5, label=run.mode, color=_colour(run.mode, k))
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("time to first token (ms, log scale)")
    ax.set_ylabel("share of requests")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"TTFT distribution: {title}", fontsize=10)
    ax.legend(fontsize=8, loc="lower right")
    return _save(plt, fig, path)


def plot_residency(runs: Sequence[ModeRun], path: Path, title: str) -> str:
    plt, fig, ax = _figure()
    for k, run in enumerate(runs):
        if not run.residency:
            continue
        c = _colour(run.mode, k)
        ts = [s.t_s for s in run.residency]
        ax.plot(ts, [(s.device_kv_bytes + s.device_state_bytes) / MiB for s in run.residency], color=c,
                linewidth=1.4, label=f"{run.mode}: device")
        if any(s.host_bytes for s in run.residency):
            ax.plot(ts, [s.host_bytes / MiB for s in run.residency], color=c, linewidth=1.2, linestyle="--",
                    label=f"{run.mode}: host")
    ax.set_xlabel("seconds since the mode's first request")
    ax.set_ylabel("cache held (MiB)")
    ax.set_title(f"cache residency: {title}", fontsize=10)
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def write_plots(runs: Sequence[ModeRun], out_dir: Path, title: str) -> dict[str, str]:
    """The three PNGs in ``out_dir``; name -> path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    return {"reuse": plot_reuse(runs, out_dir / "reuse.png", title),
            "ttft": plot_ttft(runs, out_dir / "ttft.png", title),
            "residency": plot_residency(runs, out_dir / "residency.png", title)}
