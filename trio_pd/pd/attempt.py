"""One PD attempt: the prefill and decode legs as siblings in one trio nursery.

This module is the outcome table of docs/protocol.md §4 in code:

- prefill fails (status, transport, timeout, in-band) -> the decode leg is cancelled at once; its
  connection is closed by cancellation, not by an explicit drop;
- decode fails first -> the prefill leg is cancelled at once;
- decode answers 2xx first -> its answer is held until prefill is known (at most
  `prefill_hold_secs` more);
- the deadline, the first-token timeout, a silent decode stream or a client that stopped reading
  end the legs that still run;
- the client goes away -> an enclosing scope is cancelled and ``Cancelled`` simply propagates.

Nothing an attempt starts outlives it: when ``Attempt.run`` returns (or raises), both
connections are either back in the pool, fully read, or closed. Each leg remembers whether it
was cancelled after its request went out, and why, so the caller can count it and ask the
engine to free the request at once (`Leg.cancel_cause`).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractContextManager
from typing import Any

import attrs
import orjson
import trio

from trio_pd.config import TimeoutConfig
from trio_pd.fleet.worker import Worker
from trio_pd.observe.metrics import RouterMetrics
from trio_pd.pd.answers import (
    AnswerScan,
    buffer_failure,
    event_failure,
    is_sse,
    read_answer,
    status_failure,
)
from trio_pd.pd.budget import Account, OverBudget
from trio_pd.pd.offload import AnswerWork
from trio_pd.pd.outcome import LegFailure, LegResult, LegSuccess
from trio_pd.pd.payload import OFFLOAD_BYTES
from trio_pd.pd.relay import event_data
from trio_pd.pd.resume import Migration, transcribed
from trio_pd.pd.sse import EventReader, EventTooLarge
from trio_pd.respond import Reply, Responder
from trio_pd.spec import Role
from trio_pd.upstream.headers import relayable_headers
from trio_pd.upstream.pool import UpstreamError, UpstreamPool, UpstreamResponse

log = logging.getLogger(__name__)

DEFAULT_EVENT_LIMIT = 16 << 20  # RouterConfig.max_sse_event_bytes
CACHED_TOKENS = re.compile(rb'"cached_tokens"\s*:\s*(\d{1,12})')
WATCHDOG_CHECKS = 4  # the stream watchdog looks this often per (shortest) timeout


@attrs.define(eq=False)
class Leg:
    """One side of an attempt: its worker, its cancel scope and how it ended.

    ``cancel_cause`` is set when the leg was cancelled while its request was out ("prefill_failed",
    "decode_failed", "client_gone", "deadline", "stall", "shutdown"): the engine may still hold
    the request, which is what the caller's abort is for.
    """

    role: Role
    worker: Worker
    body: bytes
    headers: list[tuple[bytes, bytes]]
    track: Callable[[], AbstractContextManager[Any]]  # load accounting while the leg runs
    on_abandon: Callable[[Leg], None] | None = None  # asks the engine to abort (aborts.py)
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    result: LegResult = None
    posted: bool = False  # the request is being written (or was): the engine may hold it
    abandoned: bool = False  # the engine was asked to drop it
    cancel_cause: str | None = None
    cancelled_at: float | None = None
    ended_at: float | None = None  # its connection released (pooled or closed)

    def cancel(self, cause: str) -> None:
        """Cancel the leg unless it already ended; the first cause wins."""
        if self.result is not None or self.ended_at is not None or self.cancel_cause is not None:
            return
        self.cancel_cause = cause
        self.cancelled_at = trio.current_time()
        self.scope.cancel()
        self.abandon()

    def sending(self) -> None:
        """The pool has a connection and writes the request next (`UpstreamPool.post`): from
        here the engine may hold it. A leg cancelled before this (while connecting, say) sent
        nothing, since the write begins with a cancel point: no abort, no count."""
        if not self.scope.cancel_called:
            self.posted = True

    def note_outer_cancel(self, cause: str, at: float) -> None:
        """The leg ended by an enclosing scope's cancellation (client gone, shutdown, deadline)."""
        if self.result is None and self.cancel_cause is None and self.posted:
            self.cancel_cause = cause
            self.cancelled_at = at
            self.abandon()

    def abandon(self) -> None:
        """The router gave up on this leg while the engine may still hold it: have the engine
        free it now rather than at its next disconnect poll. Once per leg."""
        if self.posted and not self.abandoned and self.on_abandon is not None:
            self.abandoned = True
            self.on_abandon(self)

    @property
    def failed(self) -> bool:
        return isinstance(self.result, LegFailure)

    @property
    def url(self) -> str:
        return self.worker.url


@attrs.define
class StreamClock:
    """What the stream watchdog reads: counters the relay bumps, no clock reads per event (the
    watchdog notes the time when it sees them move)."""

    chunks: int = 0  # decode chunks received
    started: int = 0  # client writes begun
    sent: int = 0  # client writes finished (started != sent: a write is in progress)


@attrs.define(eq=False)
class Attempt:
    """One try of a request on one (prefill, decode) pair, with its own bootstrap room."""

    pool: UpstreamPool
    path: str
    prefill: Leg
    decode: Leg
    stream: bool
    logprobs: bool
    responder: Responder
    deadline: float
    timeouts: TimeoutConfig
    outer_cause: Callable[[], tuple[str, float]]  # why an enclosing scope cancelled us, and when
    metrics: RouterMetrics
    request_started: float  # the client request's start: time to first token counts from it
    account: Account | None = None  # the request's share of --max-buffered-bytes
    event_limit: int = DEFAULT_EVENT_LIMIT  # --max-sse-event-bytes
    # Prefill's first answer (an event's data), kept only when logprobs are merged: its bytes,
    # parsed only by the merge, off the event loop when large (`offload.py`).
    prefill_answer: bytes | None = None
    prefill_answer_known: trio.Event = attrs.field(factory=trio.Event)
    stalled: bool = False  # the client stopped reading: nothing more can be sent to it
    # What a relayed stream chunk becomes on its way to the client (None: sent as it came; a
    # vLLM pair's attempt strips the handoff from it, `vllm_attempt.py`).
    transform: Callable[[bytes], bytes] | None = None
    parsers: Any = None  # trio_parallel.WorkerContext of the lifespan (None: JSON work inline)
    decode_scan: AnswerScan | None = None  # what reading decode's whole answer found
    work: AnswerWork = attrs.field(
        default=attrs.Factory(lambda self: AnswerWork(self.parsers, self.account), takes_self=True)
    )
    # The prefill engine's own count of prompt tokens it reused (`cached_tokens` of its answer),
    # for kv_aware's self-check; None when its answer did not say.
    prefill_cached_tokens: int | None = None
    # Whether anyone reads it (kv_aware's self-check probed this request): else the prefill's
    # answers are not searched for it, on every request's path.
    note_cached: bool = False
    # A stream that may resume on another pair if decode breaks (`resume.py`): relayed as
    # whole events through its transcript. None: relayed raw.
    migration: Migration | None = None

    async def run(self) -> None:
        """Run both legs to completion; on return the legs' results say what happened."""
        ended = False
        try:
            with trio.CancelScope(deadline=self.deadline) as deadline_scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._decode_leg)
                    await self._prefill_leg()  # the nursery's own task: one task spawn less
            ended = True
        finally:
            if not ended:  # an enclosing scope cancelled us (client gone, shutdown)
                cause, at = self.outer_cause()
                self.prefill.note_outer_cancel(cause, at)
                self.decode.note_outer_cancel(cause, at)
        if deadline_scope.cancelled_caught:
            now = trio.current_time()
            self.prefill.note_outer_cancel("deadline", now)
            self.decode.note_outer_cancel("deadline", now)
            # The slow leg: prefill while decode is still waiting for its KV cache; decode once
            # prefill is done or the stream has started.
            timeout = LegFailure("timeout", "request deadline passed")
            if (
                self.prefill.result is None
                and not self.decode.failed
                and not self.responder.started
            ):
                self.prefill.result = timeout
            elif self.decode.result is None:
                self.decode.result = timeout
        if self.logprobs and self.prefill_answer is not None and not self.responder.started:
            await self._merge_answer()

    def reply(self) -> Reply | None:
        """The client's answer once the attempt ran, or None when it was streamed already."""
        if self.responder.started:
            return None
        if isinstance(self.prefill.result, LegFailure):
            return self.prefill.result.client_reply("prefill")
        if isinstance(self.decode.result, LegFailure):
            return self.decode.result.client_reply("decode")
        decode = self.decode.result
        assert isinstance(decode, LegSuccess), "both legs finished without a failure"
        return Reply(decode.status, decode.headers, decode.body)

    async def _merge_answer(self) -> None:
        """Both legs answered whole and logprobs were asked for: prefill's input logprobs go in
        front of decode's (off the event loop when large, `offload.py`). An answer the router
        cannot hold or re-encode (nested past orjson's 255 levels) is the decode worker's
        fault, never a 500."""
        decode = self.decode.result
        prefill_answer = self.prefill_answer
        if not (isinstance(decode, LegSuccess) and isinstance(self.prefill.result, LegSuccess)):
            return
        assert prefill_answer is not None
        try:
            scan = self.decode_scan
            marks = None if scan is None else scan.marks
            body = await self.work.merged(prefill_answer, decode.body, marks=marks)
            if body is not None:
                self.decode.result = LegSuccess(decode.status, decode.headers, body)
        except OverBudget as exc:
            self.decode.result = buffer_failure(exc)
        except orjson.JSONEncodeError as exc:
            self.decode.result = LegFailure("transport", f"answer the router cannot merge: {exc}")

    def culprit(self) -> Leg | None:
        """The leg whose failure decided the attempt (docs/protocol.md §4: prefill's first)."""
        if self.prefill.failed:
            return self.prefill
        if self.decode.failed:
            return self.decode
        return None

    # -- prefill ----------------------------------------------------------------------------

    def _fail_prefill(self, failure: LegFailure) -> None:
        self.prefill.result = failure
        self.prefill_answer_known.set()
        if not self.responder.started:
            self.decode.cancel("prefill_failed")  # the heart of trio_pd: decode closes now
        log.info("prefill failed (%s): %s", failure.kind, failure.message)

    async def _prefill_leg(self) -> None:
        leg = self.prefill
        with leg.scope, leg.track():
            try:
                post = self.pool.post(leg.url, self.path, leg.headers, leg.body, leg.sending)
                async with post as response:
                    await self._read_prefill(response)
            except UpstreamError as exc:
                self._fail_prefill(LegFailure(exc.kind, str(exc)))
            except (EventTooLarge, OverBudget) as exc:
                self._fail_prefill(buffer_failure(exc))
            finally:
                leg.ended_at = trio.current_time()
        if leg.scope.cancelled_caught and leg.cancel_cause is None and leg.result is None:
            # Not cancelled by its sibling: the hold deadline set once decode had answered.
            hold = self.timeouts.prefill_hold_secs
            self._fail_prefill(
                LegFailure("timeout", f"prefill did not finish within {hold:g}s of decode's answer")
            )
            leg.abandon()
        self.prefill_answer_known.set()  # also when cancelled: decode must not wait for it

    def _hold_prefill(self) -> None:
        """Decode has answered (or streamed its first event): prefill gets a bounded while."""
        if self.prefill.result is None and self.prefill.ended_at is None:
            deadline = trio.current_time() + self.timeouts.prefill_hold_secs
            self.prefill.scope.deadline = min(self.prefill.scope.deadline, deadline)

    async def _read_prefill(self, response: UpstreamResponse) -> None:
        if not 200 <= response.status < 300:
            self._fail_prefill(await status_failure(response))
            return
        if is_sse(response):
            await self._read_prefill_stream(response)
            return
        scan = AnswerScan()
        body = await read_answer(response, self.account, scan)
        self._note_cached(body)
        # Parsed only when something is to be read in it: a failure marker, or logprobs (by the
        # merge). Either parse is priced once, off the event loop when large (`offload.py`).
        found = await self.work.failure(body, marks=scan.marks) if scan.suspect else None
        if found is not None:
            self._fail_prefill(LegFailure("inband", found.message, found.code))
            return
        if self.logprobs:
            if not scan.suspect:
                await self.work.price(body, scan.marks)
            self.prefill_answer = body
        self.prefill_answer_known.set()
        self.prefill.result = LegSuccess(response.status, [], b"")

    async def _read_prefill_stream(self, response: UpstreamResponse) -> None:
        """Read prefill's SSE to its end: any error event fails it; the first one may be merged."""
        reader = EventReader(self.event_limit, self.account)
        try:
            async for chunk in response.chunks():
                if not await self._read_prefill_events(reader.feed(chunk)):
                    return
        finally:
            reader.close()
        self.prefill.result = LegSuccess(response.status, [], b"")

    def _note_cached(self, body: bytes) -> None:
        """The engine's `cached_tokens` (meta_info, or usage.prompt_tokens_details), if said."""
        if self.note_cached and b"cached_tokens" in body:
            found = CACHED_TOKENS.search(body)
            if found is not None:
                self.prefill_cached_tokens = int(found.group(1))

    async def _read_prefill_events(self, events: list[bytes]) -> bool:
        """Prefill's events: False once one failed the leg."""
        for event in events:
            if len(event) >= OFFLOAD_BYTES:  # each pass over a large event a step of its own
                await trio.lowlevel.checkpoint()
            data = event_data(event)
            if data is None or data == b"[DONE]":
                continue
            if await self.work.suspect(data):  # else no failure: no parse
                found = await self.work.failure(data, hold=False)
                if found is not None:
                    self._fail_prefill(LegFailure("inband", found.message, found.code))
                    return False
            self._note_cached(data)
            if not self.prefill_answer_known.is_set():
                if self.logprobs:
                    await self.work.price(data)  # the merge's parse of it
                    self.prefill_answer = data
                self.prefill_answer_known.set()
        return True

    # -- decode -----------------------------------------------------------------------------

    def _fail_decode(self, failure: LegFailure) -> None:
        self.decode.result = failure
        self.prefill.cancel("decode_failed")
        log.info("decode failed (%s): %s", failure.kind, failure.message)

    async def _decode_leg(self) -> None:
        leg = self.decode
        with leg.scope, leg.track():
            if not self.stream:
                await self._post_decode(None)
                return
            # Streams: decode's first event must come within `first_token_secs` of the start;
            # the relay lifts this deadline once it has arrived.
            first_token = self.timeouts.first_token_secs
            with trio.CancelScope(deadline=trio.current_time() + first_token) as first_scope:
                await self._post_decode(first_scope)
            if first_scope.cancelled_caught:
                self._fail_decode(LegFailure("timeout", f"no first token within {first_token:g}s"))
                leg.abandon()

    async def _post_decode(self, first_scope: trio.CancelScope | None) -> None:
        leg = self.decode
        try:
            post = self.pool.post(leg.url, self.path, leg.headers, leg.body, leg.sending)
            async with post as response:
                await self._read_decode(response, first_scope)
        except UpstreamError as exc:
            self._fail_decode(LegFailure(exc.kind, str(exc)))
        except (EventTooLarge, OverBudget) as exc:
            self._fail_decode(buffer_failure(exc))
        finally:
            leg.ended_at = trio.current_time()

    async def _read_decode(
        self, response: UpstreamResponse, first_scope: trio.CancelScope | None
    ) -> None:
        if not 200 <= response.status < 300:
            self._fail_decode(await status_failure(response))
            return
        headers = relayable_headers(response)
        if is_sse(response):
            if first_scope is None:  # never buffered: a stream has no bound but its deadline
                self._fail_decode(
                    LegFailure("transport", "decode answered a stream to a request for none")
                )
                return
            await self._relay_decode_stream(response, headers, first_scope)
            return
        scan = self.decode_scan = AnswerScan()
        body = await read_answer(response, self.account, scan)
        found = await self.work.failure(body, marks=scan.marks) if scan.suspect else None
        if found is not None:
            self._fail_decode(LegFailure("inband", found.message, found.code))
            return
        self.decode.result = LegSuccess(response.status, headers, body)
        self._hold_prefill()

    async def _relay_decode_stream(
        self,
        response: UpstreamResponse,
        headers: list[tuple[bytes, bytes]],
        first_scope: trio.CancelScope,
    ) -> None:
        """Hold decode's stream until its first event, then relay it raw to the client.

        The first event proves the KV cache arrived, so only then do the client's headers go out;
        with logprobs it also waits for prefill's first answer to merge into that event.
        """
        chunks: AsyncIterator[bytes] = response.chunks()
        reader = EventReader(self.event_limit, self.account)
        events: list[bytes] = []
        try:
            async for chunk in chunks:
                events = reader.feed(chunk, first_only=True)
                if events:
                    break
            rest = reader.pending
        finally:
            reader.close()
        if not events:
            self._fail_decode(LegFailure("transport", "decode stream ended before any event"))
            return
        first_scope.deadline = math.inf
        event = events[0]
        data = event_data(event)
        found = event_failure(data, self.account) if data is not None else None
        if found is not None:
            self._fail_decode(LegFailure("inband", found.message, found.code))
            return
        self._hold_prefill()
        if self.logprobs:
            await self.prefill_answer_known.wait()
            if data is not None and self.prefill_answer is not None:
                try:
                    event = await self.work.merged(self.prefill_answer, data, event=True) or event
                except orjson.JSONEncodeError as exc:
                    message = f"first event the router cannot merge: {exc}"
                    self._fail_decode(LegFailure("transport", message))
                    return
        if self.prefill.failed:
            # Prefill failed while this task held a chunk read before its cancellation landed.
            return
        migration = self.migration
        if migration is not None and migration.transcript is not None:
            try:
                event, chunks = transcribed(
                    migration, migration.transcript, event, rest, chunks,
                    self.event_limit, self.account,
                )  # fmt: skip
            except UpstreamError as exc:
                self._fail_decode(LegFailure(exc.kind, str(exc)))
                return
            rest = b""
        await self.responder.start(response.status, headers)
        clock = StreamClock()
        metrics = self.metrics
        last = trio.current_time()
        metrics.first_token.observe(last - self.request_started)
        gaps = metrics.chunk_gap
        send = self.responder.send
        relayed = 1 + rest.count(b"\n\n")
        transform = self.transform
        try:
            async with trio.open_nursery() as guard:
                guard.start_soon(self._watch_stream, clock, response)
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
                    self._fail_decode(LegFailure(exc.kind, str(exc)))
                    guard.cancel_scope.cancel()
                    return
                guard.cancel_scope.cancel()
        finally:
            metrics.events_relayed.inc(relayed)
        await self.responder.finish_stream(b"")
        self.decode.result = LegSuccess(response.status, headers, b"")

    async def _watch_stream(self, clock: StreamClock, response: UpstreamResponse) -> None:
        """The stream's watchdog: a client that stopped reading, or a decode gone silent.

        A client write can block for good (hypercorn shields its socket writes; the listening
        socket's TCP_USER_TIMEOUT ends such a connection in the end), so a stall cannot cancel the
        relay task itself: the watchdog closes decode's connection under it instead (the engine
        sees the disconnect at once) and cancels the leg. A silent decode is simply cancelled.
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
                self.stalled = True
                response.close_connection_now()
                self.decode.cancel("stall")
                self.prefill.cancel("stall")
                return
            if not writing and now - moved_at >= idle:
                self._fail_decode(LegFailure("timeout", f"decode sent nothing for {idle:g}s"))
                self.decode.scope.cancel()
                self.decode.abandon()
                return
