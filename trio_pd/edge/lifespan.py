"""The router process's lifespan: what starts before the first request and stops after the last.

Startup opens the control plane's client, the body parsers' worker processes and the tracer,
then the services (`services.py`), supervised as a whole by the process's `ServiceGuard`
(crash-only); it is complete once membership has had its first read and the first health round
found a pair (or timed out). Shutdown comes after hypercorn drained the connections: the aborts
of the requests the drain cut are sent (`AbortService.flush`), the services are cancelled, and
every client is closed, shielded; spans are flushed last, when every request span has ended.
"""

from __future__ import annotations

import logging
import ssl
from functools import partial
from typing import TYPE_CHECKING

import attrs
import trio
import trio_parallel

from trio_pd.asgi import Receive, Send
from trio_pd.config import RouterConfig
from trio_pd.control.context import ControlContext
from trio_pd.edge.admission import Admission
from trio_pd.edge.auth import Access, startup_warnings
from trio_pd.edge.generation import GenerationContext
from trio_pd.edge.services import ServiceContext, run_background
from trio_pd.edge.supervision import ServiceGuard
from trio_pd.fleet.registry import Fleet
from trio_pd.membership.setup import Membership
from trio_pd.membership.source import MembershipSource
from trio_pd.observe.metrics import RouterMetrics
from trio_pd.pd.aborts import AbortService
from trio_pd.upstream.client import make_client
from trio_pd.upstream.destinations import Destinations
from trio_pd.upstream.pool import UpstreamPool

if TYPE_CHECKING:
    from trio_pd.edge.tracing import Tracing

log = logging.getLogger(__name__)


@attrs.frozen
class Lifespan:
    """The parts of a router the lifespan starts and stops (the Router wires them)."""

    config: RouterConfig
    access: Access
    metrics: RouterMetrics
    fleet: Fleet
    pool: UpstreamPool
    admission: Admission
    control: ControlContext
    generation: GenerationContext
    guard: ServiceGuard
    aborts: AbortService | None
    membership: Membership
    ssl_context: ssl.SSLContext
    destinations: Destinations
    sources: tuple[MembershipSource, ...]

    async def run(self, receive: Receive, send: Send) -> None:
        message = await receive()
        assert message["type"] == "lifespan.startup"
        self.control.client = make_client(self.ssl_context, self.destinations)
        startup_warnings(self.access)
        self.metrics.attach(self.fleet, self.pool, lambda: self.admission.waiting)
        self.generation.tracing = start_tracing(self.config)
        try:
            async with trio_parallel.open_worker_context() as parsers:
                self.generation.parsers = parsers
                async with trio.open_nursery() as nursery:
                    # Supervised as a whole too: an exception escaping the services' own
                    # nursery restarts them, and repeated ones end the process (crash-only).
                    services = partial(run_background, self.services())
                    await nursery.start(self.guard.supervised, "services", services)
                    await send({"type": "lifespan.startup.complete"})
                    message = await receive()
                    assert message["type"] == "lifespan.shutdown"
                    if self.aborts is not None:  # what the drain cut is freed in its engines
                        await self.aborts.flush()
                    nursery.cancel_scope.cancel(reason="lifespan shutdown")
        finally:
            self.generation.parsers = None
            tracing, self.generation.tracing = self.generation.tracing, None
            with trio.CancelScope(shield=True):
                await self.control.http.aclose()
                await self.pool.aclose()
                await close_membership(self.membership)
                if tracing is not None:  # after the drain: every request span has ended
                    await tracing.shutdown()
        await send({"type": "lifespan.shutdown.complete"})

    def services(self) -> ServiceContext:
        """The narrow context of the services (once the control client is open)."""
        return ServiceContext(
            self.config, self.fleet, self.metrics, self.pool, self.control.http, self.aborts,
            self.sources, self.guard,
        )  # fmt: skip


def start_tracing(config: RouterConfig) -> Tracing | None:
    """This process's tracer (`--enable-trace`), made in the process that serves: with
    `--workers N` each spawned process exports its own spans. OpenTelemetry is imported here
    and only here, so a router without tracing never loads it."""
    if not config.enable_trace:
        return None
    from trio_pd.edge.tracing import Tracing

    return Tracing.start(config.otlp_traces_endpoint)


async def close_membership(membership: Membership) -> None:
    """Close the clients the store and sources hold (etcd's), once their tasks have ended."""
    closers = {id(x): x for x in (membership.store, *membership.sources) if hasattr(x, "aclose")}
    for thing in closers.values():
        try:
            await thing.aclose()
        except Exception:
            log.exception("closing membership %s failed", getattr(thing, "name", thing))
