"""CPU windows: what a process tree (and the machine) spent between two instants.

`CpuMeter` brackets a load with start()/stop(); `snap` and `window` are the same thing for a
window inside a running load (router-bound opens it after a lead-in and counts the items the
server completed in it, so CPU per item needs no client-side bookkeeping); `settle` waits for a
tree to go idle so one measurement's stragglers do not land in the next.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import attrs
import psutil


def tree_procs(pid: int) -> list[psutil.Process]:
    try:
        proc = psutil.Process(pid)
        return [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return []


def proc_cpu(pid: int) -> float:
    """User+system CPU seconds of one process (0 when it is gone)."""
    with contextlib.suppress(psutil.Error):
        t = psutil.Process(pid).cpu_times()
        return t.user + t.system
    return 0.0


def tree_cpu(pid: int) -> float:
    """User+system CPU seconds of a process and all its live descendants."""
    return sum(proc_cpu(p.pid) for p in tree_procs(pid))


def machine_busy() -> float:
    """Busy CPU seconds of the whole machine so far (all cores)."""
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + t.irq + t.softirq + getattr(t, "steal", 0.0)


class CpuMeter:
    """CPU seconds used between start() and stop() by some process trees and the machine."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids
        self.before: dict[str, float] = {}
        self.result: dict[str, float] = {}
        self.t0 = 0.0
        self.wall = 0.0

    def start(self) -> None:
        self.t0 = time.monotonic()
        self.before = {name: tree_cpu(pid) for name, pid in self.pids.items()}
        self.before["machine"] = machine_busy()

    def stop(self) -> dict[str, float]:
        self.wall = time.monotonic() - self.t0
        now = {name: tree_cpu(pid) for name, pid in self.pids.items()}
        now["machine"] = machine_busy()
        self.result = {k: round(now[k] - self.before[k], 4) for k in now}
        return self.result


@attrs.define
class Snap:
    """One instant of a window: per-process CPU of the measured tree, the engines', the
    machine's, the client's, and the server's own counters (completed requests, events)."""

    t: float
    cpu: dict[int, float]  # pid -> CPU seconds (the measured tree)
    engines: float
    machine: float
    counters: dict[str, int]
    client: float = 0.0
    steal: float = 0.0


def snap(root: int, engines: list[int], counters: dict[str, int], client: int | None) -> Snap:
    t = time.monotonic()
    cpu = {p.pid: proc_cpu(p.pid) for p in tree_procs(root)}
    spent = sum(tree_cpu(pid) for pid in engines)
    steal = getattr(psutil.cpu_times(), "steal", 0.0)
    return Snap(t, cpu, spent, machine_busy(), counters, proc_cpu(client) if client else 0.0, steal)


def window(a: Snap, b: Snap, count_key: str, workers: list[int]) -> dict[str, Any]:
    """CPU of the measured tree (and per worker process) between two snapshots, per item."""
    wall = b.t - a.t
    pids = set(a.cpu) | set(b.cpu)
    per = {pid: b.cpu.get(pid, 0.0) - a.cpu.get(pid, 0.0) for pid in pids}
    cpu = sum(per.values())
    count = b.counters.get(count_key, 0) - a.counters.get(count_key, 0)
    out: dict[str, Any] = {
        "window_s": round(wall, 3),
        "cpu_s": round(cpu, 4),
        count_key: count,
        "per_s": round(count / wall, 1) if wall else None,
        "cpu_us": round(1e6 * cpu / count, 1) if count else None,
        "cores": round(cpu / wall, 3) if wall else None,
        "engines_us": round(1e6 * (b.engines - a.engines) / count, 1) if count else None,
        "client_us": round(1e6 * (b.client - a.client) / count, 1) if count and b.client else None,
        "machine_busy": round((b.machine - a.machine) / wall, 2) if wall else None,
        "steal": round((b.steal - a.steal) / wall, 2) if wall else None,
    }
    if len(workers) > 1:
        shares = [per.get(pid, 0.0) for pid in workers]
        out["worker_cpu_s"] = [round(x, 3) for x in shares]
        out["split"] = round(max(shares) / min(shares), 3) if min(shares) > 0 else None
    return out


def settle(root: int, timeout: float = 15.0) -> float:
    """Wait until a process tree is idle (under 5 % of a core over 0.2 s): requests a finished
    load left behind must not land in the next measurement. Returns the seconds waited."""
    t0 = time.monotonic()
    before = tree_cpu(root)
    while time.monotonic() - t0 < timeout:
        time.sleep(0.2)
        now = tree_cpu(root)
        if now - before < 0.01:
            break
        before = now
    return round(time.monotonic() - t0, 2)


def peak_rss_mb(pid: int) -> float | None:
    """Sum over the process tree of each process's peak RSS (VmHWM) so far."""
    total = 0
    for proc in tree_procs(pid):
        with contextlib.suppress(OSError, ValueError):
            for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1]) * 1024
    return round(total / 2**20, 1) if total else None


def worker_pids(pid: int) -> list[int]:
    """The processes of a router that serve requests: the root, or its spawned workers."""
    workers = []
    for proc in tree_procs(pid)[1:]:
        with contextlib.suppress(psutil.Error):
            cmdline = " ".join(proc.cmdline())
            if "resource_tracker" not in cmdline and "semaphore_tracker" not in cmdline:
                workers.append(proc.pid)
    return workers or [pid]
