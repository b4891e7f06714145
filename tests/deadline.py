"""Every test ends: a per-test deadline that fails that test alone, and its processes reaped.

A hang must cost one test, not the run. The deadline (`DEADLINE_SECS`, or
`@pytest.mark.deadline(secs)`) is a hang guard far above any test's time on a loaded machine,
never an assertion about speed:

- a trio test runs inside a cancel scope that a real-time timer thread cancels at the deadline
  (trio's own clock is not used: a `MockClock` test may jump hours ahead). The test's `finally`
  blocks and its fixtures' teardown run as after any cancellation, and the test fails with
  `ran past its N s deadline` and its node id;
- a synchronous test gets SIGALRM at the deadline (safe outside trio's loop), which fails it the
  same way;
- whatever the test started (`tests/processes.py`: every child in its own process group) is
  SIGKILLed by group after its teardown, except what a module- or session-scoped fixture
  started (reaped when the session ends); what had to be reaped is listed in the summary;
- a test whose call is still running `GRACE_SECS` after its deadline (a step that blocks the
  thread, a shielded wait) is beyond saving in-process: its node id and every thread's stack
  are written, every process the session started is reaped, and the process exits (under
  pytest-xdist the controller reports the crashed test and starts a new worker; the run goes
  on).

Fixture set-up and teardown have their own hang guards (a fixture's waits) and pytest-timeout,
configured far above all this (pyproject.toml), as the last resort.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import functools
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import trio

from tests import processes

DEADLINE_SECS = 240.0  # the slowest test takes ~20 s alone on an idle 2-core machine
GRACE_SECS = 60.0


def deadline_of(item: pytest.Item) -> float:
    marker = item.get_closest_marker("deadline")
    return float(marker.args[0]) if marker else DEADLINE_SECS


def message(nodeid: str, secs: float) -> str:
    return f"{nodeid} ran past its {secs:g} s deadline (a hang guard, tests/deadline.py)"


def bounded_trio_test(test: Callable[..., Any], nodeid: str, secs: float) -> Callable[..., Any]:
    """`test` inside a cancel scope a real-time timer cancels at `secs`."""

    @functools.wraps(test)
    async def bounded(**kwargs: Any) -> None:
        token = trio.lowlevel.current_trio_token()

        def cancel_from_timer(scope: trio.CancelScope) -> None:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(scope.cancel)

        with trio.CancelScope() as scope:
            timer = threading.Timer(secs, cancel_from_timer, (scope,))
            timer.daemon = True
            timer.start()
            try:
                await test(**kwargs)
            finally:
                timer.cancel()
        if scope.cancelled_caught:
            pytest.fail(message(nodeid, secs), pytrace=False)

    return bounded


def is_hypothesis(item: pytest.Item) -> bool:
    return hasattr(getattr(item, "obj", None), "hypothesis")


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """Before pytest-trio wraps the test (its hookwrapper runs after this one's first half)."""
    secs = deadline_of(item)
    hard = threading.Timer(secs + GRACE_SECS, hard_exit, (item.nodeid, secs))
    hard.daemon = True
    hard.start()
    alarm = False
    if item.get_closest_marker("trio") is not None:
        if not is_hypothesis(item):  # pytest-trio wraps the inner test itself; the hard path
            item.obj = bounded_trio_test(item.obj, item.nodeid, secs)  # type: ignore[attr-defined]
    elif threading.current_thread() is threading.main_thread():

        def expire(signum: int, frame: Any) -> None:
            pytest.fail(message(item.nodeid, secs), pytrace=False)

        signal.signal(signal.SIGALRM, expire)
        signal.setitimer(signal.ITIMER_REAL, secs)
        alarm = True
    try:
        yield
    finally:
        hard.cancel()
        if alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, signal.SIG_DFL)


REAPED: list[processes.Started] = []


def hard_exit(nodeid: str, secs: float) -> None:
    """The test did not end after its deadline and the grace: say which, reap all, exit."""
    out = sys.__stderr__ or sys.stderr
    out.write(
        f"\n+++ {nodeid} still running {GRACE_SECS:g} s after its {secs:g} s deadline: "
        "every thread's stack follows, every process the session started is reaped, and this "
        "test process exits +++\n"
    )
    out.flush()
    faulthandler.dump_traceback(file=out, all_threads=True)
    for each in processes.reap_all():
        out.write(f"reaped: {each.command} (started by {each.owner})\n")
    out.flush()
    os._exit(3)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """What the test started (its call and its function-scoped fixtures) is reaped after its
    teardown; what a module- or session-scoped fixture started lives on (the real-engine tier's
    SGLang pairs) until the session ends."""
    processes.owner = item.nodeid
    try:
        yield
    finally:
        processes.owner = "(outside any test)"
        mine = [each for each in processes.STARTED if each.owner == item.nodeid]
        processes.STARTED[:] = [each for each in processes.STARTED if each.owner != item.nodeid]
        REAPED.extend(processes.reap(mine))


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef: Any, request: Any) -> Iterator[None]:
    """A process a wider-scoped fixture starts belongs to the session, not to this test."""
    if fixturedef.scope == "function":
        yield
        return
    previous = processes.owner
    processes.owner = f"({fixturedef.scope} fixture {fixturedef.argname})"
    try:
        yield
    finally:
        processes.owner = previous


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if REAPED:
        terminalreporter.section("processes reaped after their test ended")
        for each in REAPED:
            terminalreporter.write_line(f"{each.owner}: {each.command}")


def on_signal(signum: int, frame: Any) -> None:
    processes.reap_all()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "deadline(secs): this test's hang guard instead of DEADLINE_SECS"
    )
    xdist_controller = getattr(config.option, "dist", "no") != "no" and not hasattr(
        config, "workerinput"
    )
    if xdist_controller:
        return  # it runs no test; its workers each install their own
    processes.install()
    atexit.register(processes.reap_all)
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, on_signal)


def pytest_unconfigure(config: pytest.Config) -> None:
    processes.reap_all()
