"""The stream relay and its watchdog: decode's SSE bytes to the client, raw, once it has begun.

The attempt (`attempt.py`) holds decode's stream until its first event proves the KV cache
arrived; from then on this module owns the stream: the client's headers, the first event and
every later chunk relayed as they came (through the engine's rewrite, `pd/engines/`), under a
watchdog that ends the stream when the client stopped reading (`stream_stall_secs`) or decode
went silent (`stream_idle_secs`). What the relay decides it tells the attempt through its
callbacks; it changes no leg itself.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable

import attrs
import trio

from trio_pd.config import TimeoutConfig
from trio_pd.observe.metrics import RouterMetrics
from trio_pd.pd.outcome import LegFailure
from trio_pd.respond import Responder
from trio_pd.upstream.pool import UpstreamError, UpstreamResponse

log = logging.getLogger(__name__)

WATCHDOG_CHECKS = 4  # the stream watchdog looks this often per (shortest) timeout


@attrs.define
class StreamClock:
    """What the stream watchdog reads: counters the relay bumps, no clock reads per event (the
    watchdog notes the time when it sees them move)."""

    chunks: int = 0  # decode chunks received
    started: int = 0  # client writes begun
    sent: int = 0  # client writes finished (started != sent: a write is in progress)


@attrs.define(eq=False)
class StreamRelay:
    """One decode stream relayed to its client, with the watchdog beside it.

    The callbacks are the attempt's: ``on_broken`` when decode's connection broke mid-stream,
    ``on_stall`` when the client stopped reading (the relay has closed decode's connection under
    the blocked write already), ``on_idle`` when decode sent nothing for `stream_idle_secs`.
    """

    responder: Responder
    metrics: RouterMetrics
    timeouts: TimeoutConfig
    transform: Callable[[bytes], bytes] | None  # the engine's rewrite of each chunk (None: raw)
    on_broken: Callable[[LegFailure], None]
    on_stall: Callable[[], None]
    on_idle: Callable[[LegFailure], None]

    async def relay(
        self,
        response: UpstreamResponse,
        headers: list[tuple[bytes, bytes]],
        event: bytes,
        rest: bytes,
        chunks: AsyncIterator[bytes],
        request_started: float,
    ) -> bool:
        """Send the client's headers, the first `event` with the `rest` read along with it, and
        the rest of `chunks`; True when the stream was finished whole, False when decode broke."""
        await self.responder.start(response.status, headers)
        clock = StreamClock()
        metrics = self.metrics
        last = trio.current_time()
        metrics.first_token.observe(last - request_started)
        gaps = metrics.chunk_gap
        send = self.responder.send
        relayed = 1 + rest.count(b"\n\n")
        transform = self.transform
        try:
            async with trio.open_nursery() as guard:
                guard.start_soon(self._watch, clock, response)
                try:
                    clock.started += 1
                    head = event + rest
                    await send(head if transform is None else transform(head))
                    clock.sent += 1
                    async for chunk in chunks:
                        clock.chunks += 1
                        now = trio.current_time()
                        gaps.observe(now - last)
                        last = now
                        relayed += chunk.count(b"\n\n")
                        clock.started += 1
                        await send(chunk if transform is None else transform(chunk))
                        clock.sent += 1
                except UpstreamError as exc:  # decode broke mid-stream: dispatch sends a frame
                    self.on_broken(LegFailure(exc.kind, str(exc)))
                    guard.cancel_scope.cancel()
                    return False
                guard.cancel_scope.cancel()
        finally:
            metrics.events_relayed.inc(relayed)
        await self.responder.finish_stream(b"")
        return True

    async def _watch(self, clock: StreamClock, response: UpstreamResponse) -> None:
        """The stream's watchdog: a client that stopped reading, or a decode gone silent.

        A client write can block for good (hypercorn shields its socket writes; the listening
        socket's TCP_USER_TIMEOUT ends such a connection in the end), so a stall cannot cancel the
        relay task itself: the watchdog closes decode's connection under it instead (the engine
        sees the disconnect at once) and has the attempt cancel the legs. A silent decode is
        failed and cancelled by the attempt.
        """
        stall, idle = self.timeouts.stream_stall_secs, self.timeouts.stream_idle_secs
        period = min(stall, idle) / WATCHDOG_CHECKS  # a few wakeups per timeout, per stream
        seen = (clock.chunks, clock.started, clock.sent)
        moved_at = trio.current_time()  # when the counters last moved
        while True:
            await trio.sleep(period)
            now = trio.current_time()
            current = (clock.chunks, clock.started, clock.sent)
            if current != seen:
                seen, moved_at = current, now
                continue
            writing = clock.started != clock.sent
            if writing and now - moved_at >= stall:
                log.warning("client stopped reading for %gs: ending the stream", stall)
                response.close_connection_now()
                self.on_stall()
                return
            if not writing and now - moved_at >= idle:
                self.on_idle(LegFailure("timeout", f"decode sent nothing for {idle:g}s"))
                return
