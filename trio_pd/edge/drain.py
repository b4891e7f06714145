"""Graceful drain: what a router process does between SIGTERM and its exit.

On the first SIGTERM or SIGINT the process starts draining: readiness answers 503 at once, a
new generation request on a connection still open is answered 503 with `Retry-After` and
`Connection: close`, and hypercorn (through its `shutdown_trigger`) closes the listening sockets,
so new connections are refused. Requests in flight, streams included, run on for up to
`--shutdown-grace-period-secs`; whatever still runs then is cancelled with cause "shutdown" and
ends with the docs/protocol.md §4 answer (504, or an error frame once a stream has started), both of
its legs closed. A second signal ends the grace period at once. Hypercorn's own graceful timeout
is set a little past the grace period, as a backstop.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Iterator
from contextlib import contextmanager

import attrs
import trio

from trio_pd.errors import RouterError
from trio_pd.pd.cancel import RequestCancel

log = logging.getLogger(__name__)
RETRY_AFTER = b"1"


def shutting_down() -> RouterError:
    """The answer to a generation request that arrives while the process drains."""
    return RouterError(
        503,
        "this router is shutting down; retry on another replica",
        "service_unavailable",
        headers=((b"retry-after", RETRY_AFTER), (b"connection", b"close")),
    )


def cut_by_shutdown(grace_secs: float) -> RouterError:
    """The answer to a request the end of the grace period cut (docs/protocol.md §4: 504)."""
    return RouterError(
        504,
        f"the router shut down before the request finished (grace period {grace_secs:g}s)",
        "timeout_error",
    )


@attrs.define(eq=False)
class Drain:
    """The process's drain state and the generation requests in flight."""

    grace_secs: float
    draining: bool = False
    expired: bool = False
    exit_status: int = 0  # 1 once the process gave up on itself (`fail`)
    _requests: set[RequestCancel] = attrs.field(factory=set)
    _stop: trio.Event = attrs.field(factory=trio.Event)  # hypercorn's shutdown trigger
    _first: trio.Event = attrs.field(factory=trio.Event)
    _second: trio.Event = attrs.field(factory=trio.Event)

    @contextmanager
    def track(self, cancel: RequestCancel) -> Iterator[None]:
        """Register one request for the whole of its life."""
        self._requests.add(cancel)
        if self.expired:
            cancel.cancel("shutdown")
        try:
            yield
        finally:
            self._requests.discard(cancel)

    @property
    def in_flight(self) -> int:
        return len(self._requests)

    def begin(self) -> None:
        if not self.draining:
            self.draining = True
            log.info(
                "draining: %d requests in flight get up to %gs", self.in_flight, self.grace_secs
            )

    def expire(self) -> None:
        """End the grace period: cancel every request still in flight."""
        self.begin()
        if not self.expired:
            self.expired = True
            log.info("grace period over: cancelling %d requests still in flight", self.in_flight)
        for cancel in list(self._requests):
            cancel.cancel("shutdown")

    async def run(
        self,
        stop: trio.Event,
        signums: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT),
        parent_sentinel: int | None = None,
    ) -> None:
        """The process's shutdown handler: the first trigger (a signal, or the parent process
        of `--workers N` gone) starts the drain and sets `stop`, hypercorn's shutdown trigger;
        the grace period or a second trigger ends it. Runs until cancelled."""
        self._stop = stop
        if self._first.is_set():  # failed before this ran: stop at once
            stop.set()
        async with trio.open_nursery() as nursery:
            if signums:
                nursery.start_soon(self._watch_signals, signums)
            if parent_sentinel is not None:
                nursery.start_soon(self._watch_parent, parent_sentinel)
            await self._first.wait()
            with trio.move_on_after(self.grace_secs):
                await self._second.wait()
            self.expire()

    def fail(self, why: str) -> None:
        """The process cannot go on (its services died, `edge/supervision.py`): drain as on a
        signal and exit non-zero, so that its orchestrator restarts it."""
        self.exit_status = 1
        self.trigger(why)

    def trigger(self, why: str) -> None:
        if not self._first.is_set():
            log.info("%s: starting graceful shutdown", why)
            self.begin()
            self._stop.set()
            self._first.set()
        else:
            log.info("%s again: ending the grace period now", why)
            self._second.set()
            self.expire()

    async def _watch_signals(self, signums: tuple[int, ...]) -> None:
        with trio.open_signal_receiver(*signums) as signals:
            async for signum in signals:
                self.trigger(signal.Signals(signum).name)

    async def _watch_parent(self, sentinel: int) -> None:
        """A router process of `--workers N` whose parent died (killed, OOM) shuts down too."""
        await trio.lowlevel.wait_readable(sentinel)
        self.trigger("parent process gone")
