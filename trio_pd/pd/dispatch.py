"""Answering one PD request: attempts on fresh pairs with fresh rooms, retried while that can help.

The retry loop only: choosing the pair (the fleet), building each attempt's body (injection),
running it (`attempt.py`), charging the breakers (`outcome.py`) and deciding whether to try
again. Each attempt is its own nursery (``Attempt.run``), so nothing of attempt k survives into
k+1. A retry needs all of: nothing reached the client yet, a failure another worker might not
have (`LegFailure.retryable`), the same failure not already seen on two workers of that role
(then it is the request's doing), attempts left, and time before the deadline.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import attrs
import trio

from trio_pd.config import RouterConfig
from trio_pd.errors import RouterError, bad_request, no_worker
from trio_pd.fleet.gates import Gates, Slot
from trio_pd.fleet.hints import RouteHints
from trio_pd.fleet.registry import NO_COMPATIBLE_PAIR, Fleet
from trio_pd.fleet.retry import attempts, backoff_delay
from trio_pd.fleet.worker import Hold, NoWorkerAvailable, RankHold, Worker, joined
from trio_pd.observe.metrics import RouterMetrics
from trio_pd.pd.aborts import AbortJob, AbortService
from trio_pd.pd.admission import admit_decode, admit_pair
from trio_pd.pd.answers import read_answer
from trio_pd.pd.attempt import Attempt, Leg
from trio_pd.pd.budget import Account
from trio_pd.pd.cancel import RequestCancel
from trio_pd.pd.ending import account_cancelled_legs, count_failures, stream_error_frame
from trio_pd.pd.injection import (
    attempt_rids,
    bootstrap_fields,
    bootstrap_host,
    dp_fields,
    rooms_for,
    splice,
)
from trio_pd.pd.outcome import FailureHistory, LegFailure, LegSuccess, record_outcome
from trio_pd.pd.payload import COMPLETIONS, GENERATE, Inspected
from trio_pd.pd.relay import error_frame
from trio_pd.pd.resume import (
    TOKENIZE_PATH,
    ContinuedResponder,
    Migration,
    ResumeFailed,
    parse_tokenize,
    tokenize_body,
)
from trio_pd.pd.samples import dispatch_samples
from trio_pd.pd.trace import RequestTrace
from trio_pd.pd.vllm_attempt import VllmAttempt, VllmBodies, engine_headers
from trio_pd.pd.vllm_bodies import VllmBodyMaker
from trio_pd.respond import Responder
from trio_pd.upstream.headers import admin_key, generation_key, worker_authorization
from trio_pd.upstream.pool import UpstreamError, UpstreamPool

log = logging.getLogger(__name__)
# How long the first abort of a leg waits where the latch hazard applies (see `abort_hook`).
LATCH_DELAY_SECS = 1.0


@attrs.frozen
class PDRequest:
    """A validated client request: what dispatch needs to know of it, and its bytes."""

    path: str
    inspected: Inspected
    headers: list[tuple[bytes, bytes]]  # the legs' headers, less authorization
    authorization: bytes | None = None  # the client's, forwarded when a worker has no key
    request_id: str = ""
    routing_key: str | None = None  # read only when a policy routes by it (edge/routing_key.py)
    trace: RequestTrace | None = None  # its span (`--enable-trace`), else None
    account: Account | None = None  # its share of --max-buffered-bytes (budget.py)
    affinity: str | None = None  # consistent_hashing's key without a routing key (RouteHints)
    vllm: VllmBodyMaker | None = None  # its legs' bodies on vLLM pairs, made once (None: inline)
    parsers: Any = None  # trio_parallel.WorkerContext: large answers' JSON work (`offload.py`)


@attrs.frozen
class DispatchContext:
    """What dispatch reads from the router: one per process, shared by every request."""

    pool: UpstreamPool
    fleet: Fleet
    config: RouterConfig
    rng: random.Random
    metrics: RouterMetrics
    aborts: AbortService | None = None  # None: --no-abort-on-cancel
    # The prefill cap and the decode window (`fleet/gates.py`), one set per process.
    gates: Gates = attrs.field(
        default=attrs.Factory(lambda self: Gates(self.config.overload), takes_self=True)
    )


async def dispatch_request(
    ctx: DispatchContext, request: PDRequest, responder: Responder, cancel: RequestCancel
) -> None:
    """Answer a client request: one PD request, or one per sample when it asks `n > 1`
    (`samples.py`: PD engines cannot sample n > 1 themselves)."""
    rid = request.inspected.rid
    if rid is not None:  # logged, never sent: the engines' rids are the router's own
        responder.route_info["client_rid"] = str(rid)[:200]
    count = request.inspected.samples
    if count <= 1:
        await dispatch(ctx, request, responder, cancel)
        return

    async def one(index: int, sub: Responder, sub_cancel: RequestCancel) -> None:
        await dispatch(ctx, request, sub, sub_cancel)

    await dispatch_samples(
        request.path, count, request.inspected.stream, responder, cancel, one,
        ctx.config.max_sse_event_bytes, request.account,
    )  # fmt: skip


async def dispatch(
    ctx: DispatchContext, request: PDRequest, responder: Responder, cancel: RequestCancel
) -> None:
    """Answer one PD request (see the module docstring for when it is retried)."""
    started = trio.current_time()
    deadline = started + ctx.config.request_timeout_secs
    total = attempts(ctx.config.retry)
    history = FailureHistory()
    avoid: set[Worker] = set()
    model = resolve_model(ctx, request.inspected.model)
    responder.route_info["model"] = model or "-"
    inspected = request.inspected
    kv = ctx.fleet.kv_policy()
    probe = None
    # kv_aware: a text prompt the engine tokenizes as it is (chat goes through the model's chat
    # template, a batch is several prompts: those use the approximate tree).
    if kv is not None and request.path in (GENERATE, COMPLETIONS) and inspected.batch is None:
        probe = await kv.probe(inspected.text, capped=inspected.length > len(inspected.text or ""))
    hints = RouteHints(
        inspected.text, inspected.length, request.routing_key, model, request.affinity, probe
    )
    trace = request.trace
    # Migration (`resume.py`): a stream whose decode breaks resumes on a fresh pair; the
    # attempts after a resume write to the client's open stream (`answering`) and send the
    # resumed body (`sent`); each resume starts its own count of retries (`number`).
    migration = Migration.for_request(request.path, inspected, ctx.config.migration_limit)
    answering, sent, resuming = responder, request, False
    number = tries = 0
    while number < total:
        number += 1
        tries += 1
        try:
            prefill, decode, slots = await admitted_pair(ctx, hints, frozenset(avoid), inspected)
        except NoWorkerAvailable as exc:
            code = exc.reason if exc.reason == NO_COMPATIBLE_PAIR else None
            if answering is not responder:
                await end_resumed(ctx, migration, responder, str(exc))
                return
            await responder.error(no_worker(str(exc), code))
            return
        except RouterError as exc:  # shed, or the prefill line or the decode window said no
            if answering is not responder:
                await end_resumed(ctx, migration, responder, exc.message)
                return
            await responder.error(exc)
            return
        ranks = with_slots(choose_ranks(ctx, prefill, decode), *slots)
        engine = prefill.spec.engine
        try:
            if migration is not None:
                migration.resumable = engine == "sglang"
                if resuming:
                    resumed = await migration.resumed_inspected(
                        inspected, tokenizer(ctx, request, prefill)
                    )
                    sent, resuming = attrs.evolve(request, inspected=resumed), False
                elif answering is responder:
                    sent = attrs.evolve(request, inspected=migration.request_inspected())
            bodies = await vllm_bodies(sent) if engine == "vllm" else None
            attempt = new_attempt(
                ctx, sent, answering, cancel, (prefill, decode), (started, deadline), number,
                ranks, bodies,
            )  # fmt: skip
        except (ResumeFailed, UpstreamError) as exc:
            ranks.release()
            await end_resumed(ctx, migration, responder, f"the resume failed: {exc}")
            return
        except BaseException:
            ranks.release()
            raise
        if migration is not None and migration.watching():
            attempt.migration = migration
        attempt.note_cached = probe is not None  # kv_aware's self-check reads it
        responder.route_info.update(prefill=prefill.id, decode=decode.id, attempts=tries)
        if number > 1:
            ctx.metrics.retries.inc()
        spans = None
        try:
            # Its span and its legs' (each leg's traceparent is its own span's): tracing only.
            spans = trace.attempt(tries, attempt) if trace is not None else None
            await attempt.run()
        finally:
            ranks.release()  # a leg that never started still held its rank
            account_cancelled_legs(ctx.metrics, attempt)
            if spans is not None:
                spans.end(attempt)
        record_outcome(
            ctx.fleet, (prefill, attempt.prefill.result), (decode, attempt.decode.result), history
        )
        if kv is not None and probe is not None and not attempt.prefill.failed:
            kv.observe(probe, prefill, attempt.prefill_cached_tokens)
        count_failures(ctx.metrics, attempt)
        if migration is not None:
            migration.settle(ctx.metrics, answering.started)
        if answering.started:
            if not responder.finished and not attempt.stalled:
                if migration is not None and resume(ctx, migration, attempt, trace):
                    avoid.add(decode)
                    answering, resuming, number = ContinuedResponder.of(responder), True, 0
                    responder.route_info["migrations"] = migration.resumes + 1
                    continue
                await responder.finish_stream(stream_error_frame(attempt))
            return
        reply = attempt.reply()
        assert reply is not None
        retry = retry_plan(ctx, attempt, history, number, total, deadline)
        if retry is not None:
            culprit, delay = retry
            avoid.add(prefill if culprit is attempt.prefill else decode)
            if leases_a_prefill(attempt, culprit) and not fresh_decodes(ctx, avoid, model, decode):
                ctx.metrics.retries_declined.labels("no_fresh_decode").inc()
                retry = None
        if retry is not None:
            log.info("attempt %d failed with %d, retrying in %.3fs", number, reply.status, delay)
            if trace is not None:
                trace.retrying(number, culprit.role, delay)
            await trio.sleep(delay)
            continue
        if answering is not responder:  # a resumed attempt that sent nothing, and no retry
            await end_resumed(ctx, migration, responder, failure_message(attempt))
            return
        await responder.reply(reply)
        return
    if answering is not responder:  # pragma: no cover - the loop returns from its last attempt
        await end_resumed(ctx, migration, responder, "no attempt left")


def resume(
    ctx: DispatchContext,
    migration: Migration,
    attempt: Attempt,
    trace: RequestTrace | None,
) -> bool:
    """Decode's stream broke after the client got part of it: resume it on a fresh pair (True),
    or count why not (False; the stream then ends with the error event, as before)."""
    decode = attempt.decode
    reason = migration.broke(attempt.prefill.failed, decode.result, decode.cancel_cause)
    if reason is None:
        return False
    why = migration.decide(migration.resumable)
    if why is not None:
        migration.count(ctx.metrics, reason, why)
        log.info("decode broke (%s) mid-stream; not resumed: %s", reason, why)
        return False
    migration.open_break = reason
    sent = migration.transcript.sent if migration.transcript is not None else 0
    log.info("decode broke (%s) after %d tokens: resuming on a fresh pair", reason, sent)
    if trace is not None:
        trace.migrating(migration.resumes + 1, reason, sent)
    return True


async def end_resumed(
    ctx: DispatchContext, migration: Migration | None, responder: Responder, message: str
) -> None:
    """A resumed stream that cannot go on: the client's stream ends with the error event."""
    if migration is not None:
        migration.fail_open_break(ctx.metrics)
    if not responder.finished:
        await responder.finish_stream(error_frame(message, "upstream_error", 502))


def failure_message(attempt: Attempt) -> str:
    culprit = attempt.culprit()
    if culprit is not None and isinstance(culprit.result, LegFailure):
        return f"{culprit.role} worker failed: {culprit.result.message}"
    return "the resumed attempt failed"


def tokenizer(
    ctx: DispatchContext, request: PDRequest, worker: Worker
) -> Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]:
    """The prompt's ids as `worker`'s engine makes them: its own `/tokenize`."""

    async def tokenize(payload: dict[str, Any]) -> dict[str, Any]:
        headers = leg_headers_for(ctx, request, worker)
        post = ctx.pool.post(worker.url, TOKENIZE_PATH, headers, tokenize_body(payload))
        async with post as response:
            body = await read_answer(response)
            return parse_tokenize(response.status, body)

    return tokenize


async def admitted_pair(
    ctx: DispatchContext, hints: RouteHints, avoid: frozenset[Worker], inspected: Inspected
) -> tuple[Worker, Worker, tuple[Slot | None, Slot | None]]:
    """The pair through the admission gates (`pd/admission.py`), with the slots it holds."""
    interval = ctx.config.load_poll_interval_secs
    prefill, decode, prefill_slot = await admit_pair(
        ctx.fleet, ctx.gates, ctx.metrics, hints, avoid, interval
    )
    try:
        rooms = inspected.batch or 1
        decode_slot = await admit_decode(ctx.gates, ctx.metrics, decode, rooms, interval)
    except BaseException:
        if prefill_slot is not None:
            prefill_slot.release()
        raise
    return prefill, decode, (prefill_slot, decode_slot)


def with_slots(ranks: Ranks, prefill_slot: Slot | None, decode_slot: Slot | None) -> Ranks:
    """The gates' slots ride on the legs' holds: each is freed when its leg ends (the prefill
    slot with the prefill phase, not the request), and by `Ranks.release` in any case."""
    if prefill_slot is None and decode_slot is None:
        return ranks
    return attrs.evolve(
        ranks,
        prefill_hold=joined(ranks.prefill_hold, prefill_slot),
        decode_hold=joined(ranks.decode_hold, decode_slot),
    )


def retry_plan(
    ctx: DispatchContext,
    attempt: Attempt,
    history: FailureHistory,
    number: int,
    total: int,
    deadline: float,
) -> tuple[Leg, float] | None:
    """(the leg to blame, the backoff) when another attempt may help, else None: a failure
    another worker might not have, not already seen on two workers of that role, attempts left,
    and time before the deadline."""
    culprit = attempt.culprit()
    if culprit is None or number >= total:
        return None
    failure = culprit.result
    assert isinstance(failure, LegFailure)
    history.add(culprit.role, culprit.worker, failure)
    delay = backoff_delay(number, ctx.config.retry, ctx.rng)
    if (
        failure.retryable()
        and not history.repeats_across_workers(culprit.role, failure)
        and trio.current_time() + delay < deadline
    ):
        return culprit, delay
    return None


def leases_a_prefill(attempt: Attempt, culprit: Leg) -> bool:
    """A vLLM decode failed after its prefill answered: the prefill's KV blocks are leased to
    that handoff (until read, or `kv_lease_duration`, 30 s by default), and a retry runs a fresh
    prefill that leases more (docs/vllm.md §8, finding 1)."""
    return (
        isinstance(attempt, VllmAttempt)
        and culprit is attempt.decode
        and isinstance(attempt.prefill.result, LegSuccess)
    )


def fresh_decodes(
    ctx: DispatchContext, avoid: set[Worker], model: str | None, decode: Worker
) -> bool:
    """Whether a decode of this engine that has not failed this request is there to retry on.
    Without one a retry would lease another prefill's blocks for the same dead decode: a vLLM
    request spends at most one prefill per decode it tries, so the KV a dead decode can pin is
    one lease per request, not one per attempt."""
    return any(
        w not in avoid and w.spec.engine == decode.spec.engine
        for w in ctx.fleet.available("decode", model)
    )


def new_attempt(
    ctx: DispatchContext,
    request: PDRequest,
    responder: Responder,
    cancel: RequestCancel,
    pair: tuple[Worker, Worker],
    times: tuple[float, float],
    number: int = 1,
    ranks: Ranks | None = None,
    bodies: VllmBodies | None = None,
) -> Attempt:
    """An attempt on this pair, its body carrying fresh bootstrap fields; `times` are the
    request's start and deadline; `bodies`: the request's on a vLLM pair (`vllm_bodies`)."""
    prefill, decode = pair
    if prefill.spec.engine == "vllm":
        assert bodies is not None
        return new_vllm_attempt(ctx, request, responder, cancel, pair, times, bodies)
    started, deadline = times
    inspected = request.inspected
    ranks = ranks or Ranks()
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
        logprobs=inspected.logprobs,
        responder=responder,
        deadline=deadline,
        timeouts=ctx.config.timeouts,
        outer_cause=cancel.why,
        metrics=ctx.metrics,
        request_started=started,
        account=request.account,
        event_limit=ctx.config.max_sse_event_bytes,
        parsers=request.parsers,
    )


async def vllm_bodies(request: PDRequest) -> VllmBodies:
    """The request's legs' bodies on a vLLM pair: made once per request (its retries and
    samples share them), off the event loop when large (`vllm_bodies.py`), or a 400 for what a
    vLLM pair cannot take."""
    if request.path == GENERATE:
        raise bad_request(
            "vLLM workers serve /v1/completions and /v1/chat/completions, not /generate"
        )
    if request.inspected.batch is not None:
        raise bad_request(
            "a vLLM pair takes one prompt per request (the prefill's answer carries one KV "
            "handoff): send the prompts as separate requests"
        )
    maker = request.vllm
    if maker is None:
        maker = VllmBodyMaker(request.path, request.inspected.body)
    return await maker.bodies(request.account)


def new_vllm_attempt(
    ctx: DispatchContext,
    request: PDRequest,
    responder: Responder,
    cancel: RequestCancel,
    pair: tuple[Worker, Worker],
    times: tuple[float, float],
    bodies: VllmBodies,
) -> VllmAttempt:
    """An attempt on a vLLM pair (docs/vllm.md): the prefill's body now, the decode's once the
    prefill answered. vLLM has no abort endpoint: closing a leg's connection is its abort."""
    prefill, decode = pair
    started, deadline = times
    inspected = request.inspected
    body = bodies.prefill
    if len(body) > ctx.config.max_payload_size:
        raise RouterError(
            413,
            f"the request with the router's fields exceeds {ctx.config.max_payload_size} bytes",
            "payload_too_large",
        )

    def leg(worker: Worker, leg_body: bytes) -> Leg:
        return Leg(
            worker.role,
            worker,
            leg_body,
            engine_headers(leg_headers_for(ctx, request, worker), request.path),
            partial(ctx.fleet.track, worker, None, request.routing_key),
        )

    return VllmAttempt(
        pool=ctx.pool,
        path=request.path,
        prefill=leg(prefill, body),
        decode=leg(decode, b""),  # written once the prefill answered
        stream=inspected.stream,
        logprobs=False,  # SGLang's merge; vLLM's prompt_logprobs are the attempt's own
        responder=responder,
        deadline=deadline,
        timeouts=ctx.config.timeouts,
        outer_cause=cancel.why,
        metrics=ctx.metrics,
        request_started=started,
        account=request.account,
        event_limit=ctx.config.max_sse_event_bytes,
        bodies=bodies,
        missing_params=ctx.config.vllm_missing_kv_params,
    )


@attrs.frozen
class Ranks:
    """The DP ranks of one attempt (`--dp-aware`); None: the worker's engine chooses."""

    prefill: int | None = None
    decode: int | None = None
    prefill_dp: int = 1
    decode_dp: int = 1
    prefill_hold: Hold | None = None  # a RankHold, with a gate's slot when one applies
    decode_hold: Hold | None = None

    def release(self) -> None:
        for hold in (self.prefill_hold, self.decode_hold):
            if hold is not None:
                hold.release()

    @property
    def room_alignment(self) -> tuple[int, int]:
        """(dp_size, rank) rooms must agree with: `room % dp_size == rank` on the prefill."""
        return (self.prefill_dp, self.prefill or 0) if self.prefill is not None else (1, 0)

    @property
    def prefill_fields(self) -> dict[str, Any]:
        return dp_fields(self.prefill_dp, self.prefill or 0, self.decode_dp, self.decode or 0)[0]

    @property
    def decode_fields(self) -> dict[str, Any]:
        return dp_fields(self.prefill_dp, self.prefill or 0, self.decode_dp, self.decode or 0)[1]


def choose_ranks(ctx: DispatchContext, prefill: Worker, decode: Worker) -> Ranks:
    """With `--dp-aware`, the least loaded rank of each worker that has several (the policy
    chose the worker; the ranks balance inside it): a (worker, rank) pair is the unit of load."""
    if not ctx.config.dp_aware or (prefill.dp_size <= 1 and decode.dp_size <= 1):
        return Ranks()
    p_rank = prefill.least_loaded_rank() if prefill.dp_size > 1 else None
    d_rank = decode.least_loaded_rank() if decode.dp_size > 1 else None
    return Ranks(
        prefill=p_rank,
        decode=d_rank,
        prefill_dp=prefill.dp_size,
        decode_dp=decode.dp_size,
        prefill_hold=RankHold(prefill, p_rank) if p_rank is not None else None,
        decode_hold=RankHold(decode, d_rank) if d_rank is not None else None,
    )


def resolve_model(ctx: DispatchContext, requested: str | None) -> str | None:
    """The model a request routes to, or None when the router serves one model (zero
    configuration: the `model` field routes nothing, exactly as with one model before).

    Several models: the request's `model` (an alias of `--model-alias` names its model, unless
    a worker serves a model of that very name: the served model wins), else `--default-model`;
    an unknown one is a 404 listing the models served, none at all a 400."""
    models = ctx.fleet.models()
    if len(models) <= 1:
        return None
    model = requested or ctx.config.default_model
    if model is not None and model not in models:  # `--model-alias`: another name of one
        model = dict(ctx.config.model_aliases).get(model, model)
    if model is None:
        raise bad_request(
            f"this router serves several models ({', '.join(models)}): name one in `model`, "
            "or start the router with --default-model"
        )
    if model not in models:
        raise RouterError(
            404,
            f"model {model!r} is not served here; models: {', '.join(models)}",
            "not_found_error",
            code="model_not_found",
        )
    return model


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


def leg_headers_for(
    ctx: DispatchContext, request: PDRequest, worker: Worker
) -> list[tuple[bytes, bytes]]:
    key = generation_key(worker.spec, ctx.config.api_key)
    if not key and not request.authorization:
        return request.headers
    return [*request.headers, *worker_authorization(key, request.authorization)]
