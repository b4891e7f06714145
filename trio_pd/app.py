"""The router's ASGI callable: route table, body limit, request id, error envelope, lifespan.

A bare ASGI app, no framework: hypercorn calls ``Router.__call__`` for every request and once for
the lifespan, whose nursery holds every long-lived task (health checks, cache-tree eviction).
"""

from __future__ import annotations

import logging
import random
import uuid

import attrs
import httpx2
import trio

from trio_pd import payload as shape
from trio_pd.admin import ADMIN_ROUTES, WORKER_ITEM_ROUTES
from trio_pd.admission import Admission
from trio_pd.asgi import (
    ClientGone,
    Handler,
    Receive,
    Scope,
    Send,
    json_reply,
    read_json_object,
)
from trio_pd.config import RouterConfig
from trio_pd.dispatch import DispatchContext, PDRequest, dispatch
from trio_pd.errors import RouterError, method_not_allowed, not_found
from trio_pd.fleet.workers import Fleet
from trio_pd.lifespan import run_background
from trio_pd.logs import current_request_id
from trio_pd.metrics import RouterMetrics
from trio_pd.respond import Reply, Responder
from trio_pd.upstream import UpstreamPool, leg_headers, make_client

log = logging.getLogger("trio_pd.app")
CLIENT_GONE_STATUS = 499  # nginx's convention for "the client closed the request"


@attrs.define(eq=False)
class Router:
    """One router: its config, fleet and (from lifespan startup on) its pooled upstream client.

    State lives here, not in module globals, so a test can run two routers in one process.
    """

    config: RouterConfig
    fleet: Fleet = attrs.field()
    rng: random.Random = attrs.field(factory=random.Random)
    client: httpx2.AsyncClient | None = None  # control plane: health probes, fan-out
    pool: UpstreamPool = attrs.field(factory=UpstreamPool)  # the data plane's two legs
    context: DispatchContext | None = None
    metrics: RouterMetrics = attrs.field(factory=RouterMetrics)
    admission: Admission = attrs.field()

    @admission.default
    def _default_admission(self) -> Admission:
        c = self.config
        return Admission(c.max_concurrent_requests, c.queue_size, c.queue_timeout_secs)

    @fleet.default
    def _default_fleet(self) -> Fleet:
        return Fleet(self.config)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self.handle_http(scope, receive, send)
        elif scope["type"] == "lifespan":
            await self.lifespan(receive, send)

    # -- lifespan ---------------------------------------------------------------------------

    async def lifespan(self, receive: Receive, send: Send) -> None:
        message = await receive()
        assert message["type"] == "lifespan.startup"
        self.client = make_client()
        self.context = DispatchContext(self.pool, self.fleet, self.config, self.rng, self.metrics)
        self.metrics.attach(self.fleet, self.pool)
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(self.background)
                await send({"type": "lifespan.startup.complete"})
                message = await receive()
                assert message["type"] == "lifespan.shutdown"
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await self.client.aclose()
                await self.pool.aclose()
        await send({"type": "lifespan.shutdown.complete"})

    async def background(self, *, task_status: trio.TaskStatus[None]) -> None:
        """Long-lived tasks of the process; they end when the lifespan nursery is cancelled."""
        await run_background(self, task_status=task_status)

    # -- http -------------------------------------------------------------------------------

    async def handle_http(self, scope: Scope, receive: Receive, send: Send) -> None:
        request_id = incoming_request_id(scope["headers"]) or uuid.uuid4().hex
        current_request_id.set(request_id)
        responder = Responder(send, request_id.encode())
        path = scope["path"]
        label = path if path in ROUTES else "other"
        started_at = trio.current_time()
        try:
            handler = self.route(scope["method"], path)
            await handler(self, scope, receive, responder)
        except RouterError as error:
            if not responder.started:
                await responder.error(error)
        except ClientGone:
            log.info("client went away before its body arrived")
        finally:
            status = responder.status if responder.finished else CLIENT_GONE_STATUS
            self.metrics.requests.labels(label, str(status)).inc()
            self.metrics.latency.labels(label).observe(trio.current_time() - started_at)

    def route(self, method: str, path: str) -> Handler:
        methods = ROUTES.get(path)
        if methods is None and path.startswith("/workers/"):
            methods = WORKER_ITEM_ROUTES
        if methods is None:
            raise not_found(path)
        handler = methods.get(method)
        if handler is None:
            raise method_not_allowed(method, path, tuple(methods))
        return handler


async def handle_generation(
    router: Router, scope: Scope, receive: Receive, responder: Responder
) -> None:
    """A PD request: validate, then dispatch inside a scope the client's disconnect cancels."""
    payload = await read_json_object(scope, receive, router.config.max_payload_size)
    path = scope["path"]
    request = PDRequest(
        path=path,
        payload=payload,
        headers=leg_headers(scope["headers"], responder.request_id.decode()),
        stream=shape.wants_stream(payload),
        logprobs=shape.wants_logprobs(path, payload),
        batch=shape.batch_size(path, payload),
        text=shape.routing_text(path, payload),
    )
    assert router.context is not None, "the lifespan has not started"
    with trio.CancelScope() as client_scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_disconnect, receive, responder, client_scope)
            try:
                async with router.admission.slot():
                    await dispatch(router.context, request, responder)
            except RouterError as error:  # 429 from admission: answered here, not in a group
                await responder.error(error)
            nursery.cancel_scope.cancel()
    if client_scope.cancelled_caught:
        log.info("client disconnected; every leg of the request was cancelled")


async def watch_disconnect(
    receive: Receive, responder: Responder, client_scope: trio.CancelScope
) -> None:
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
                client_scope.cancel()
            return


def incoming_request_id(headers: list[tuple[bytes, bytes]]) -> str | None:
    found = None
    for name, value in headers:
        if name == b"x-request-id" and value:
            return value.decode("latin-1")
        if name == b"x-correlation-id" and value:
            found = value.decode("latin-1")
    return found


async def handle_liveness(router: Router, scope: Scope, receive: Receive, rsp: Responder) -> None:
    await json_reply(rsp, 200, {"status": "alive"})


async def handle_health(router: Router, scope: Scope, receive: Receive, rsp: Responder) -> None:
    """200 only when at least one prefill and one decode can take traffic."""
    missing = [role for role in ("prefill", "decode") if not router.fleet.available(role)]
    if missing:
        await json_reply(
            rsp,
            503,
            {
                "status": "unavailable",
                "error": {
                    "message": f"no available {' or '.join(missing)} worker",
                    "type": "service_unavailable",
                    "code": 503,
                },
            },
        )
    else:
        await json_reply(rsp, 200, {"status": "ok"})


async def handle_metrics(router: Router, scope: Scope, receive: Receive, rsp: Responder) -> None:
    body = router.metrics.render()
    await rsp.reply(Reply(200, [(b"content-type", b"text/plain; version=0.0.4")], body))


ROUTES: dict[str, dict[str, Handler]] = {
    **ADMIN_ROUTES,
    shape.GENERATE: {"POST": handle_generation},
    shape.COMPLETIONS: {"POST": handle_generation},
    shape.CHAT: {"POST": handle_generation},
    "/health": {"GET": handle_health},
    "/readiness": {"GET": handle_health},
    "/liveness": {"GET": handle_liveness},
    "/metrics": {"GET": handle_metrics},
}
