"""Session fixtures of the vLLM tier: a real vLLM pair, started once, and real `trio-pd serve`
processes in front of it (sync, as the SGLang tier's: pytest-trio has no session-scoped async
fixtures, and a pair costs ~30-100 s and ~2 GB of RAM per server).

A pair that dies mid-session fails the tests that use it, with the engines' log tails.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import httpx2
import pytest

from trio_pd.testing.sglang.launcher import free_port, http_status
from trio_pd.testing.vllm import VllmPair
from trio_pd.testing.vllm.launcher import REPO_ROOT

LOG_DIR = REPO_ROOT / ".cache" / "vllm-logs"
ROUTER_READY_SECS = 60.0


@pytest.fixture(scope="session")
def log_dir() -> Path:
    path = LOG_DIR / time.strftime("%Y%m%d-%H%M%S")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def pair_session(log_dir: Path) -> Iterator[VllmPair]:
    pair = VllmPair.start(log_dir=log_dir, name="main")
    print(f"\nvLLM pair: {pair.describe()}", file=sys.stderr)
    try:
        yield pair
    finally:
        pair.stop()


@pytest.fixture
def pair(pair_session: VllmPair) -> VllmPair:
    for engine in pair_session.engines:
        if not engine.alive():
            pytest.fail(f"{engine.role} engine died:\n{engine.log_tail()}")
    return pair_session


@pytest.fixture
async def engines():
    async with httpx2.AsyncClient(timeout=httpx2.Timeout(120.0)) as c:
        yield c


class RouterProcess:
    """A real `trio-pd serve --vllm-pd-disaggregation` (the router's venv) in front of the
    pair, or of whatever decode URLs a test gives."""

    def __init__(
        self, prefills: Sequence[str], decodes: Sequence[str], log_path: Path, extra: Sequence[str]
    ) -> None:
        self.port = free_port()
        self.metrics_port = free_port()
        self.log_path = log_path
        command = [
            sys.executable, "-m", "trio_pd", "serve", "--vllm-pd-disaggregation",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port),
            "--admin-port", "0", "--log-level", "info",
        ]  # fmt: skip
        for url in prefills:
            command += ["--prefill", url]
        for url in decodes:
            command += ["--decode", url]
        command += list(extra)
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self) -> None:
        deadline = time.monotonic() + ROUTER_READY_SECS
        while http_status(self.url + "/readiness") != 200:
            if self.process.poll() is not None:
                raise AssertionError(f"trio-pd serve exited early:\n{self.log()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"trio-pd serve not ready:\n{self.log()[-4000:]}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture
def start_router(
    request: pytest.FixtureRequest, log_dir: Path
) -> Iterator[Callable[..., RouterProcess]]:
    """`start_router(pair, *flags, decodes=None, ready=True)`: a router, stopped after the test."""
    started: list[RouterProcess] = []

    def start(
        pair: VllmPair, *extra: str, decodes: Sequence[str] | None = None, ready: bool = True
    ) -> RouterProcess:
        name = request.node.name.replace("/", "_")[:80]
        router = RouterProcess(
            [pair.prefill_url],
            [pair.decode_url] if decodes is None else decodes,
            log_dir / f"router-{name}-{len(started)}.log",
            extra,
        )
        started.append(router)
        if ready:
            router.wait_ready()
        return router

    yield start
    for router in started:
        with contextlib.suppress(Exception):
            router.stop()


# One attempt, so each outcome is seen as it is (a test that wants retries says so).
ROUTER_FLAGS = ("--policy", "round_robin", "--disable-retries")
