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
from trio_pd.fleet.worker import Worker
from trio_pd.membership.source import MembershipStore
from trio_pd.respond import Responder
from trio_pd.upstream.destinations import Destinations
from trio_pd.upstream.headers import RouterKeys, generation_key, worker_authorization


@attrs.frozen(eq=False)
class ControlContext:
    """What admin and fan-out handlers read: config, fleet, membership store, the control-plane
    client.

    Made by the router's lifespan once it opened the client (it needs a running trio loop;
    `edge/lifespan.py`), which closes it after the last request.
    """

    config: RouterConfig
    fleet: Fleet
    rng: random.Random
    store: MembershipStore  # where POST/DELETE /workers write
    destinations: Destinations
    http: httpx2.AsyncClient
    router_keys: RouterKeys = attrs.field(init=False)  # never forwarded to a worker

    @router_keys.default
    def _router_keys(self) -> RouterKeys:
        return RouterKeys.of(self.config)

    def authorization(self, worker: Worker) -> list[tuple[bytes, bytes]]:
        """The authorization a call to `worker` carries (its key, else `--api-key`)."""
        return worker_authorization(generation_key(worker.spec, self.config.api_key), None)


# The control plane's handlers before binding: admin and fan-out routes.
ControlHandler: TypeAlias = Callable[[ControlContext, Scope, Receive, Responder], Awaitable[None]]
