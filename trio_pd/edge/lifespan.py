"""The router process's lifespan resources: what is opened before the first request and closed
after the last, handed to the handlers as one value.

The control plane's client, the body parsers' worker processes and the tracer need a running
trio loop (or a process of their own), so they cannot be made with the router
(`router.build_router`); `open_resources` opens them at lifespan startup and yields them as a
frozen `Resources`, from which the router binds its route table (`Router.lifespan`). Nothing is
written into the router: the table goes to the requests through the ASGI lifespan state. At
shutdown, after the router has closed its pool and membership, the client is closed and the
spans are flushed, last, when every request span has ended.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import attrs
import httpx2
import trio
import trio_parallel

from trio_pd.config import RouterConfig
from trio_pd.membership.setup import Membership
from trio_pd.upstream.client import make_client
from trio_pd.upstream.destinations import Destinations

if TYPE_CHECKING:
    from trio_pd.edge.tracing import Tracing

log = logging.getLogger(__name__)


@attrs.frozen
class Resources:
    """What the lifespan opened for one process's handlers and services."""

    client: httpx2.AsyncClient  # the control plane's: fan-out, probes of workers, load polls
    parsers: trio_parallel.WorkerContext  # large bodies' JSON work, off the event loop
    tracing: Tracing | None  # --enable-trace


@asynccontextmanager
async def open_resources(
    config: RouterConfig, ssl_context: ssl.SSLContext, destinations: Destinations
) -> AsyncIterator[Resources]:
    """The resources, open for the body; closed after it, shielded."""
    tracing = start_tracing(config)  # first: without OpenTelemetry it stops the start here
    client = make_client(ssl_context, destinations)
    try:
        async with trio_parallel.open_worker_context() as parsers:
            yield Resources(client, parsers, tracing)
    finally:
        with trio.CancelScope(shield=True):
            await client.aclose()
            if tracing is not None:  # after the drain: every request span has ended
                await tracing.shutdown()


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
