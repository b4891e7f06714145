"""The control plane's HTTP client (httpx2): health probes, fan-out, admin checks.

Off the hot path on purpose: the legs use `pool.py`'s httptools client. One per router process,
opened by the lifespan; no redirects, no proxies from the environment, HTTP/1.1 only.

Every connection it opens goes through `CheckedBackend`, httpcore2's network backend with the
router's destination rule (`destinations.py`) in front of the connect: the host is resolved and
checked there and the socket connected to the checked address itself, so DNS rebinding cannot
pass between the admin API's check and a probe. TLS still verifies the worker's name (httpcore2
takes the server name from the URL, not from the address connected to).
"""

from __future__ import annotations

import ssl
from collections.abc import Iterable
from typing import Any

import httpcore2
import httpx2
import trio

from trio_pd.upstream.destinations import DestinationRefused, Destinations
from trio_pd.upstream.pool import CONNECT_TIMEOUT_SECS, KEEPALIVE_EXPIRY_SECS


class CheckedBackend(httpcore2.AsyncNetworkBackend):
    """httpcore2's trio backend, connecting only where `destinations` allows."""

    def __init__(self, destinations: Destinations) -> None:
        self.destinations = destinations
        self._trio = httpcore2.TrioBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore2's interface
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore2.AsyncNetworkStream:
        deadline = trio.current_time() + (timeout if timeout is not None else float("inf"))
        try:
            with trio.fail_at(deadline):
                addresses = await self.destinations.resolve(host, port, "control")
        except DestinationRefused as exc:
            raise httpcore2.ConnectError(str(exc)) from exc
        except trio.TooSlowError:
            raise httpcore2.ConnectTimeout(f"resolving {host} timed out") from None
        except OSError as exc:
            raise httpcore2.ConnectError(f"cannot resolve {host}: {exc}") from exc
        failure: httpcore2.ConnectError | None = None
        for address in addresses:
            left = max(0.0, deadline - trio.current_time())
            try:
                stream = await self._trio.connect_tcp(
                    address, port, left, local_address, socket_options
                )
            except httpcore2.ConnectError as exc:
                failure = exc
                continue
            try:
                self.destinations.check_connected(stream.get_extra_info("socket"), "control")
            except DestinationRefused as exc:
                await stream.aclose()
                raise httpcore2.ConnectError(str(exc)) from exc
            return stream
        assert failure is not None  # `resolve` gives at least one address
        raise failure

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore2's interface
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore2.AsyncNetworkStream:
        raise httpcore2.ConnectError("the control plane's client connects over TCP only")

    async def sleep(self, seconds: float) -> None:
        await trio.sleep(seconds)


class CheckedTransport(httpx2.AsyncHTTPTransport):
    """httpx2's transport over a connection pool whose backend is `CheckedBackend`.

    httpx2's transport takes no network backend, so its pool is made again here with one (its
    `_pool` is what it sends every request through; tests/router/test_destinations.py shows
    the check is in the path of probes and fan-out alike)."""

    def __init__(self, destinations: Destinations, ssl_context: ssl.SSLContext) -> None:
        super().__init__(verify=ssl_context, http1=True, http2=False, trust_env=False)
        self._pool = httpcore2.AsyncConnectionPool(
            ssl_context=ssl_context,
            max_connections=None,
            keepalive_expiry=KEEPALIVE_EXPIRY_SECS,
            http1=True,
            http2=False,
            network_backend=CheckedBackend(destinations),
        )


def make_client(
    ssl_context: ssl.SSLContext | None = None, destinations: Destinations | None = None
) -> httpx2.AsyncClient:
    """The httpx2 client of the control plane (health probes, fan-out, admin), off the hot path.

    With `destinations` every connect is checked (`CheckedBackend`)."""
    options: dict[str, Any] = {}
    if destinations is not None:
        context = ssl_context if ssl_context is not None else ssl.create_default_context()
        options["transport"] = CheckedTransport(destinations, context)
    return httpx2.AsyncClient(
        verify=ssl_context if ssl_context is not None else True,
        http1=True,
        http2=False,
        trust_env=False,
        follow_redirects=False,
        limits=httpx2.Limits(max_connections=None, keepalive_expiry=KEEPALIVE_EXPIRY_SECS),
        timeout=httpx2.Timeout(None, connect=CONNECT_TIMEOUT_SECS),
        headers={"user-agent": "trio-pd"},
        **options,
    )
