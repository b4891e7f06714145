"""The narrow context of the control-plane handlers (membership, fan-out, info routes)."""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from typing import TypeAlias

import attrs
import httpx2

from trio_pd.asgi import Receive, Scope
from trio_pd.config import RouterConfig
from trio_pd.fleet.registry import Fleet
from trio_pd.membership.source import MembershipStore
from trio_pd.respond import Responder
from trio_pd.upstream.urls import Network


@attrs.define(eq=False)
class ControlContext:
    """What admin and fan-out handlers read: config, fleet, membership store, the control-plane
    client.

    The client is opened by the app's lifespan (it needs a running trio loop) and closed there.
    """

    config: RouterConfig
    fleet: Fleet
    rng: random.Random
    store: MembershipStore  # where POST/DELETE /workers write
    url_allow: tuple[Network, ...] = ()
    client: httpx2.AsyncClient | None = None
    # The router's listening addresses (data plane and admin listener), set once they are bound:
    # a worker URL naming one of them is the router itself.
    own_addresses: list[tuple[str, int]] = attrs.Factory(list)

    @property
    def http(self) -> httpx2.AsyncClient:
        assert self.client is not None, "the lifespan has not started"
        return self.client


# The control plane's handlers before binding: admin and fan-out routes.
ControlHandler: TypeAlias = Callable[[ControlContext, Scope, Receive, Responder], Awaitable[None]]
