"""`hpc-cli cache inspect` and `verify` (spec §5.5)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from hpc_cli.cli import cli

from .test_file_format import _populated, _save


def test_inspect_and_verify(tmp_path):
    ix, host, _ = _populated()
    path = _save(tmp_path, ix, host)
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
