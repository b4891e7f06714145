"""Session fixtures of the vLLM tier: a real vLLM pair, started once, and real `trio-pd serve`
processes in front of it (sync, as the SGLang tier's: pytest-trio has no session-scoped async
fixtures, and a pair costs ~30-100 s and ~2 GB of RAM per server).

A pair that dies mid-session fails the tests that use it, with the engines' log tails.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import httpx2
import pytest

from tests.real_tier import StartedRouters, alive, session_log_dir
from trio_pd_testing.real_pair import ServeProcess, post
from trio_pd_testing.vllm import KV_LEASE_SECS, SERVED_MODEL_NAME, VllmPair, engine_metrics
from trio_pd_testing.vllm.launcher import REPO_ROOT

LOG_DIR = REPO_ROOT / ".cache" / "vllm-logs"


@pytest.fixture(scope="session")
def log_dir() -> Path:
    return session_log_dir(LOG_DIR)


@pytest.fixture(scope="session")
def pair_session(log_dir: Path) -> Iterator[VllmPair]:
    pair = VllmPair.start(log_dir=log_dir, name="main")
    print(f"\nvLLM pair: {pair.describe()}", file=sys.stderr)
    try:
        print(f"warm-up: the first KV read took {warm_up(pair):.1f} s", file=sys.stderr)
        yield pair
    finally:
        pair.stop()


WARM_UP_ATTEMPTS = 5


def warm_up(pair: VllmPair) -> float:
    """One PD request straight to the engines before any test, then until both are idle; the
    seconds its decode took. The decode's first read opens its NIXL connection to the prefill
    (measured 5.7 s on an idle machine); on a loaded one it once came after the prefill's 30 s
    lease (2026-12-05: the session's first test then saw a lease expire and a read after it,
    finding 4 by itself), so no test's snapshot may hold it. A read whose handshake failed is
    tried again (up to `WARM_UP_ATTEMPTS` PD requests): its prefill's blocks then wait out the
    lease, which the wait for idle below covers."""
    return warm_up_read(pair.prefill_url, pair.decode_url, [e.url for e in pair.engines])


def warm_up_read(prefill_url: str, decode_url: str, idle_urls: Sequence[str]) -> float:
    """`warm_up` of one decode's first read from the prefill (a decode joining the pair's
    prefill needs its own), then until the engines at `idle_urls` are idle."""
    body = {"model": SERVED_MODEL_NAME, "prompt": "warm up", "max_tokens": 1}
    prefill = {**body, "kv_transfer_params": {"do_remote_decode": True}}
    for attempt in range(1, WARM_UP_ATTEMPTS + 1):
        status, raw, _ = post(prefill_url + "/v1/completions", prefill, 120.0)
        assert status == 200, raw
        params = json.loads(raw)["kv_transfer_params"]
        status, raw, secs = post(
            decode_url + "/v1/completions", {**body, "kv_transfer_params": params}, 120.0
        )
        if status == 200:
            break
        # NIXL's handshake answers within 5 s or fails the read (`handshake_setup_failed`,
        # a 500): seen on a busy machine (2026-12-05); the next read handshakes again.
        print(f"warm-up read {attempt} failed: {status} {raw[:200]!r}", file=sys.stderr)
    assert status == 200, raw
    deadline = time.monotonic() + KV_LEASE_SECS + 30.0
    for url in idle_urls:
        while True:
            with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
                if engine_metrics.idle(engine_metrics.summed(response.read().decode())):
                    break
            assert time.monotonic() < deadline, f"{url} not idle after the warm-up"
            time.sleep(0.05)
    return secs


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The migration test last: it runs a third server, a decode it SIGKILLs, and after it the
    prefill's NIXL notifications of reads came up to 2 minutes late (2026-12-05: the reads done,
    their leases expired first), failing the tier's tests that assert no lease expired. Last,
    it disturbs none (its own test counts an expired lease only if it was read late)."""
    items.sort(key=lambda item: item.nodeid.startswith("tests/vllm/test_migration_real.py"))


@pytest.fixture
def pair(pair_session: VllmPair) -> VllmPair:
    return alive(pair_session)


@pytest.fixture
async def engines():
    async with httpx2.AsyncClient(timeout=httpx2.Timeout(120.0)) as c:
        yield c


class RouterProcess(ServeProcess):
    """A real `trio-pd serve --vllm-pd-disaggregation` (the router's venv) in front of the
    pair, or of whatever decode URLs a test gives."""

    def __init__(
        self, prefills: Sequence[str], decodes: Sequence[str], log_path: Path, extra: Sequence[str]
    ) -> None:
        workers = ["--vllm-pd-disaggregation"]
        for url in prefills:
            workers += ["--prefill", url]
        for url in decodes:
            workers += ["--decode", url]
        super().__init__(workers, log_path, extra)


@pytest.fixture
def start_router(
    request: pytest.FixtureRequest, log_dir: Path
) -> Iterator[Callable[..., RouterProcess]]:
    """`start_router(pair, *flags, decodes=None, ready=True)`: a router, stopped after the test."""
    routers = StartedRouters(request, log_dir)

    def start(
        pair: VllmPair, *extra: str, decodes: Sequence[str] | None = None, ready: bool = True
    ) -> RouterProcess:
        decode_urls = [pair.decode_url] if decodes is None else decodes
        router = RouterProcess([pair.prefill_url], decode_urls, routers.log_path(), extra)
        return routers.add(router, ready)

    yield start
    routers.stop_all()


# One attempt, so each outcome is seen as it is (a test that wants retries says so).
ROUTER_FLAGS = ("--policy", "round_robin", "--disable-retries")
