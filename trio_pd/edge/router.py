"""The router's ASGI callable, and the wiring of its parts: route table, request id, error envelope.

A bare ASGI app, no framework: hypercorn calls ``Router.__call__`` for every request and once for
the lifespan (`lifespan.py`), whose nursery holds every long-lived service (`services.py`).
Whatever happens inside a handler, the client gets the docs/protocol.md §7 envelope with its
`x-request-id` (or, once a stream has started, an error event): never hypercorn's empty 500.
"""

from __future__ import annotations

import logging
import math
import random
import ssl
from functools import partial
from typing import TYPE_CHECKING, Any

import attrs
import trio

from trio_pd.asgi import ClientGone, Receive, Scope, Send
from trio_pd.config import RouterConfig
from trio_pd.control.context import ControlContext
from trio_pd.edge.admission import Admission
from trio_pd.edge.auth import Access, Door
from trio_pd.edge.cors import CorsPolicy, handle_preflight
from trio_pd.edge.drain import Drain
from trio_pd.edge.generation import GenerationContext, owned_keys
from trio_pd.edge.intake import BODY_COPIES
from trio_pd.edge.lifespan import Lifespan
from trio_pd.edge.request_ids import RequestIds
from trio_pd.edge.routes import Route, route_table
from trio_pd.edge.routing_key import RoutingKeys
from trio_pd.edge.supervision import ServiceGuard
from trio_pd.errors import RouterError, internal_error, method_not_allowed, not_found
from trio_pd.fleet.registry import Fleet
from trio_pd.membership.setup import Membership, membership_for
from trio_pd.membership.source import MembershipSource, MembershipStore
from trio_pd.observe.logs import current_request_id, log_access
from trio_pd.observe.metrics import RouterMetrics
from trio_pd.pd.aborts import AbortService
from trio_pd.pd.budget import MemoryBudget
from trio_pd.pd.dispatch import DispatchContext
from trio_pd.pd.frames import error_frame
from trio_pd.respond import Responder, deny_websocket, final_status
from trio_pd.upstream.destinations import Destinations, parse_allow
from trio_pd.upstream.headers import RouterKeys
from trio_pd.upstream.pool import UpstreamPool
from trio_pd.upstream.tls import worker_ssl_context

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)


@attrs.define(eq=False)
class Router:
    """One router: its config, fleet and (from lifespan startup on) its upstream clients.

    State lives here, not in module globals, so a test can run two routers in one process.
    """

    config: RouterConfig
    metrics: RouterMetrics = attrs.field()
    fleet: Fleet = attrs.field()
    rng: random.Random = attrs.field(factory=random.Random)
    ssl_context: ssl.SSLContext = attrs.field()
    destinations: Destinations = attrs.field()  # where a worker connection may go
    pool: UpstreamPool = attrs.field()  # the data plane's two legs
    admission: Admission = attrs.field()
    budget: MemoryBudget = attrs.field()  # --max-buffered-bytes
    aborts: AbortService | None = attrs.field()
    access: Access = attrs.field()
    drain: Drain = attrs.field()
    guard: ServiceGuard = attrs.field()  # crash-only supervision of the lifespan's services
    membership: Membership = attrs.field()  # the admin API's store and the sources
    control: ControlContext = attrs.field()
    generation: GenerationContext = attrs.field()
    routes: dict[str, dict[str, Route]] = attrs.field()
    request_ids: RequestIds = attrs.field()
    cors: CorsPolicy = attrs.field()
    preflight: Route = attrs.field()

    @metrics.default
    def _default_metrics(self) -> RouterMetrics:
        return RouterMetrics(duration_buckets=self.config.prometheus_duration_buckets)

    @fleet.default
    def _default_fleet(self) -> Fleet:
        # With a shared membership file the command line's workers live in the file.
        panics = self.metrics.panic_selections
        overload = self.metrics.overload_decisions
        rejected = self.metrics.load_reports_rejected
        return Fleet(
            self.config,
            static=self.config.membership_file is None,
            on_panic=lambda role: panics.labels(role).inc(),
            on_overload=lambda role, outcome: overload.labels(role, outcome).inc(),
            on_load_rejected=lambda w, reason: rejected.labels(w.id, w.role, reason).inc(),
        )

    @ssl_context.default
    def _default_ssl_context(self) -> ssl.SSLContext:
        return worker_ssl_context(self.config)

    @destinations.default
    def _default_destinations(self) -> Destinations:
        """The operator's allowed ranges and the listeners the config names; `serve` adds
        the sockets it binds (port 0 included), and every other listener adds its own."""
        refused = self.metrics.destinations_refused
        destinations = Destinations(
            parse_allow(self.config.worker_url_allow),
            on_refused=lambda client, kind: refused.labels(client, kind).inc(),
        )
        for host, port in own_listeners(self.config):
            destinations.add_own(host, port)
        return destinations

    @pool.default
    def _default_pool(self) -> UpstreamPool:
        idle = self.config.edges.upstream_pool_idle_timeout_secs  # 0: kept forever
        return UpstreamPool(
            idle or math.inf, ssl_context=self.ssl_context, destinations=self.destinations
        )

    @admission.default
    def _default_admission(self) -> Admission:
        c = self.config
        return Admission(
            c.max_concurrent_requests,
            c.queue_size,
            c.queue_timeout_secs,
            self.metrics.admission_waits,
            c.rate_limit_tokens_per_second,
        )

    @budget.default
    def _default_budget(self) -> MemoryBudget:
        return MemoryBudget(self.config.max_buffered_bytes)

    @aborts.default
    def _default_aborts(self) -> AbortService | None:
        return AbortService(self.metrics) if self.config.abort_on_cancel else None

    @access.default
    def _default_access(self) -> Access:
        c = self.config
        return Access(
            c.control_plane_api_keys,
            c.data_plane_api_keys,
            c.control_plane_audit_enabled,
            router_key=c.api_key,
        )

    @drain.default
    def _default_drain(self) -> Drain:
        return Drain(self.config.shutdown_grace_period_secs)

    @guard.default
    def _default_guard(self) -> ServiceGuard:
        return ServiceGuard(self.metrics, on_fatal=self.drain.fail)

    @membership.default
    def _default_membership(self) -> Membership:
        return membership_for(self.config, self.fleet, self.metrics, self.destinations)

    @control.default
    def _default_control(self) -> ControlContext:
        return ControlContext(self.config, self.fleet, self.rng, self.store, self.destinations)

    @generation.default
    def _default_generation(self) -> GenerationContext:
        dispatch_context = DispatchContext(
            self.pool, self.fleet, self.config, self.rng, self.metrics, self.aborts
        )
        owned = owned_keys(self.config)
        return GenerationContext(
            self.config,
            self.admission,
            self.drain,
            dispatch_context,
            owned,
            RoutingKeys.of(self.config.policy),
            client_key_is_ours=bool(self.access.client_keys),
            router_keys=RouterKeys.of(self.config),
            budget=self.budget,
            body_copies=BODY_COPIES + 1 if self.config.dp_aware else BODY_COPIES,
        )

    @routes.default
    def _default_routes(self) -> dict[str, dict[str, Route]]:
        return route_table(
            self.control, self.generation, self.fleet, self.drain, self.metrics, self.guard
        )

    @request_ids.default
    def _default_request_ids(self) -> RequestIds:
        return RequestIds(self.config.request_id_headers)

    @cors.default
    def _default_cors(self) -> CorsPolicy:
        if not self.config.cors_enabled:  # `trio-pd launch` without --cors-allowed-origins
            return CorsPolicy(frozenset())
        return CorsPolicy.from_origins(self.config.cors_allowed_origins)

    @preflight.default
    def _default_preflight(self) -> Route:
        return Route(partial(handle_preflight, self.cors), "open")

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
            await self.lifespan(receive, send)
        elif scope["type"] == "websocket":
            await deny_websocket(send)

    # -- lifespan ---------------------------------------------------------------------------

    async def lifespan(self, receive: Receive, send: Send) -> None:
        await Lifespan(
            self.config, self.access, self.metrics, self.fleet, self.pool, self.admission,
            self.control, self.generation, self.guard, self.aborts, self.membership,
            self.ssl_context, self.destinations, self.sources,
        ).run(receive, send)  # fmt: skip

    # -- http -------------------------------------------------------------------------------

    async def handle_http(
        self, scope: Scope, receive: Receive, send: Send, door: Door = "data"
    ) -> None:
        """One request through `door`: the data-plane port, or the admin listener
        (`serve/admin_listener.py`), which serves the control plane, probes and metrics."""
        headers = scope["headers"]
        path = scope["path"]
        request_id = self.request_ids.incoming(headers)
        if request_id is not None and self.generation.router_keys.carried_by(request_id):
            request_id = None  # a key of the router's would go to the workers and the logs
        request_id = request_id or self.request_ids.new(path)
        current_request_id.set(request_id.decode("latin-1"))
        # The request id is echoed as its exact bytes; the CORS headers go on every answer of
        # the data plane (the admin listener answers no browser: `auth.py`).
        cors = self.cors.response_headers(headers) if door == "data" else ()
        responder = Responder(send, request_id, cors)
        label = path if path in self.routes else "other"
        started_at = trio.current_time()
        body = BodySeen(receive)
        try:
            route = self.route(scope["method"], path, door)
            caller = self.access.check(route.access, headers, door)
            await route.handler(scope, body, responder)
            if route.access == "write":
                self.access.record(
                    caller, scope["method"], path, responder.status or 0, responder.audit
                )
        except* RouterError as group:
            if not responder.started:
                await responder.error(first_leaf(group), close=body.unread(headers))
        except* ClientGone:
            log.info("client went away before its body arrived")
        except* Exception as group:
            await self.internal_error(group, responder)
        finally:
            status = final_status(responder)
            elapsed = trio.current_time() - started_at
            self.metrics.count_request(label, status, elapsed)
            model = responder.route_info.get("model")
            if model not in (None, "-"):
                self.metrics.model_requests.labels(model, str(status)).inc()
            if self.config.access_log:
                log_access({
                    "method": scope["method"], "path": path, "status": status,
                    "ms": round(elapsed * 1000, 1), "bytes": responder.bytes_sent,
                    **responder.route_info,
                })  # fmt: skip

    async def internal_error(self, group: BaseExceptionGroup, responder: Responder) -> None:
        """A bug or an unforeseen input: logged with its traceback, answered with the envelope."""
        log.error("internal error", exc_info=group)
        self.metrics.internal_errors.inc()
        with trio.CancelScope(shield=True):
            if not responder.started:
                await responder.error(internal_error())
            elif not responder.finished:
                frame = error_frame("internal router error", "internal_error", 500)
                await responder.finish_stream(frame)

    def route(self, method: str, path: str, door: Door = "data") -> Route:
        methods = self.routes.get(path)
        if methods is None and path.startswith("/workers/"):
            methods = self.routes["/workers/{id}"]
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
            return self.preflight
        route = methods.get(method)
        if route is None:
            allowed = (*methods, "OPTIONS") if door == "data" else tuple(methods)  # preflights
            raise method_not_allowed(method, path, allowed)
        return route


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


def first_leaf(group: BaseExceptionGroup) -> RouterError:
    """The first RouterError in a (possibly nested) group `except*` caught."""
    error = group.exceptions[0]
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    assert isinstance(error, RouterError)
    return error
