"""Worker URLs: their syntax (command line and admin API alike) and where they may point.

A worker receives users' prompts and, with `--api-key`, the router's key for the workers, so the
admin API refuses URLs that point where a worker cannot be: link-local and cloud-metadata
addresses (169.254.169.254 and friends), unspecified, multicast and broadcast addresses, and the
router's own listening address. `--worker-url-allow CIDR` lets an operator allow a range anyway.
A host name is resolved once, when the worker is added, and every address it gives is checked.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Sequence
from urllib.parse import urlsplit

import trio

from trio_pd.errors import bad_request

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address

REFUSED: tuple[tuple[str, str], ...] = (
    ("169.254.0.0/16", "link-local (cloud metadata lives here)"),
    ("fe80::/10", "link-local"),
    ("fd00:ec2::254/128", "cloud metadata"),
    ("100.100.100.200/32", "cloud metadata"),
    ("0.0.0.0/8", "unspecified"),
    ("::/128", "unspecified"),
    ("224.0.0.0/4", "multicast"),
    ("ff00::/8", "multicast"),
    ("255.255.255.255/32", "broadcast"),
)
_REFUSED = tuple((ipaddress.ip_network(net), why) for net, why in REFUSED)


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


def parse_allow(cidrs: Sequence[str]) -> tuple[Network, ...]:
    return tuple(ipaddress.ip_network(c, strict=False) for c in cidrs)


async def check_destination(
    url: str, allow: Sequence[Network], own: Sequence[tuple[str, int]]
) -> None:
    """400 unless every address `url` points at may be a worker (see the module docstring).

    `own` holds the router's listening addresses (host, port) as clients reached them."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    for address in await resolve(host, port):
        if any(address in net for net in allow):
            continue
        for net, why in _REFUSED:
            if address in net:
                raise bad_request(
                    f"url {url!r} points at {address}, a {why} address; an operator can allow "
                    "it with --worker-url-allow"
                )
        if is_own(address, port, own):
            raise bad_request(f"url {url!r} points at this router itself")


def is_own(address: Address, port: int, own: Sequence[tuple[str, int]]) -> bool:
    for own_host, own_port in own:
        if port != own_port:
            continue
        try:
            own_address = ipaddress.ip_address(own_host)
        except ValueError:
            continue
        if address == own_address or address.is_loopback or own_address.is_unspecified:
            return True
    return False


async def resolve(host: str, port: int) -> list[Address]:
    try:
        return [ipaddress.ip_address(host)]
    except ValueError:
        pass
    try:
        infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise bad_request(f"worker host {host!r} does not resolve: {exc}") from None
    return [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]
