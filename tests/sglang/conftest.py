"""Session fixtures of the real-engine tier: real SGLang pairs, started once, and real
`trio-pd serve` processes in front of them.

Sync on purpose: pytest-trio cannot run session-scoped async fixtures, and a pair costs ~30 s
and ~3 GB of RAM per server. At most two pairs live at once (main for the session; admin from
the first test that asks for it). A pair that dies mid-session fails the tests that use it
(each fixture checks both engines are alive), with the engines' log tails.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from tests.real_tier import StartedRouters, alive, session_log_dir
from tests.sglang import pairs
from tests.sglang.scenarios import Target
from trio_pd_testing.real_pair import ServeProcess
from trio_pd_testing.sglang import SGLangPair

# kv_aware on the real engine starts a pair of its own (a prefill with --kv-events-config): it
# runs alone, in `make test-sglang`'s second step (TRIO_PD_SGLANG_KV), never beside these pairs.
collect_ignore = [] if os.environ.get("TRIO_PD_SGLANG_KV") else ["test_kv_aware_real.py"]


@pytest.fixture(scope="session")
def log_dir() -> Path:
    return session_log_dir(pairs.LOG_DIR)


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
    return alive(main_pair_session)


@pytest.fixture
def admin_pair(admin_pair_session: SGLangPair) -> SGLangPair:
    return alive(admin_pair_session)


@pytest.fixture
def main_target(main_pair: SGLangPair) -> Target:
    return pairs.target(main_pair)


@pytest.fixture
def admin_target(admin_pair: SGLangPair) -> Target:
    return pairs.target(admin_pair)


class RouterProcess(ServeProcess):
    """A real `trio-pd serve` (the router's own venv) in front of one pair."""

    def __init__(self, pair: SGLangPair, log_path: Path, extra: Sequence[str]) -> None:
        workers = ["--prefill", pair.prefill_url, str(pair.bootstrap_port)]
        super().__init__([*workers, "--decode", pair.decode_url], log_path, extra)


@pytest.fixture
def start_router(
    request: pytest.FixtureRequest, log_dir: Path
) -> Iterator[Callable[..., RouterProcess]]:
    """`start_router(pair, *flags)`: a ready router, stopped at the end of the test."""
    routers = StartedRouters(request, log_dir)

    def start(pair: SGLangPair, *extra: str) -> RouterProcess:
        return routers.add(RouterProcess(pair, routers.log_path(), extra))

    yield start
    routers.stop_all()


# Flags of every router in the tier unless a test says otherwise: one attempt, so each outcome
# is seen as it is, and round robin over the single pair.
ROUTER_FLAGS = ("--policy", "round_robin", "--disable-retries")
