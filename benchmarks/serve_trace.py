"""A multi-turn chat trace through the HTTP server: the hybrid cache against the cache off, as a user feels it.

What it measures: a seeded chat trace (``--sessions`` sessions x ``--turns`` turns sharing a long
system preamble, user messages of random lengths, the history re-rendered every turn with the
previous answers as assistant messages and thinking stripped, optionally ``--edits`` that change
a message deep in the history) is replayed through ``hpc-cli serve`` with the official ``openai``
client, streaming, once per cache mode (``hybrid``, ``off`` = ``--cache-mode off``) and per
``--concurrency`` (up to that many sessions run in parallel threads, the turns of a session in
order; the server's lanes are its own ``--max-concurrency``). Each concurrency level's trace
starts with its own header line, so no run reuses another's prefixes; ``--rounds N`` replays each
level N times on the same server (each round with its own header), pools the rounds' turns in
the summaries and lists each round's TTFT p50 ratio, the spread between replays. Trace lengths
are in tokens of the model's ``tokenizer.json`` (UTF-8 bytes for the builtin models).

Printed (one JSON document on stdout, and to ``--out``): per mode and concurrency the reuse share
(sum cached_tokens / sum prompt_tokens), prompt and prefill tokens, client-side TTFT (time to the
first content or reasoning delta) p50/p95/max over all turns, over turns that reuse >= 80% of
their prompt, over each session's first turn and over the later turns, the inter-chunk latency
p50 (stream chunk arrival gaps), time per output token, output tok/s (completion tokens over the
run's wall time), the wall time, and the server's count of kernel compilations since its warm-up
at the start and the end of the run and the difference (``compilations`` in /v1/cache/stats, else
``hpc_kernel_compilations_total`` in /metrics; null when the server reports neither); per server
its startup time (spawn to /health ok) and its warm-up pass; and the ratios of every mode to
``off`` (TTFT p50, p95, output tok/s, and more). A short table goes to stderr. A server that wants
an API key gets it from ``SERVE_TRACE_API_KEY``.

It can also write a Qwen3.5 dense checkpoint with random weights (transformers' own
``Qwen3_5TextConfig`` and ``save_pretrained`` for the config, safetensors shards, a small BPE
tokenizer with a ChatML template): ``--shape 27b`` has the released 27B widths with 8 layers
(bf16), ``--shape cpu`` the same mixer widths with hidden 256 and 4 layers (fp32).

    python benchmarks/serve_trace.py --quick                       # CPU, builtin:tiny, a small trace
    python benchmarks/serve_trace.py --serve-arg=--host-cache-mib=1024 --out trace.json
    python benchmarks/serve_trace.py --write-checkpoint /tmp/q27 --shape 27b       # writes, then exits
    python benchmarks/serve_trace.py --model /tmp/q27 --edits \\
        --serve-args "--kv-profile int8-g64 --prefill-chunk 2048 --max-concurrency 8"
    python benchmarks/serve_trace.py --base http://127.0.0.1:8000 --label mine     # a running server

With ``--write-checkpoint DIR`` and ``--model`` together the checkpoint is written first and the
benchmark runs after. Servers listen on 127.0.0.1 only; each is stopped with SIGTERM and waited
for (SIGKILL after ``--stop-timeout``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:
    import httpx
    import openai
    import tokenizers
    import torch
    import transformers
    from openai.types.chat.chat_completion_chunk import ChoiceDelta

Messages = list[dict[str, str]]

REUSE_HIGH = 0.8  # "turns that reuse >= 80% of their prompt"
LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")
# flags the script sets itself for each server
OWN_FLAGS = ("--cache-mode", "--no-prefix-reuse", "--port", "--host", "--model")


# ---------------------------------------------------------------------------------------------
# The words and the trace: hpc_cli.bench.trace (shared with `hpc-cli bench generate`)
# ---------------------------------------------------------------------------------------------

from hpc_cli.engine.api import PHASES  # noqa: E402
from hpc_cli.server.timing import SERVER_PHASES  # noqa: E402
from hpc_cli.bench.trace import (Edit, Lexicon, SessionPlan, TokenCounter, Trace, TraceConfig,  # noqa: E402,F401
                                 TurnPlan, build_trace, compose, render, strip_thinking)


# ---------------------------------------------------------------------------------------------
# Replay
# ---------------------------------------------------------------------------------------------

@dataclass
class RequestRecord:
    session: int
    turn: int
    edited: bool
    sent_s: float  # since the run started
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None
    total_s: float = 0.0
    arrivals: list[float] = field(default_factory=list)  # content chunks, seconds since sent
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    timing: dict | None = None  # the server's usage.hpc_timing (seconds per phase, prefill passes)
    #: seconds the openai client took to build the request before its first byte went out
    client_prepare_s: float | None = None
    round: int = 0  # which of --rounds replays (each with its own header) the turn belongs to

    @property
    def key(self) -> tuple[int, int, int]:
        """The turn's place in the run: (round, session, turn), the same in every mode."""
        return (self.round, self.session, self.turn)

    @property
    def reuse(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(frozen=True)
class ReplayOptions:
    model: str
    max_tokens: int
    request_timeout_s: float


def _delta_text(delta: "ChoiceDelta") -> tuple[str, bool]:
    """(content, whether the delta carries anything: content, reasoning or tool calls)."""
    content = delta.content or ""
    reasoning = getattr(delta, "reasoning_content", None) or getattr(delta, "reasoning", None) or ""  # extra fields
    return content, bool(content or reasoning or delta.tool_calls)


#: when the calling thread's request went out (httpx's request hook, :func:`mark_sent`)
_SENT = threading.local()


def mark_sent(_request: "httpx.Request") -> None:
    """httpx's ``request`` event hook: the moment the client hands the built request to the
    connection, so a turn's path splits into the client's preparation and the rest."""
    _SENT.at = time.perf_counter()


def one_request(client: "openai.OpenAI", opts: ReplayOptions, messages: Messages, rec: RequestRecord) -> None:
    import openai

    _SENT.at = None
    t0 = time.perf_counter()
    try:
        stream = client.chat.completions.create(
            model=opts.model, messages=messages, max_tokens=opts.max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, timeout=opts.request_timeout_s,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}, "hpc": {"timing": True}})
        with stream:
            for chunk in stream:
                now = time.perf_counter() - t0
                if chunk.usage is not None:
                    u = chunk.usage
                    rec.prompt_tokens = u.prompt_tokens
                    rec.completion_tokens = u.completion_tokens
                    details = u.prompt_tokens_details
                    rec.cached_tokens = (details.cached_tokens or 0) if details is not None else 0
                    timing = getattr(u, "hpc_timing", None) or (u.model_extra or {}).get("hpc_timing")
                    rec.timing = timing if isinstance(timing, dict) else None
                for choice in chunk.choices:
                    text, carries = _delta_text(choice.delta)
                    if carries:
                        rec.arrivals.append(now)
                        if rec.ttft_s is None:
                            rec.ttft_s = now
                            if _SENT.at is not None:
                                rec.client_prepare_s = _SENT.at - t0
                    rec.text += text
                    if choice.finish_reason:
                        rec.finish_reason = choice.finish_reason
                        if rec.ttft_s is None:  # nothing came before the end: the end is the first answer
                            rec.ttft_s = now
    except (openai.OpenAIError, OSError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:300]
    rec.total_s = time.perf_counter() - t0


def run_session(client: "openai.OpenAI", opts: ReplayOptions, trace: Trace, header: str,
                session: SessionPlan, t_start: float) -> list[RequestRecord]:
    users: list[str] = []
    answers: list[str] = []
    records = []
    system = header + trace.preamble
    for t, turn in enumerate(session.turns):
        if turn.edit is not None:
            users[turn.edit.message] = turn.edit.text
        users.append(turn.user_text)
        rec = RequestRecord(session.index, t, turn.edit is not None, time.perf_counter() - t_start)
        one_request(client, opts, render(system, users, answers), rec)
        answers.append(strip_thinking(rec.text))
        records.append(rec)
    return records


@dataclass
class RunResult:
    mode: str
    concurrency: int
    records: list[RequestRecord]
    wall_s: float
    compilations_start: int | None
    compilations_end: int | None
    #: the client's own first request before the trace (a one-line chat, 1 token): the openai
    #: client's and the connection's first-use costs land there, not on the trace's first turn
    client_warmup: RequestRecord | None = None


def _api_key() -> str:
    return os.environ.get("SERVE_TRACE_API_KEY", "unused")


def _http(timeout: float = 10.0) -> "httpx.Client":
    import httpx

    # loopback only: never through a proxy
    return httpx.Client(trust_env=False, timeout=timeout, headers={"authorization": f"Bearer {_api_key()}"})


def replay(base: str, mode: str, model: str, trace: Trace, run_index: int, concurrency: int,
           max_tokens: int, request_timeout_s: float) -> RunResult:
    import httpx
    import openai

    opts = ReplayOptions(model, max_tokens, request_timeout_s)
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    http = httpx.Client(trust_env=False, timeout=request_timeout_s, limits=limits,
                        event_hooks={"request": [mark_sent]})
    client = openai.OpenAI(base_url=base + "/v1", api_key=_api_key(), http_client=http, max_retries=0)
    header = trace.headers[run_index]
    try:
        warm = RequestRecord(-1, -1, False, 0.0)
        one_request(client, ReplayOptions(model, 1, request_timeout_s), [{"role": "user", "content": "Hello."}], warm)
        with _http() as probe:
            comp_start = read_compilations(probe, base)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix=f"trace-{mode}-c{concurrency}") as pool:
            futures = [pool.submit(run_session, client, opts, trace, header, s, t0) for s in trace.sessions]
            records = [r for f in futures for r in f.result()]
        wall = time.perf_counter() - t0
        with _http() as probe:
            comp_end = read_compilations(probe, base)
    finally:
        http.close()
    return RunResult(mode, concurrency, records, wall, comp_start, comp_end, warm)


def _find_key(tree: object, key: str) -> object:
    if isinstance(tree, dict):
        if key in tree:
            return tree[key]
        for value in tree.values():
            found = _find_key(value, key)
            if found is not None:
                return found
    return None


def read_compilations(http: "httpx.Client", base: str) -> int | None:
    """The server's kernel compilation count, or None where it reports none."""
    import httpx

    try:
        value = _find_key(http.get(base + "/v1/cache/stats").json(), "compilations")
        if isinstance(value, dict):
            value = value.get("total")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return int(value)
        text = http.get(base + "/metrics").text
    except (httpx.HTTPError, ValueError):
        return None
    found = [float(line.rsplit(" ", 1)[-1]) for line in text.splitlines()
             if re.match(r"hpc_kernel_compilations_total(\{| )", line)]
    return int(sum(found)) if found else None


# ---------------------------------------------------------------------------------------------
# Servers
# ---------------------------------------------------------------------------------------------

@dataclass
class ServerInfo:
    mode: str
    url: str
    command: list[str]
    startup_s: float | None = None  # spawn -> /health ok
    warmup_s: float | None = None  # the server's own warm-up pass (from its log)
    log: str | None = None
    exit_code: int | None = None
    stop_s: float | None = None


def _port_busy(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class ManagedServer:
    """``hpc-cli serve`` as a child process on 127.0.0.1 in one cache mode."""

    def __init__(self, mode: str, model: str, serve_args: Sequence[str], port: int, log_dir: Path,
                 startup_timeout_s: float, stop_timeout_s: float) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        extra = list(serve_args)
        if not any(a.split("=")[0] == "--log-level" for a in extra):
            extra += ["--log-level", "warning"]
        cmd = [sys.executable, "-m", "hpc_cli", "serve", "--model", model, "--host", "127.0.0.1",
               "--port", str(port), "--cache-mode", mode, *extra]
        self.info = ServerInfo(mode, self.url, cmd, log=str(log_dir / f"serve-{mode}-{port}.log"))
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ServerInfo:
        import httpx

        if _port_busy(self.port):
            raise RuntimeError(f"port {self.port} on 127.0.0.1 is in use: pass --port with a free one")
        log_path = Path(self.info.log or "serve.log")
        log = open(log_path, "wb")
        t0 = time.perf_counter()
        # its own session: a Ctrl+C in this terminal reaches only us, and we stop it in order
        self.proc = subprocess.Popen(self.info.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, env={**os.environ, "NO_COLOR": "1"})
        log.close()
        deadline = t0 + self.startup_timeout_s
        with _http(2.0) as http:
            while time.perf_counter() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"hpc-cli serve ({self.info.mode}) exited with {self.proc.returncode}:\n"
                                       + _tail(log_path))
                try:
                    if http.get(self.url + "/health").status_code == 200:
                        self.info.startup_s = round(time.perf_counter() - t0, 3)
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
            else:
                raise RuntimeError(f"hpc-cli serve ({self.info.mode}) not healthy after {self.startup_timeout_s:.0f} s:\n"
                                   + _tail(log_path))
        m = re.search(r"warm-up(?: pass)? done in ([0-9.]+) s", log_path.read_text(errors="replace"))
        self.info.warmup_s = float(m.group(1)) if m else None
        return self.info

    def stop(self) -> None:
        proc = self.proc
        if proc is None:
            return
        t0 = time.perf_counter()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)
        self.info.exit_code = proc.returncode
        self.info.stop_s = round(time.perf_counter() - t0, 2)
        self.proc = None


def served_model(base: str) -> str:
    with _http() as http:
        r = http.get(base + "/v1/models")
        r.raise_for_status()
        return str(r.json()["data"][0]["id"])


def openai_client(base: str, timeout_s: float = 600.0) -> tuple["openai.OpenAI", str]:
    """The official client for the server at ``base`` (no retries: a failed request is a figure)
    and the name of the model it serves."""
    import openai

    client = openai.OpenAI(base_url=base + "/v1", api_key=_api_key(), max_retries=0, timeout=timeout_s)
    return client, served_model(base)


# ---------------------------------------------------------------------------------------------
# Summaries
# ---------------------------------------------------------------------------------------------

def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    s = sorted(values)
    pos = (len(s) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass(frozen=True)
class Dist:
    n: int
    p50: float
    p95: float
    max: float
    mean: float

    @classmethod
    def of(cls, values: Sequence[float]) -> "Dist | None":
        if not values:
            return None
        return cls(len(values), round(percentile(values, 0.5), 4), round(percentile(values, 0.95), 4),
                   round(max(values), 4), round(sum(values) / len(values), 4))


def _ttfts(records: Sequence[RequestRecord], keep: Callable[[RequestRecord], bool]) -> list[float]:
    return [r.ttft_s for r in records if r.ttft_s is not None and keep(r)]


def _stat(d: Dist | None, name: str) -> float | None:
    return None if d is None else getattr(d, name)


@dataclass(frozen=True)
class Compilations:
    """The server's count of compilations since its warm-up, before and after the run."""

    at_start: int | None
    at_end: int | None
    during_run: int | None


@dataclass(frozen=True)
class TurnRow:
    round: int
    session: int
    turn: int
    edited: bool
    prompt: int
    cached: int
    completion: int
    ttft_s: float | None
    total_s: float
    sent_s: float
    error: str | None
    engine_ttft_s: float | None = None  # usage.hpc_timing.time_to_first_token: the engine's part
    client_prepare_s: float | None = None  # the openai client building the request, before it went out
    #: the server's first token to its first chunk with output (a first token that is part of a
    #: character waits there for the rest of it: about one decode step more on such a turn)
    server_first_send_s: float | None = None


@dataclass(frozen=True)
class RunSummary:
    mode: str
    concurrency: int
    parallel_sessions: int
    requests: int
    errors: int
    error_examples: list[str]
    prompt_tokens: int
    cached_tokens: int
    prefill_tokens: int
    reuse_share: float | None
    prompt_tokens_min: int | None
    prompt_tokens_max: int | None
    completion_tokens: int
    ttft_s: Dist | None
    ttft_reuse80_s: Dist | None  # turns that reuse >= 80% of their prompt
    ttft_first_turn_s: Dist | None  # each session's first turn
    ttft_later_turns_s: Dist | None
    ttft_edit_turns_s: Dist | None
    itl_p50_s: float | None  # gaps between content chunks
    #: the same per gap: element j is the p50 over requests of the gap between their content
    #: chunks j and j + 1 (which step of a request's decode is slow)
    itl_p50_by_gap_s: list[float]
    tpot_p50_s: float | None  # (last chunk - first chunk) / (completion tokens - 1), per request
    decode_tok_s_p50: float | None
    output_tok_s: float | None  # completion tokens / wall time
    wall_s: float
    compilations: Compilations | None
    #: the server's own phase seconds (usage.hpc_timing), median over requests; "passes": prefill
    #: passes per request; None where the server reports none
    phases_p50: dict[str, float] | None
    #: the client's warm-up request before the trace: its TTFT and the engine's part of it
    client_warmup_ttft_s: float | None
    client_warmup_engine_ttft_s: float | None
    turns: list[TurnRow]


def _compilations(run: RunResult) -> Compilations | None:
    a, b = run.compilations_start, run.compilations_end
    if a is None and b is None:
        return None
    return Compilations(a, b, b - a if a is not None and b is not None else None)


def _rows(records: Sequence[RequestRecord]) -> list[TurnRow]:
    return [TurnRow(r.round, r.session, r.turn, r.edited, r.prompt_tokens, r.cached_tokens, r.completion_tokens,
                    None if r.ttft_s is None else round(r.ttft_s, 4), round(r.total_s, 4), round(r.sent_s, 3),
                    r.error, _engine_ttft(r),
                    None if r.client_prepare_s is None else round(r.client_prepare_s, 5),
                    _timing_s(r, "server_first_send", 5)) for r in records]


def _timing_s(r: RequestRecord, key: str, digits: int) -> float | None:
    """Seconds the server's usage timing gives for ``key`` (None where it gives none)."""
    value = (r.timing or {}).get(key)
    return round(float(value), digits) if isinstance(value, (int, float)) else None


def _engine_ttft(r: RequestRecord) -> float | None:
    return _timing_s(r, "time_to_first_token", 4)


def _p50(values: Sequence[float], digits: int = 5) -> float | None:
    return round(percentile(values, 0.5), digits) if values else None


def _phases(records: Sequence[RequestRecord]) -> dict[str, float] | None:
    timed = [r.timing for r in records if r.timing]
    if not timed:
        return None
    out = {p: _p50([float(t.get(p) or 0.0) for t in timed]) for p in PHASES}
    out["passes"] = _p50([float(len(t.get("prefill_passes") or ())) for t in timed], 1)
    for name in (f"server_{p}" for p in SERVER_PHASES):  # the server's own part (a server that reports it)
        seen = [float(t[name]) for t in timed if t.get(name) is not None]
        if seen:
            out[name] = _p50(seen)
    # the engine's submit-to-first-token, and what the client waited beyond it (the HTTP exchange,
    # the template and the tokenizer, the stream's first chunk)
    engine = [(r, float(r.timing["time_to_first_token"])) for r in records
              if r.timing and r.timing.get("time_to_first_token") is not None and r.ttft_s is not None]
    if engine:
        out["engine_ttft"] = _p50([e for _, e in engine])
        out["server_overhead"] = _p50([r.ttft_s - e for r, e in engine])
    # of that, the openai client's own building of the request before it is sent
    prepared = [r.client_prepare_s for r in records if r.client_prepare_s is not None]
    if prepared:
        out["client_prepare"] = _p50(prepared)
    return out


def _gaps_by_position(recs: list[RequestRecord]) -> list[float]:
    """The p50 over requests of each chunk gap by its place in the answer (first gap first)."""
    by: list[list[float]] = []
    for r in recs:
        for j, (a, b) in enumerate(zip(r.arrivals, r.arrivals[1:])):
            if j == len(by):
                by.append([])
            by[j].append(b - a)
    return [_p50(g, 6) for g in by]


def summarize(run: RunResult, sessions: int) -> RunSummary:
    recs = [r for r in run.records if r.error is None]
    prompt = sum(r.prompt_tokens for r in recs)
    cached = sum(r.cached_tokens for r in recs)
    completion = sum(r.completion_tokens for r in recs)
    gaps = [b - a for r in recs for a, b in zip(r.arrivals, r.arrivals[1:])]
    tpot = [(r.arrivals[-1] - r.arrivals[0]) / (r.completion_tokens - 1)
            for r in recs if r.completion_tokens > 1 and len(r.arrivals) > 1 and r.arrivals[-1] > r.arrivals[0]]
    tpot50 = _p50(tpot)
    return RunSummary(
        mode=run.mode, concurrency=run.concurrency, parallel_sessions=min(run.concurrency, sessions),
        requests=len(run.records), errors=len(run.records) - len(recs),
        error_examples=sorted({r.error for r in run.records if r.error})[:3],
        prompt_tokens=prompt, cached_tokens=cached, prefill_tokens=prompt - cached,
        reuse_share=round(cached / prompt, 4) if prompt else None,
        prompt_tokens_min=min((r.prompt_tokens for r in recs), default=None),
        prompt_tokens_max=max((r.prompt_tokens for r in recs), default=None),
        completion_tokens=completion,
        ttft_s=Dist.of(_ttfts(recs, lambda r: True)),
        ttft_reuse80_s=Dist.of(_ttfts(recs, lambda r: r.reuse >= REUSE_HIGH)),
        ttft_first_turn_s=Dist.of(_ttfts(recs, lambda r: r.turn == 0)),
        ttft_later_turns_s=Dist.of(_ttfts(recs, lambda r: r.turn > 0)),
        ttft_edit_turns_s=Dist.of(_ttfts(recs, lambda r: r.edited)),
        itl_p50_s=_p50(gaps), itl_p50_by_gap_s=_gaps_by_position(recs), tpot_p50_s=tpot50,
        decode_tok_s_p50=round(1.0 / tpot50, 2) if tpot50 else None,
        output_tok_s=round(completion / run.wall_s, 2) if run.wall_s > 0 else None,
        wall_s=round(run.wall_s, 3), compilations=_compilations(run), phases_p50=_phases(recs),
        client_warmup_ttft_s=run.client_warmup.ttft_s if run.client_warmup is not None else None,
        client_warmup_engine_ttft_s=_engine_ttft(run.client_warmup) if run.client_warmup is not None else None,
        turns=_rows(run.records))


@dataclass(frozen=True)
class Ratios:
    """A mode against the base mode (``off``) at one concurrency; below 1 is faster for TTFT and wall."""

    ttft_p50: float | None
    ttft_p95: float | None
    ttft_later_turns_p50: float | None
    ttft_first_turn_p50: float | None
    ttft_reuse80_p50_vs_same_turns: float | None  # the turns this mode served >= 80% from cache, both modes
    output_tok_s: float | None
    decode_tok_s_p50: float | None
    wall: float | None
    answers_equal_share: float | None  # greedy answers identical to the base mode's
    #: per gap between content chunks j and j + 1 (the summaries' ``itl_p50_by_gap_s``), this
    #: mode's p50 over the base mode's: which decode step a decode ratio below 1 comes from
    itl_p50_by_gap: list[float | None] = field(default_factory=list)


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


def compare(run: RunResult, s: RunSummary, base_run: RunResult, b: RunSummary) -> Ratios:
    high = {r.key for r in run.records if r.error is None and r.reuse >= REUSE_HIGH}
    same = [r.ttft_s for r in base_run.records if r.key in high and r.ttft_s is not None and r.error is None]
    answers = {r.key: r.text for r in base_run.records}
    equal = [answers.get(r.key) == r.text for r in run.records]
    return Ratios(
        ttft_p50=_ratio(_stat(s.ttft_s, "p50"), _stat(b.ttft_s, "p50")),
        ttft_p95=_ratio(_stat(s.ttft_s, "p95"), _stat(b.ttft_s, "p95")),
        ttft_later_turns_p50=_ratio(_stat(s.ttft_later_turns_s, "p50"), _stat(b.ttft_later_turns_s, "p50")),
        ttft_first_turn_p50=_ratio(_stat(s.ttft_first_turn_s, "p50"), _stat(b.ttft_first_turn_s, "p50")),
        ttft_reuse80_p50_vs_same_turns=_ratio(_stat(s.ttft_reuse80_s, "p50"), _p50(same)),
        output_tok_s=_ratio(s.output_tok_s, b.output_tok_s),
        decode_tok_s_p50=_ratio(s.decode_tok_s_p50, b.decode_tok_s_p50),
        wall=_ratio(s.wall_s, b.wall_s),
        answers_equal_share=round(sum(equal) / len(equal), 4) if equal else None,
        itl_p50_by_gap=[_ratio(x, y) for x, y in zip(s.itl_p50_by_gap_s, b.itl_p50_by_gap_s)])


Summaries = dict[str, dict[str, RunSummary]]  # mode -> concurrency -> summary


def ratios(runs: dict[tuple[str, int], RunResult], summaries: Summaries,
           base_mode: str = "off") -> dict[str, dict[str, Ratios]]:
    """``"MODE/off"`` -> concurrency -> :class:`Ratios`, for every mode other than ``base_mode``."""
    out: dict[str, dict[str, Ratios]] = {}
    for mode, by_c in summaries.items():
        if mode == base_mode or base_mode not in summaries:
            continue
        for c, s in by_c.items():
            b = summaries[base_mode].get(c)
            if b is not None:
                out.setdefault(f"{mode}/{base_mode}", {})[c] = compare(runs[(mode, int(c))], s,
                                                                        runs[(base_mode, int(c))], b)
    return out


def round_ratios(rounds: dict[tuple[str, int], list[RunResult]], sessions: int,
                 base_mode: str = "off") -> dict[str, dict[str, list[float | None]]]:
    """``"MODE/off"`` -> concurrency -> each round's TTFT p50 ratio (the spread the pooled
    ratio hides: a round is one replay of the trace, its p50 over the trace's turns)."""
    out: dict[str, dict[str, list[float | None]]] = {}
    for (mode, c), rs in rounds.items():
        base = rounds.get((base_mode, c))
        if mode == base_mode or base is None:
            continue
        out.setdefault(f"{mode}/{base_mode}", {})[str(c)] = [
            _ratio(_stat(summarize(a, sessions).ttft_s, "p50"), _stat(summarize(b, sessions).ttft_s, "p50"))
            for a, b in zip(rs, base)]
    return out


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f}"


def table(summaries: Summaries, servers: dict[str, ServerInfo]) -> str:
    """The short human table (stderr)."""
    lines = [f"{'mode':<8} {'conc':>4} {'reuse':>6} {'prefill':>8} {'p50 ms':>7} {'p95 ms':>7} {'max ms':>7} "
             f"{'>=80% p50':>9} {'first p50':>9} {'itl ms':>6} {'tok/s':>7} {'wall s':>7} {'comp':>5} "
             f"{'passes':>6} {'pf ms':>6}"]
    for mode, by_c in summaries.items():
        for c, s in by_c.items():
            t = s.ttft_s
            reuse = "-" if s.reuse_share is None else f"{s.reuse_share:.3f}"
            during = s.compilations.during_run if s.compilations is not None else None
            lines.append(
                f"{mode:<8} {c:>4} {reuse:>6} {s.prefill_tokens:>8} {_ms(_stat(t, 'p50')):>7} "
                f"{_ms(_stat(t, 'p95')):>7} {_ms(_stat(t, 'max')):>7} {_ms(_stat(s.ttft_reuse80_s, 'p50')):>9} "
                f"{_ms(_stat(s.ttft_first_turn_s, 'p50')):>9} {_ms(s.itl_p50_s):>6} "
                f"{'-' if s.output_tok_s is None else s.output_tok_s:>7} {s.wall_s:>7} "
                f"{'-' if during is None else during:>5} "
                f"{'-' if s.phases_p50 is None else s.phases_p50['passes']:>6} "
                f"{'-' if s.phases_p50 is None else _ms(s.phases_p50['prefill']):>6}")
    for mode, info in servers.items():
        if info.startup_s is not None:
            lines.append(f"server {mode}: startup {info.startup_s:.1f} s"
                         + (f" (warm-up pass {info.warmup_s:.1f} s)" if info.warmup_s is not None else ""))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The checkpoint writer
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class CheckpointShape:
    name: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    dtype: str  # "bfloat16" or "float32"


SHAPES = {
    "27b": CheckpointShape("27b", 5120, 17408, 8, "bfloat16"),
    "cpu": CheckpointShape("cpu", 256, 1024, 4, "float32"),
}
# the mixers of Qwen3.5-27B: 24 query / 4 KV heads of 256, GDN 16 key / 48 value heads of 128, conv 4
MIXER = dict(num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
             linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
             linear_conv_kernel_dim=4)
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ADDED = ("<think>", "</think>", "<tool_call>", "</tool_call>")
SHARD_BYTES = 4 << 30


@dataclass(frozen=True)
class CheckpointInfo:
    path: str
    shape: str
    dtype: str
    parameters: int
    bytes: int
    shards: int
    vocab_size: int
    seconds: float


def train_tokenizer(lexicon: Lexicon, vocab_size: int, seed: int = 11) -> "tokenizers.Tokenizer":
    """A byte-level BPE on the lexicon's text, with the Qwen special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(lexicon.corpus(seed, 300_000), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    return tok


def save_tokenizer(tok: "tokenizers.Tokenizer", path: Path, chat_template: str) -> None:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=chat_template, model_max_length=262_144)
    fast.save_pretrained(str(path))
    # readable by older transformers (and so vLLM) too: a generic class name, the template inline
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=chat_template)
    cfg.pop("backend", None)
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")


def hf_config(shape: CheckpointShape, vocab_size: int, eos: list[int], pad: int) -> "transformers.Qwen3_5TextConfig":
    import torch
    from transformers import Qwen3_5TextConfig

    n = shape.num_hidden_layers
    cfg = Qwen3_5TextConfig(
        vocab_size=vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=n, layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)],
        max_position_embeddings=262_144, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
        eos_token_id=eos, pad_token_id=pad, **MIXER)
    cfg.architectures = ["Qwen3_5ForCausalLM"]
    cfg.dtype = getattr(torch, shape.dtype)
    return cfg


def tensor_shapes(cfg: "transformers.Qwen3_5TextConfig") -> dict[str, tuple[int, ...]]:
    """Every tensor ``Qwen3_5ForCausalLM.save_pretrained`` would write, with its shape (built on
    the meta device: no memory)."""
    import torch
    from transformers import Qwen3_5ForCausalLM

    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(cfg)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def _init_std(name: str, shape: tuple[int, ...], hidden: int, layers: int) -> float:
    if name.endswith("embed_tokens.weight"):
        return 1.0
    if name == "lm_head.weight":
        return 4.0 / math.sqrt(hidden)
    if name.endswith("conv1d.weight"):
        return 1.0 / math.sqrt(shape[-1])
    std = 1.0 / math.sqrt(shape[-1])
    if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
        std /= math.sqrt(2 * layers)
    return std


def init_tensor(name: str, shape: tuple[int, ...], dtype: "torch.dtype", gen: "torch.Generator",
                hidden: int, layers: int) -> "torch.Tensor":
    """Random weights scaled so activations stay O(1) (the builtin models' rule): matrices from
    255-level uniform draws (fast), the norms at their identity, A_log from log U(1, 16)."""
    import torch

    if name.endswith("A_log"):
        return torch.empty(shape).uniform_(1.0, 16.0, generator=gen).log().to(dtype)
    if name.endswith("dt_bias"):
        return torch.ones(shape, dtype=dtype)
    if name.endswith("linear_attn.norm.weight"):  # plain gated norm: weight * x
        return (1.0 + 0.05 * torch.randn(shape, generator=gen)).to(dtype)
    if name.endswith("norm.weight"):  # (1 + weight) * x norms
        return (0.05 * torch.randn(shape, generator=gen)).to(dtype)
    std = _init_std(name, shape, hidden, layers)
    # integers uniform on [-127, 127] have std sqrt((255^2 - 1) / 12)
    scale = std / math.sqrt((255 ** 2 - 1) / 12)
    return torch.randint(-127, 128, shape, dtype=torch.int8, generator=gen).to(dtype).mul_(scale)


def plan_shards(shapes: dict[str, tuple[int, ...]], itemsize: int, limit: int = SHARD_BYTES) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        n = math.prod(shape) * itemsize
        if shards[-1] and size + n > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def write_weights(path: Path, shapes: dict[str, tuple[int, ...]], shape: CheckpointShape, seed: int,
                  shard_bytes: int = SHARD_BYTES) -> tuple[int, int]:
    """Safetensors shards (at most ``shard_bytes`` each unless one tensor is larger, an index when
    there are several); returns (parameters, bytes)."""
    import torch
    from safetensors.torch import save_file

    dtype = getattr(torch, shape.dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    gen = torch.Generator().manual_seed(seed)
    shards = plan_shards(shapes, itemsize, shard_bytes)
    for old in list(path.glob("model*.safetensors")) + list(path.glob("model.safetensors.index.json")):
        old.unlink()
    weight_map: dict[str, str] = {}
    total = 0
    for k, names in enumerate(shards):
        fname = "model.safetensors" if len(shards) == 1 else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {n: init_tensor(n, shapes[n], dtype, gen, shape.hidden_size, shape.num_hidden_layers) for n in names}
        save_file(tensors, str(path / fname), metadata={"format": "pt"})
        total += sum(t.numel() * itemsize for t in tensors.values())
        weight_map.update({n: fname for n in names})
        del tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return sum(math.prod(s) for s in shapes.values()), total


def write_checkpoint(path: str | Path, shape_name: str, seed: int = 0, vocab: int = 6144,
                     shard_bytes: int = SHARD_BYTES) -> CheckpointInfo:
    """A Qwen3.5 dense checkpoint with random weights that ``hpc-cli serve --model PATH`` loads."""
    from hpc_cli.model.tokenizer import BYTE_CHAT_TEMPLATE

    t0 = time.perf_counter()
    shape = SHAPES[shape_name]
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(Lexicon.make(), vocab)
    save_tokenizer(tok, out, BYTE_CHAT_TEMPLATE.strip())
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    eos = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    cfg = hf_config(shape, vocab_size, eos, pad=eos[1])
    cfg.save_pretrained(str(out))
    params, nbytes = write_weights(out, tensor_shapes(cfg), shape, seed, shard_bytes)
    shards = len(list(out.glob("model*.safetensors")))
    return CheckpointInfo(str(out), shape_name, shape.dtype, params, nbytes, shards, vocab_size,
                          round(time.perf_counter() - t0, 2))


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

FULL = dict(sessions=4, turns=6, preamble_tokens=2200, user_tokens="150,750")
QUICK = dict(sessions=2, turns=3, preamble_tokens=400, user_tokens="40,160")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write-checkpoint", metavar="DIR", help="write a random-weight Qwen3.5 checkpoint to DIR")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="cpu", help="checkpoint widths (default cpu)")
    ap.add_argument("--checkpoint-seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=6144, help="BPE vocabulary of the written tokenizer")
    ap.add_argument("--model", default=None, help="checkpoint directory or builtin:NAME (default builtin:tiny)")
    ap.add_argument("--tokenizer", default=None, help="directory with tokenizer.json to size the trace by "
                    "(default: --model's, else UTF-8 bytes)")
    ap.add_argument("--quick", action="store_true", help="a small trace: " + json.dumps(QUICK))
    ap.add_argument("--sessions", type=int, default=None, help=f"default {FULL['sessions']}")
    ap.add_argument("--turns", type=int, default=None, help=f"default {FULL['turns']}")
    ap.add_argument("--preamble-tokens", type=int, default=None, help=f"default {FULL['preamble_tokens']}")
    ap.add_argument("--user-tokens", default=None, help=f"MIN,MAX of user messages, default {FULL['user_tokens']}")
    ap.add_argument("--edits", action="store_true", help="turns that change a message deep in the history")
    ap.add_argument("--edit-prob", type=float, default=0.35, help="chance of an edit at each turn from the third")
    ap.add_argument("--seed", type=int, default=0, help="seed of the trace")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--concurrency", default="1,8", help="comma list of parallel sessions")
    ap.add_argument("--modes", default="hybrid,off", help="comma list of cache modes")
    ap.add_argument("--rounds", type=int, default=1,
                    help="replays of the trace per mode and concurrency on the same server, each with its own "
                         "header (nothing carried over): the summaries pool every round's turns, and each "
                         "round's TTFT p50 ratio is listed (round_ttft_p50_ratios)")
    ap.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                    help="one extra flag for hpc-cli serve (repeatable; write --serve-arg=--flag=value)")
    ap.add_argument("--serve-args", default="", metavar="ARGS", help="extra flags for hpc-cli serve, one string")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--base", default=None, help="URL of a running server (then one mode, --label)")
    ap.add_argument("--label", default=None, help="name of the --base server's mode in the output")
    ap.add_argument("--startup-timeout", type=float, default=900.0, help="seconds to wait for /health")
    ap.add_argument("--stop-timeout", type=float, default=60.0, help="seconds to wait after SIGTERM")
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--log-dir", default=None, help="where the servers' logs go (default a temporary directory)")
    ap.add_argument("--out", default=None, help="also write the JSON document here")
    args = ap.parse_args(argv)
    preset = QUICK if args.quick else FULL
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def _loopback(url: str) -> bool:
    from urllib.parse import urlsplit

    host = urlsplit(url).hostname or ""
    return host in LOOPBACK or host.startswith("127.")


def _check(args: argparse.Namespace, serve_args: list[str]) -> None:
    if args.base is not None and not _loopback(args.base):
        raise SystemExit(f"--base {args.base}: only a server on this machine (loopback) is measured")
    for a in serve_args:
        if a.split("=")[0] in OWN_FLAGS:
            raise SystemExit(f"serve flag {a!r} is set by the script (use --model, --port, --modes)")
    try:
        lo, hi = (int(x) for x in args.user_tokens.split(","))
    except ValueError:
        raise SystemExit("--user-tokens wants MIN,MAX") from None
    if not 1 <= lo <= hi:
        raise SystemExit("--user-tokens wants MIN,MAX with 1 <= MIN <= MAX")
    if min(args.sessions, args.turns, args.preamble_tokens, args.max_tokens, args.rounds) < 1:
        raise SystemExit("--sessions, --turns, --preamble-tokens, --max-tokens and --rounds must be at least 1")
    if not all(c.strip().isdigit() and int(c) >= 1 for c in str(args.concurrency).split(",")):
        raise SystemExit("--concurrency wants a comma list of positive integers, e.g. 1,8")


def _machine() -> dict[str, object]:
    info: dict[str, object] = {"platform": platform.platform(), "python": platform.python_version(),
                               "cpus": os.cpu_count()}
    try:
        import torch

        info["torch"] = torch.__version__
        info["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu"
    except ImportError:
        pass
    return info


def _sigterm_to_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through the servers' stop


def trace_config(args: argparse.Namespace) -> TraceConfig:
    lo, hi = (int(x) for x in args.user_tokens.split(","))
    return TraceConfig(args.seed, args.sessions, args.turns, args.preamble_tokens, (lo, hi), args.edits,
                       args.edit_prob)


def pooled(rounds: Sequence[RunResult]) -> RunResult:
    """The rounds of one mode and concurrency as one run: their turns together, their wall
    times added, the compilations from the first round's start to the last one's end."""
    first, last = rounds[0], rounds[-1]
    return RunResult(first.mode, first.concurrency, [rec for run in rounds for rec in run.records],
                     sum(r.wall_s for r in rounds), first.compilations_start, last.compilations_end,
                     first.client_warmup)


def run_mode(mode: str, args: argparse.Namespace, serve_args: list[str], model: str, trace: Trace,
             concurrency: list[int], log_dir: Path) -> tuple[ServerInfo | None, dict[int, list[RunResult]]]:
    """Every concurrency level of the trace on one server, ``--rounds`` times each (the rounds of
    a level one after another, each with its own header): started here (and stopped, whatever
    happens) unless ``--base`` names a running one."""
    server = None if args.base else ManagedServer(mode, model, serve_args, args.port, log_dir,
                                                  args.startup_timeout, args.stop_timeout)
    runs: dict[int, list[RunResult]] = {}
    try:
        if server is not None:
            print(f"serve_trace: starting hpc-cli serve --cache-mode {mode} ...", file=sys.stderr, flush=True)
            server.start()
        base = server.url if server is not None else args.base.rstrip("/")
        name = served_model(base)
        for k, c in enumerate(concurrency):
            for r in range(args.rounds):
                print(f"serve_trace: {mode}, concurrency {c}: {len(trace.sessions)} sessions x "
                      f"{trace.config.turns} turns" + (f", round {r + 1} of {args.rounds}" if args.rounds > 1 else ""),
                      file=sys.stderr, flush=True)
                run = replay(base, mode, name, trace, k * args.rounds + r, c, args.max_tokens, args.request_timeout)
                for rec in run.records:
                    rec.round = r
                runs.setdefault(c, []).append(run)
    finally:
        if server is not None:
            server.stop()
    return (server.info if server is not None else None), runs


def run_benchmark(args: argparse.Namespace, serve_args: list[str]) -> dict[str, object]:
    model = args.model or "builtin:tiny"
    concurrency = [int(c) for c in str(args.concurrency).split(",") if c]
    modes = [args.label or "server"] if args.base else [m.strip() for m in args.modes.split(",") if m.strip()]
    cfg = trace_config(args)
    tok_dir = args.tokenizer or (model if not model.startswith("builtin:") else None)
    trace = build_trace(cfg, len(concurrency) * args.rounds, TokenCounter(tok_dir))
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="serve_trace-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    runs: dict[tuple[str, int], RunResult] = {}
    rounds: dict[tuple[str, int], list[RunResult]] = {}
    servers: dict[str, ServerInfo] = {}
    t0 = time.perf_counter()
    for mode in modes:
        info, by_c = run_mode(mode, args, serve_args, model, trace, concurrency, log_dir)
        if info is not None:
            servers[mode] = info
        rounds.update({(mode, c): rs for c, rs in by_c.items()})
        runs.update({(mode, c): pooled(rs) for c, rs in by_c.items()})
    summaries: Summaries = {}
    for (mode, c), run in runs.items():
        summaries.setdefault(mode, {})[str(c)] = summarize(run, len(trace.sessions))
    print(table(summaries, servers), file=sys.stderr)
    edits = sum(t.edit is not None for sess in trace.sessions for t in sess.turns)
    return {
        "benchmark": "serve_trace",
        "machine": _machine(),
        "model": model, "serve_args": serve_args, "base": args.base,
        "trace": {**asdict(cfg), "requests_per_run": cfg.sessions * cfg.turns, "max_tokens": args.max_tokens,
                  "sized_by": trace.counter_kind, "edit_turns": edits},
        "servers": {m: asdict(s) for m, s in servers.items()},
        "results": {m: {c: asdict(x) for c, x in by_c.items()} for m, by_c in summaries.items()},
        "ratios": {k: {c: asdict(x) for c, x in by_c.items()} for k, by_c in ratios(runs, summaries).items()},
        "rounds": args.rounds,
        "round_ttft_p50_ratios": round_ratios(rounds, len(trace.sessions)),
        "total_s": round(time.perf_counter() - t0, 2),
    }


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    serve_args = list(args.serve_arg) + shlex.split(args.serve_args)
    _check(args, serve_args)
    signal.signal(signal.SIGTERM, _sigterm_to_exit)
    doc: dict[str, object] = {}
    if args.write_checkpoint:
        info = write_checkpoint(args.write_checkpoint, args.shape, args.checkpoint_seed, args.vocab)
        print(f"serve_trace: wrote {info.path} ({info.parameters / 1e9:.3f} B parameters, {info.shards} shard(s), "
              f"{info.seconds:.1f} s)", file=sys.stderr)
        if args.model is None:
            doc = {"benchmark": "serve_trace", "checkpoint": asdict(info)}
        else:
            doc = {"checkpoint": asdict(info)}
    if args.model is not None or not args.write_checkpoint:
        try:
            doc = {**run_benchmark(args, serve_args), **doc}
        except RuntimeError as exc:  # a server that did not start
            raise SystemExit(f"serve_trace: {exc}") from None
    text = json.dumps(doc, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
