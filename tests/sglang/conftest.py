"""Session fixtures of the real-engine tier: real SGLang pairs, started once, and real
`trio-pd serve` processes in front of them.

Sync on purpose: pytest-trio cannot run session-scoped async fixtures, and a pair costs ~30 s
and ~3 GB of RAM per server. At most two pairs live at once (main for the session; admin from
the first test that asks for it). A pair that dies mid-session fails the tests that use it
(each fixture checks both engines are alive), with the engines' log tails.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from tests.sglang import pairs
from tests.sglang.scenarios import Target
from trio_pd.testing.sglang import SGLangPair
from trio_pd.testing.sglang.launcher import free_port, http_status

# kv_aware on the real engine starts a pair of its own (a prefill with --kv-events-config): it
# runs alone, in `make test-sglang`'s second step (TRIO_PD_SGLANG_KV), never beside these pairs.
collect_ignore = [] if os.environ.get("TRIO_PD_SGLANG_KV") else ["test_kv_aware_real.py"]

ROUTER_READY_SECS = 60.0


def _alive(pair: SGLangPair) -> SGLangPair:
    for engine in pair.engines:
        if not engine.alive():
            pytest.fail(f"{engine.role} engine died:\n{engine.log_tail()}")
    return pair


@pytest.fixture(scope="session")
def log_dir() -> Path:
    path = pairs.LOG_DIR / time.strftime("%Y%m%d-%H%M%S")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def main_pair_session(log_dir: Path) -> Iterator[SGLangPair]:
    pair = pairs.start_main(log_dir)
    print(f"\nmain pair: {pair.describe()}", file=sys.stderr)
    try:
        yield pair
    finally:
        pair.stop()


@pytest.fixture(scope="session")
def admin_pair_session(log_dir: Path) -> Iterator[SGLangPair]:
    pair = pairs.start_admin(log_dir)
    print(f"\nadmin pair: {pair.describe()}", file=sys.stderr)
    try:
        yield pair
    finally:
        pair.stop()


@pytest.fixture
def main_pair(main_pair_session: SGLangPair) -> SGLangPair:
    return _alive(main_pair_session)


@pytest.fixture
def admin_pair(admin_pair_session: SGLangPair) -> SGLangPair:
    return _alive(admin_pair_session)


@pytest.fixture
def main_target(main_pair: SGLangPair) -> Target:
    return pairs.target(main_pair)


@pytest.fixture
def admin_target(admin_pair: SGLangPair) -> Target:
    return pairs.target(admin_pair)


class RouterProcess:
    """A real `trio-pd serve` (the router's own venv) in front of one pair."""

    def __init__(self, pair: SGLangPair, log_path: Path, extra: Sequence[str]) -> None:
        self.port = free_port()
        self.metrics_port = free_port()
        self.log_path = log_path
        command = [
            sys.executable, "-m", "trio_pd", "serve",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--prefill", pair.prefill_url, str(pair.bootstrap_port),
            "--decode", pair.decode_url,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port),
            "--admin-port", "0",
            "--log-level", "info",
            *extra,
        ]  # fmt: skip
        self.command = command
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

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
    """`start_router(pair, *flags)`: a ready router, stopped at the end of the test."""
    started: list[RouterProcess] = []

    def start(pair: SGLangPair, *extra: str) -> RouterProcess:
        name = request.node.name.replace("/", "_")[:80]
        router = RouterProcess(pair, log_dir / f"router-{name}-{len(started)}.log", extra)
        started.append(router)
        router.wait_ready()
        return router

    yield start
    for router in started:
        with contextlib.suppress(Exception):
            router.stop()


# Flags of every router in the tier unless a test says otherwise: one attempt, so each outcome
# is seen as it is, and round robin over the single pair.
ROUTER_FLAGS = ("--policy", "round_robin", "--disable-retries")
