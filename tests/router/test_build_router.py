"""`build_router` makes the whole router, and nothing writes into it afterwards (issue 31 item
3): the Router and every context its handlers read are frozen, the lifespan's resources reach
the handlers only through the route table it binds and hands to the requests, and what `serve`
binds (a port 0, the admin listener's address) is known when the router is built."""

from __future__ import annotations

from functools import partial
from typing import Any

import attrs
import httpx2
import pytest
import trio

from tests.conftest import Cluster
from trio_pd.config import RouterConfig
from trio_pd.edge.lifespan import Resources
from trio_pd.edge.router import ROUTES, Router, build_router
from trio_pd.errors import RouterError, first_router_error


def test_the_router_is_frozen() -> None:
    router = build_router(RouterConfig())
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        router.pool = router.pool  # type: ignore[misc]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        router.access.admin_url = "http://127.0.0.1:1"  # type: ignore[misc]


async def test_every_context_a_handler_reads_is_frozen() -> None:
    router = build_router(RouterConfig())
    async with httpx2.AsyncClient() as client:
        resources = Resources(client, parsers=None, tracing=None)  # type: ignore[arg-type]
        table = router.route_table(resources)
    contexts: dict[str, Any] = {}
    for methods in table.values():
        for route in methods.values():
            handler = route.handler
            assert isinstance(handler, partial)
            for bound in handler.args:
                if type(bound).__name__.endswith("Context"):
                    contexts[type(bound).__name__] = bound
    assert set(contexts) == {"ControlContext", "GenerationContext"}  # found what is bound
    for context in contexts.values():
        for field in attrs.fields(type(context)):
            with pytest.raises(attrs.exceptions.FrozenInstanceError):
                setattr(context, field.name, getattr(context, field.name))
    generation = contexts["GenerationContext"]
    assert generation.parsers is None and generation.tracing is None  # the resources given
    assert contexts["ControlContext"].http is client


async def test_what_serve_bound_is_known_when_the_router_is_built(cluster: Cluster) -> None:
    router: Router = cluster.router
    assert router.access.admin_url == str(cluster.admin.base_url).rstrip("/")
    port = int(cluster.url.rsplit(":", 1)[1])  # port 0 was asked: this one was bound
    assert any(own_port == port for _, own_port in router.destinations.own)


async def test_a_request_before_the_lifespan_started_is_a_503() -> None:
    router = build_router(RouterConfig())
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": "/readiness", "headers": [], "state": {}}
    assert ROUTES not in scope["state"]  # no lifespan put its table there
    await router.handle_http(scope, receive, send, "admin")
    assert sent[0]["status"] == 503
    assert b"starting" in sent[1]["body"]


def test_the_first_router_error_of_a_nested_group() -> None:
    first, second = RouterError(400, "first", "x"), RouterError(404, "second", "y")
    group = BaseExceptionGroup("", [ValueError(), ExceptionGroup("", [first]), second])
    assert first_router_error(group) is first
    assert first_router_error(ExceptionGroup("", [second, first])) is second


async def test_the_route_table_reaches_requests_through_the_lifespan_state(
    cluster: Cluster,
) -> None:
    # The lifespan bound the table to its control client: a route reading it answers.
    answer = await cluster.admin.get("/get_loads")
    assert answer.status_code == 200, answer.text
    with trio.fail_after(30):
        assert (await cluster.client.get("/readiness")).status_code == 200
