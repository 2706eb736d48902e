"""`hpc-cli cache inspect` and `verify` (spec §5.5; hpc_cli/cli/cache_cmd.py, cache_view.py)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from hpc_cli.cli import cli

from .conftest import populated, save_file


def test_inspect_and_verify(tmp_path):
    ix, host, _ = populated()
    path = save_file(tmp_path, ix, host)
    r = CliRunner().invoke(cli, ["cache", "inspect", str(path), "--json", "--tree"])
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["snapshots"]["count"] >= 3 and d["blocks"]["count"] > 0 and d["tree"]["max_fanout"] >= 2
    assert d["top_snapshots"][0]["density"] >= d["top_snapshots"][-1]["density"]
    r = CliRunner().invoke(cli, ["cache", "inspect", str(path), "--tree"])
    assert r.exit_code == 0 and "most valuable" in r.output, r.output
    r = CliRunner().invoke(cli, ["cache", "verify", str(path)])
    assert r.exit_code == 0 and r.output.strip().startswith("ok:"), r.output
    data = bytearray(path.read_bytes())
    data[-5] ^= 1
    path.write_bytes(bytes(data))
    r = CliRunner().invoke(cli, ["cache", "verify", str(path)])
    assert r.exit_code == 2 and "checksum mismatch" in r.output and "hint:" in r.output
    data[-5] ^= 1
    data[20] ^= 1
    path.write_bytes(bytes(data))
    r = CliRunner().invoke(cli, ["cache", "inspect", str(path)])
    assert r.exit_code == 2 and "damaged" in r.output


def test_inspect_tree_draws_a_tree(tmp_path):
    """`cache inspect --tree` (a real process): children are indented under their parent with
    rich's tree guides, not every line at column 0."""
    import subprocess
    import sys

    ix, host, _ = populated()
    path = save_file(tmp_path, ix, host)
    r = subprocess.run([sys.executable, "-m", "hpc_cli", "cache", "inspect", str(path), "--tree"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("root"))
    tree = lines[start:]
    assert tree[1].startswith(("├── ", "└── "))
    nested = [line for line in tree if line.startswith(("│   ├── ", "│   └── ", "    ├── ", "    └── "))]
    assert nested, "\n".join(tree)  # a second level, drawn under its parent
    assert sum("block " in line for line in tree) == d_blocks(path)


def d_blocks(path) -> int:
    """Tree nodes the file's block tree draws: blocks that branch, end a chain or anchor snapshots."""
    from hpc_cli.cache.cachefile.format import open_cache_file

    cf = open_cache_file(path)
    kids: dict[int, int] = {}
    for b in cf.blocks:
        kids[b.parent] = kids.get(b.parent, 0) + 1
    anchored = {s.anchor for s in cf.snapshots}
    return sum(1 for i in range(len(cf.blocks)) if kids.get(i, 0) != 1 or i in anchored)
