"""Fixtures of the simulator tests (helpers live in helpers.py)."""

from __future__ import annotations

import httpx2
import pytest
import trio

from trio_pd_testing.engine import EngineHandle

from .helpers import start_engine


@pytest.fixture
async def client():
    async with httpx2.AsyncClient(trust_env=False, timeout=20.0) as c:
        yield c


@pytest.fixture
async def pair(nursery: trio.Nursery) -> tuple[EngineHandle, EngineHandle]:
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode", waiting_timeout=5.0)
    return prefill, decode
