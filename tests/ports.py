"""Ports for tests that start servers on consecutive ports (one per mode or backend).

An ephemeral port (``bind(("127.0.0.1", 0))``) comes from the range the kernel also gives the
client sockets of the same machine, so the port after it can be taken by a client's connection to
the first server before the second server starts. These come from below that range."""

from __future__ import annotations

import random
import socket

LOW, HIGH = 20000, 32000  # Linux's default ephemeral range starts at 32768


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(n: int) -> int:
    """The first of ``n`` consecutive free loopback ports outside the ephemeral range."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(LOW, HIGH - n)
        if all(_free(base + i) for i in range(n)):
            return base
    raise RuntimeError(f"no {n} consecutive free ports in {LOW}..{HIGH}")
