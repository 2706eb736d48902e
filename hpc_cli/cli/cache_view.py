"""What `hpc-cli cache inspect` shows of a prefix cache file (spec §5.5): the summary (also its
``--json``), the block tree and the tables printed from them. The file itself is
:mod:`hpc_cli.cache.cachefile`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

from rich.console import Console
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from hpc_cli.cache.cachefile.format import CacheFile, FileSnapshot
from hpc_cli.cache.cachefile.plan import density
from hpc_cli.cache.cost import GENERIC, CacheCostModel
from hpc_cli.cli.output import print_table

MiB = 1 << 20


def mib(n: int) -> str:
    return f"{n / MiB:,.1f} MiB"


def _hex(v: int) -> str:
    return f"{v:016x}"


# ------------------------------------------------------------------ summary (the --json document)
def summarize(cf: CacheFile, *, top: int = 10, cost: CacheCostModel = GENERIC) -> dict[str, Any]:
    g = cf.geometry
    by_kind: dict[str, dict[str, int]] = {}
    for s in cf.snapshots:
        d = by_kind.setdefault(s.kind.value, {"count": 0, "bytes": 0, "tailed": 0})
        d["count"] += 1
        d["bytes"] += cf.snapshot_slabs(s) * g.slab_bytes
        d["tailed"] += 1 if s.has_tail else 0
    children: dict[int, int] = {}
    depth = [0] * len(cf.blocks)
    for i, b in enumerate(cf.blocks):
        children[b.parent] = children.get(b.parent, 0) + 1
        depth[i] = depth[b.parent] + 1 if b.parent >= 0 else 1
    inner = [c for c in children.values()]
    ranked = sorted(range(len(cf.snapshots)), key=lambda j: -density(cf, cf.snapshots[j], cost))[:top]
    return {
        "path": str(cf.path), "format": cf.format, "file_bytes": cf.file_size,
        "fingerprint": cf.fingerprint, "geometry": {**g.as_dict(), "image_slabs": g.image_slabs},
        "blocks": {"count": len(cf.blocks), "bytes": len(cf.blocks) * g.slab_bytes},
        "snapshots": {"count": len(cf.snapshots), "by_kind": by_kind,
                      "bytes": sum(cf.snapshot_slabs(s) for s in cf.snapshots) * g.slab_bytes},
        "slabs": cf.num_slabs, "slab_bytes_total": cf.num_slabs * g.slab_bytes,
        "tree": {"depth_blocks": max(depth, default=0), "roots": children.get(-1, 0),
                 "max_fanout": max(inner, default=0),
                 "branching_nodes": sum(1 for c in inner if c > 1),
                 "leaves": len(cf.blocks) - sum(1 for k in children if k >= 0)},
        "top_snapshots": [{"index": j, "kind": cf.snapshots[j].kind.value, "frontier": cf.snapshots[j].frontier,
                           "hits": cf.snapshots[j].hits, "density": density(cf, cf.snapshots[j], cost)}
                          for j in ranked],
        "media": media_summary(cf, top=top),
    }


def media_summary(cf: CacheFile, *, top: int = 10) -> dict[str, Any]:
    """The Vision items the file's blocks hold, by content digest, and the snapshots whose tails
    carry a media key."""
    images: dict[bytes, dict[str, Any]] = {}
    keyed = 0
    for i, b in enumerate(cf.blocks):
        keyed += 1 if b.media else 0
        for it in b.media:
            d = images.setdefault(it.content_digest, {"digest": it.content_digest.hex(), "modality": it.modality,
                                                      "grid": list(it.grid), "spans": [], "blocks": []})
            if [it.begin, it.length] not in d["spans"]:
                d["spans"].append([it.begin, it.length])
            d["blocks"].append(i)
    items = sorted(images.values(), key=lambda d: (-len(d["blocks"]), d["digest"]))
    return {"blocks": keyed, "images": len(images),
            "tail_keyed_snapshots": sum(1 for s in cf.snapshots if s.tail_extra),
            "items": [{**d, "media_keys": sorted({_hex(cf.blocks[i].extra) for i in d["blocks"]})[:top]}
                      for d in items[:top]]}


def _tree(cf: CacheFile) -> tuple[dict[int, list[int]], dict[int, list[FileSnapshot]]]:
    """Each block's children and the snapshots anchored on it, by block index (-1: the root)."""
    kids: dict[int, list[int]] = {}
    for i, b in enumerate(cf.blocks):
        kids.setdefault(b.parent, []).append(i)
    anchored: dict[int, list[FileSnapshot]] = {}
    for snap in cf.snapshots:
        anchored.setdefault(snap.anchor, []).append(snap)
    return kids, anchored


def iter_tree_lines(cf: CacheFile, limit: int = 200) -> Iterable[str]:
    """A text view of the block tree (block index, depth, snapshots anchored)."""
    kids, anchored = _tree(cf)
    lines = 0

    def label(i: int) -> str:
        sn = anchored.get(i, [])
        tag = ", ".join(f"{s.kind.value}@{s.frontier}(hits {s.hits})" for s in sn)
        media = " ".join(f"[image {it.content_digest.hex()[:12]}]" for it in cf.blocks[i].media)
        return f"block {i}" + (f"  {media}" if media else "") + (f"  ({tag})" if tag else "")

    stack = [(i, 0) for i in reversed(kids.get(-1, []))]
    for s in anchored.get(-1, []):
        yield f"root  ({s.kind.value}@{s.frontier})"
    while stack and lines < limit:
        i, d = stack.pop()
        ch = kids.get(i, [])
        # compress single chains without snapshots
        run = 0
        while len(ch) == 1 and i not in anchored:
            i = ch[0]
            ch = kids.get(i, [])
            run += 1
        yield "  " * d + ("… " + f"+{run} blocks → " if run else "") + label(i)
        lines += 1
        stack += [(c, d + 1) for c in reversed(ch)]
    if stack:
        yield f"… ({len(stack)} more branches)"


# ------------------------------------------------------------------ printing
TREE_LIMIT = 200  # tree nodes drawn; the rest are counted


def block_tree(cf: CacheFile, limit: int = TREE_LIMIT) -> Tree:
    """The file's block tree as a rich tree: a node per block that branches or anchors snapshots,
    runs of single-child blocks without snapshots folded into the node that ends them."""
    kids, anchored = _tree(cf)

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


def print_media(media: dict[str, Any], con) -> None:
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


def print_inspect(file: Path, cf: CacheFile, summ: dict[str, Any], con: Console, *, profile: str | None,
                  show_tree: bool) -> None:
    """The tables of ``inspect`` (without ``--json``)."""
    fp = summ["fingerprint"]
    t = Table(title=f"prefix cache file {file}", show_header=False)
    t.add_column("field")
    t.add_column("value", overflow="fold")
    t.add_row("format", str(summ["format"]))
    t.add_row("size", mib(summ["file_bytes"]))
    for k in ("checkpoint", "prefill_signature", "kv_profile", "speculative_backend", "product"):
        t.add_row(k, str(fp.get(k)))
    t.add_row("checkpoint files", str(len(fp.get("checkpoint_files", []))))
    if fp.get("speculative_drafter"):
        d = fp["speculative_drafter"]
        t.add_row("speculative drafter", f"{d.get('source')} ({len(d.get('files', []))} files)")
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
    c.add_row("blocks", str(summ["blocks"]["count"]), mib(summ["blocks"]["bytes"]))
    for kind, d in sorted(summ["snapshots"]["by_kind"].items()):
        c.add_row(f"snapshots: {kind} ({d['tailed']} with tail)", str(d["count"]), mib(d["bytes"]))
    c.add_row("all slabs", str(summ["slabs"]), mib(summ["slab_bytes_total"]))
    print_table(c, con)
    print_media(summ["media"], con)
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
            fit = "whole" if pc["fits_whole"] else f"partly (tier {mib(pc['host_tier_bytes'])}, file needs {mib(pc['file_needs_bytes'])})"
            con.print(f"[green]would load[/green] under {profile}: {fit}; checked at load: "
                      + ", ".join(pc["checked_at_load"]))
        else:
            con.print(f"[red]would not load[/red] under {profile}: differs in " + ", ".join(pc["differs"]))
