"""One PD attempt: the prefill and decode legs in one cancel scope, under an engine's rules.

On SGLang the legs are siblings in one trio nursery; on vLLM they run in sequence (prefill,
then decode): the schedule, the reading of prefill's answer, the rewriting of decode's and
what a failure means on that engine are the engine's (`EngineRules`, `pd/engines/`). The rest
is one code path for every engine. This module is the outcome table of docs/protocol.md §4 in
code:

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
engine to free the request at once (`Leg.cancel_cause`). ``run`` returns how the attempt ended as
one frozen value (`outcome.AttemptOutcome`); the stream relay and its watchdog are
`stream_relay.py`'s.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

import attrs
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
from trio_pd.pd.frames import event_data
from trio_pd.pd.offload import AnswerWork
from trio_pd.pd.outcome import AttemptOutcome, LegEnd, LegFailure, LegResult, LegSuccess
from trio_pd.pd.resume import Migration, transcribed
from trio_pd.pd.sse import EventReader, EventTooLarge
from trio_pd.pd.stream_relay import StreamRelay
from trio_pd.respond import Responder
from trio_pd.spec import Role
from trio_pd.upstream.headers import relayable_headers
from trio_pd.upstream.pool import UpstreamError, UpstreamPool, UpstreamResponse

log = logging.getLogger(__name__)

DEFAULT_EVENT_LIMIT = 16 << 20  # RouterConfig.max_sse_event_bytes


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

    def end(self) -> LegEnd:
        """How the leg ended, as a value."""
        return LegEnd(
            self.role,
            self.worker,
            self.result,
            self.posted,
            self.cancel_cause,
            self.cancelled_at,
            self.ended_at,
        )

    @property
    def url(self) -> str:
        return self.worker.url


class EngineRules(Protocol):
    """What an engine decides inside one attempt (`pd/engines/`: one module per engine).

    The attempt owns the legs, their scopes, the timeouts and the relay; an engine's rules say
    only what differs: the schedule, how the prefill's answer is read (and what it makes of the
    decode's body), how decode's answer is rewritten for the client, and which failures mean
    something else on this engine.
    """

    sequential: bool  # the schedule: prefill first, then decode (vLLM); else both at once
    leases_prefill: bool  # a decode failing after prefill answered leaves prefill's KV leased
    # What each relayed stream chunk becomes on its way to the client (None: sent as it came).
    transform: Callable[[bytes], bytes] | None

    async def read_prefill(self, attempt: Attempt, response: UpstreamResponse) -> None:
        """Read prefill's 2xx answer: fail the prefill (`attempt.fail_prefill`) or set its
        result; a sequential engine writes the decode leg's body here."""

    async def first_event(self, attempt: Attempt, event: bytes, data: bytes | None) -> bytes | None:
        """Decode's first stream event as the client gets it; None when this failed decode."""

    def reclassify(self, attempt: Attempt) -> None:
        """After both legs ended: a failure that means something else on this engine."""

    async def rewrite_answer(self, attempt: Attempt) -> None:
        """After both legs ended: decode's whole answer as the client gets it."""

    def close(self) -> None:
        """The attempt is over: free what the rules hold (buffers charged to the request)."""


@attrs.define(eq=False)
class Attempt:
    """One try of a request on one (prefill, decode) pair, under its engine's rules."""

    pool: UpstreamPool
    path: str
    prefill: Leg
    decode: Leg
    stream: bool
    responder: Responder
    deadline: float
    timeouts: TimeoutConfig
    outer_cause: Callable[[], tuple[str, float]]  # why an enclosing scope cancelled us, and when
    metrics: RouterMetrics
    request_started: float  # the client request's start: time to first token counts from it
    rules: EngineRules
    engine: str  # the pair's engine (`WorkerSpec.engine`), for the outcome
    account: Account | None = None  # the request's share of --max-buffered-bytes
    event_limit: int = DEFAULT_EVENT_LIMIT  # --max-sse-event-bytes
    # Set once prefill's first answer is known (read, failed, or the leg ended): a decode whose
    # first event merges it waits for this (`EngineRules.first_event`).
    prefill_answer_known: trio.Event = attrs.field(factory=trio.Event)
    stalled: bool = False  # the client stopped reading: nothing more can be sent to it
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
    # whole events through its transcript. None: relayed as it came.
    migration: Migration | None = None

    async def run(self) -> AttemptOutcome:
        """Run both legs to completion, in the engine's schedule; how they ended is returned."""
        ended = False
        try:
            with trio.CancelScope(deadline=self.deadline) as deadline_scope:
                if self.rules.sequential:
                    await self._prefill_leg()
                    if isinstance(self.prefill.result, LegSuccess):
                        await self._decode_leg()
                else:
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(self._decode_leg)
                        await self._prefill_leg()  # the nursery's own task: one task spawn less
            ended = True
        finally:
            self.rules.close()
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
        self.rules.reclassify(self)
        await self.rules.rewrite_answer(self)
        return self.outcome()

    def outcome(self) -> AttemptOutcome:
        """How the attempt ended so far, as a value (also when an enclosing scope cut it)."""
        return AttemptOutcome(
            engine=self.engine,
            prefill=self.prefill.end(),
            decode=self.decode.end(),
            streamed=self.responder.started,
            finished=self.responder.finished,
            stalled=self.stalled,
            leases_prefill=self.rules.leases_prefill,
            prefill_cached_tokens=self.prefill_cached_tokens,
        )

    # -- prefill ----------------------------------------------------------------------------

    def fail_prefill(self, failure: LegFailure) -> None:
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
                    if not 200 <= response.status < 300:
                        self.fail_prefill(await status_failure(response))
                    else:
                        await self.rules.read_prefill(self, response)
            except UpstreamError as exc:
                self.fail_prefill(LegFailure(exc.kind, str(exc)))
            except (EventTooLarge, OverBudget) as exc:
                self.fail_prefill(buffer_failure(exc))
            finally:
                leg.ended_at = trio.current_time()
        if leg.scope.cancelled_caught and leg.cancel_cause is None and leg.result is None:
            # Not cancelled by its sibling: the hold deadline set once decode had answered.
            hold = self.timeouts.prefill_hold_secs
            self.fail_prefill(
                LegFailure("timeout", f"prefill did not finish within {hold:g}s of decode's answer")
            )
            leg.abandon()
        self.prefill_answer_known.set()  # also when cancelled: decode must not wait for it

    def _hold_prefill(self) -> None:
        """Decode has answered (or streamed its first event): prefill gets a bounded while."""
        if self.prefill.result is None and self.prefill.ended_at is None:
            deadline = trio.current_time() + self.timeouts.prefill_hold_secs
            self.prefill.scope.deadline = min(self.prefill.scope.deadline, deadline)

    # -- decode -----------------------------------------------------------------------------

    def fail_decode(self, failure: LegFailure) -> None:
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
                self.fail_decode(LegFailure("timeout", f"no first token within {first_token:g}s"))
                leg.abandon()

    async def _post_decode(self, first_scope: trio.CancelScope | None) -> None:
        leg = self.decode
        try:
            post = self.pool.post(leg.url, self.path, leg.headers, leg.body, leg.sending)
            async with post as response:
                await self._read_decode(response, first_scope)
        except UpstreamError as exc:
            self.fail_decode(LegFailure(exc.kind, str(exc)))
        except (EventTooLarge, OverBudget) as exc:
            self.fail_decode(buffer_failure(exc))
        finally:
            leg.ended_at = trio.current_time()

    async def _read_decode(
        self, response: UpstreamResponse, first_scope: trio.CancelScope | None
    ) -> None:
        if not 200 <= response.status < 300:
            self.fail_decode(await status_failure(response))
            return
        headers = relayable_headers(response)
        if is_sse(response):
            if first_scope is None:  # never buffered: a stream has no bound but its deadline
                self.fail_decode(
                    LegFailure("transport", "decode answered a stream to a request for none")
                )
                return
            await self._relay_decode_stream(response, headers, first_scope)
            return
        scan = self.decode_scan = AnswerScan()
        body = await read_answer(response, self.account, scan)
        found = await self.work.failure(body, marks=scan.marks) if scan.suspect else None
        if found is not None:
            self.fail_decode(LegFailure("inband", found.message, found.code))
            return
        self.decode.result = LegSuccess(response.status, headers, body)
        self._hold_prefill()

    async def _relay_decode_stream(
        self,
        response: UpstreamResponse,
        headers: list[tuple[bytes, bytes]],
        first_scope: trio.CancelScope,
    ) -> None:
        """Hold decode's stream until its first event, then have the relay send it raw.

        The first event proves the KV cache arrived, so only then do the client's headers go out;
        an engine may rewrite that event first (SGLang's logprob merge waits for prefill's).
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
            self.fail_decode(LegFailure("transport", "decode stream ended before any event"))
            return
        first_scope.deadline = math.inf
        data = event_data(events[0])
        found = event_failure(data, self.account) if data is not None else None
        if found is not None:
            self.fail_decode(LegFailure("inband", found.message, found.code))
            return
        self._hold_prefill()
        event = await self.rules.first_event(self, events[0], data)
        if event is None:
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
                self.fail_decode(LegFailure(exc.kind, str(exc)))
                return
            rest = b""
        relay = StreamRelay(
            self.responder,
            self.metrics,
            self.timeouts,
            self.rules.transform,
            on_broken=self.fail_decode,
            on_stall=self._stalled,
            on_idle=self._idle,
        )
        if await relay.relay(response, headers, event, rest, chunks, self.request_started):
            self.decode.result = LegSuccess(response.status, headers, b"")

    def _stalled(self) -> None:
        """The client stopped reading (the relay closed decode's connection): both legs end."""
        self.stalled = True
        self.decode.cancel("stall")
        self.prefill.cancel("stall")

    def _idle(self, failure: LegFailure) -> None:
        """Decode went silent mid-stream: it failed, and is cancelled and aborted."""
        self.fail_decode(failure)
        self.decode.scope.cancel()
        self.decode.abandon()
