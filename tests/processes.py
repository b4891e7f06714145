"""Every process the suite starts, in its own process group, and reaped when its test ends.

Tests start engines, `trio-pd serve` (which spawns its own workers), etcd and command-line
runs through `subprocess.Popen` (directly, or through `trio.lowlevel.open_process` and
`trio.run_process`, which call it). `install()` puts `GroupedPopen` in its place for the whole
test process, so no call site can forget: each child is a session leader (its own process
group, so a kill reaches the workers it spawned) and is recorded with the test that started it.
`tests/deadline.py` reaps a test's groups after its teardown, and everything on the way out
(session end, `atexit`, SIGTERM/SIGHUP, the hard deadline's exit): a hung or failed test
leaves nothing running.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import attrs

_ORIGINAL_POPEN = subprocess.Popen


@attrs.define
class Started:
    popen: subprocess.Popen[Any]
    owner: str  # the test (node id) running when it started
    command: str


STARTED: list[Started] = []
owner = "(outside any test)"  # set by tests/deadline.py around each test


class GroupedPopen(_ORIGINAL_POPEN):  # type: ignore[misc,valid-type]
    """`subprocess.Popen`, in a new session unless the caller chose, and recorded."""

    def __init__(self, args: Any, *rest: Any, **kwargs: Any) -> None:
        if "process_group" not in kwargs:
            kwargs.setdefault("start_new_session", True)
        super().__init__(args, *rest, **kwargs)
        command = args if isinstance(args, str) else " ".join(str(a) for a in args)
        STARTED.append(Started(self, owner, command[:160]))


@contextlib.contextmanager
def outliving_the_test(why: str) -> Any:
    """Processes started inside belong to the session, not to the running test: a test that
    restarts a session fixture's engine in place (the real-engine tier's fault matrix) leaves it
    for the later tests, reaped when the session ends."""
    global owner
    previous, owner = owner, f"(session: {why})"
    try:
        yield
    finally:
        owner = previous


def install() -> None:
    subprocess.Popen = GroupedPopen  # type: ignore[misc]


def groups() -> dict[int, list[int]]:
    """Every process group on the machine and its live pids (read from /proc: no signal sent)."""
    found: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_bytes()
        except OSError:
            continue
        fields = stat[stat.rindex(b")") + 2 :].split()  # state, ppid, pgrp, ...
        if fields[0] in (b"Z", b"X"):
            continue  # dead, waiting for its parent (or init) to collect it
        found.setdefault(int(fields[2]), []).append(int(entry.name))
    return found


def reap(started: list[Started]) -> list[Started]:
    """SIGKILL every group in `started` that still has a process; returns those. A group is
    killed only while its number cannot belong to someone else: its leader is our unreaped
    child (a zombie still holds the number), or no process has that pid any more (Linux keeps
    a group's number allocated while any member lives)."""
    alive = []
    live_groups = groups()
    for each in started:
        pgid = each.popen.pid
        ours = each.popen.returncode is None  # not yet waited for: the pid is still ours
        if pgid not in live_groups:
            each.popen.poll()
            continue
        if not ours and Path(f"/proc/{pgid}").exists():
            continue  # the number was reused by another process: not ours to signal
        alive.append(each)
        with contextlib.suppress((ProcessLookupError, PermissionError)):
            os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            each.popen.wait(5)
    return alive


def reap_all() -> list[Started]:
    alive = reap(STARTED)
    STARTED.clear()
    return alive
