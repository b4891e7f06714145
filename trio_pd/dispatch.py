"""Dual dispatch of one PD attempt: the prefill and decode legs as siblings in one trio nursery.

This module is the outcome table of PROTOCOL.md §4 in code:

- prefill fails (status, transport, timeout, in-band) -> ``decode_scope.cancel()`` at once; the
  decode connection is closed by cancellation, not by an explicit drop;
- decode fails first -> ``prefill_scope.cancel()`` at once;
- decode answers 2xx first -> its answer is held until prefill is known;
- the attempt's deadline passes -> both legs are cancelled and the leg still running timed out;
- the client goes away -> an enclosing scope is cancelled and ``Cancelled`` simply propagates.

Nothing an attempt starts outlives it: when ``Attempt.run`` returns, both connections are either
back in the pool, fully read, or closed.
"""

from __future__ import annotations

import logging
import random
from functools import partial
from typing import Any, Literal

import attrs
import orjson
import trio

from trio_pd.bootstrap import bootstrap_host, inject
from trio_pd.config import RouterConfig
from trio_pd.errors import RouterError, gateway_timeout, no_worker
from trio_pd.fleet.retry import RETRYABLE_STATUSES, attempts, backoff_delay
from trio_pd.fleet.workers import Fleet, NoWorkerAvailable, Worker
from trio_pd.metrics import RouterMetrics
from trio_pd.relay import (
    data_failure,
    error_frame,
    event_data,
    inband_failure,
    merge_logprobs,
    parse_json,
    split_event,
)
from trio_pd.respond import Reply, Responder, error_reply
from trio_pd.upstream import UpstreamError, UpstreamPool, UpstreamResponse

log = logging.getLogger("trio_pd.dispatch")

FailureKind = Literal["status", "inband", "transport", "timeout"]
SSE_TYPE = b"text/event-stream"
MAX_ERROR_BODY = 1 << 20  # an upstream error body we relay is read up to this size


@attrs.frozen
class LegFailure:
    """Why one leg failed; ``status`` only for kind == "status"."""

    kind: FailureKind
    message: str
    status: int | None = None
    body: bytes = b""
    content_type: bytes = b"application/json"

    def client_error(self, role: str) -> Reply:
        """The answer a client gets for this failure (PROTOCOL.md §4, first and third rows)."""
        if self.kind == "status":
            assert self.status is not None
            if role == "decode" or 400 <= self.status < 500:
                return Reply(self.status, [(b"content-type", self.content_type)], self.body)
            return error_reply(
                RouterError(
                    502, f"prefill worker answered {self.status}: {self.message}", "upstream_error"
                )
            )
        if self.kind == "timeout":
            return error_reply(gateway_timeout(f"{role} worker timed out: {self.message}"))
        return error_reply(
            RouterError(502, f"{role} worker failed: {self.message}", "upstream_error")
        )

    def counts_against_worker(self) -> bool:
        """A breaker failure? A 4xx is the client's fault and counts as the worker's success."""
        return not (self.kind == "status" and self.status is not None and self.status < 500)


@attrs.frozen
class LegSuccess:
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes  # empty when the body was streamed to the client


LegResult = LegSuccess | LegFailure | None  # None: still running, or cancelled by its sibling


@attrs.define(eq=False)
class Attempt:
    """One try of a request on one (prefill, decode) pair, with its own bootstrap room."""

    pool: UpstreamPool
    prefill_url: str  # worker base URLs; both legs POST to the same `path`
    decode_url: str
    path: str
    body: bytes
    headers: list[tuple[bytes, bytes]]
    stream: bool
    logprobs: bool
    responder: Responder
    deadline: float
    track_prefill: Any  # context manager factories from the fleet: load counts while a leg runs
    track_decode: Any
    prefill_result: LegResult = None
    decode_result: LegResult = None
    prefill_answer: Any = None  # prefill's first answer, parsed only when logprobs are merged
    prefill_answer_known: trio.Event = attrs.field(factory=trio.Event)
    prefill_scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    decode_scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)

    async def run(self) -> None:
        """Run both legs to completion; on return the results say what happened."""
        with trio.CancelScope(deadline=self.deadline) as deadline_scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._prefill_leg)
                nursery.start_soon(self._decode_leg)
        if deadline_scope.cancelled_caught:
            timeout = LegFailure("timeout", "request deadline passed")
            if self.prefill_result is None and not isinstance(self.decode_result, LegFailure):
                self.prefill_result = timeout
            elif self.decode_result is None:
                self.decode_result = timeout

    @property
    def prefill_failed(self) -> bool:
        return isinstance(self.prefill_result, LegFailure)

    @property
    def decode_failed(self) -> bool:
        return isinstance(self.decode_result, LegFailure)

    def reply(self) -> Reply | None:
        """The client's answer once the attempt ran, or None when it was streamed already."""
        if self.responder.started:
            return None
        if isinstance(self.prefill_result, LegFailure):
            return self.prefill_result.client_error("prefill")
        if isinstance(self.decode_result, LegFailure):
            return self.decode_result.client_error("decode")
        decode = self.decode_result
        assert isinstance(decode, LegSuccess), "both legs finished without a failure"
        body = decode.body
        if self.logprobs and self.prefill_answer is not None:
            merged = parse_json(body)
            if merge_logprobs(self.prefill_answer, merged):
                body = orjson.dumps(merged)
        return Reply(decode.status, decode.headers, body)

    # -- prefill ----------------------------------------------------------------------------

    def _fail_prefill(self, failure: LegFailure) -> None:
        self.prefill_result = failure
        self.prefill_answer_known.set()
        if not self.responder.started:
            self.decode_scope.cancel()  # the heart of trio_pd: decode's connection closes now
        log.info("prefill failed (%s): %s", failure.kind, failure.message)

    async def _prefill_leg(self) -> None:
        with self.prefill_scope, self.track_prefill():
            try:
                async with self.pool.post(
                    self.prefill_url, self.path, self.headers, self.body
                ) as response:
                    await self._read_prefill(response)
            except UpstreamError as exc:
                self._fail_prefill(LegFailure(exc.kind, str(exc)))
        self.prefill_answer_known.set()  # also when cancelled: decode must not wait for it

    async def _read_prefill(self, response: UpstreamResponse) -> None:
        if not 200 <= response.status < 300:
            self._fail_prefill(await status_failure(response))
            return
        if is_sse(response):
            await self._read_prefill_stream(response)
            return
        body = await response.read()
        answer = parse_json(body)
        message = inband_failure(answer)
        if message is not None:
            self._fail_prefill(LegFailure("inband", message))
            return
        self.prefill_answer = answer
        self.prefill_answer_known.set()
        self.prefill_result = LegSuccess(response.status, [], b"")

    async def _read_prefill_stream(self, response: UpstreamResponse) -> None:
        """Read prefill's SSE to its end: any error event fails it; the first one may be merged."""
        buffer = b""
        async for chunk in response.chunks():
            buffer += chunk
            while (split := split_event(buffer)) is not None:
                event, buffer = split
                data = event_data(event)
                if data is None or data == b"[DONE]":
                    continue
                message = data_failure(data)
                if message is not None:
                    self._fail_prefill(LegFailure("inband", message))
                    return
                if not self.prefill_answer_known.is_set():
                    if self.logprobs:
                        self.prefill_answer = parse_json(data)
                    self.prefill_answer_known.set()
        self.prefill_result = LegSuccess(response.status, [], b"")

    # -- decode -----------------------------------------------------------------------------

    def _fail_decode(self, failure: LegFailure) -> None:
        self.decode_result = failure
        if self.prefill_result is None:
            self.prefill_scope.cancel()
        log.info("decode failed (%s): %s", failure.kind, failure.message)

    async def _decode_leg(self) -> None:
        with self.decode_scope, self.track_decode():
            try:
                async with self.pool.post(
                    self.decode_url, self.path, self.headers, self.body
                ) as response:
                    await self._read_decode(response)
            except UpstreamError as exc:
                self._fail_decode(LegFailure(exc.kind, str(exc)))
                if self.responder.started:
                    await self.responder.finish_stream(
                        error_frame(f"decode worker failed: {exc}", "upstream_error", 502)
                    )

    async def _read_decode(self, response: UpstreamResponse) -> None:
        if not 200 <= response.status < 300:
            self._fail_decode(await status_failure(response))
            return
        headers = response.relayable_headers()
        if self.stream and is_sse(response):
            await self._relay_decode_stream(response, headers)
            return
        body = await response.read()
        message = inband_failure(parse_json(body)) if b"error" in body or b"abort" in body else None
        if message is not None:
            self._fail_decode(LegFailure("inband", message))
            return
        self.decode_result = LegSuccess(response.status, headers, body)

    async def _relay_decode_stream(
        self, response: UpstreamResponse, headers: list[tuple[bytes, bytes]]
    ) -> None:
        """Hold decode's stream until its first event, then relay it raw to the client.

        The first event proves the KV cache arrived, so only then do the client's headers go out;
        with logprobs it also waits for prefill's first answer to merge into that event.
        """
        chunks = response.chunks()
        buffer = b""
        first = None
        async for chunk in chunks:
            buffer += chunk
            first = split_event(buffer)
            if first is not None:
                break
        if first is None:
            self._fail_decode(LegFailure("transport", "decode stream ended before any event"))
            return
        event, rest = first
        data = event_data(event)
        message = data_failure(data) if data is not None else None
        if message is not None:
            self._fail_decode(LegFailure("inband", message))
            return
        if self.logprobs:
            await self.prefill_answer_known.wait()
            if data is not None and self.prefill_answer is not None:
                event = merged_event(self.prefill_answer, data) or event
        if self.prefill_failed:
            # Prefill failed while this task held a chunk read before its cancellation landed.
            return
        await self.responder.start(response.status, headers)
        await self.responder.send(event + rest)
        await response.forward(chunks, self.responder.send)
        await self.responder.finish_stream(b"")
        self.decode_result = LegSuccess(response.status, headers, b"")


def merged_event(prefill_answer: Any, decode_data: bytes) -> bytes | None:
    decode_answer = parse_json(decode_data)
    if not merge_logprobs(prefill_answer, decode_answer):
        return None
    return b"data: " + orjson.dumps(decode_answer) + b"\n\n"


def is_sse(response: UpstreamResponse) -> bool:
    return (response.header(b"content-type") or b"").startswith(SSE_TYPE)


async def status_failure(response: UpstreamResponse) -> LegFailure:
    """A non-2xx answer: keep (a bounded part of) its body and content type to relay it."""
    body = await response.read(limit=MAX_ERROR_BODY)
    content_type = response.header(b"content-type") or b"application/json"
    message = upstream_message(body) or f"status {response.status}"
    return LegFailure("status", message, response.status, body, content_type)


def upstream_message(body: bytes) -> str | None:
    parsed = parse_json(body)
    if isinstance(parsed, dict):
        error = parsed.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str):
            return error
        if parsed.get("message"):
            return str(parsed["message"])
    return None


@attrs.frozen
class PDRequest:
    """A validated client request: its parsed body and what dispatch needs to know of it."""

    path: str
    payload: dict[str, Any]
    headers: list[tuple[bytes, bytes]]  # already the legs' headers
    stream: bool
    logprobs: bool
    batch: int | None
    text: str | None


@attrs.frozen
class DispatchContext:
    """What dispatch reads from the router: one per process, shared by every request."""

    pool: UpstreamPool
    fleet: Fleet
    config: RouterConfig
    rng: random.Random
    metrics: RouterMetrics


async def dispatch(ctx: DispatchContext, request: PDRequest, responder: Responder) -> None:
    """Answer one PD request: attempts on fresh pairs with fresh rooms, retried with backoff
    while nothing reached the client and the outcome is retryable.

    Each attempt is its own nursery (``Attempt.run``), so nothing of attempt k survives into k+1.
    """
    deadline = trio.current_time() + ctx.config.request_timeout_secs
    total = attempts(ctx.config.retry)
    avoid: set[Worker] = set()
    for number in range(1, total + 1):
        try:
            prefill, decode = ctx.fleet.select_pair(request.text, frozenset(avoid))
        except NoWorkerAvailable as exc:
            await responder.error(no_worker(str(exc)))
            return
        inject(
            request.payload,
            bootstrap_host(prefill.url),
            prefill.bootstrap_port,
            request.batch,
            ctx.rng,
        )
        attempt = Attempt(
            pool=ctx.pool,
            prefill_url=prefill.url,
            decode_url=decode.url,
            path=request.path,
            body=orjson.dumps(request.payload),
            headers=request.headers,
            stream=request.stream,
            logprobs=request.logprobs,
            responder=responder,
            deadline=deadline,
            track_prefill=partial(ctx.fleet.track, prefill),
            track_decode=partial(ctx.fleet.track, decode),
        )
        if number > 1:
            ctx.metrics.retries.inc()
        await attempt.run()
        record_outcome(ctx.fleet, prefill, decode, attempt)
        count_failures(ctx.metrics, attempt)
        if responder.started:
            if not responder.finished:  # the deadline cut a stream that had started
                await responder.finish_stream(
                    error_frame("request deadline passed", "timeout_error", 504)
                )
            return
        reply = attempt.reply()
        assert reply is not None
        culprit = prefill if attempt.prefill_failed else decode if attempt.decode_failed else None
        if number < total and culprit is not None and reply.status in RETRYABLE_STATUSES:
            delay = backoff_delay(number, ctx.config.retry, ctx.rng)
            if trio.current_time() + delay < deadline:
                log.info(
                    "attempt %d failed with %d, retrying in %.3fs", number, reply.status, delay
                )
                avoid.add(culprit)
                await trio.sleep(delay)
                continue
        await responder.reply(reply)
        return


def count_failures(metrics: RouterMetrics, attempt: Attempt) -> None:
    for role, result in (("prefill", attempt.prefill_result), ("decode", attempt.decode_result)):
        if isinstance(result, LegFailure):
            metrics.leg_failures.labels(role, result.kind).inc()


def record_outcome(fleet: Fleet, prefill: Worker, decode: Worker, attempt: Attempt) -> None:
    """Circuit-breaker attribution, once per worker per attempt (PROTOCOL.md §5).

    Prefill failed: only prefill records (a 4xx is a success: the client's fault); decode was a
    victim. Decode failed: only decode records. Both fine: both succeed. A client disconnect never
    gets here: ``Cancelled`` propagates past this call.
    """
    p, d = attempt.prefill_result, attempt.decode_result
    if isinstance(p, LegFailure):
        fleet.record(prefill, ok=not p.counts_against_worker())
    elif isinstance(d, LegFailure):
        fleet.record(decode, ok=not d.counts_against_worker())
    else:
        if isinstance(p, LegSuccess):
            fleet.record(prefill, ok=True)
        if isinstance(d, LegSuccess):
            fleet.record(decode, ok=True)
