"""The live views on a real terminal (a pseudo-terminal): `hpc-cli top` shows its keys and quits
on `q`; `hpc-cli serve --tui` prints its banner before the view opens, shows where it listens and
how to stop it, says what a first Ctrl+C means, and stops on the second."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import signal
import socket
import struct
import sys
import termios
import time

import pytest

from .test_tui import stats_server  # noqa: F401 - a fixture

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Z0-9]|\x1b[=>]")
ALT_SCREEN = "\x1b[?1049h"


class Terminal:
    """A command on a pseudo-terminal of ``columns`` x ``rows``: read what it draws, type keys."""

    def __init__(self, args: list[str], columns: int = 120, rows: int = 40) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("HPC_") and k not in ("COLUMNS", "LINES")}
        self.pid, self.fd = pty.fork()
        if self.pid == 0:
            os.execve(sys.executable, [sys.executable, "-m", "hpc_cli", *args], {**env, "TERM": "xterm-256color"})
        fcntl.ioctl(self.fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
        self.raw = ""
        self.status: int | None = None

    def _read(self, timeout: float) -> None:
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if ready:
            try:
                data = os.read(self.fd, 65536)
            except OSError:
                data = b""
            self.raw += data.decode(errors="replace")

    @property
    def text(self) -> str:
        return ANSI.sub("", self.raw)

    def expect(self, pattern: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while pattern not in self.text:
            if time.monotonic() > deadline or self.exited():
                raise AssertionError(f"{pattern!r} never appeared; the terminal showed:\n{self.text[-3000:]}")
            self._read(0.1)

    def type(self, keys: bytes) -> None:
        os.write(self.fd, keys)

    def exited(self) -> bool:
        if self.status is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = os.waitstatus_to_exitcode(status)
        return self.status is not None

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while not self.exited():
            if time.monotonic() > deadline:
                raise AssertionError(f"still running after {timeout} s; it showed:\n{self.text[-3000:]}")
            self._read(0.1)
        self._read(0)
        return self.status

    def close(self) -> None:
        if not self.exited():
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        os.close(self.fd)


def test_top_shows_its_keys_and_quits_on_q(stats_server):  # noqa: F811 - the fixture
    _, url = stats_server
    term = Terminal(["top", "--url", url, "--api-key", "sekret", "--refresh-hz", "10"], columns=100, rows=30)
    try:
        term.expect("Device KV pages", timeout=60)
        term.expect("q quit")
        term.type(b"q")
        assert term.wait(10) == 0
    finally:
        term.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_tui_address_banner_and_ctrl_c():
    port = _free_port()
    term = Terminal(["serve", "--model", "builtin:random", "--tui", "--port", str(port), "--device", "cpu",
                     "--max-model-len", "1024",
                     "--max-concurrency", "1", "--host-cache-mib", "16"], columns=120, rows=40)
    url = f"http://127.0.0.1:{port}"
    try:
        term.expect("Ctrl+C twice within 5 s stops the server", timeout=120)  # the view is up
        term.expect("Device KV pages", timeout=30)  # and has drawn its panels
        assert ALT_SCREEN in term.raw
        before_view = ANSI.sub("", term.raw.split(ALT_SCREEN, 1)[0])
        assert f"hpc-cli serving builtin:random as 'builtin:random' at {url}" in before_view  # the banner first
        view = ANSI.sub("", term.raw.split(ALT_SCREEN, 1)[1])
        assert f"at {url}" in view and "Device KV pages" in view
        term.type(b"\x03")  # Ctrl+C: the terminal sends SIGINT
        term.expect("press Ctrl+C again within 5 s to stop", timeout=20)
        assert not term.exited()
        term.type(b"\x03")
        assert term.wait(60) == 0
        assert "stopping (Ctrl+C)" in term.text
    finally:
        term.close()
