"""SGLang 0.5.23 pairs: both legs at once, each carrying the bootstrap fields (docs/protocol.md).

The prefill and the decode are sent the same body with fresh bootstrap fields (host, port, a room
per prompt) and rids; the decode waits in its engine for the KV cache the prefill pushes. Both
run at once in the attempt's nursery (`attempt.py`). Prefill's answer is read only for a failure,
its `cached_tokens` (kv_aware's self-check) and, with logprobs, its input logprobs, which go in
front of decode's (the first stream event, or the whole answer). An abandoned leg is aborted in
its engine (`POST /abort_request`, `aborts.py`). No failure means anything else on SGLang.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from functools import partial
from typing import Any

import attrs
import orjson
import trio

from trio_pd.errors import RouterError
from trio_pd.fleet.worker import Hold, Worker
from trio_pd.pd.aborts import AbortJob
from trio_pd.pd.answers import AnswerScan, buffer_failure, is_sse, read_answer
from trio_pd.pd.attempt import Attempt, Leg
from trio_pd.pd.budget import OverBudget
from trio_pd.pd.cancel import RequestCancel
from trio_pd.pd.frames import event_data
from trio_pd.pd.injection import attempt_rids, bootstrap_fields, bootstrap_host, rooms_for, splice
from trio_pd.pd.outcome import LegFailure, LegSuccess
from trio_pd.pd.payload import OFFLOAD_BYTES
from trio_pd.pd.request import DispatchContext, PDRequest, Ranks, leg_headers_for
from trio_pd.pd.sse import EventReader
from trio_pd.respond import Responder
from trio_pd.upstream.headers import admin_key, worker_authorization
from trio_pd.upstream.pool import UpstreamResponse

log = logging.getLogger(__name__)

NAME = "sglang"
# A stream broken mid-way resumes on a fresh pair (`pd/resume.py`): `/generate` events carry
# their ids, completions give them with `return_token_ids`, `/tokenize` a prompt's.
RESUMES = True
# Its `/detokenize` takes `{"tokens": [[ids], ...]}` and answers each list's text: a greedy
# resume finds its seam there (a break inside a multi-byte character, `migration.py`).
SEAM_BY_DETOKENIZE = True
CACHED_TOKENS = re.compile(rb'"cached_tokens"\s*:\s*(\d{1,12})')
# How long the first abort of a leg waits where the latch hazard applies (see `abort_hook`).
LATCH_DELAY_SECS = 1.0


@attrs.define(eq=False)
class SglangRules:
    """`attempt.EngineRules` of an SGLang pair."""

    logprobs: bool  # the client asked input logprobs: prefill's are merged into decode's
    sequential: bool = False
    leases_prefill: bool = False
    transform: Callable[[bytes], bytes] | None = None  # decode's stream goes out as it came
    # Prefill's first answer (an event's data), kept only when logprobs are merged: its bytes,
    # parsed only by the merge, off the event loop when large (`offload.py`).
    prefill_answer: bytes | None = None

    # -- prefill's answer -----------------------------------------------------------------------

    async def read_prefill(self, attempt: Attempt, response: UpstreamResponse) -> None:
        if is_sse(response):
            await self._read_prefill_stream(attempt, response)
            return
        scan = AnswerScan()
        body = await read_answer(response, attempt.account, scan)
        note_cached(attempt, body)
        # Parsed only when something is to be read in it: a failure marker, or logprobs (by the
        # merge). Either parse is priced once, off the event loop when large (`offload.py`).
        found = await attempt.work.failure(body, marks=scan.marks) if scan.suspect else None
        if found is not None:
            attempt.fail_prefill(LegFailure("inband", found.message, found.code))
            return
        if self.logprobs:
            if not scan.suspect:
                await attempt.work.price(body, scan.marks)
            self.prefill_answer = body
        attempt.prefill_answer_known.set()
        attempt.prefill.result = LegSuccess(response.status, [], b"")

    async def _read_prefill_stream(self, attempt: Attempt, response: UpstreamResponse) -> None:
        """Read prefill's SSE to its end: any error event fails it; the first one may be merged."""
        reader = EventReader(attempt.event_limit, attempt.account)
        try:
            async for chunk in response.chunks():
                if not await self._read_prefill_events(attempt, reader.feed(chunk)):
                    return
        finally:
            reader.close()
        attempt.prefill.result = LegSuccess(response.status, [], b"")

    async def _read_prefill_events(self, attempt: Attempt, events: list[bytes]) -> bool:
        """Prefill's events: False once one failed the leg."""
        work = attempt.work
        for event in events:
            if len(event) >= OFFLOAD_BYTES:  # each pass over a large event a step of its own
                await trio.lowlevel.checkpoint()
            data = event_data(event)
            if data is None or data == b"[DONE]":
                continue
            if await work.suspect(data):  # else no failure: no parse
                found = await work.failure(data, hold=False)
                if found is not None:
                    attempt.fail_prefill(LegFailure("inband", found.message, found.code))
                    return False
            note_cached(attempt, data)
            if not attempt.prefill_answer_known.is_set():
                if self.logprobs:
                    await work.price(data)  # the merge's parse of it
                    self.prefill_answer = data
                attempt.prefill_answer_known.set()
        return True

    # -- decode's answer ------------------------------------------------------------------------

    async def first_event(self, attempt: Attempt, event: bytes, data: bytes | None) -> bytes | None:
        """With logprobs, decode's first event waits for prefill's first answer to merge it."""
        if not self.logprobs:
            return event
        await attempt.prefill_answer_known.wait()
        if data is not None and self.prefill_answer is not None:
            try:
                return await attempt.work.merged(self.prefill_answer, data, event=True) or event
            except orjson.JSONEncodeError as exc:
                attempt.fail_decode(
                    LegFailure("transport", f"first event the router cannot merge: {exc}")
                )
                return None
        return event

    def reclassify(self, attempt: Attempt) -> None:
        """Nothing: SGLang's failures mean what they say."""

    async def rewrite_answer(self, attempt: Attempt) -> None:
        """Both legs answered whole and logprobs were asked for: prefill's input logprobs go in
        front of decode's (off the event loop when large, `offload.py`). An answer the router
        cannot hold or re-encode (nested past orjson's 255 levels) is the decode worker's
        fault, never a 500."""
        if not self.logprobs or self.prefill_answer is None or attempt.responder.started:
            return
        decode = attempt.decode.result
        if not (isinstance(decode, LegSuccess) and isinstance(attempt.prefill.result, LegSuccess)):
            return
        try:
            scan = attempt.decode_scan
            marks = None if scan is None else scan.marks
            body = await attempt.work.merged(self.prefill_answer, decode.body, marks=marks)
            if body is not None:
                attempt.decode.result = LegSuccess(decode.status, decode.headers, body)
        except OverBudget as exc:
            attempt.decode.result = buffer_failure(exc)
        except orjson.JSONEncodeError as exc:
            attempt.decode.result = LegFailure(
                "transport", f"answer the router cannot merge: {exc}"
            )

    def close(self) -> None:
        """Nothing held beyond the attempt's own buffers."""


def note_cached(attempt: Attempt, body: bytes) -> None:
    """The engine's `cached_tokens` (meta_info, or usage.prompt_tokens_details), if said."""
    if attempt.note_cached and b"cached_tokens" in body:
        found = CACHED_TOKENS.search(body)
        if found is not None:
            attempt.prefill_cached_tokens = int(found.group(1))


# -- building an attempt ------------------------------------------------------------------------


async def new_attempt(
    ctx: DispatchContext,
    request: PDRequest,
    responder: Responder,
    cancel: RequestCancel,
    pair: tuple[Worker, Worker],
    times: tuple[float, float],
    ranks: Ranks,
) -> Attempt:
    """An attempt on this pair, its body carrying fresh bootstrap fields; `times` are the
    request's start and deadline."""
    prefill, decode = pair
    started, deadline = times
    inspected = request.inspected
    fields: dict[str, Any] = bootstrap_fields(
        bootstrap_host(prefill.url),
        prefill.bootstrap_port,
        rooms_for(inspected.batch, ctx.rng, *ranks.room_alignment),
        inspected.batch,
    )
    rid = attempt_rids(inspected.batch)
    fields["rid"] = rid
    rids = (rid,) if isinstance(rid, str) else tuple(rid)
    prefill_body = splice(inspected.body, inspected.empty, {**fields, **ranks.prefill_fields})
    decode_body = (
        splice(inspected.body, inspected.empty, {**fields, **ranks.decode_fields})
        if ranks.decode_fields or ranks.prefill_fields
        else prefill_body  # the same bytes to both legs (docs/protocol.md §1) unless ranks differ
    )
    if max(len(prefill_body), len(decode_body)) > ctx.config.max_payload_size:
        raise RouterError(
            413,
            f"the request with the router's fields exceeds {ctx.config.max_payload_size} bytes",
            "payload_too_large",
        )

    def leg(worker: Worker, body: bytes, hold: Hold | None) -> Leg:
        return Leg(
            worker.role,
            worker,
            body,
            leg_headers_for(ctx, request, worker),
            partial(ctx.fleet.track, worker, hold, request.routing_key),
            abort_hook(
                ctx, worker, rids, request.request_id.encode("latin-1"), inspected.multimodal
            ),
        )

    return Attempt(
        pool=ctx.pool,
        path=request.path,
        prefill=leg(prefill, prefill_body, ranks.prefill_hold),
        decode=leg(decode, decode_body, ranks.decode_hold),
        stream=inspected.stream,
        responder=responder,
        deadline=deadline,
        timeouts=ctx.config.timeouts,
        outer_cause=cancel.why,
        metrics=ctx.metrics,
        request_started=started,
        rules=SglangRules(logprobs=inspected.logprobs),
        engine=NAME,
        account=request.account,
        event_limit=ctx.config.max_sse_event_bytes,
        parsers=request.parsers,
    )


def abort_hook(
    ctx: DispatchContext,
    worker: Worker,
    rids: tuple[str, ...],
    request_id: bytes,
    multimodal: bool = False,
) -> Callable[[Leg], None] | None:
    """What an abandoned leg does: queue `/abort_request` for its rids on its worker.

    The first abort is held back `LATCH_DELAY_SECS` where the engine can be caught between
    registering the rid and scheduling it (its async dynamic batch tokenizer, or a multimodal
    request): an abort landing there is lost and latches, suppressing every later abort of the
    rid, the engine's own disconnect abort included (docs/protocol.md §10). Elsewhere that
    path does not yield, and the abort goes at once."""
    aborts = ctx.aborts
    if aborts is None or not rids:
        return None

    config = ctx.config
    key = admin_key(worker.spec, config.worker_admin_api_key, config.api_key)
    headers = (*worker_authorization(key, None), (b"x-request-id", request_id))
    delay = LATCH_DELAY_SECS if worker.abort_latch_hazard or multimodal else 0.0

    def abandon(leg: Leg) -> None:
        aborts.request(AbortJob(leg.role, worker.url, rids, headers, delay))

    return abandon
