"""Pods of the fake API server that stand for simulator engines on 127.0.0.1.

A pod names its engine's port in `smg.ai/worker-ports` (and a prefill its bootstrap port in
`sglang.ai/bootstrap-port`), with podIP 127.0.0.1: discovery then makes a worker whose URL is
the engine's, so the real router in front of them routes real requests to real engines.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx2

from tests.k8s.fake_apiserver import FakeApiServer
from trio_pd_testing.engine import EngineHandle

PREFILL = {"app": "sglang", "role": "prefill"}
DECODE = {"app": "sglang", "role": "decode"}
SELECTOR_FLAGS = (
    "--prefill-selector", "app=sglang", "role=prefill",
    "--decode-selector", "app=sglang", "role=decode",
)  # fmt: skip
BODY = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}


def engine_annotations(engine: EngineHandle) -> dict[str, str]:
    annotations = {"smg.ai/worker-ports": str(engine.port)}
    if engine.role == "prefill":
        annotations["sglang.ai/bootstrap-port"] = str(engine.bootstrap_port)
    return annotations


def create_engine_pod(
    fake: FakeApiServer, name: str, engine: EngineHandle, **create: Any
) -> dict[str, Any]:
    """A Pending pod for ``engine`` (ADDED, no IP yet)."""
    labels = PREFILL if engine.role == "prefill" else DECODE
    return fake.create_pod(name, labels=labels, annotations=engine_annotations(engine), **create)


def ready_engine_pod(fake: FakeApiServer, name: str, engine: EngineHandle) -> dict[str, Any]:
    """Pending, then Running and Ready on 127.0.0.1."""
    create_engine_pod(fake, name, engine)
    return fake.run_pod(name, ip="127.0.0.1")


async def workers(client: httpx2.AsyncClient) -> dict[str, dict[str, Any]]:
    return {w["id"]: w for w in (await client.get("/workers")).json()["workers"]}


def served(engine: EngineHandle) -> int:
    return len(engine.events.find("request_start"))


async def route(client: httpx2.AsyncClient, count: int) -> None:
    for _ in range(count):
        response = await client.post("/generate", json=BODY)
        assert response.status_code == 200, response.text


async def served_through(client: httpx2.AsyncClient, engine: EngineHandle) -> bool:
    """One request through the router; did ``engine`` take it (and answer)? A 503 is no: a
    worker that just joined may be the role's only one and not through its first health
    check yet."""
    before = served(engine)
    response = await client.post("/generate", json=BODY)
    assert response.status_code in (200, 503), response.text
    return response.status_code == 200 and served(engine) > before


async def untouched(
    client: httpx2.AsyncClient, engines: Sequence[EngineHandle], count: int
) -> None:
    """``count`` requests through the router, none of them on ``engines``."""
    before = [served(e) for e in engines]
    await route(client, count)
    assert [served(e) for e in engines] == before
