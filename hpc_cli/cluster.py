"""A local cluster (``hpc-cli cluster up``, docs/shared-cache.md): a redis-server as the shared
cache tier, N ``hpc-cli serve --shared-cache`` replicas on consecutive ports and a cache-aware
router in front of them (sglang-router or vllm-router, both Rust routers shipped as wheels), all
on this machine's loopback.

    cluster = Cluster(ClusterSpec(replicas=2, port=8000))
    endpoints = cluster.start()          # redis, replicas (healthy), router (healthy)
    cluster.add_replica()                # one more, registered with the router
    cluster.supervise(stop_event)        # until the event, or the router / every replica ends
    cluster.stop()                       # router, replicas (orderly stop), redis

Children run in their own sessions (a terminal's Ctrl+C reaches only the launcher, which stops
them in order) and, on Linux, get SIGTERM if the launcher dies. A redis-server that exits is
started again on its port (the replicas serve from their own tiers meanwhile).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import httpx

from hpc_cli.errors import HpcError

HOST = "127.0.0.1"
#: children run as ``python -P -m ...``: -P keeps the working directory off sys.path (a folder
#: named like a package there, e.g. ``triton/`` in /tmp, would shadow the installed one)
#: serve flags the launcher sets itself
OWN_SERVE_FLAGS = ("--host", "--port", "--shared-cache", "--tui")


class ClusterError(HpcError):
    """The cluster cannot start: a missing program, a port in use, a child that did not come up."""


@dataclass(frozen=True, slots=True)
class RouterKind:
    """A router program: the Python module that launches it and how workers are added later."""

    name: str
    module: str
    package: str
    add_path: str  # POST here to add a worker
    add_json: bool  # the URL in a JSON body (else the query string)

    def command(self, port: int, workers: Sequence[str], metrics_port: int) -> list[str]:
        return [sys.executable, "-P", "-m", self.module, "--host", HOST, "--port", str(port), "--worker-urls", *workers,
                "--policy", "cache_aware", "--prometheus-host", HOST, "--prometheus-port", str(metrics_port),
                "--log-level", "warn" if self.name == "sglang" else "warning"]

    def installed(self) -> bool:
        return importlib.util.find_spec(self.module.split(".")[0]) is not None


ROUTERS = {
    "sglang": RouterKind("sglang", "sglang_router.launch_router", "sglang-router", "/workers", True),
    "vllm": RouterKind("vllm", "vllm_router.launch_router", "vllm-router", "/add_worker", False),
}


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    replicas: int = 2
    router: str = "sglang"
    port: int = 8000  # the router; replicas on port+1 .. port+N
    redis_port: int | None = None  # default port+N+1
    redis_mib: int = 1024  # redis maxmemory (least recently used keys go first)
    serve_args: tuple[str, ...] = ()
    router_args: tuple[str, ...] = ()  # extra router flags, e.g. --balance-abs-threshold=4
    log_dir: Path | None = None  # default a temporary directory
    startup_timeout_s: float = 300.0
    stop_timeout_s: float = 60.0

    @property
    def redis_at(self) -> int:
        return self.redis_port if self.redis_port is not None else self.port + self.replicas + 1


@dataclass(slots=True)
class Child:
    """One process of the cluster."""

    name: str
    url: str
    command: list[str]
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    os.setsid()
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def port_free(port: int) -> bool:
    """Whether a server could listen on ``port`` (as the servers bind: SO_REUSEADDR, so the
    TIME_WAIT connections of an earlier run do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def redis_binary() -> str:
    for name in ("redis-server", "valkey-server"):
        path = shutil.which(name)
        if path:
            return path
    raise ClusterError("no redis-server (or valkey-server) on PATH",
                       hint="install it: apt-get install redis-server (or your distribution's valkey)")


class Cluster:
    def __init__(self, spec: ClusterSpec, echo: Callable[[str], None] = lambda _msg: None) -> None:
        if spec.replicas < 1:
            raise ClusterError("a cluster needs at least one replica", hint="pass --replicas 1 or more")
        if spec.router not in ROUTERS:
            raise ClusterError(f"unknown router {spec.router!r}", hint=f"choose one of: {', '.join(ROUTERS)}")
        for arg in spec.serve_args:
            if arg.split("=", 1)[0] in OWN_SERVE_FLAGS:
                raise ClusterError(f"serve option {arg.split('=', 1)[0]} is set by the cluster",
                                   hint="choose the router's port with --port; replicas take the next ones")
        self.spec = spec
        self.echo = echo
        self.router_kind = ROUTERS[spec.router]
        self.log_dir = Path(spec.log_dir) if spec.log_dir else Path(tempfile.mkdtemp(prefix="hpc-cluster-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.redis: Child | None = None
        self.replicas: list[Child] = []
        self.router: Child | None = None
        self.redis_restarts = 0
        self._lock = threading.Lock()

    @property
    def redis_url(self) -> str:
        return f"redis://{HOST}:{self.spec.redis_at}/0"

    # ------------------------------------------------------------------ start
    def _check(self) -> None:
        kind = self.router_kind
        if not kind.installed():
            raise ClusterError(f"the router {kind.package} is not installed",
                               hint=f"pip install {kind.package} (or pip install 'hpc-cli[cluster]')")
        s = self.spec
        ports = [s.port, *range(s.port + 1, s.port + 1 + s.replicas), s.redis_at]
        if len(set(ports)) != len(ports):
            raise ClusterError(f"--redis-port {s.redis_at} is one of the replicas' ports",
                               hint="choose a redis port outside the router's and the replicas' range")
        busy = [p for p in ports if not port_free(p)]
        if busy:
            raise ClusterError(f"ports in use on {HOST}: {', '.join(map(str, busy))}",
                               hint=f"choose another --port (the cluster takes {s.port} .. {s.port + s.replicas} "
                                    f"and {s.redis_at} for redis)")

    def _spawn(self, child: Child) -> Child:
        log = open(child.log, "ab")
        try:
            child.proc = subprocess.Popen(child.command, stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent,
                                          env={**os.environ, "NO_COLOR": "1"})
        finally:
            log.close()
        return child

    def _redis_child(self) -> Child:
        s = self.spec
        d = self.log_dir / "redis"
        d.mkdir(exist_ok=True)
        cmd = [redis_binary(), "--bind", HOST, "--port", str(s.redis_at), "--dir", str(d), "--save", "",
               "--appendonly", "no", "--maxmemory", f"{s.redis_mib}mb", "--maxmemory-policy", "allkeys-lru",
               "--protected-mode", "yes", "--daemonize", "no"]
        return Child("redis", self.redis_url, cmd, self.log_dir / "redis.log")

    def _replica_child(self, i: int, port: int, serve_args: Sequence[str]) -> Child:
        cmd = [sys.executable, "-P", "-m", "hpc_cli", "serve", "--host", HOST, "--port", str(port),
               "--shared-cache", self.redis_url, *serve_args]
        return Child(f"replica {i}", f"http://{HOST}:{port}", cmd, self.log_dir / f"replica-{i}.log")

    def start(self) -> dict[str, object]:
        """Start everything and wait until each part answers; stop what started on a failure."""
        self._check()
        try:
            self.redis = self._spawn(self._redis_child())
            self._wait_redis(self.redis)
            s = self.spec
            self.replicas = [self._spawn(self._replica_child(i + 1, s.port + 1 + i, s.serve_args))
                             for i in range(s.replicas)]
            deadline = time.monotonic() + s.startup_timeout_s
            for r in self.replicas:
                self._wait_health(r, "/health", deadline)
            kind = self.router_kind
            router = Child(f"router ({kind.name}, cache_aware)", f"http://{HOST}:{s.port}",
                           kind.command(s.port, [r.url for r in self.replicas], free_port()) + list(s.router_args),
                           self.log_dir / "router.log")
            self.router = self._spawn(router)
            self._wait_health(router, "/health", time.monotonic() + 60)
        except BaseException:
            self.stop()
            raise
        return self.endpoints()

    def _wait_redis(self, child: Child, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not child.running:
                raise ClusterError(f"redis-server exited at startup:\n{child.tail()}",
                                   hint="see the log; is the port free?")
            try:
                with socket.create_connection((HOST, self.spec.redis_at), timeout=0.5) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise ClusterError(f"redis-server did not answer within {timeout:.0f} s", hint=f"see {child.log}")

    def _wait_health(self, child: Child, path: str, deadline: float) -> None:
        with httpx.Client(trust_env=False, timeout=2.0) as http:
            while time.monotonic() < deadline:
                if not child.running:
                    raise ClusterError(f"{child.name} exited with status {child.proc.returncode} at startup:\n"
                                       f"{child.tail()}", hint=f"see {child.log}")
                try:
                    if http.get(child.url + path).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
        raise ClusterError(f"{child.name} not healthy at {child.url}{path} in time", hint=f"see {child.log}")

    def add_replica(self, serve_args: Sequence[str] | None = None, timeout_s: float | None = None) -> Child:
        """Start one more replica on the next free port after the others and register it with
        the router."""
        args = self.spec.serve_args if serve_args is None else tuple(serve_args)
        port = max(int(r.url.rsplit(":", 1)[1]) for r in self.replicas) + 1
        while not port_free(port) or port == self.spec.redis_at:
            port += 1
        child = self._spawn(self._replica_child(len(self.replicas) + 1, port, args))
        with self._lock:
            self.replicas.append(child)
        self._wait_health(child, "/health", time.monotonic() + (timeout_s or self.spec.startup_timeout_s))
        assert self.router is not None
        kind = self.router_kind
        with httpx.Client(trust_env=False, timeout=10.0) as http:
            if kind.add_json:
                r = http.post(self.router.url + kind.add_path, json={"url": child.url})
            else:
                r = http.post(self.router.url + kind.add_path, params={"url": child.url})
        if r.status_code >= 300:
            raise ClusterError(f"the router refused {child.url}: {r.status_code} {r.text[:200]}",
                               hint=f"see {self.router.log}")
        return child

    def endpoints(self) -> dict[str, object]:
        def one(c: Child | None) -> dict[str, object] | None:
            return None if c is None else {"url": c.url, "pid": c.pid, "log": str(c.log)}

        return {"router": one(self.router), "router_kind": self.router_kind.name,
                "replicas": [one(r) for r in self.replicas], "redis": one(self.redis),
                "log_dir": str(self.log_dir)}

    # ------------------------------------------------------------------ run, stop
    def supervise(self, stop: threading.Event, poll_s: float = 0.2) -> int:
        """Watch the children until ``stop`` is set (0), or the router or every replica ended
        (1). A redis-server that ends is started again (up to 10 times)."""
        reported: set[str] = set()
        while not stop.wait(poll_s):
            if self.router is not None and not self.router.running:
                self.echo(f"the router exited with status {self.router.proc.returncode}; stopping:\n"
                          f"{self.router.tail()}")
                return 1
            with self._lock:
                replicas = list(self.replicas)
            for r in replicas:
                if not r.running and r.name not in reported:
                    reported.add(r.name)
                    self.echo(f"warning: {r.name} ({r.url}) exited with status {r.proc.returncode}; "
                              f"the router sends its requests elsewhere (log {r.log})")
            if replicas and all(not r.running for r in replicas):
                self.echo("every replica exited; stopping")
                return 1
            if self.redis is not None and not self.redis.running and self.redis_restarts < 10:
                self.redis_restarts += 1
                self.echo(f"warning: redis-server exited with status {self.redis.proc.returncode}; starting it "
                          f"again (the replicas serve from their own tiers meanwhile)")
                self.redis = self._spawn(self._redis_child())
        return 0

    def stop(self) -> None:
        """Router first (no new requests), then the replicas (their orderly stop), then redis."""
        with self._lock:
            replicas = list(self.replicas)
        for group in ([self.router], replicas, [self.redis]):
            alive = [c for c in group if c is not None and c.running]
            for c in alive:
                c.proc.send_signal(signal.SIGTERM)
            for c in alive:
                try:
                    c.proc.wait(self.spec.stop_timeout_s)
                except subprocess.TimeoutExpired:
                    c.proc.kill()
                    c.proc.wait(10)


def describe(endpoints: dict[str, object]) -> list[str]:
    """The endpoint lines ``cluster up`` prints."""
    lines = []
    redis = endpoints["redis"]
    if isinstance(redis, dict):
        lines.append(f"shared cache  {redis['url']}  (redis-server, pid {redis['pid']})")
    for i, r in enumerate(endpoints["replicas"] or [], 1):
        if isinstance(r, dict):
            lines.append(f"replica {i}     {r['url']}  (pid {r['pid']}, log {r['log']})")
    router = endpoints["router"]
    if isinstance(router, dict):
        lines.append(f"router        {router['url']}  ({endpoints['router_kind']}, cache_aware; OpenAI: "
                     f"{router['url']}/v1)")
    return lines


def endpoints_json(endpoints: dict[str, object]) -> str:
    return json.dumps(endpoints, sort_keys=True)
