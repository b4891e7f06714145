"""What the kernel holds on loopback TCP connections: requests a frozen server has not read.

A SIGSTOPped engine still has its connections accepted by the kernel (its listen backlog) and
their bytes queued; `/proc/net/tcp` shows both ends of every IPv4 connection, with the bytes
each end has not read yet. So a test can wait until what it sent sits in a frozen engine's
sockets (an event, not a sleep) before it resumes the engine.
"""

from __future__ import annotations

import os
from pathlib import Path


def _rows() -> list[tuple[int, int, int, int]]:
    """(local port, remote port, unread bytes, inode) of every IPv4 TCP socket."""
    rows = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        local, remote, queues = f[1], f[2], f[4]
        rows.append(
            (int(local.split(":")[1], 16), int(remote.split(":")[1], 16),
             int(queues.split(":")[1], 16), int(f[9]))
        )  # fmt: skip
    return rows


def unread_from(pid: int, port: int) -> int:
    """How many of process `pid`'s open connections to `port` carry bytes the listener has not
    read (accepted or still in its backlog)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    rows = _rows()
    mine = {local for local, remote, _, inode in rows if inode in inodes and remote == port}
    return sum(1 for local, remote, left, _ in rows if local == port and remote in mine and left)
