"""Ports for the servers the tests, the demo and the real-engine tiers start.

The old way, `bind(("127.0.0.1", 0))` then release, takes a port from the kernel's ephemeral
range: the range every outgoing connection's local port comes from too. In the moment between
the pick and the server's own bind, any of the suite's client connections could take the port,
and a test failed with "address already in use" on a busy machine (tests/ops/test_processes,
2026-12-05). A port below that range is never given to a connection, so only another server
picking the same port at random (about 1 in 20,000) can take it first.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOWEST = 10_000  # below the usual registered services a developer machine runs
RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_choose = random.SystemRandom()  # not a test's seeded `random`: parallel workers must not agree


def ephemeral_start() -> int:
    """The lowest port the kernel gives outgoing connections (Linux's default 32768)."""
    try:
        return int(RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing is bound to on `host` now, outside the ephemeral range where it can be."""
    top = ephemeral_start()
    if top - LOWEST >= 1000:
        for _ in range(200):
            port = _choose.randrange(LOWEST, top)
            with socket.socket() as sock:
                try:
                    sock.bind((host, port))
                except OSError:
                    continue
            return port
    with socket.socket() as sock:  # a machine with no room below its ephemeral range
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def distinct_free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` different free ports (one server's HTTP, bootstrap and side ports, say)."""
    ports: list[int] = []
    while len(ports) < n:
        port = free_port(host)
        if port not in ports:
            ports.append(port)
    return ports
