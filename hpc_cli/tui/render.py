"""Pure functions from a :class:`~hpc_cli.tui.collect.View` to rich renderables.

:func:`frame` lays the panels out for a terminal size: two columns below 120 columns, three from
120; borderless sections when the terminal is short (an 80x24 terminal shows every panel and a
few snapshot rows), bordered panels when it is tall. Nothing here reads the clock or the terminal.
"""

from __future__ import annotations

from rich import box
from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from hpc_cli.tui.collect import View

SPARK = "▁▂▃▄▅▆▇█"
DASH = "-"


# ---------------------------------------------------------------------------------------------
# Formatting
# ---------------------------------------------------------------------------------------------
def fmt_bytes(n: int | float | None) -> str:
    if n is None:
        return DASH
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} {unit}" if unit == "B" else f"{n:.1f} {unit}" if n < 100 else f"{n:.0f} {unit}"
        n /= 1024
    return f"{n:.0f} TiB"  # pragma: no cover


def fmt_count(n: int | float | None) -> str:
    if n is None:
        return DASH
    n = float(n)
    if abs(n) < 10_000:
        return f"{int(n)}" if n == int(n) else f"{n:.1f}"
    for unit in ("k", "M", "G"):
        n /= 1000
        if abs(n) < 1000:
            return f"{n:.1f}{unit}" if n < 100 else f"{n:.0f}{unit}"
    return f"{n:.0f}G"


def fmt_secs(s: float | None) -> str:
    if s is None:
        return DASH
    return f"{s * 1000:.0f}ms" if s < 1 else f"{s:.2f}s" if s < 10 else f"{s:.0f}s"


def fmt_pct(x: float | None) -> str:
    return DASH if x is None else f"{100 * x:.0f}%"


def fmt_gbps(x: float | None) -> str:
    return DASH if x is None else f"{x:.2f} GB/s"


def fmt_uptime(s: float) -> str:
    s = int(s)
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def sparkline(values: list[float], width: int, lo: float | None = 0.0) -> str:
    """The last ``width`` values as block characters, scaled to their max (and ``lo``)."""
    if width <= 0:
        return ""
    if not values:
        return " " * width
    vals = values[-width:]
    low = min(vals) if lo is None else lo
    high = max(vals)
    span = high - low
    out = "".join(SPARK[0] if span <= 0 else SPARK[min(7, int((v - low) / span * 7.999))] for v in vals)
    return out.rjust(width)


# ---------------------------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------------------------
class Bar:
    """A one-line bar that takes the width it is given: ``█`` filled, ``░`` empty (legible without colour)."""

    def __init__(self, value: int, total: int, colour: str) -> None:
        self.value, self.total, self.colour = value, max(total, 1), colour

    def __rich_console__(self, console, options):
        w = max(1, options.max_width)
        filled = min(w, round(w * self.value / self.total))
        if self.value > 0 and filled == 0:
            filled = 1  # something there shows
        yield Text.assemble(("█" * filled, self.colour), ("░" * (w - filled), "bright_black"), no_wrap=True)

    def __rich_measure__(self, console, options):
        from rich.measure import Measurement

        return Measurement(4, options.max_width)


class Spark:
    """A sparkline that takes the width it is given, newest value at the right edge."""

    def __init__(self, values: list[float], colour: str) -> None:
        self.values, self.colour = values, colour

    def __rich_console__(self, console, options):
        yield Text(sparkline(self.values, max(1, options.max_width)), style=self.colour, no_wrap=True)

    def __rich_measure__(self, console, options):
        from rich.measure import Measurement

        return Measurement(1, options.max_width)


def _spark_cell(value: str, values: list[float], colour: str, value_w: int) -> Table:
    """``value`` in a column of ``value_w`` characters, then the sparkline in the rest: the
    sparklines of one panel start in one column and end at its right edge."""
    t = Table.grid(expand=True, padding=(0, 1))
    t.add_column(no_wrap=True, min_width=value_w)
    t.add_column(ratio=1, min_width=1)
    t.add_row(value, Spark(values, colour))
    return t


def _bars(rows: list[tuple[str, int, int, str, str]]) -> Table:
    """Label, value, total, right-hand text, colour -> label | bar | text (the bar takes the rest)."""
    t = Table.grid(expand=True, padding=(0, 1))
    t.add_column(no_wrap=True, min_width=8)
    t.add_column(ratio=1, min_width=6)
    t.add_column(no_wrap=True, justify="right")
    for label, value, total, right, colour in rows:
        t.add_row(label, Bar(value, total, colour), right)
    return t


def _kv(rows: list[tuple[str, RenderableType | str]]) -> Table:
    t = Table.grid(expand=True, padding=(0, 1))
    t.add_column(no_wrap=True, style="dim")
    t.add_column(no_wrap=True, overflow="ellipsis", ratio=1)
    for k, v in rows:
        t.add_row(k, v)
    return t


def section(title: str, body: RenderableType, compact: bool) -> RenderableType:
    if compact:
        return Group(Text(title, style="bold cyan", no_wrap=True, overflow="ellipsis"), body)
    return Panel(body, title=f"[bold cyan]{title}[/]", title_align="left", box=box.ROUNDED,
                 border_style="bright_black", padding=(0, 1))


# ---------------------------------------------------------------------------------------------
# Panels
# ---------------------------------------------------------------------------------------------
def header(v: View) -> RenderableType:
    t = Text(no_wrap=True, overflow="ellipsis")
    t.append("hpc-cli top ", style="bold")
    t.append(v.model, style="bold green")
    for label, value in (("kv", v.kv_profile), ("spec", v.spec_backend), ("cache", v.cache_mode),
                         ("profile", v.profile)):
        if value is None and label == "profile":
            continue
        t.append(f"  {label} ", style="dim")
        t.append(str(value if value is not None else DASH))
    t.append("  up ", style="dim")
    t.append(fmt_uptime(v.uptime_s))
    t2 = Text(no_wrap=True, overflow="ellipsis")
    t2.append("requests ", style="dim")
    t2.append(f"running {v.running}/{v.max_concurrency or DASH}", style="bold")
    t2.append(f" (prefill {v.prefilling})  ")
    t2.append(f"waiting {v.waiting}", style="bold yellow" if v.waiting else "bold")
    t2.append(f"  total {fmt_count(v.reuse.requests)}")
    if v.source:
        t2.append(f"  {v.source}", style="dim")
    lines: list[RenderableType] = [t, t2]
    if v.fatal:
        lines.append(Text(f"engine stopped: {v.fatal}", style="bold red", no_wrap=True, overflow="ellipsis"))
    return Group(*chrome_lines(v), *lines)


def chrome_lines(v: View) -> list[Text]:
    """What the live loop adds above the stats: the server's banner lines, the keys, a notice."""
    lines = [Text(line, style="bold" if i == 0 else "", no_wrap=True, overflow="ellipsis")
             for i, line in enumerate(v.banner)]
    if v.keys:
        lines.append(Text(v.keys, style="dim", no_wrap=True, overflow="ellipsis"))
    if v.notice:
        lines.append(Text(v.notice, style="bold yellow", no_wrap=False, overflow="fold"))
    return lines


def header_height(v: View, width: int) -> int:
    notice = -(-len(v.notice) // max(1, width)) - 1 if v.notice else 0
    return 2 + (1 if v.fatal else 0) + len(chrome_lines(v)) + max(0, notice)


def pool_panel(v: View, compact: bool = False) -> RenderableType:
    p = v.pool
    total = p.pages or 1
    pb = p.page_bytes
    title = f"Device KV pages {fmt_count(p.pages)} × {fmt_bytes(pb)}"
    rows = [(name, n, total, f"{fmt_count(n):>6} {fmt_bytes(n * pb):>9}", colour)
            for name, n, colour in (("Free", p.free, "white"), ("Active", p.active, "green"),
                                    ("Cached", p.cached, "cyan"), ("Filling", p.filling, "yellow"))]
    return section(title, _bars(rows), compact)


def slots_panel(v: View, compact: bool = False) -> RenderableType:
    s = v.slots
    free = max(0, s.slots - s.snapshot - s.staging)
    total = max(s.slots, 1)
    rows = [("Active", s.active, max(s.lanes, 1), f"{s.active}/{s.lanes} lanes", "green"),
            ("Snapshot", s.snapshot, total, f"{s.snapshot}/{s.slots}", "cyan"),
            ("Staging", s.staging, total, f"{s.staging}/{s.slots}", "yellow"),
            ("Superseded", s.superseded, total, f"{s.superseded}/{s.slots} · {free} free", "magenta")]
    return section(f"Snapshot slots {s.slots} × {fmt_bytes(s.image_bytes)}", _bars(rows), compact)


def host_panel(v: View, compact: bool = False) -> RenderableType:
    h = v.host
    sb = h.slab_bytes
    if not h.enabled:
        return section("Host slabs", Text("host tier off (cache.host_cache_mib = 0)", style="dim"), compact)
    total = max(h.slabs, 1)

    def right(n: int) -> str:
        return f"{fmt_count(n):>6} {fmt_bytes(n * sb):>9}"

    rows = [("Free", h.free, total, right(h.free), "white"),
            ("KV blocks", h.node, total, right(h.node), "cyan"),
            ("Images", h.image, total, right(h.image), "blue")]
    body = Group(_bars(rows), Text(f"Tails {h.tail} ({fmt_bytes(h.tail * sb)})  Filling {h.filling} "
                                   f"({fmt_bytes(h.filling * sb)})", no_wrap=True, overflow="ellipsis"))
    return section(f"Host slabs {fmt_count(h.slabs)} × {fmt_bytes(sb)}", body, compact)


def transfers_panel(v: View, compact: bool = False) -> RenderableType:
    t = v.transfers
    rate = lambda x: DASH if x is None else f"{x:.1f}/s"  # noqa: E731
    restore = Text(no_wrap=True, overflow="ellipsis")
    restore.append(f"{t.restores_inflight} in flight {fmt_bytes(t.restore_bytes_inflight)}",
                   style="bold yellow" if t.restores_inflight else "")
    restore.append(f" · {fmt_gbps(t.restore_gbps)}")
    write = Text(no_wrap=True, overflow="ellipsis")
    write.append(f"{t.writes_inflight} in flight {fmt_bytes(t.write_bytes_inflight)}",
                 style="bold yellow" if t.writes_inflight else "")
    write.append(f" · {fmt_gbps(t.write_gbps) if t.write_gbps is not None else rate(t.writes_per_s)}")
    rows = [("Restore", restore),
            ("  done", f"{fmt_count(t.restores_total)} · {fmt_bytes(t.restored_bytes_total)} · {rate(t.restores_per_s)}"),
            ("Write", write),
            ("  done", f"{fmt_count(t.writes_landed_total)} landed"
                       + (f" · {fmt_bytes(t.written_bytes_total)}" if t.written_bytes_total is not None else "")
                       + f" · jobs {t.pending_jobs}"
                       + (f" · [red]fail {t.failures}[/]" if t.failures else ""))]
    return section("Restores / write-through", _kv(rows), compact)


def reuse_panel(v: View, compact: bool = False) -> RenderableType:
    r = v.reuse
    ttft = f"p50 {fmt_secs(r.ttft_p50)} p95 {fmt_secs(r.ttft_p95)}"
    w = max(5, len(ttft))
    rows = [("Hit rate", _spark_cell(f"{fmt_pct(r.hit_rate):>5}", v.spark_hit_rate, "green", w)),
            ("Reuse tok", _spark_cell(f"{fmt_count(r.reuse_tokens):>5}", v.spark_reuse_tps, "cyan", w)),
            ("Saved", f"{fmt_count(r.saved_tokens)} tok · {fmt_count(r.prefill_tokens)} prefilled"),
            ("TTFT", _spark_cell(ttft, v.spark_ttft, "magenta", w))]
    return section("Reuse (TTFT over the last minute)", _kv(rows), compact)


def requests_panel(v: View, compact: bool = False) -> RenderableType:
    restored = fmt_gbps(v.transfers.restore_gbps)
    w = max(9, len(restored))
    rows = [("Running", _spark_cell(f"{v.running:>3}/{v.max_concurrency or DASH}", v.spark_running, "green", w)),
            ("Waiting", _spark_cell(f"{v.waiting:>3}", v.spark_waiting, "yellow", w)),
            ("Prefill", f"{v.prefilling:>3}  snapshot hits {fmt_count(v.reuse.snapshot_hits)}"),
            ("Restored", _spark_cell(restored, v.spark_restore_gbps, "blue", w))]
    return section("Requests", _kv(rows), compact)


def snapshots_panel(v: View, max_rows: int, compact: bool = False) -> RenderableType:
    kinds = " ".join(f"{k} {n}" for k, n in sorted(v.snapshots_by_kind.items())) or "none"
    res = " ".join(f"{k} {n}" for k, n in sorted(v.snapshots_by_residency.items())) or DASH
    summary = Text(f"{v.snapshots_total} total · {kinds} · on {res} · nodes {fmt_count(v.nodes_total)} "
                   f"· L {v.gdsf_L:.3g}", no_wrap=True, overflow="ellipsis", style="dim")
    title = "Snapshots"
    if v.snapshot_rows is None:
        body: RenderableType = Group(summary, Text("(these stats list no snapshot rows)", style="dim"))
        return section(title, body, compact)
    t = Table(box=None, padding=(0, 1), show_edge=False, header_style="bold")
    for name, justify in (("id", "right"), ("frontier", "right"), ("kind", "left"), ("image", "left"),
                          ("tail", "left"), ("hits", "right"), ("GDSF", "right"), ("state", "left")):
        t.add_column(name, justify=justify, no_wrap=True, overflow="ellipsis")
    rows = v.snapshot_rows[:max(0, max_rows)]
    for s in rows:
        t.add_row(str(s.id), fmt_count(s.frontier), s.kind, s.residency, s.tail, fmt_count(s.hits),
                  DASH if s.gdsf is None else f"{s.gdsf:.3g}",
                  Text("superseded", style="magenta") if s.superseded else Text("retained", style="green"))
    more = len(v.snapshot_rows) - len(rows)
    parts: list[RenderableType] = [summary]
    if max_rows > 0:
        parts.append(t)
    if more > 0:
        parts.append(Text(f"… {more} more", style="dim"))
    return section(title, Group(*parts), compact)


def extras_lines(v: View) -> list[RenderableType]:
    """One line each for the speculative backend and the MoE expert tier, only when the stats
    carry them (the default view has neither). The key numbers come first: a narrow terminal
    cuts the tail."""
    out: list[RenderableType] = []
    if v.speculative is not None:
        s = v.speculative
        t = Text(no_wrap=True, overflow="ellipsis")
        t.append("Speculative ", style="bold cyan")
        t.append(f"{s.backend} k{s.k}")
        t.append("  accept ", style="dim")
        t.append(fmt_pct(s.acceptance_rate), style="bold")
        t.append(f" ({fmt_count(s.accepted_draft_tokens)}/{fmt_count(s.draft_tokens)})")
        t.append("  mean length ", style="dim")
        t.append(DASH if s.mean_acceptance_length is None else f"{s.mean_acceptance_length:.2f}", style="bold")
        t.append("  rounds ", style="dim")
        t.append(fmt_count(s.rounds))
        out.append(t)
    if v.experts is not None:
        e = v.experts
        t = Text(no_wrap=True, overflow="ellipsis")
        t.append("Experts ", style="bold cyan")
        t.append(f"slots {e.resident}/{e.slots} resident")
        t.append("  hit ", style="dim")
        t.append(fmt_pct(e.hit_rate), style="bold")
        t.append("  host ", style="dim")
        t.append(f"{fmt_bytes(e.host_bytes_per_token)}/token", style="bold")
        t.append(f"  {e.admission}" + ("" if e.offload else " (no offload)"), style="dim")
        out.append(t)
    return out


# ---------------------------------------------------------------------------------------------
# The frame
# ---------------------------------------------------------------------------------------------
def _row(*cells: RenderableType) -> Table:
    t = Table.grid(expand=True, padding=(0, 1))
    for _ in cells:
        t.add_column(ratio=1)
    t.add_row(*cells)
    return t


def frame(v: View, width: int = 80, height: int = 24) -> RenderableType:
    """The whole screen for a terminal of ``width`` x ``height``."""
    if v.empty:
        return Group(header(v), Text("waiting for the engine's first stats…", style="dim"))
    compact = height < 34
    three = width >= 120
    pool, slots, host = pool_panel(v, compact), slots_panel(v, compact), host_panel(v, compact)
    trans, reuse = transfers_panel(v, compact), reuse_panel(v, compact)
    reqs = requests_panel(v, compact)
    head_h = header_height(v, width)
    panel_h = 5 if compact else 6
    if three:
        grid = [_row(pool, slots, host), _row(trans, reuse, reqs)]
    else:
        grid = [_row(pool, host), _row(slots, trans), _row(reuse, reqs)]
    lines = extras_lines(v)
    extras: list[RenderableType] = []
    if lines:  # one line each when short; a bordered panel when tall
        title = " · ".join(n for n, on in (("Speculative decoding", v.speculative is not None),
                                           ("MoE experts", v.experts is not None)) if on)
        extras = [Group(*lines)] if compact else [section(title, Group(*lines), compact)]
    used = head_h + panel_h * len(grid) + len(lines) + (0 if compact or not lines else 2)
    # snapshots: title/border (1 or 2) + summary + table header
    max_rows = max(0, height - used - (3 if compact else 4) - 1)
    return Group(header(v), *grid, *extras, snapshots_panel(v, max_rows, compact))
