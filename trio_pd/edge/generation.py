"""The generation request path: `/generate`, `/v1/completions`, `/v1/chat/completions`.

Read and inspect the body, then dispatch in a scope the client's disconnect cancels; the whole
of it is one trio nursery, so nothing the request starts outlives it.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import TYPE_CHECKING

import attrs
import trio
import trio_parallel

from trio_pd.asgi import ClientGone, Receive, Scope
from trio_pd.config import RouterConfig
from trio_pd.edge.admission import Admission
from trio_pd.edge.drain import Drain, cut_by_shutdown, shutting_down
from trio_pd.edge.intake import BODY_COPIES, ClientBody, inspect
from trio_pd.edge.keepalive import keep_alive
from trio_pd.edge.routing_key import RoutingKeys
from trio_pd.errors import RouterError, without_frames
from trio_pd.pd import payload
from trio_pd.pd.budget import MemoryBudget
from trio_pd.pd.cancel import RequestCancel
from trio_pd.pd.dispatch import DispatchContext, PDRequest, dispatch_request
from trio_pd.pd.frames import error_frame
from trio_pd.pd.injection import DP_KEYS
from trio_pd.pd.vllm_bodies import VllmBodyMaker
from trio_pd.respond import Responder
from trio_pd.upstream.headers import NO_KEYS, RouterKeys, client_authorization, leg_headers

if TYPE_CHECKING:
    from trio_pd.edge.tracing import Tracing
    from trio_pd.pd.trace import RequestTrace

log = logging.getLogger(__name__)


GENERATION_PATHS = (payload.GENERATE, payload.COMPLETIONS, payload.CHAT)


@attrs.frozen(eq=False)
class GenerationContext:
    """What the generation routes read: config, admission, dispatch, the body parsers."""

    config: RouterConfig
    admission: Admission
    drain: Drain
    dispatch: DispatchContext
    owned_keys: frozenset[str]  # body keys the router writes itself
    routing_keys: RoutingKeys | None = None  # None: no policy routes by a routing key
    client_key_is_ours: bool = False  # --api-key/--data-plane-api-keys: not for the workers
    router_keys: RouterKeys = NO_KEYS  # every key of the router's: never forwarded
    budget: MemoryBudget = attrs.Factory(lambda: MemoryBudget(0))  # --max-buffered-bytes
    body_copies: int = BODY_COPIES  # copies of a body held while it runs (3: --dp-aware ranks)
    parsers: trio_parallel.WorkerContext | None = None  # opened by the lifespan
    tracing: Tracing | None = None  # --enable-trace, from the lifespan's start to its end


async def handle_generation(
    gen: GenerationContext, scope: Scope, receive: Receive, rsp: Responder
) -> None:
    """A PD request: admitted first, then its body read within the memory budget and inspected,
    then dispatched, all in a scope the client's disconnect cancels (`intake.py` says why in
    this order). With tracing, the whole of it is the request's span: begun here, ended by the
    router with the request's outcome once the client's answer is sent (`rsp.span`)."""
    # Tracing off costs the None checks; one function, not a wrapper, for the same reason.
    trace = gen.tracing.begin(scope, rsp.request_id) if gen.tracing is not None else None
    rsp.span = trace
    cancel = RequestCancel()
    gone = False
    try:
        config = gen.config
        if gen.drain.draining:
            raise shutting_down()
        body = ClientBody.of(scope, receive, config.max_payload_size, gen.body_copies)
        with gen.drain.track(cancel), cancel.scope:
            async with trio.open_nursery() as nursery:
                try:
                    body.check_declared(gen.budget.limit)
                    await admitted_run(gen, scope, receive, rsp, cancel, body, trace, nursery)
                except RouterError as error:  # 4xx of the body, 429 of admission or the budget
                    # Its frames hold the body read so far: freed now, not by a collection.
                    without_frames(error)
                    rsp.notes.error = error.message  # the outcome's: the message only
                    if not rsp.started:
                        if not body.complete:  # refused unread: see intake.DISCARD_SECS
                            await body.discard_rest()
                        await rsp.error(error)
                except ClientGone:  # raised below, outside the nursery's group
                    gone = True  # not the exception: its frames hold the body read so far
                nursery.cancel_scope.cancel()
        if gone:
            raise ClientGone
        if cancel.scope.cancelled_caught:
            log.info("request cancelled (%s); every leg of it was closed", cancel.cause)
            if cancel.cause == "shutdown":
                await answer_cut(rsp, cut_by_shutdown(gen.drain.grace_secs))
    finally:
        if cancel.scope.cancel_called:
            rsp.notes.cancel_cause = cancel.cause


async def admitted_run(
    gen: GenerationContext,
    scope: Scope,
    receive: Receive,
    rsp: Responder,
    cancel: RequestCancel,
    body: ClientBody,
    trace: RequestTrace | None,
    nursery: trio.Nursery,
) -> None:
    """Wait for admission (reading at most the first bytes of the body meanwhile), then read,
    inspect and dispatch the request, its buffers charged to its account until it ends."""
    config = gen.config
    slot = gen.admission.slot()
    if not slot.enter_now():  # a wait in line: meanwhile the body's first bytes, the client
        body.start_waiting(nursery, partial(cancel.cancel, "client_gone"))
        await slot.wait()
    try:
        await body.stop_waiting()  # from here this task owns `receive`
        account = gen.budget.account()
        try:
            raw = await body.read(account, config.timeouts.client_body_secs)
            inspected = await inspect(
                scope["path"], raw, config.max_batch_size, gen.owned_keys, gen.parsers,
                account, body.marks,
            )  # fmt: skip
            del raw  # `inspected.body` holds the bytes the legs start from
            slot.widen(inspected.samples)  # n samples: n PD requests, n slots (admission.py)
            request = PDRequest(
                scope["path"],
                inspected,
                leg_headers(scope["headers"], rsp.request_id, gen.router_keys),
                # With client keys the client's authorization is the router's credential: kept;
                # without, it goes on to the workers unless it is one of the router's keys.
                None
                if gen.client_key_is_ours
                else client_authorization(scope["headers"], gen.router_keys),
                rsp.request_id.decode("latin-1"),
                gen.routing_keys.key(scope["headers"], inspected.rid) if gen.routing_keys else None,
                trace,
                account,
                gen.routing_keys.affinity(scope["headers"]) if gen.routing_keys else None,
                VllmBodyMaker(scope["path"], inspected.body, body.marks, gen.parsers),
                gen.parsers,
            )
            nursery.start_soon(watch_disconnect, receive, rsp, cancel)
            interval = config.edges.sse_keepalive_secs
            if not inspected.stream or interval <= 0:
                await dispatch_request(gen.dispatch, request, rsp, cancel)
                return
            async with trio.open_nursery() as pinging:  # the keep-alive lives as long as this
                pinging.start_soon(keep_alive, rsp, interval)
                await dispatch_request(gen.dispatch, request, rsp, cancel)
                pinging.cancel_scope.cancel()
        finally:
            account.close()
    finally:
        slot.release()


def owned_keys(config: RouterConfig) -> frozenset[str]:
    """The body keys the router writes itself (a client's own are removed first). `rid` always:
    the engines' rids are the router's, whatever a client sends (`pd/injection.attempt_rids`)."""
    owned = {*payload.BOOTSTRAP_KEYS, "rid"}
    if config.dp_aware:
        owned |= DP_KEYS
    return frozenset(owned)


async def answer_cut(rsp: Responder, error: RouterError) -> None:
    """The answer of a request ended from outside (docs/protocol.md §4): an error, or a frame
    after the start."""
    if not rsp.started:
        await rsp.error(error)
    elif not rsp.finished:
        await rsp.finish_stream(error_frame(error.message, error.error_type, error.status))


async def watch_disconnect(receive: Receive, responder: Responder, cancel: RequestCancel) -> None:
    """Cancel the request when the client goes away before its response is complete.

    Hypercorn never cancels an app on disconnect and its send() keeps succeeding afterwards,
    so without this task a gone client would keep both upstream connections busy. Hypercorn also
    reports `http.disconnect` right after a complete response: that one is no client gone (the
    attempt may still be waiting for prefill's end to record its outcome).
    """
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if not responder.finished:
                cancel.cancel("client_gone")
            return
