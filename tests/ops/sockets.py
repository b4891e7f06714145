"""Who listens where, read from /proc (Linux): no traffic needed to see an address or an owner."""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Iterable

LISTEN = "0A"


def listeners(port: int) -> dict[str, int]:
    """The listening TCP sockets on `port`: address -> socket inode."""
    found: dict[str, int] = {}
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        try:
            with open(table) as f:
                lines = f.readlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], int(fields[9])
            address, _, hex_port = local.partition(":")
            if state == LISTEN and int(hex_port, 16) == port:
                found[str(decode_address(address, width))] = inode
    return found


def decode_address(hex_address: str, width: int) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """/proc/net/tcp writes each 32-bit word of an address in host (little-endian) order."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.IPv4Address(words) if width == 4 else ipaddress.IPv6Address(words)


def holders(inode: int, pids: Iterable[int]) -> set[int]:
    """Which of `pids` hold the socket `inode` open."""
    target = f"socket:[{inode}]"
    owners = set()
    for pid in pids:
        fd_dir = f"/proc/{pid}/fd"
        try:
            names = os.listdir(fd_dir)
        except OSError:
            continue
        for name in names:
            try:
                if os.readlink(f"{fd_dir}/{name}") == target:
                    owners.add(pid)
                    break
            except OSError:
                continue
    return owners
