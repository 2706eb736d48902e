"""`hpc-cli cache`: look inside a prefix cache file (spec §5.5).

``inspect FILE`` shows the header, fingerprint, geometry, what the file holds and whether it would
load under a profile (printed by :mod:`hpc_cli.cli.cache_view`); ``verify FILE`` checks every
checksum (exit 2 on damage).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
from hpc_cli.cache.cachefile.format import HINT_DAMAGED, CacheFile, open_cache_file
from hpc_cli.cache.cachefile.slab_io import verify_slabs
from hpc_cli.cli import cache_view
from hpc_cli.cli.cache_view import MiB, mib
from hpc_cli.cli.groups import HelpGroup
from hpc_cli.cli.output import console, echo_json, stdout_is_terminal
from hpc_cli.errors import CacheFileError

def profile_check(cf: CacheFile, profile: str) -> dict[str, Any]:
    """What can be checked without loading the model: checkpoint identity, KV profile,
    speculative backend, prefill chunk and dtype, product build. Geometry, global scales and the
    full prefill signature are checked when the server loads the file."""
    from hpc_cli.engine.persistence import build_id
    from hpc_cli.settings import load_settings

    s = load_settings(profile).settings
    fp = cf.fingerprint
    name = str(s.model.name)
    if not name.startswith("builtin:"):
        p = Path(name).expanduser()
        name = str(p.resolve()) if p.exists() else name
    checks = {
        "checkpoint": (fp.get("checkpoint"), name),
        "kv_profile": (fp.get("kv_profile"), s.kv.profile),
        "speculative_backend": (fp.get("speculative_backend"), s.speculative.backend),
        "prefill_chunk": (str(fp.get("prefill_signature", "")).split("/")[1:2], [f"chunk{s.engine.prefill_chunk}"]),
        "product": (fp.get("product"), build_id()),
    }
    if s.model.dtype != "auto":
        checks["dtype"] = (str(fp.get("prefill_signature", "")).split("/")[0], s.model.dtype)
    if not s.cache.host_cache_mib:
        checks["host_tier"] = ("needed", "host_cache_mib = 0")
    differ = [k for k, (a, b) in checks.items() if a != b]
    if s.plugins if hasattr(s, "plugins") else False:  # pragma: no cover - defensive
        pass
    from hpc_cli import plugins

    try:
        canon = plugins.kv_profile(s.kv.profile).name
        if canon == fp.get("kv_profile") and "kv_profile" in differ:
            differ.remove("kv_profile")
    except Exception:
        pass
    tier = s.cache.host_cache_mib * MiB
    need = cf.num_slabs * cf.geometry.slab_bytes
    return {"profile": profile, "would_load": not differ, "differs": differ,
            "host_tier_bytes": tier, "file_needs_bytes": need, "fits_whole": tier >= need,
            "checked_at_load": ["geometry", "kv_global_scales", "prefill_signature", "rope", "checkpoint_files"]}


@click.group("cache", cls=HelpGroup)
def cache_group() -> None:
    """Prefix cache files (--prefix-cache-file)."""


@cache_group.command("inspect")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--profile", "profile", default=None, help="say whether the file would load under this profile")
@click.option("--tree", "show_tree", is_flag=True, help="show the block tree")
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.option("--top", default=10, show_default=True, help="how many of the most valuable snapshots to list")
def inspect_command(file: Path, profile: str | None, show_tree: bool, as_json: bool, top: int) -> None:
    """Show what a prefix cache file holds (tables only; `verify` checks the slab bytes).
    An expert residency profile (STRP) is recognised by its magic and summarised instead."""
    from hpc_cli.model.expert_profile import is_profile_file

    if is_profile_file(file):
        from hpc_cli.cli.expert_cmd import inspect_profile

        return inspect_profile(file, as_json, top)
    cf = open_cache_file(file)
    summ = cache_view.summarize(cf, top=top)
    if profile is not None:
        summ["profile_check"] = profile_check(cf, profile)
    if show_tree:
        summ["tree_lines"] = list(cache_view.iter_tree_lines(cf))
    if as_json:
        echo_json(summ)
        return
    cache_view.print_inspect(file, cf, summ, console(), profile=profile, show_tree=show_tree)


@cache_group.command("verify")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True)
def verify_command(file: Path, as_json: bool) -> None:
    """Check every checksum of a prefix cache file: header, tables and each slab run."""
    cf = open_cache_file(file)  # header and tables (raises on damage)
    total = cf.num_slabs * cf.geometry.slab_bytes
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    with Progress("{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  transient=True, console=console(), disable=as_json or not stdout_is_terminal()) as bar:
        task = bar.add_task("verifying", total=total)
        problems = verify_slabs(cf, on_bytes=lambda n: bar.advance(task, n))
    if problems:
        raise CacheFileError(f"prefix cache file {file} is damaged: " + "; ".join(problems[:5]),
                             hint=HINT_DAMAGED)
    if as_json:
        echo_json({"path": str(file), "ok": True, "runs": len(cf.runs), "bytes": cf.file_size})
        return
    click.echo(f"ok: {file}: header, 3 tables and {len(cf.runs)} slab runs verified ({mib(cf.file_size)})")


def register(cli: click.Group) -> None:
    cli.add_command(cache_group)
