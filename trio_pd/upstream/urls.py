"""Worker URLs: their syntax (command line and admin API alike) and where they may point.

Where a worker may point is `destinations.py`'s rule; the admin API applies it when a worker is
added (every address its host resolves to, so the operator gets a 400 saying why), and both
upstream clients apply it again at every connect (so a name that resolves elsewhere later is
still refused).
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Sequence
from urllib.parse import urlsplit

import trio

from trio_pd.errors import bad_request
from trio_pd.upstream.destinations import Address, Destinations, parse_address


def check_syntax(url: object) -> str:
    """`url` if it is an http(s) URL with a host and nothing a worker URL cannot carry, else a
    ValueError saying why (the command line and the admin API turn it into their own error)."""
    if not isinstance(url, str) or not url:
        raise ValueError("url is required: the worker's base URL, e.g. http://10.0.0.5:30000")
    if any(c.isspace() for c in url):
        raise ValueError(f"url must not contain whitespace: {url!r}")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError as exc:
        raise ValueError(f"url {url!r} is not a valid URL: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"url must start with http:// or https://: {url!r}")
    if not parts.hostname:
        raise ValueError(f"url has no host: {url!r}")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError(f"url must not carry a query, fragment or credentials: {url!r}")
    if "[" in parts.netloc:
        try:
            ipaddress.IPv6Address(parts.hostname)
        except ValueError:
            raise ValueError(f"url has an invalid IPv6 host: {url!r}") from None
    return url


async def check_destination(
    url: str, destinations: Destinations, extra_own: Sequence[tuple[str, int]] = ()
) -> None:
    """400 unless every address `url` points at may be a worker (`destinations.py`).

    `extra_own`: more of the router's addresses (the one the admin request came in on)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    refused = destinations.refuse_name(host)
    if refused is not None:
        raise bad_request(f"url {url!r} names {refused}; it cannot be a worker")
    for address in await resolve(host, port):
        refused = destinations.refusal(address, port, extra_own)
        if refused is None:
            continue
        if refused.kind == "router_itself":
            raise bad_request(f"url {url!r} points at this router itself ({refused})")
        raise bad_request(
            f"url {url!r} points at {refused}; an operator can allow it with --worker-url-allow"
        )


def refuse_listed(url: str, destinations: Destinations) -> None:
    """A ValueError when `url` names a host no worker may have: a refused name, or an address
    literal the rule refuses (`destinations.py`). No lookup: a membership file is read on the
    event loop, and a name is resolved and checked at every connect anyway."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    refused = destinations.refuse_name(host)
    if refused is None:
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return
        refused = destinations.refusal(address, port)
    if refused is not None:
        raise ValueError(f"url {url!r} points at {refused}; it cannot be a worker")


async def resolve(host: str, port: int) -> list[Address]:
    try:
        return [ipaddress.ip_address(host)]
    except ValueError:
        pass
    try:
        infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise bad_request(f"worker host {host!r} does not resolve: {exc}") from None
    return [parse_address(info[4][0]) for info in infos]
