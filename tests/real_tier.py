"""What the real-engine tiers' fixtures share (`tests/sglang/conftest.py`,
`tests/vllm/conftest.py`): a session's log directory, a pair checked alive, and the routers a
test started, each logging to a file named after the test and all stopped at its end; and a
router waited on until its workers are healthy."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import TypeVar

import httpx2
import pytest
import trio

from trio_pd_testing.real_pair import PairBase, ServeProcess

P = TypeVar("P", bound=PairBase)
R = TypeVar("R", bound=ServeProcess)


def session_log_dir(root: Path) -> Path:
    path = root / time.strftime("%Y%m%d-%H%M%S")
    path.mkdir(parents=True, exist_ok=True)
    return path


async def all_healthy(client: httpx2.AsyncClient, router_url: str, count: int) -> None:
    """Until the router lists `count` workers, all healthy (its `GET /workers`), 120 s at most."""
    with trio.fail_after(120):
        while True:
            listed = (await client.get(router_url + "/workers")).json()["workers"]
            if len(listed) == count and all(w["is_healthy"] for w in listed):
                return
            await trio.sleep(0.2)


def alive(pair: P) -> P:
    """The pair, or the test fails with the log tail of the engine that died."""
    for engine in pair.engines:
        if not engine.alive():
            pytest.fail(f"{engine.role} engine died:\n{engine.log_tail()}")
    return pair


class StartedRouters:
    """The `trio-pd serve` processes one test started."""

    def __init__(self, request: pytest.FixtureRequest, log_dir: Path) -> None:
        self.name = request.node.name.replace("/", "_")[:80]
        self.log_dir = log_dir
        self.started: list[ServeProcess] = []

    def log_path(self) -> Path:
        return self.log_dir / f"router-{self.name}-{len(self.started)}.log"

    def add(self, router: R, ready: bool = True) -> R:
        self.started.append(router)
        if ready:
            router.wait_ready()
        return router

    def stop_all(self) -> None:
        for router in self.started:
            with contextlib.suppress(Exception):
                router.stop()
