"""Prometheus metrics on /metrics: requests by status, leg failures, fleet gauges."""

from __future__ import annotations

import trio

from tests.conftest import start_cluster
from tests.router.helpers import generate_body


async def test_metrics_count_requests_by_status(nursery: trio.Nursery) -> None:
    cluster = await start_cluster(nursery)
    await cluster.client.post("/generate", json=generate_body())
    await cluster.client.post("/generate", json=generate_body(sim_fault="prefill:500@50"))
    await cluster.client.post("/generate", content=b"nope")
    text = (await cluster.client.get("/metrics")).text
    assert 'trio_pd_requests_total{path="/generate",status="200"} 1.0' in text
    assert 'trio_pd_requests_total{path="/generate",status="502"} 1.0' in text
    assert 'trio_pd_requests_total{path="/generate",status="400"} 1.0' in text
    assert 'trio_pd_leg_failures_total{kind="status",role="prefill"} 1.0' in text
    assert 'trio_pd_worker_healthy{role="decode"' in text
    await cluster.client.aclose()
