"""The terminal view: render functions against fixture stats (``engine.stats()`` documents, see
make_fixtures.py), and `hpc-cli top` against a stand-in HTTP server on 127.0.0.1 (fixture JSON from
http.server), including one that goes away. test_real_server.py runs it against `hpc-cli serve`."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from rich.console import Console

from hpc_cli.tui.collect import Collector, build_view, percentile, settings_meta, url_source, SourceGone
from hpc_cli.tui.render import fmt_bytes, frame, sparkline

FIX = Path(__file__).parent / "fixtures"


def load(name: str) -> dict:
    return json.loads((FIX / f"{name}.json").read_text())


def text_of(renderable, width: int, height: int) -> str:
    con = Console(width=width, height=height, record=True, color_system=None, file=open(os.devnull, "w"))
    con.print(renderable)
    return con.export_text()


def render(stats: dict, width=80, height=24, collector=None) -> str:
    c = collector or Collector(lambda: stats, "fixture")
    return text_of(frame(c.update(stats), width, height), width, height)


# ---------------------------------------------------------------------------------------------- collect
def test_view_from_busy_fixture():
    s = load("busy")
    v = build_view(s)
    pool = s["cache"]["pool"]
    assert (v.pool.free, v.pool.active, v.pool.cached, v.pool.filling) == (
        pool["free"], pool["active"], pool["cached"], pool["filling"])
    assert v.pool.pages == s["cache"]["pages"] and v.pool.page_bytes == s["cache"]["page_bytes"]
    req = s["requests"]
    assert (v.running, v.waiting, v.prefilling) == (req["running"], req["waiting"], req["prefilling"])
    assert v.running >= 2 and v.waiting >= 1
    host = s["cache"]["index"]["host"]
    assert v.host.free == host["free_slabs"] and v.host.image == host["slabs_by_use"]["image"]
    assert v.snapshot_rows and len(v.snapshot_rows) == len(s["cache"]["top_snapshots"])
    assert v.transfers.write_bytes_inflight == s["cache"]["inflight"]["write_bytes"]
    assert v.spec_backend == "none" and v.cache_mode == "hybrid" and v.profile is None
    assert v.speculative is None and v.experts is None
    c = s["counters"]
    assert v.reuse.hit_rate == pytest.approx(c["reuse_tokens"] / c["prompt_tokens"])
    assert v.reuse.ttft_p50 == pytest.approx(percentile(s["ttft_recent_s"], 0.5))


def test_older_stats_without_rows_or_settings():
    s = load("idle")
    for key in ("top_snapshots", "inflight"):
        del s["cache"][key]
    del s["settings"]
    v = build_view(s)
    assert v.snapshot_rows is None and v.running == 0 and v.snapshots_total > 0
    assert v.spec_backend is None and v.transfers.restore_bytes_inflight is None
    out = render(s, 80, 24)
    assert "spec -  cache -" in out and "(these stats list no snapshot rows)" in out


def test_spec_and_expert_stats():
    s = load("spec_moe")
    v = build_view(s)
    sp, ex = s["speculative"], s["experts"]
    assert v.spec_backend == "mtp" and v.speculative.backend == "mtp" and v.speculative.k == sp["k"]
    assert v.speculative.acceptance_rate == pytest.approx(sp["acceptance_rate"])
    assert v.speculative.mean_acceptance_length == pytest.approx(sp["mean_acceptance_length"])
    assert (v.experts.slots, v.experts.resident) == (ex["slots"], ex["resident"])
    assert v.experts.hit_rate == pytest.approx(ex["hit_rate"])
    assert v.experts.host_bytes_per_token == pytest.approx(ex["host_bytes_per_token"])
    for w, h in ((80, 24), (200, 50)):
        out = render(s, w, h)
        assert f"Speculative mtp k{sp['k']}  accept {100 * sp['acceptance_rate']:.0f}% " in out
        assert f"mean length {sp['mean_acceptance_length']:.2f}" in out
        assert f"Experts slots {ex['resident']}/{ex['slots']} resident  hit {100 * ex['hit_rate']:.0f}%" in out
        assert f"host {fmt_bytes(ex['host_bytes_per_token'])}/token" in out
    assert "Speculative decoding · MoE experts" in render(s, 200, 50)  # a panel when tall
    # stats of an engine with a drafting backend but no expert tier: one line, no expert line
    s2 = copy.deepcopy(s)
    del s2["experts"]
    out = render(s2, 80, 24)
    assert "Speculative mtp" in out and "Experts" not in out


@pytest.mark.parametrize("name", ["idle", "busy"])
def test_default_view_has_no_spec_or_expert_lines(name):
    for w, h in ((80, 24), (200, 50)):
        out = render(load(name), w, h)
        assert "Speculative" not in out and "Experts" not in out and "MoE" not in out
        assert "spec none  cache hybrid" in out


def test_empty_and_partial_stats_do_not_crash():
    assert build_view({}).empty
    out = render({"model": "m", "requests": {"running": 1}})
    assert "m" in out and "Snapshots" in out
    assert "waiting for the engine" in render({})


def test_rates_and_sparklines_from_history():
    s = load("busy")
    clock = [100.0]
    c = Collector(lambda: s, clock=lambda: clock[0])
    c.update(s)
    s2 = copy.deepcopy(s)
    s2["cache"]["index"]["counters"]["restored_bytes"] += 4_000_000_000
    s2["cache"]["index"]["counters"]["restores"] += 8
    s2["counters"]["prompt_tokens"] += 1000
    s2["counters"]["reuse_tokens"] += 900
    clock[0] += 2.0
    v = c.update(s2)
    assert v.transfers.restore_gbps == pytest.approx(2.0)
    assert v.transfers.restores_per_s == pytest.approx(4.0)
    assert v.spark_hit_rate[-1] == pytest.approx(0.9)
    clock[0] += 1.0  # no prompt finished in this interval: the rate carries on, it is no 0% dip
    assert c.update(s2).spark_hit_rate[-2:] == pytest.approx([0.9, 0.9])
    out = text_of(frame(v, 80, 24), 80, 24)
    assert "2.00 GB/s" in out
    clock[0] += 120  # history keeps one minute
    c.update(s2)
    assert len(c.samples) == 1


def test_settings_meta():
    from hpc_cli.settings import load_settings

    meta = settings_meta(load_settings(None, {"speculative.backend": "mtp"}, environ={}))
    assert meta["speculative_backend"] == "mtp" and meta["cache_mode"] == "hybrid" and meta["kv_profile"] == "bf16"
    assert meta["profile_path"] is None
    v = build_view({"model": "m", "settings": {**meta, "profile_path": "/etc/hpc/h200-27b.toml"}})
    assert (v.spec_backend, v.cache_mode, v.profile) == ("mtp", "hybrid", "h200-27b")
    assert "profile h200-27b" in render({"model": "m", "settings": {**meta, "profile_path": "/x/h200-27b.toml"}})


# ---------------------------------------------------------------------------------------------- render
def test_helpers():
    assert fmt_bytes(0) == "0 B" and fmt_bytes(65536) == "64.0 KiB" and fmt_bytes(None) == "-"
    assert sparkline([0, 1, 2, 3], 4) == "▁▃▆█" and sparkline([], 3) == "   "
    assert len(sparkline(list(range(100)), 10)) == 10


@pytest.mark.parametrize("size", [(80, 24), (200, 50), (100, 30), (120, 40)])
@pytest.mark.parametrize("name", ["idle", "busy", "spec_moe"])
def test_frame_fits_and_shows_key_numbers(name, size):
    width, height = size
    s = load(name)
    out = render(s, width, height)
    lines = out.rstrip("\n").split("\n")
    assert all(len(line) <= width for line in lines), max(lines, key=len)
    assert len(lines) <= height, f"{len(lines)} lines at {size}"
    for panel in ("Device KV pages", "Snapshot slots", "Host slabs", "Restores / write-through", "Reuse",
                  "Requests", "Snapshots"):
        assert panel in out
    pool = s["cache"]["pool"]
    assert str(pool["free"]) in out and str(s["cache"]["pages"]) in out
    assert f"waiting {s['requests']['waiting']}" in out
    assert f"running {s['requests']['running']}/" in out
    assert str(s["counters"]["reuse_tokens"]) in out
    assert s["model"] in out and "kv bf16" in out
    assert "…" not in out.replace("… ", ""), "a cut cell"  # "… N more" is the only ellipsis allowed


def test_busy_snapshot_rows_appear():
    s = load("busy")
    out = render(s, 200, 50)
    assert len(s["cache"]["top_snapshots"]) > 3
    for row in s["cache"]["top_snapshots"]:
        assert any(str(row["frontier"]) in line and row["kind"] in line for line in out.split("\n"))
    small = render(s, 80, 24)
    assert "more" in small  # the rows that do not fit are counted, not cut


def test_fatal_is_shown():
    s = load("idle")
    s["fatal"] = "RuntimeError: transfer failed"
    assert "engine stopped: RuntimeError: transfer failed" in render(s, 80, 24)


# ---------------------------------------------------------------------------------------------- hpc-cli top
class _Stats(BaseHTTPRequestHandler):
    payload = b"{}"
    key: str | None = None
    hits: threading.Event

    def do_GET(self):  # noqa: N802
        self.hits.set()
        if self.path != "/v1/cache/stats":
            self.send_error(404)
            return
        if self.key and self.headers.get("Authorization") != f"Bearer {self.key}":
            self.send_response(401)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(self.payload)))
        self.end_headers()
        self.wfile.write(self.payload)

    def log_message(self, *args):
        pass


@pytest.fixture()
def stats_server():
    handler = type("H", (_Stats,), {"payload": (FIX / "busy.json").read_bytes(), "key": "sekret",
                                   "hits": threading.Event()})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    yield srv, f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def _top(*args: str):
    """`hpc-cli top ARGS` in process (the HTTP client is real; subprocesses only where it matters)."""
    from click.testing import CliRunner

    from hpc_cli.cli import cli

    return CliRunner(env={"COLUMNS": "80", "LINES": "24", "NO_COLOR": "1"}).invoke(cli, ["top", *args])


def test_top_once_against_live_server(stats_server):
    _, url = stats_server
    r = _top("--once", "--url", url, "--api-key", "sekret")
    assert r.exit_code == 0, r.stderr
    assert "Device KV pages" in r.stdout and f"waiting {load('busy')['requests']['waiting']}" in r.stdout and url in r.stdout
    assert all(len(line) <= 80 for line in r.stdout.split("\n"))


def test_top_wrong_key_is_one_clear_line(stats_server):
    _, url = stats_server
    r = _top("--once", "--url", url)
    assert r.exit_code == 2
    assert "refused the API key" in r.stderr and "Traceback" not in r.stderr


def test_top_no_server_is_one_clear_line():
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = _top("--once", "--url", f"http://127.0.0.1:{port}")
    assert r.exit_code == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith(f"error: cannot reach http://127.0.0.1:{port}"), r.stderr


def test_top_server_going_away_while_attached(stats_server):
    srv, url = stats_server
    proc = subprocess.Popen([sys.executable, "-m", "hpc_cli", "top", "--url", url, "--api-key", "sekret",
                             "--refresh-hz", "10"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**{k: v for k, v in os.environ.items() if not k.startswith("HPC_")},
                                 "COLUMNS": "80", "LINES": "24"})
    try:
        assert srv.RequestHandlerClass.hits.wait(20), "the client never asked for stats"
        time.sleep(0.3)  # a few frames while attached
        srv.shutdown()
        srv.server_close()
        out, err = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2, err
    assert "Traceback" not in err
    assert re.search(rf"^error: {url} went away \(connection (refused|closed)\)$", err, re.M) and len(err.strip().split("\n")) == 2  # error + hint
    assert "Device KV pages" in out


def test_url_source_errors(stats_server):
    _, url = stats_server
    with pytest.raises(SourceGone, match="HTTP 404"):
        url_source(url + "/nope/")()
    assert url_source(url, "sekret")()["requests"] == load("busy")["requests"]
