"""Shared fixtures: a real PD cluster (simulator engines + router) on 127.0.0.1 ephemeral ports."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import pytest
import trio

from tests import deadline
from tests.cluster import (  # noqa: F401 - the suite's own names for them
    ENGINE_DEFAULTS,
    ROUTER_DEFAULTS,
    Cluster,
    cluster_of,
    start_cluster,
    start_engine,
    start_router,
    wait_until_ready,
)

# The real-engine tier (tests/sglang, docs/sglang-tier.md) needs .venv-sglang and real SGLang
# engines; only `make test-sglang` (which sets TRIO_PD_SGLANG_TIER) collects it.
collect_ignore = [] if os.environ.get("TRIO_PD_SGLANG_TIER") else ["sglang"]
# The vLLM tier (tests/vllm, docs/vllm-tier.md) likewise: only `make test-vllm` collects it.
if not os.environ.get("TRIO_PD_VLLM_TIER"):
    collect_ignore.append("vllm")


def pytest_configure(config: pytest.Config) -> None:
    """The per-test deadline and the process reaping (tests/deadline.py, tests/processes.py)."""
    config.pluginmanager.register(deadline, "trio-pd-deadline")


@pytest.fixture
async def cluster(nursery: trio.Nursery) -> AsyncIterator[Cluster]:
    """One prefill, one decode, one router; retries off so every outcome is seen as it is."""
    c = await start_cluster(nursery)
    yield c
    await c.client.aclose()
    await c.admin.aclose()
