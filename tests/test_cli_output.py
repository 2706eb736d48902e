"""The CLI as a new user meets it, run as a real process: tables print whole into a pipe and wrap
(never cut) on a narrow terminal, `--help` shows whole descriptions, the shipped default profile is
the real default, and `config validate` reports every problem of a profile in one pass."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios
import time

import pytest

CUT = "…"  # rich's ellipsis: what a cut cell ends with


def hpc(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("HPC_")}
    return subprocess.run([sys.executable, "-m", "hpc_cli", *args], capture_output=True, text=True,
                          env={**base, "COLUMNS": "80", **(env or {})}, timeout=120)


def on_terminal(*args: str, columns: int, rows: int = 40) -> str:
    """`hpc-cli ARGS` with stdout on a pseudo-terminal of ``columns`` x ``rows``; its output."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: a terminal of that size, then the command
        env = {k: v for k, v in os.environ.items() if not k.startswith("HPC_") and k not in ("COLUMNS", "LINES")}
        os.execve(sys.executable, [sys.executable, "-m", "hpc_cli", *args], {**env, "TERM": "xterm"})
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    chunks = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            data = os.read(fd, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.waitpid(pid, 0)
    os.close(fd)
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", b"".join(chunks).decode(errors="replace"))


# ------------------------------------------------------------------------------------------ tables
def test_piped_config_show_prints_every_key_whole():
    r = hpc("config", "show", "--profile", "int8-mtp.toml", "--sources")
    assert r.returncode == 0, r.stderr
    rows = [line for line in r.stdout.splitlines() if "device_snapshot_slots" in line]
    assert len(rows) == 1 and rows[0].split()[:3] == ["cache.hybrid.device_snapshot_slots", "5", "derived"]
    assert rows[0].split()[3] == "HPC_CACHE__HYBRID__DEVICE_SNAPSHOT_SLOTS"
    assert "HPC_ENGINE__MAX_CONCURRENCY" in r.stdout and CUT not in r.stdout
    shown = json.loads(hpc("config", "show", "--profile", "int8-mtp.toml", "--json").stdout)["values"]
    for key in shown:  # every key on a line of its own, whole
        assert re.search(rf"^{re.escape(key)}\s", r.stdout, re.M), key


@pytest.mark.parametrize("args,names", [
    (("plugins",), ["hpc_plugins.kv_profiles", "hpc_plugins.spec_backends", "hpc_register_cache_modes"]),
    (("kv", "profiles"), ["fp8-e4m3fn-row256", "hpc_plugins.kv_profiles"]),
    (("kv", "table"), ["fp8-e4m3fn-row256"]),
])
def test_piped_tables_are_whole(args, names):
    r = hpc(*args)
    assert r.returncode == 0, r.stderr
    assert CUT not in r.stdout and all(n in r.stdout for n in names), r.stdout


@pytest.mark.parametrize("args", [("plugins",), ("kv", "profiles"), ("config", "show", "--sources")])
def test_narrow_terminal_wraps_instead_of_cutting(args):
    out = on_terminal(*args, columns=60)
    assert "┃" in out or "│" in out  # a rich table on the terminal
    assert CUT not in out, out
    assert max(len(line) for line in out.splitlines()) <= 60


# ------------------------------------------------------------------------------------------ --help
def _first_sentences() -> dict[tuple[str, ...], str]:
    from hpc_cli.cli import cli

    out = {}
    for name, cmd in cli.commands.items():
        out[(name,)] = cmd.get_short_help_str(10_000)
        for sub, subcmd in getattr(cmd, "commands", {}).items():
            out[(name, sub)] = subcmd.get_short_help_str(10_000)
    return out


def _flat(text: str) -> str:
    """Whitespace collapsed; a line may break after a hyphen."""
    return re.sub(r"-\s+", "-", " ".join(text.split()))


def test_help_shows_whole_descriptions():
    sentences = _first_sentences()
    assert any(len(s) > 60 for s in sentences.values())  # some do not fit 80 columns in one line
    groups = {()} | {path[:1] for path in sentences if len(path) == 2}
    for group in sorted(groups):
        r = hpc(*group, "--help")
        body = r.stdout.split("\n", 1)[1]  # after the usage line (whose [ARGS]... is click's)
        assert r.returncode == 0 and "..." not in body, r.stdout
        for path, sentence in sentences.items():
            if path[:-1] == group:
                assert _flat(sentence) in _flat(r.stdout), (path, sentence)


# ------------------------------------------------------------------------------------------ profiles
def test_shipped_default_profile_is_the_default():
    plain = json.loads(hpc("config", "show", "--json").stdout)["values"]
    shipped = json.loads(hpc("config", "show", "--profile", "default.toml", "--json").stdout)["values"]
    assert shipped == plain


def test_validate_reports_every_problem_at_once(tmp_path):
    p = tmp_path / "p.toml"
    p.write_text('[model]\nname = "/no/such/dir"\n[kv]\nprofile = "int9"\n[speculative]\nbackend = "mtq"\n'
                 '[cache]\nhost_cache_mib = "x"\n')
    r = hpc("config", "validate", str(p))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 4 and r.stderr.count("\nhint: ") == 4, r.stderr
    for what in ("model.name = '/no/such/dir'", "kv.profile = 'int9'", "speculative.backend = 'mtq'",
                 "cache.host_cache_mib = 'x'"):
        assert any(what in e for e in errors), what


def test_validate_checks_paths(tmp_path):
    p = tmp_path / "p.toml"
    p.write_text('[model]\nname = "/no/such/dir"\n')
    r = hpc("config", "validate", str(p))
    assert r.returncode == 2 and r.stderr.startswith("error: model.name = '/no/such/dir': no such checkpoint")
    p.write_text(f'[cache]\nprefix_cache_file = "{tmp_path / "notes.txt"}"\n')
    (tmp_path / "notes.txt").write_text("my notes, not a cache\n")
    r = hpc("config", "validate", str(p))
    assert r.returncode == 2 and "holds other data" in r.stderr and "hint:" in r.stderr
    p.write_text('[model]\nname = "builtin:random"\n')
    assert hpc("config", "validate", str(p)).returncode == 0
