"""`hpc-cli cluster up`: replicas behind a cache-aware router, sharing a Redis cache tier
(hpc_cli.cluster, docs/shared-cache.md)."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import click

from hpc_cli.cli.groups import HelpGroup


@click.group("cluster", cls=HelpGroup)
def cluster_group() -> None:
    """Run several serve replicas behind a cache-aware router, sharing a Redis cache tier."""


@cluster_group.command("up", context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.option("--replicas", default=2, show_default=True, type=click.IntRange(1, 64), help="serve replicas")
@click.option("--router", "router", default="sglang", show_default=True, type=click.Choice(["sglang", "vllm"]),
              help="sglang-router or vllm-router, with the cache_aware policy")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(1, 65535),
              help="the router's port; replicas listen on the next N ports")
@click.option("--router-arg", "router_args", multiple=True, metavar="ARG",
              help="one more router flag (repeatable; write --router-arg=--flag=value), e.g. "
                   "--router-arg=--balance-abs-threshold=4")
@click.option("--redis-port", default=None, type=click.IntRange(1, 65535),
              help="redis-server's port (default: the port after the replicas')")
@click.option("--redis-mib", default=1024, show_default=True, type=click.IntRange(16),
              help="redis maxmemory; the least recently used entries go first")
@click.option("--log-dir", default=None, type=click.Path(file_okay=False, path_type=Path),
              help="the children's logs (default a temporary directory)")
@click.option("--startup-timeout", default=300.0, show_default=True, type=float, help="seconds per replica")
@click.option("--json", "as_json", is_flag=True, help="print the endpoints as one JSON line on stdout once up")
@click.argument("serve_args", nargs=-1, type=click.UNPROCESSED)
def cluster_up(replicas: int, router: str, router_args: tuple[str, ...], port: int, redis_port: int | None, redis_mib: int,
               log_dir: Path | None, startup_timeout: float, as_json: bool, serve_args: tuple[str, ...]) -> None:
    """Start redis-server, N `hpc-cli serve --shared-cache` replicas on consecutive ports and a
    cache-aware router on 127.0.0.1; print the endpoints; stop everything on Ctrl+C or SIGTERM.
    Options after the cluster's own are passed to every replica (e.g. --kv-profile int8-g64)."""
    from hpc_cli.cluster import Cluster, ClusterSpec, describe, endpoints_json

    echo = lambda msg: click.echo(f"hpc-cli cluster: {msg}", err=True)  # noqa: E731
    spec = ClusterSpec(replicas=replicas, router=router, port=port, redis_port=redis_port, redis_mib=redis_mib,
                       serve_args=tuple(serve_args), router_args=router_args, log_dir=log_dir, startup_timeout_s=startup_timeout)
    cluster = Cluster(spec, echo=echo)
    stop = threading.Event()

    def on_signal(signum, _frame) -> None:
        if stop.is_set():
            return
        stop.set()
        echo(f"{signal.Signals(signum).name}: stopping the router, the replicas and redis")

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    code = 0
    try:
        echo(f"starting redis-server, {replicas} replica(s) and the {router} router (logs in {cluster.log_dir})")
        endpoints = cluster.start()
        for line in describe(endpoints):
            echo(line)
        if as_json:
            click.echo(endpoints_json(endpoints))
        echo("ready; Ctrl+C or SIGTERM stops everything")
        code = cluster.supervise(stop)
    finally:
        cluster.stop()
        for s, h in old.items():
            signal.signal(s, h)
        echo("stopped")
    if code:
        raise SystemExit(code)


def register(cli: click.Group) -> None:
    cli.add_command(cluster_group)
