"""A router bound to the wildcard address is reached on every address of its host, which no
list can know in advance: after the connect, both upstream clients compare the socket's own
addresses and refuse a peer that is the router (`Destinations.check_connected`). Issue 28's
survivor: this was tested as a unit only.

Here through a real router: `tests/router/wildcard_probe.py` runs in a network namespace of its
own (`unshare -rn`: a user and a network namespace, no privilege needed), where 10.11.12.13 is
an address of the host that is not a loopback one, so no traffic can leave it. A worker URL
naming that address and the router's wildcard-bound metrics port passes every check before the
connect; the health probe (the control plane's client) and a leg (the hot path's) are refused
once connected, and the leg never reaches an engine."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parents[2]
SETUP = "ip link set lo up && ip addr add 10.11.12.13/32 dev lo"


async def test_a_worker_url_that_is_the_wildcard_bound_router_is_refused_once_connected() -> None:
    unshare, ip = shutil.which("unshare"), shutil.which("ip")
    assert unshare and ip, "this test needs unshare(1) (util-linux) and ip(8) (iproute2)"
    command = [unshare, "-rn", "sh", "-c", f'{SETUP} && exec "$0" -m tests.router.wildcard_probe',
               sys.executable]  # fmt: skip
    done = await trio.run_process(
        command, cwd=ROOT, capture_stdout=True, capture_stderr=True, check=False
    )
    stderr = done.stderr.decode(errors="replace")
    assert done.returncode == 0, stderr[-3000:]
    seen = json.loads(done.stdout)
    assert seen["added"] == 202  # provoked: nothing before the connect could tell
    assert seen["control_refused"] >= 1  # the probes were refused once connected
    assert seen["healthy"] is True and seen["removed"] == 202  # provoked: the only decode
    assert seen["leg_status"] == 502
    assert "this router's own listener" in seen["leg_message"], seen
    assert seen["legs_refused"] == 1
    assert seen["decode_saw"] == 0
