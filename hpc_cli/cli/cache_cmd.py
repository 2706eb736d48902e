"""`hpc-cli cache`: look inside a prefix cache file (spec §5.5).

``inspect FILE`` shows the header, fingerprint, geometry, what the file holds and whether it would
load under a profile; ``verify FILE`` checks every checksum (exit 2 on damage).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from hpc_cli.cache import persist
from hpc_cli.cli.groups import HelpGroup
from hpc_cli.cli.output import console, echo_json, print_table, stdout_is_terminal
from hpc_cli.errors import CacheFileError

MiB = 1 << 20


def _mib(n: int) -> str:
    return f"{n / MiB:,.1f} MiB"


def profile_check(cf: persist.CacheFile, profile: str) -> dict[str, Any]:
    """What can be checked without loading the model: checkpoint identity, KV profile,
    speculative backend, prefill chunk and dtype, product build. Geometry, global scales and the
    full prefill signature are checked when the server loads the file."""
    from hpc_cli.engine.persistence import _build_id
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
        "product": (fp.get("product"), _build_id()),
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


TREE_LIMIT = 200  # tree nodes drawn; the rest are counted


def block_tree(cf: persist.CacheFile, limit: int = TREE_LIMIT) -> Tree:
    """The file's block tree as a rich tree: a node per block that branches or anchors snapshots,
    runs of single-child blocks without snapshots folded into the node that ends them."""
    kids: dict[int, list[int]] = {}
    for i, b in enumerate(cf.blocks):
        kids.setdefault(b.parent, []).append(i)
    anchored: dict[int, list[persist.FileSnapshot]] = {}
    for snap in cf.snapshots:
        anchored.setdefault(snap.anchor, []).append(snap)

    def label(i: int, folded: int) -> Text:
        tags = ", ".join(f"{s.kind.value}@{s.frontier} (hits {s.hits})" for s in anchored.get(i, []))
        text = f"block {i}" if i >= 0 else "root"
        if i >= 0 and cf.blocks[i].media:
            text += "  " + " ".join(f"[image {it.content_digest.hex()[:12]}]" for it in cf.blocks[i].media)
        if folded:
            text = f"+{folded} blocks → {text}"
        return Text(text + (f"  ({tags})" if tags else ""))

    root = Tree(label(-1, 0), highlight=False)
    drawn = 0
    stack: list[tuple[int, Tree]] = [(c, root) for c in reversed(kids.get(-1, []))]
    while stack and drawn < limit:
        i, parent = stack.pop()
        folded = 0
        while len(kids.get(i, [])) == 1 and i not in anchored:
            i = kids[i][0]
            folded += 1
        node = parent.add(label(i, folded))
        drawn += 1
        stack += [(c, node) for c in reversed(kids.get(i, []))]
    if stack:
        root.add(Text(f"… {len(stack)} more branches"))
    return root


def _print_media(media: dict[str, Any], con) -> None:
    """The images the file's blocks hold (docs/vision.md): digest, grid, spans, media keys."""
    if not media["images"]:
        return
    m = Table(title=f"images: {media['images']} in {media['blocks']} blocks, "
                    f"{media['tail_keyed_snapshots']} snapshot tails keyed")
    for col in ("sha256", "grid (t, h, w)", "spans [begin, length]", "blocks", "media keys"):
        m.add_column(col, overflow="fold")
    for it in media["items"]:
        m.add_row(it["digest"][:16], "x".join(str(g) for g in it["grid"]), str(it["spans"]),
                  str(len(it["blocks"])), " ".join(it["media_keys"]))
    print_table(m, con)


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
    cf = persist.open_cache_file(file)
    summ = persist.summarize(cf, top=top)
    if profile is not None:
        summ["profile_check"] = profile_check(cf, profile)
    if show_tree:
        summ["tree_lines"] = list(persist.iter_tree_lines(cf))
    if as_json:
        echo_json(summ)
        return
    con = console()
    fp = summ["fingerprint"]
    t = Table(title=f"prefix cache file {file}", show_header=False)
    t.add_column("field")
    t.add_column("value", overflow="fold")
    t.add_row("format", str(summ["format"]))
    t.add_row("size", _mib(summ["file_bytes"]))
    for k in ("checkpoint", "prefill_signature", "kv_profile", "speculative_backend", "product"):
        t.add_row(k, str(fp.get(k)))
    t.add_row("checkpoint files", str(len(fp.get("checkpoint_files", []))))
    if fp.get("kv_global_scales"):
        t.add_row("kv global scales", f"{len(fp['kv_global_scales'])} layers")
    t.add_row("rope", str(fp.get("rope")))
    g = summ["geometry"]
    t.add_row("geometry", f"slab {g['slab_bytes']} B, image {g['image_bytes']} B ({g['image_slabs']} slabs), "
                          f"block {g['block_bytes']} B")
    print_table(t, con)
    c = Table(title="contents")
    for col in ("what", "count", "bytes"):
        c.add_column(col, justify="left" if col == "what" else "right")
    c.add_row("blocks", str(summ["blocks"]["count"]), _mib(summ["blocks"]["bytes"]))
    for kind, d in sorted(summ["snapshots"]["by_kind"].items()):
        c.add_row(f"snapshots: {kind} ({d['tailed']} with tail)", str(d["count"]), _mib(d["bytes"]))
    c.add_row("all slabs", str(summ["slabs"]), _mib(summ["slab_bytes_total"]))
    print_table(c, con)
    _print_media(summ["media"], con)
    tr = summ["tree"]
    con.print(f"tree: depth {tr['depth_blocks']} blocks, {tr['roots']} roots, {tr['leaves']} leaves, "
              f"max fan-out {tr['max_fanout']}, {tr['branching_nodes']} branching nodes")
    if summ["top_snapshots"]:
        v = Table(title="most valuable snapshots (restore density)")
        for col in ("#", "kind", "frontier", "hits", "density"):
            v.add_column(col, justify="right")
        for r in summ["top_snapshots"]:
            v.add_row(str(r["index"]), r["kind"], str(r["frontier"]), str(r["hits"]), f"{r['density']:.3e}")
        print_table(v, con)
    if show_tree:
        con.print(block_tree(cf))
    pc = summ.get("profile_check")
    if pc is not None:
        if pc["would_load"]:
            fit = "whole" if pc["fits_whole"] else f"partly (tier {_mib(pc['host_tier_bytes'])}, file needs {_mib(pc['file_needs_bytes'])})"
            con.print(f"[green]would load[/green] under {profile}: {fit}; checked at load: "
                      + ", ".join(pc["checked_at_load"]))
        else:
            con.print(f"[red]would not load[/red] under {profile}: differs in " + ", ".join(pc["differs"]))


@cache_group.command("verify")
@click.argument("file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True)
def verify_command(file: Path, as_json: bool) -> None:
    """Check every checksum of a prefix cache file: header, tables and each slab run."""
    cf = persist.open_cache_file(file)  # header and tables (raises on damage)
    total = cf.num_slabs * cf.geometry.slab_bytes
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    with Progress("{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  transient=True, console=console(), disable=as_json or not stdout_is_terminal()) as bar:
        task = bar.add_task("verifying", total=total)
        problems = persist.verify_slabs(cf, on_bytes=lambda n: bar.advance(task, n))
    if problems:
        raise CacheFileError(f"prefix cache file {file} is damaged: " + "; ".join(problems[:5]),
                             hint=persist._HINT_DAMAGED)
    if as_json:
        echo_json({"path": str(file), "ok": True, "runs": len(cf.runs), "bytes": cf.file_size})
        return
    click.echo(f"ok: {file}: header, 3 tables and {len(cf.runs)} slab runs verified ({_mib(cf.file_size)})")


def register(cli: click.Group) -> None:
    cli.add_command(cache_group)
