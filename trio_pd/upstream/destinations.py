"""Where a connection to a worker may go: one rule for the admin API and for every connect.

A worker receives users' prompts and, with `--api-key`, the router's key for the workers, so no
connection to a "worker" may reach what cannot be one: a cloud metadata service (credentials),
link-local, unspecified, multicast or broadcast addresses, or the router itself (a request would
loop through it). The rule is checked twice:

- when a worker is added through the admin API (`urls.check_destination`), on every address its
  host resolves to, so the operator gets a 400 saying why;
- at every connect, on both upstream clients (the legs' `connect.connect`, the control plane's
  httpx2 transport in `client.py`): the host is resolved here, every address checked, and the
  connection made to the checked address itself (never re-resolved), so a name that answered a
  safe address when the worker was added and a metadata address later (DNS rebinding) is still
  refused. After the connect the socket's own addresses are compared too: a worker URL naming
  one of this host's interfaces on a port the router listens on with a wildcard bind (0.0.0.0)
  is the router itself, which no list could have known in advance.

Addresses are normalised first: an IPv4 address embedded in IPv6 (IPv4-mapped `::ffff:a.b.c.d`,
IPv4-compatible `::a.b.c.d`, NAT64 `64:ff9b::/96` and `64:ff9b:1::/48`, 6to4 `2002::/16`,
Teredo's server and client) is checked as well as the IPv6 address, since the packets may end
at the IPv4 one. `--worker-url-allow CIDR` lets an operator allow a range anyway; nothing allows
the router's own listening addresses.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Callable, Iterable, Sequence

import attrs
import trio

log = logging.getLogger(__name__)

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address

# (range, kind, why). The kind labels the refusal metric; the why goes into the message.
REFUSED: tuple[tuple[str, str, str], ...] = (
    # 169.254.169.254 is the metadata service of AWS (IMDS), GCP (metadata.google.internal),
    # Azure (IMDS), Oracle Cloud (IMDS), DigitalOcean, Hetzner, OpenStack and others; AWS ECS
    # serves task credentials on 169.254.170.2 and EKS Pod Identity on 169.254.170.23;
    # Tencent Cloud's metadata is 169.254.0.23: the whole link-local range goes.
    ("169.254.0.0/16", "link_local", "link-local (cloud metadata services live here)"),
    ("fe80::/10", "link_local", "link-local"),
    # AWS IMDS over IPv6 (AWS EC2 user guide, "Instance metadata service endpoints") and the
    # EKS Pod Identity agent's IPv6 address (EKS user guide, "Pod Identity agent").
    ("fd00:ec2::254/128", "cloud_metadata", "AWS instance metadata"),
    ("fd00:ec2::23/128", "cloud_metadata", "AWS EKS Pod Identity"),
    # GCP's metadata server for IPv6-only instances (Compute Engine, "About VM metadata").
    ("fd20:ce::254/128", "cloud_metadata", "GCP metadata"),
    # Alibaba Cloud ECS instance metadata (ECS docs, "Instance metadata").
    ("100.100.100.200/32", "cloud_metadata", "Alibaba Cloud metadata"),
    # Oracle Cloud Infrastructure Classic's instance metadata address.
    ("192.0.0.192/32", "cloud_metadata", "Oracle Cloud metadata"),
    # Azure's WireServer / host agent virtual IP, which hands out certificates and extension
    # settings (Azure docs, "What is IP address 168.63.129.16?").
    ("168.63.129.16/32", "cloud_metadata", "Azure WireServer"),
    # "This network": a connect to 0.0.0.0 reaches the local host (Linux), any port of it.
    ("0.0.0.0/8", "unspecified", "unspecified"),
    ("::/128", "unspecified", "unspecified"),
    ("224.0.0.0/4", "multicast", "multicast"),
    ("ff00::/8", "multicast", "multicast"),
    ("255.255.255.255/32", "broadcast", "broadcast"),  # before 240/4, which holds it
    ("240.0.0.0/4", "reserved", "reserved (240/4)"),
)
_REFUSED = tuple((ipaddress.ip_network(net), kind, why) for net, kind, why in REFUSED)

# Names of metadata services, refused before any lookup (they resolve to the addresses above on
# their clouds, and nowhere else should a worker be called so).
REFUSED_NAMES = frozenset(
    (
        "metadata.google.internal",  # GCP (Compute Engine, "About VM metadata")
        "metadata.goog",  # GCP
        "metadata",  # GCP's short name inside a VM
        "instance-data",  # AWS EC2, resolved by the Amazon-provided DNS
        "instance-data.ec2.internal",  # AWS EC2
        "metadata.tencentyun.com",  # Tencent Cloud CVM
    )
)

# NAT64: the well-known prefix (RFC 6052) and the local-use one (RFC 8215).
_NAT64_WKP = ipaddress.ip_network("64:ff9b::/96")
_NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")
_IPV4_COMPATIBLE = ipaddress.ip_network("::/96")


class DestinationRefused(Exception):
    """A connection to a worker would reach what cannot be a worker; `kind` says what."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def parse_allow(cidrs: Sequence[str]) -> tuple[Network, ...]:
    return tuple(ipaddress.ip_network(c, strict=False) for c in cidrs)


def parse_address(text: str | int) -> Address:
    """An address from a socket or getaddrinfo (an IPv6 scope id is dropped; typeshed types a
    sockaddr's host as `str | int`, getaddrinfo gives a string)."""
    return ipaddress.ip_address(str(text).split("%", 1)[0])


def embedded_ipv4(address: Address) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 address carries (see the module docstring), else none."""
    if isinstance(address, ipaddress.IPv4Address):
        return []
    if address.ipv4_mapped is not None:
        return [address.ipv4_mapped]
    if address in _NAT64_WKP:
        return [ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)]
    if address in _NAT64_LOCAL:  # a /48 prefix: bits 48-63 and 72-87 (RFC 6052 section 2.2)
        packed = address.packed
        return [ipaddress.IPv4Address(packed[6:8] + packed[9:11])]
    if address.sixtofour is not None:
        return [address.sixtofour]
    if address.teredo is not None:
        return list(address.teredo)
    if address in _IPV4_COMPATIBLE and int(address) > 1:  # not :: or ::1
        return [ipaddress.IPv4Address(int(address))]
    return []


def normalised(address: Address) -> list[Address]:
    """The address and every IPv4 address embedded in it: the forms the rule is checked on."""
    return [address, *embedded_ipv4(address)]


@attrs.define(eq=False)
class Destinations:
    """The rule for one router: the operator's allowed ranges and the router's own listening
    addresses (every listener: data plane, metrics, admin). Listeners are added as they are
    bound (`add_own`), since a port 0 is only known then.

    `on_refused(client, kind)` counts refusals (the router's metric); `client` is "legs" or
    "control".
    """

    allow: tuple[Network, ...] = ()
    on_refused: Callable[[str, str], None] | None = None
    _own: set[tuple[Address, int]] = attrs.field(factory=set, init=False)
    _warned: set[tuple[str, int, str]] = attrs.field(factory=set, init=False)

    def add_own(self, host: str, port: int) -> None:
        """A listening address of this router (host as bound: a wildcard means every local
        address). A host that is not an address literal is ignored (hypercorn binds literals)."""
        try:
            address = parse_address(host.strip("[]"))
        except ValueError:
            return
        for form in normalised(address):
            self._own.add((form, port))

    def add_own_sockets(self, sockets: Iterable[socket.socket]) -> None:
        for sock in sockets:
            name = sock.getsockname()
            if isinstance(name, tuple):
                self.add_own(name[0], name[1])

    @property
    def own(self) -> frozenset[tuple[Address, int]]:
        return frozenset(self._own)

    # -- the rule ---------------------------------------------------------------------------

    def refusal(
        self, address: Address, port: int, extra_own: Sequence[tuple[str, int]] = ()
    ) -> DestinationRefused | None:
        """Why a connection to `address`:`port` may not be made, or None. `extra_own`: more
        addresses of this router (the one an admin request came in on)."""
        forms = normalised(address)
        if self._is_own(forms, port, extra_own):
            return DestinationRefused(
                "router_itself", f"{address} port {port} is this router's own listener"
            )
        for form in forms:
            if any(form in net for net in self.allow):
                continue
            for net, kind, why in _REFUSED:
                if form in net:
                    shown = f"{address}" if form == address else f"{address} (that is {form})"
                    return DestinationRefused(kind, f"{shown} is a {why} address")
        return None

    def _is_own(
        self, forms: list[Address], port: int, extra_own: Sequence[tuple[str, int]]
    ) -> bool:
        own = set(self._own)
        for host, own_port in extra_own:
            try:
                own.update((f, own_port) for f in normalised(parse_address(host.strip("[]"))))
            except ValueError:
                continue
        for own_address, own_port in own:
            if own_port != port:
                continue
            for form in forms:
                # A loopback or unspecified destination on a port the router listens on is the
                # router (or would compete with it for the port): refused.
                if form == own_address or form.is_loopback or form.is_unspecified:
                    return True
        return False

    def refuse_name(self, host: str) -> DestinationRefused | None:
        name = host.lower().rstrip(".")
        if name in REFUSED_NAMES:
            return DestinationRefused("cloud_metadata", f"{host} is a cloud metadata service")
        return None

    # -- at connect time --------------------------------------------------------------------

    async def resolve(self, host: str, port: int, client: str) -> list[str]:
        """The addresses to connect to for `host`, every one checked: the connection is then
        made to these literals, so no later lookup can answer something else. Raises
        DestinationRefused when the name or any address it gives is refused (counted and
        logged), OSError when it does not resolve."""
        refused = self.refuse_name(host)
        if refused is None:
            try:
                addresses = [parse_address(host.strip("[]"))]
            except ValueError:
                infos = await trio.socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
                addresses = [parse_address(info[4][0]) for info in infos]
            for address in addresses:
                refused = self.refusal(address, port)
                if refused is not None:
                    break
        if refused is not None:
            raise self._refused(client, host, port, refused)
        return list(dict.fromkeys(str(a) for a in addresses))

    def check_connected(self, sock: socket.socket | trio.socket.SocketType, client: str) -> None:
        """After the connect: a peer that is one of this host's own addresses (the socket's
        local address) on a port the router listens on with a wildcard bind is the router."""
        try:
            local = parse_address(sock.getsockname()[0])
            peer_host, peer_port = sock.getpeername()[:2]
            peer = parse_address(peer_host)
        except (OSError, ValueError):
            return
        if not set(normalised(local)) & set(normalised(peer)):
            return
        for own_address, own_port in self._own:
            if own_port == peer_port and own_address.is_unspecified:
                refused = DestinationRefused(
                    "router_itself", f"{peer} port {peer_port} is this router's own listener"
                )
                raise self._refused(client, peer_host, peer_port, refused)

    def _refused(
        self, client: str, host: str, port: int, refused: DestinationRefused
    ) -> DestinationRefused:
        if self.on_refused is not None:
            self.on_refused(client, refused.kind)
        key = (host, port, refused.kind)
        if key not in self._warned:  # once per destination, not at every probe
            if len(self._warned) > 1024:
                self._warned.clear()
            self._warned.add(key)
            hint = "" if refused.kind == "router_itself" else " (--worker-url-allow can allow it)"
            log.warning("refused to connect to worker host %s port %s: %s%s", host, port,
                        refused, hint)  # fmt: skip
        return DestinationRefused(
            refused.kind, f"refused to connect to {host} port {port}: {refused}"
        )
