"""`hpc-cli top`: the live cache view of a running server (its ``/v1/cache/stats``)."""

from __future__ import annotations

import os

import click

DEFAULT_URL = "http://127.0.0.1:8000"
KEYS = "keys: q quit · Ctrl+C quit"


@click.command("top")
@click.option("--url", default=None, help=f"the server (default from [server] host/port, else {DEFAULT_URL})")
@click.option("--api-key", default=None, envvar="HPC_SERVER__API_KEY", show_envvar=True,
              help="the server's API key (sent as 'Authorization: Bearer KEY')")
@click.option("--once", is_flag=True, help="print one frame and exit (for scripts and tests)")
@click.option("--refresh-hz", type=click.FloatRange(0.1, 30), default=None,
              help="frames per second (default [tui] refresh_hz)")
def top_command(url: str | None, api_key: str | None, once: bool, refresh_hz: float | None) -> None:
    """Watch a server's prefix cache: pools, slots, host slabs, snapshots, restores, reuse.

    Keys: q (or Ctrl+C) quits."""
    from hpc_cli.errors import UnavailableError
    from hpc_cli.settings import load_settings
    from hpc_cli.tui.app import Chrome, run_view
    from hpc_cli.tui.collect import Collector, SourceGone, url_source

    if url is None or refresh_hz is None:
        s = load_settings(None, environ=os.environ).settings
        if url is None:
            host = s.server.host if s.server.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
            url = f"http://{host}:{s.server.port}"
        refresh_hz = refresh_hz or s.tui.refresh_hz
    if "://" not in url:
        url = "http://" + url
    collector = Collector(url_source(url, api_key), source=url)
    try:
        run_view(collector, refresh_hz=refresh_hz, once=once, chrome=Chrome(keys=KEYS, quit_keys="qQ"))
    except SourceGone as exc:
        if collector.frames:
            msg = str(exc)
            msg = (msg.replace("cannot reach ", "", 1).replace(" (", " went away (", 1)
                   if msg.startswith("cannot reach ") else f"the server went away: {msg}")
            raise UnavailableError(msg, hint="restart it, then run 'hpc-cli top' again") from None
        raise UnavailableError(str(exc), hint="start it with 'hpc-cli serve', or pass --url") from None


def register(cli: click.Group) -> None:
    cli.add_command(top_command)
