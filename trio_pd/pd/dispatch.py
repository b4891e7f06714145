"""Answering one PD request: attempts on fresh pairs with fresh rooms, retried while that can help.

The retry loop only: choosing the pair (the fleet), having the pair's engine build the attempt
(`pd/engines/`: dispatch never names one), running it (`attempt.py`), charging the breakers
(`outcome.py`) and asking the request's retry state (`retry_state.py`) what follows. Each
attempt is its own nursery (``Attempt.run``), so nothing of attempt k survives into k+1; what
it did comes back as one value (`outcome.AttemptOutcome`), which is all the metrics, the span,
the breakers and the retry state read.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import trio

from trio_pd.errors import RouterError, bad_request, no_worker
from trio_pd.fleet.gates import Slot
from trio_pd.fleet.hints import RouteHints
from trio_pd.fleet.registry import NO_COMPATIBLE_PAIR
from trio_pd.fleet.retry import attempts
from trio_pd.fleet.worker import NoWorkerAvailable, RankHold, Worker, joined
from trio_pd.pd.admission import admit_decode, admit_pair
from trio_pd.pd.answers import read_answer
from trio_pd.pd.cancel import RequestCancel
from trio_pd.pd.ending import account_cancelled_legs, count_failures
from trio_pd.pd.engines import engine_for
from trio_pd.pd.frames import error_frame
from trio_pd.pd.outcome import AttemptOutcome, LegFailure, record_outcome
from trio_pd.pd.payload import Inspected
from trio_pd.pd.request import DispatchContext, PDRequest, Ranks, leg_headers_for
from trio_pd.pd.resume import (
    TOKENIZE_PATH,
    ContinuedResponder,
    Migration,
    ResumeFailed,
    parse_tokenize,
    tokenize_body,
)
from trio_pd.pd.retry_state import Answer, EndStream, Resume, RetryState
from trio_pd.pd.samples import dispatch_samples
from trio_pd.respond import Responder
from trio_pd.upstream.pool import UpstreamError

log = logging.getLogger(__name__)

__all__ = ["DispatchContext", "PDRequest", "dispatch", "dispatch_request"]


async def dispatch_request(
    ctx: DispatchContext, request: PDRequest, responder: Responder, cancel: RequestCancel
) -> None:
    """Answer a client request: one PD request, or one per sample when it asks `n > 1`
    (`samples.py`: PD engines cannot sample n > 1 themselves)."""
    rid = request.inspected.rid
    if rid is not None:  # logged, never sent: the engines' rids are the router's own
        responder.notes.client_rid = str(rid)[:200]
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
    """Answer one PD request (see `retry_state.py` for when it is retried)."""
    started = trio.current_time()
    deadline = started + ctx.config.request_timeout_secs
    model = resolve_model(ctx, request.inspected.model)
    retries = RetryState(
        ctx.fleet, ctx.config.retry, ctx.rng, ctx.metrics, attempts(ctx.config.retry), deadline,
        model,
    )  # fmt: skip
    notes = responder.notes  # the route, for the request's outcome (`respond.RequestNotes`)
    notes.model = model or "-"
    inspected = request.inspected
    kv = ctx.fleet.kv_policy()
    probe = None
    # kv_aware: the prompt's ids as the engine makes them (a batch is several prompts: the
    # approximate tree routes it).
    if kv is not None and inspected.batch is None:
        probe = await kv.probe(request.path, inspected.body)
    hints = RouteHints(
        inspected.text, inspected.length, request.routing_key, model, request.affinity, probe
    )
    trace = request.trace
    # Migration (`resume.py`): a stream whose decode breaks resumes on a fresh pair; the
    # attempts after a resume write to the client's open stream (`answering`) and send the
    # resumed body (`sent`); each resume starts its own count of retries (`number`).
    migration = Migration.for_request(request.path, inspected, ctx.config.migration_limit)
    retries.migration = migration
    answering, sent, resuming = responder, request, False
    number = tries = 0
    while number < retries.total:
        number += 1
        tries += 1
        try:
            prefill, decode, slots = await admitted_pair(
                ctx, hints, frozenset(retries.avoid), inspected
            )
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
        try:
            engine = engine_for(prefill.spec.engine)
            if migration is not None:
                migration.resumable = engine.RESUMES
                migration.seam_by_detokenize = engine.SEAM_BY_DETOKENIZE
                if resuming:
                    resumed = await migration.resumed_inspected(
                        inspected, tokenizer(ctx, request, prefill)
                    )
                    sent, resuming = attrs.evolve(request, inspected=resumed), False
                elif answering is responder:
                    sent = attrs.evolve(request, inspected=migration.request_inspected())
            attempt = await engine.new_attempt(
                ctx, sent, answering, cancel, (prefill, decode), (started, deadline), ranks
            )
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
        notes.prefill, notes.decode, notes.attempts = prefill.id, decode.id, tries
        if number > 1:
            ctx.metrics.retries.inc()
        spans = None
        outcome: AttemptOutcome | None = None
        try:
            # Its span and its legs' (each leg's traceparent is its own span's): tracing only.
            spans = trace.attempt(tries, attempt) if trace is not None else None
            outcome = await attempt.run()
        finally:
            ranks.release()  # a leg that never started still held its rank
            ended = outcome if outcome is not None else attempt.outcome()  # cut: as it stands
            account_cancelled_legs(ctx.metrics, ended)
            if spans is not None:
                spans.end(ended)
        record_outcome(ctx.fleet, outcome, retries.history)
        if kv is not None and probe is not None and not outcome.prefill.failed:
            kv.observe(probe, prefill, outcome.prefill_cached_tokens)
        count_failures(ctx.metrics, outcome)
        if migration is not None:
            migration.settle(ctx.metrics, outcome.streamed)
        step = retries.next_step(outcome, number)
        if isinstance(step, Resume):
            assert migration is not None
            answering, resuming, number = ContinuedResponder.of(responder), True, 0
            notes.migrations = migration.resumes + 1
            if trace is not None:
                trace.migrating(migration.resumes + 1, step.reason, step.sent)
            continue
        if isinstance(step, EndStream):
            if step.frame is not None and not responder.finished:
                await responder.finish_stream(step.frame)
            return
        if isinstance(step, Answer):
            if answering is not responder:  # a resumed attempt that sent nothing
                await end_resumed(ctx, migration, responder, failure_message(outcome))
                return
            await responder.reply(step.reply)
            return
        log.info("attempt %d failed with %d, retrying in %.3fs", number, step.status, step.delay)
        if trace is not None:
            trace.retrying(number, step.culprit, step.delay)
        await trio.sleep(step.delay)


async def end_resumed(
    ctx: DispatchContext, migration: Migration | None, responder: Responder, message: str
) -> None:
    """A resumed stream that cannot go on: the client's stream ends with the error event."""
    if migration is not None:
        migration.fail_open_break(ctx.metrics)
    if not responder.finished:
        await responder.finish_stream(error_frame(message, "upstream_error", 502))


def failure_message(outcome: AttemptOutcome) -> str:
    culprit = outcome.culprit()
    if culprit is not None and isinstance(culprit.result, LegFailure):
        return f"{culprit.role} worker failed: {culprit.result.message}"
    return "the resumed attempt failed"


def tokenizer(
    ctx: DispatchContext, request: PDRequest, worker: Worker
) -> Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]:
    """The prompt's ids as `worker`'s engine makes them: its own `/tokenize` (or, for a
    resume's seam, its `/detokenize`: `path`)."""

    async def tokenize(payload: dict[str, Any], path: str = TOKENIZE_PATH) -> dict[str, Any]:
        headers = leg_headers_for(ctx, request, worker)
        post = ctx.pool.post(worker.url, path, headers, tokenize_body(payload))
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
