"""The router's ASGI callable and `build_router`, the one place its parts are made and wired.

A bare ASGI app, no framework: hypercorn calls ``Router.__call__`` for every request and once for
the lifespan, whose nursery holds every long-lived service (`services.py`) and which binds the
route table to the resources it opened (`lifespan.py`).
Whatever happens inside a handler, the client gets the docs/protocol.md §7 envelope with its
`x-request-id` (or, once a stream has started, an error event): never hypercorn's empty 500.
"""

from __future__ import annotations

import logging
import math
import random
import socket
import ssl
from collections.abc import Sequence
from functools import partial
from typing import Any

import attrs
import trio

from trio_pd.asgi import ClientGone, Receive, Scope, Send
from trio_pd.config import RouterConfig
from trio_pd.control.context import ControlContext
from trio_pd.edge.admission import Admission
from trio_pd.edge.auth import Access, Door, startup_warnings
from trio_pd.edge.cors import CorsPolicy, handle_preflight
from trio_pd.edge.drain import Drain
from trio_pd.edge.generation import GenerationContext, owned_keys
from trio_pd.edge.intake import BODY_COPIES
from trio_pd.edge.lifespan import Resources, close_membership, open_resources
from trio_pd.edge.request_ids import RequestIds
from trio_pd.edge.routes import Route, route_table
from trio_pd.edge.routing_key import RoutingKeys
from trio_pd.edge.services import ServiceContext, run_background
from trio_pd.edge.supervision import ServiceGuard
from trio_pd.errors import (
    RouterError,
    first_router_error,
    internal_error,
    method_not_allowed,
    not_found,
)
from trio_pd.fleet.registry import Fleet
from trio_pd.membership.setup import Membership, membership_for
from trio_pd.membership.source import MembershipSource, MembershipStore
from trio_pd.observe.logs import current_request_id, log_access
from trio_pd.observe.metrics import RouterMetrics
from trio_pd.pd.aborts import AbortService
from trio_pd.pd.budget import MemoryBudget
from trio_pd.pd.dispatch import DispatchContext
from trio_pd.pd.frames import error_frame
from trio_pd.respond import RequestOutcome, Responder, deny_websocket
from trio_pd.upstream.destinations import Destinations, parse_allow
from trio_pd.upstream.headers import RouterKeys
from trio_pd.upstream.pool import UpstreamPool
from trio_pd.upstream.tls import worker_ssl_context

log = logging.getLogger(__name__)


ROUTES = "trio_pd.routes"  # the lifespan state's key of the route table the requests use


@attrs.frozen(eq=False)
class Router:
    """One router: its config and the parts `build_router` made, in the order it made them.

    Frozen: nothing is written into it once built. What the lifespan opens (the control
    client, the parsers, the tracer) reaches the handlers through the route table the lifespan
    binds and hands to every request in the ASGI lifespan state (`ROUTES`). State lives here,
    not in module globals, so a test can run two routers in one process.
    """

    config: RouterConfig
    metrics: RouterMetrics
    fleet: Fleet
    rng: random.Random
    ssl_context: ssl.SSLContext
    destinations: Destinations  # where a worker connection may go
    pool: UpstreamPool  # the data plane's two legs
    admission: Admission
    budget: MemoryBudget  # --max-buffered-bytes
    aborts: AbortService | None
    access: Access
    drain: Drain
    guard: ServiceGuard  # crash-only supervision of the lifespan's services
    membership: Membership  # the admin API's store and the sources
    dispatch: DispatchContext
    router_keys: RouterKeys  # every key of the router's: never forwarded, never logged
    request_ids: RequestIds
    cors: CorsPolicy
    preflight: Route

    @property
    def store(self) -> MembershipStore:
        """Where the admin API writes membership (`membership/setup.py` chooses)."""
        return self.membership.store

    @property
    def sources(self) -> tuple[MembershipSource, ...]:
        """The long-lived membership readers, run in the lifespan (`services.py`)."""
        return self.membership.sources

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self.handle_http(scope, receive, send)
        elif scope["type"] == "lifespan":
            await self.lifespan(scope, receive, send)
        elif scope["type"] == "websocket":
            await deny_websocket(send)

    # -- lifespan ---------------------------------------------------------------------------

    async def lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Startup opens the resources (`lifespan.py`), binds the route table to them and
        hands it to the requests (`scope["state"]`), then starts the services, supervised as a
        whole by the process's `ServiceGuard` (crash-only); it is complete once membership had
        its first read and the first health round found a pair (or timed out). Shutdown comes
        after hypercorn drained the connections: the aborts of the requests the drain cut are
        sent (`AbortService.flush`), the services are cancelled, every client is closed."""
        message = await receive()
        assert message["type"] == "lifespan.startup"
        startup_warnings(self.access)
        async with open_resources(self.config, self.ssl_context, self.destinations) as resources:
            try:
                async with trio.open_nursery() as nursery:
                    services = partial(run_background, self.services(resources))
                    await nursery.start(self.guard.supervised, "services", services)
                    # Requests are routed from now on, through every door (`serve/process.py`
                    # opens the routed doors after this; one open earlier would get a 503).
                    scope["state"][ROUTES] = self.route_table(resources)
                    await send({"type": "lifespan.startup.complete"})
                    message = await receive()
                    assert message["type"] == "lifespan.shutdown"
                    if self.aborts is not None:  # what the drain cut is freed in its engines
                        await self.aborts.flush()
                    nursery.cancel_scope.cancel(reason="lifespan shutdown")
            finally:
                with trio.CancelScope(shield=True):
                    await self.pool.aclose()
                    await close_membership(self.membership)
        await send({"type": "lifespan.shutdown.complete"})

    def route_table(self, resources: Resources) -> dict[str, dict[str, Route]]:
        """Every route, its handler bound to its narrow context, the resources included."""
        control = ControlContext(
            self.config, self.fleet, self.rng, self.store, self.destinations, resources.client
        )
        generation = GenerationContext(
            self.config,
            self.admission,
            self.drain,
            self.dispatch,
            owned_keys(self.config),
            RoutingKeys.of(self.config.policy),
            client_key_is_ours=bool(self.access.client_keys),
            router_keys=self.router_keys,
            budget=self.budget,
            body_copies=BODY_COPIES + 1 if self.config.dp_aware else BODY_COPIES,
            parsers=resources.parsers,
            tracing=resources.tracing,
        )
        return route_table(control, generation, self.fleet, self.drain, self.metrics, self.guard)

    def services(self, resources: Resources) -> ServiceContext:
        """The narrow context of the long-lived services."""
        return ServiceContext(
            self.config, self.fleet, self.metrics, self.pool, resources.client, self.aborts,
            self.sources, self.guard,
        )  # fmt: skip

    # -- http -------------------------------------------------------------------------------

    async def handle_http(
        self, scope: Scope, receive: Receive, send: Send, door: Door = "data"
    ) -> None:
        """One request through `door`: the data-plane port, or the admin listener
        (`serve/doors.py`), which serves the control plane, probes and metrics."""
        headers = scope["headers"]
        path = scope["path"]
        request_id = self.request_ids.incoming(headers)
        if request_id is not None and self.router_keys.carried_by(request_id):
            request_id = None  # a key of the router's would go to the workers and the logs
        request_id = request_id or self.request_ids.new(path)
        current_request_id.set(request_id.decode("latin-1"))
        # The request id is echoed as its exact bytes; the CORS headers go on every answer of
        # the data plane (the admin listener answers no browser: `auth.py`).
        cors = self.cors.response_headers(headers) if door == "data" else ()
        responder = Responder(send, request_id, cors)
        routes: dict[str, dict[str, Route]] | None = scope["state"].get(ROUTES)
        label = path if routes is not None and path in routes else "other"
        started_at = trio.current_time()
        body = BodySeen(receive)
        try:
            if routes is None:  # a door opened before the lifespan started
                raise starting()
            route = find_route(routes, self.preflight, scope["method"], path, door)
            caller = self.access.check(route.access, headers, door)
            await route.handler(scope, body, responder)
            if route.access == "write":
                self.access.record(
                    caller, scope["method"], path, responder.status or 0, responder.audit
                )
        except* RouterError as group:
            await answer_error(responder, first_router_error(group), body.unread(headers))
        except* ClientGone:
            log.info("client went away before its body arrived")
        except* Exception as group:
            await self.internal_error(group, responder)
        finally:
            # The request's outcome, built once, all its metrics, access line and span read.
            outcome = RequestOutcome.of(responder)
            elapsed = trio.current_time() - started_at
            self.metrics.count_request(label, outcome, elapsed)
            if self.config.access_log:
                log_access({
                    "method": scope["method"], "path": path, "status": outcome.status,
                    "ms": round(elapsed * 1000, 1), "bytes": outcome.bytes_sent,
                    **outcome.access_fields(),
                })  # fmt: skip
            if responder.span is not None:
                responder.span.end(outcome)

    async def internal_error(self, group: BaseExceptionGroup, responder: Responder) -> None:
        """A bug or an unforeseen input: logged with its traceback, answered with the envelope."""
        log.error("internal error", exc_info=group)
        self.metrics.internal_errors.inc()
        with trio.CancelScope(shield=True):
            if not responder.started:
                await responder.error(internal_error())
            elif not responder.finished:
                frame = error_frame("internal router error", "internal_error", 500)
                responder.inband_status = 500
                await responder.finish_stream(frame)


def build_router(
    config: RouterConfig,
    *,
    own_sockets: Sequence[socket.socket] = (),
    admin_url: str | None = None,
) -> Router:
    """The router `config` asks for, each part made once, in this order, from the ones above
    it. `own_sockets`: every listening socket this process serves (bound before the router is
    built, so a port 0 is known): a worker URL naming one is the router itself. `admin_url`:
    where the admin listener answers, for the start-up warning (None: no admin listener)."""
    metrics = RouterMetrics(duration_buckets=config.prometheus_duration_buckets)
    panics = metrics.panic_selections
    overload = metrics.overload_decisions
    rejected = metrics.load_reports_rejected
    fleet = Fleet(
        config,
        static=config.membership_file is None,  # with a shared file its workers live there
        on_panic=lambda role: panics.labels(role).inc(),
        on_overload=lambda role, outcome: overload.labels(role, outcome).inc(),
        on_load_rejected=lambda w, reason: rejected.labels(w.id, w.role, reason).inc(),
    )
    rng = random.Random()
    ssl_context = worker_ssl_context(config)
    # The operator's allowed ranges, the listeners the config names and the ones bound.
    refused = metrics.destinations_refused
    destinations = Destinations(
        parse_allow(config.worker_url_allow),
        on_refused=lambda client, kind: refused.labels(client, kind).inc(),
    )
    for host, port in own_listeners(config):
        destinations.add_own(host, port)
    destinations.add_own_sockets(own_sockets)
    idle = config.edges.upstream_pool_idle_timeout_secs  # 0: kept forever
    pool = UpstreamPool(idle or math.inf, ssl_context=ssl_context, destinations=destinations)
    admission = Admission(
        config.max_concurrent_requests,
        config.queue_size,
        config.queue_timeout_secs,
        metrics.admission_waits,
        config.rate_limit_tokens_per_second,
    )
    metrics.attach(fleet, pool, lambda: admission.waiting)
    aborts = AbortService(metrics) if config.abort_on_cancel else None
    access = Access(
        config.control_plane_api_keys,
        config.data_plane_api_keys,
        config.control_plane_audit_enabled,
        router_key=config.api_key,
        admin_url=admin_url,
    )
    drain = Drain(config.shutdown_grace_period_secs)
    cors = (
        CorsPolicy.from_origins(config.cors_allowed_origins)
        if config.cors_enabled  # `trio-pd launch` without --cors-allowed-origins: none
        else CorsPolicy(frozenset())
    )
    return Router(
        config=config,
        metrics=metrics,
        fleet=fleet,
        rng=rng,
        ssl_context=ssl_context,
        destinations=destinations,
        pool=pool,
        admission=admission,
        budget=MemoryBudget(config.max_buffered_bytes),
        aborts=aborts,
        access=access,
        drain=drain,
        guard=ServiceGuard(metrics, on_fatal=drain.fail),
        membership=membership_for(config, fleet, metrics, destinations),
        dispatch=DispatchContext(pool, fleet, config, rng, metrics, aborts),
        router_keys=RouterKeys.of(config),
        request_ids=RequestIds(config.request_id_headers),
        cors=cors,
        preflight=Route(partial(handle_preflight, cors), "open"),
    )


def find_route(
    routes: dict[str, dict[str, Route]], preflight: Route, method: str, path: str, door: Door
) -> Route:
    """The route of `method` `path` through `door`, or the 404/405 saying why there is none."""
    methods = routes.get(path)
    if methods is None and path.startswith("/workers/"):
        methods = routes["/workers/{id}"]
    if methods is not None and door == "admin":
        methods = {m: r for m, r in methods.items() if r.access != "data"}
        if not methods:
            raise RouterError(
                404, f"{path} is served on the data-plane port, not on the admin listener",
                "not_found_error",
            )  # fmt: skip
    if methods is None:
        raise not_found(path)
    if method == "OPTIONS" and door == "data":  # a CORS preflight, on every data route
        return preflight
    route = methods.get(method)
    if route is None:
        allowed = (*methods, "OPTIONS") if door == "data" else tuple(methods)  # preflights
        raise method_not_allowed(method, path, allowed)
    return route


async def answer_error(responder: Responder, error: RouterError, close: bool) -> None:
    """The error a request ended with: noted for its outcome, and its envelope (with
    `Connection: close` when `close`) unless the answer had started."""
    responder.notes.error = error.message
    if not responder.started:
        await responder.error(error, close=close)


def starting() -> RouterError:
    return RouterError(503, "the router is starting; retry", "service_unavailable")


def own_listeners(config: RouterConfig) -> list[tuple[str, int]]:
    """The listening addresses of this router its config names (a port 0 is added when bound):
    the data plane, the metrics listener, and those another process of it serves."""
    found = [(config.host, config.port)] if config.port else []
    if config.prometheus_port:
        found.append((config.prometheus_host, config.prometheus_port))
    found.extend(config.other_listeners)
    return found


class BodySeen:
    """The request's `receive`, noting whether the body was read to its end: a request refused
    before that (a 401, a 403) is answered with `Connection: close`. hypercorn closes such a
    connection anyway once the answer is out, and a client told nothing would send its next
    request on it and see it cut (RFC 9112 §9.6)."""

    __slots__ = ("done", "receive")

    def __init__(self, receive: Receive) -> None:
        self.receive = receive
        self.done = False

    async def __call__(self) -> dict[str, Any]:
        message = await self.receive()
        if not message.get("more_body", False):
            self.done = True
        return message

    def unread(self, headers: list[tuple[bytes, bytes]]) -> bool:
        """Whether the request has a body that was not read to its end."""
        if self.done:
            return False
        for name, value in headers:
            if name == b"transfer-encoding" or (name == b"content-length" and value != b"0"):
                return True
        return False
