"""Where a worker connection may go (issue 19 item 7): the admin API refuses URLs that cannot be
a worker, in every spelling an address has, and both upstream clients check the address they
actually connect to, so DNS rebinding after the add-time check cannot pass.

Host names are answered by a resolver the test controls (trio's custom hostname resolver, which
every lookup of the router goes through), so no test looks a name up in real DNS. No connection
may leave the loopback range: refused addresses are refused before any connect and the accepted
ones are loopback ports, and a safety net (`loopback_only`) makes sure of it even when the
router's check is broken (as on the commit before it): any other connect fails at once, and is
recorded for the test to fail on.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import socket
from collections.abc import Callable
from typing import Any

import pytest
import trio

from tests.conftest import Cluster, start_cluster, start_engine
from tests.router.fleet_tools import FAST_HEALTH
from tests.router.helpers import generate_body, settle
from trio_pd.upstream.destinations import DestinationRefused, Destinations
from trio_pd_testing.ports import free_port


class Names:
    """A hostname resolver the test controls: a name answers what `answers[name]()` says;
    any other name (localhost) goes to the system resolver (/etc/hosts, no DNS)."""

    def __init__(self, guard: LoopbackOnly) -> None:
        self.answers: dict[str, Callable[[], list[str]]] = {}
        self.asked: list[str] = []
        self.guard = guard

    def set(self, name: str, *addresses: str) -> None:
        self.answers[name] = lambda: list(addresses)

    async def getaddrinfo(
        self, host: bytes | str | None, port: Any, family: int = 0, type: int = 0,
        proto: int = 0, flags: int = 0,
    ) -> list[Any]:  # fmt: skip
        name = host.decode() if isinstance(host, bytes) else host
        if name not in self.answers:
            return await trio.to_thread.run_sync(
                socket.getaddrinfo, host, port, family, type, proto, flags
            )
        self.asked.append(name)
        port = int(port) if port is not None else 0
        found = []
        for address in self.answers[name]():
            if ":" in address:
                found.append((socket.AF_INET6, socket.SOCK_STREAM, 6, "", (address, port, 0, 0)))
            else:
                found.append((socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, port)))
        return found

    async def getnameinfo(self, sockaddr: Any, flags: int) -> tuple[str, str]:
        raise OSError("no reverse lookups here")


class LoopbackOnly:
    """trio's socket connect, refusing (and recording) any destination off the loopback."""

    def __init__(self, connect: Callable[..., Any]) -> None:
        self.connect = connect
        self.blocked: list[Any] = []

    async def __call__(self, sock: Any, address: Any) -> None:
        host = ipaddress.ip_address(address[0].split("%")[0])
        local = getattr(host, "ipv4_mapped", None) or host
        if not (local.is_loopback or local.is_unspecified):  # 0.0.0.0 is this machine
            self.blocked.append(address)
            raise OSError(errno.ENETUNREACH, "the test lets nothing leave the loopback")
        await self.connect(sock, address)


@pytest.fixture
async def loopback_only(monkeypatch: pytest.MonkeyPatch) -> LoopbackOnly:
    probe = trio.socket.socket()
    connect_type = type(probe)  # trio's concrete socket class
    probe.close()
    guard = LoopbackOnly(connect_type.connect)

    async def connect(sock: Any, address: Any) -> None:
        await guard(sock, address)

    monkeypatch.setattr(connect_type, "connect", connect)
    return guard


@pytest.fixture
async def names(loopback_only: LoopbackOnly) -> Names:
    resolver = Names(loopback_only)
    trio.socket.set_custom_hostname_resolver(resolver)  # for this test's trio run only
    resolver.set("evil.test", "169.254.169.254")
    resolver.set("mixed.test", "127.0.0.1", "169.254.169.254")
    resolver.set("loop.test", "127.0.0.1")
    return resolver


# (URL, the word the refusal must carry, why it cannot be a worker). ROUTER and METRICS stand
# for the router's own data-plane and metrics ports, FREE for a loopback port nobody listens on.
REFUSED = [
    ("http://169.254.169.254/latest/meta-data", "link-local",
     "AWS IMDS; also GCP, Azure, Oracle, DigitalOcean, OpenStack metadata"),
    ("http://169.254.170.2:80", "link-local", "AWS ECS task credentials endpoint"),
    ("http://169.254.170.23:80", "link-local", "AWS EKS Pod Identity agent"),
    ("http://169.254.0.23:80", "link-local", "Tencent Cloud metadata"),
    ("http://[fd00:ec2::254]:80", "AWS instance metadata", "AWS IMDS over IPv6"),
    ("http://[fd00:ec2::23]:80", "EKS Pod Identity", "AWS EKS Pod Identity over IPv6"),
    ("http://[fd20:ce::254]:80", "GCP metadata", "GCP metadata for IPv6-only VMs"),
    ("http://100.100.100.200:80", "Alibaba", "Alibaba Cloud ECS metadata"),
    ("http://192.0.0.192:80", "Oracle", "Oracle Cloud Classic metadata"),
    ("http://168.63.129.16:80", "WireServer", "Azure host agent (certificates, extensions)"),
    ("http://metadata.google.internal", "metadata service", "GCP metadata, by name"),
    ("http://METADATA.Google.Internal.:80", "metadata service", "the same name, any case, FQDN"),
    ("http://metadata.tencentyun.com", "metadata service", "Tencent Cloud metadata, by name"),
    ("http://instance-data:80", "metadata service", "AWS metadata, by name"),
    ("http://[::ffff:169.254.169.254]:80", "169.254.169.254", "IPv4-mapped IPv6 (the finding)"),
    ("http://[::ffff:a9fe:a9fe]:80", "169.254.169.254", "the same, written in hex"),
    ("http://[::169.254.169.254]:80", "169.254.169.254", "IPv4-compatible IPv6 (deprecated)"),
    ("http://[64:ff9b::a9fe:a9fe]:80", "169.254.169.254", "NAT64 well-known prefix, RFC 6052"),
    ("http://[64:ff9b:1:a9fe:a9:fe00::]:80", "169.254.169.254", "NAT64 local-use /48, RFC 8215"),
    ("http://[2002:a9fe:a9fe::1]:80", "169.254.169.254", "6to4 embeds its IPv4 router"),
    ("http://[2001:0:4136:e378:8000:63bf:5601:5601]:80", "169.254.169.254",
     "Teredo: the client address, bit-inverted, in the last 32 bits"),
    ("http://[fe80::1]:8000", "link-local", "IPv6 link-local"),
    ("http://0.0.0.0:8000", "unspecified", "a connect to 0.0.0.0 reaches the local host"),
    ("http://0.1.2.3:8000", "unspecified", "the rest of 0.0.0.0/8 ('this network')"),
    ("http://[::]:8000", "unspecified", "IPv6 unspecified"),
    ("http://[::ffff:0.0.0.0]:8000", "unspecified", "IPv4-mapped 0.0.0.0"),
    ("http://224.0.0.1:8000", "multicast", "all-hosts multicast"),
    ("http://239.255.255.250:1900", "multicast", "SSDP multicast"),
    ("http://[ff02::1]:8000", "multicast", "IPv6 all-nodes multicast"),
    ("http://[::ffff:224.0.0.251]:5353", "multicast", "IPv4-mapped mDNS multicast"),
    ("http://255.255.255.255:8000", "broadcast", "limited broadcast"),
    ("http://240.0.0.1:8000", "reserved", "class E, never routed"),
    ("http://evil.test:80", "link-local", "a name whose address is metadata"),
    ("http://mixed.test:80", "link-local", "a name with one good and one metadata address"),
    ("http://127.0.0.1:ROUTER", "router itself", "the router's data plane"),
    ("http://localhost:ROUTER", "router itself", "the same by name"),
    ("http://[::ffff:127.0.0.1]:ROUTER", "router itself", "IPv4-mapped loopback (the finding)"),
    ("http://[::1]:ROUTER", "router itself", "IPv6 loopback on the router's port"),
    ("http://[::127.0.0.1]:ROUTER", "router itself", "IPv4-compatible loopback"),
    ("http://[64:ff9b::7f00:1]:ROUTER", "router itself", "NAT64 of 127.0.0.1"),
    ("http://[2002:7f00:1::]:ROUTER", "router itself", "6to4 of 127.0.0.1"),
    ("http://0.0.0.0:ROUTER", "router itself", "0.0.0.0 on the router's port"),
    ("http://loop.test:ROUTER", "router itself", "a name for the router"),
    ("http://127.0.0.1:METRICS", "router itself", "the router's metrics listener"),
]  # fmt: skip
ACCEPTED = [
    ("http://127.0.0.1:FREE", "a local engine"),
    ("http://localhost:FREE", "the same by name"),
    ("http://[::ffff:127.0.0.1]:FREE", "IPv4-mapped loopback, not the router's port"),
    ("http://127.0.0.2:FREE", "another loopback address"),
    ("http://loop.test:FREE", "a name for a local engine"),
]


def spell(url: str, cluster: Cluster, metrics_port: int, free: int) -> str:
    router_port = cluster.url.rsplit(":", 1)[1]
    return (
        url.replace("ROUTER", router_port)
        .replace("METRICS", str(metrics_port))
        .replace("FREE", str(free))
    )


async def test_worker_urls_that_cannot_be_workers_are_refused_in_every_spelling(
    nursery: trio.Nursery, names: Names
) -> None:
    assert len(REFUSED) + len(ACCEPTED) >= 30
    metrics_port, free = free_port(), free_port()
    cluster = await start_cluster(nursery, prometheus_port=metrics_port)
    client = cluster.admin  # changes need the admin listener without keys
    wrong = []
    for template, word, why in REFUSED:
        url = spell(template, cluster, metrics_port, free)
        response = await client.post("/workers", json={"url": url, "worker_type": "decode"})
        message = response.json()["error"]["message"] if response.status_code == 400 else ""
        if response.status_code != 400 or word not in message:
            wrong.append(f"{url} ({why}): {response.status_code} {response.text}")
    assert wrong == []
    assert [w.id for w in cluster.router.fleet.workers()] == ["prefill-1", "decode-1"]
    for template, why in ACCEPTED:
        url = spell(template, cluster, metrics_port, free)
        response = await client.post("/workers", json={"url": url, "worker_type": "decode"})
        assert response.status_code == 202, (url, why, response.text)
        assert (await client.delete(f"/workers/{response.json()['id']}")).status_code == 202
    assert names.guard.blocked == []
    await client.aclose()


def refused_count(cluster: Cluster, client: str, reason: str) -> float:
    labels = {"client": client, "reason": reason}
    value = cluster.router.metrics.registry.get_sample_value(
        "trio_pd_upstream_connects_refused_total", labels
    )
    return value or 0.0


async def test_dns_rebinding_to_the_router_itself_fails_the_health_check(
    nursery: trio.Nursery, names: Names, caplog: pytest.LogCaptureFixture
) -> None:
    """The name answers an address elsewhere when the worker is added, and the router's own
    loopback address from then on: the probes (httpx2, the control plane) are refused at
    connect time, so the router never becomes its own worker."""
    caplog.set_level(logging.WARNING, logger="trio_pd.upstream.destinations")
    answers = iter([["10.255.255.1"]])  # the add-time check only; never connected to
    names.answers["rebind.test"] = lambda: next(answers, ["127.0.0.1"])
    cluster = await start_cluster(nursery, health=FAST_HEALTH)
    port = cluster.url.rsplit(":", 1)[1]
    added = await cluster.admin.post(
        "/workers", json={"url": f"http://rebind.test:{port}", "worker_type": "decode"}
    )
    assert added.status_code == 202, added.text  # the name looked fine when it was added
    worker = cluster.router.fleet.get(added.json()["id"])
    await settle(lambda: refused_count(cluster, "control", "router_itself") >= 3)
    assert names.asked.count("rebind.test") >= 4  # looked up again at every probe
    assert not worker.healthy  # three probes refused: never the router as its own worker
    warnings = [
        r.getMessage() for r in caplog.records
        if "rebind.test" in r.getMessage() and r.name == "trio_pd.upstream.destinations"
    ]  # fmt: skip
    assert len(warnings) == 1 and "this router's own listener" in warnings[0], warnings
    assert names.guard.blocked == []
    await cluster.client.aclose()


async def test_dns_rebinding_on_the_legs_fails_the_leg_at_connect(
    nursery: trio.Nursery, names: Names
) -> None:
    """A decode worker by name, healthy and serving; then its name answers 0.0.0.0 (refused:
    a rebinding to a metadata address takes the same path, but would leave this machine): the
    next leg's connect (the hot path's own client) is refused, the request fails as a
    transport failure with the reason, counted, and the engine sees nothing more."""
    names.set("flip.test", "127.0.0.1")
    cluster = await start_cluster(nursery, health=FAST_HEALTH)
    engine = await start_engine(nursery, "decode")
    port = engine.url.rsplit(":", 1)[1]
    added = await cluster.admin.post(
        "/workers", json={"url": f"http://flip.test:{port}", "worker_type": "decode"}
    )
    assert added.status_code == 202
    assert (await cluster.admin.delete("/workers/decode-1")).status_code == 202
    worker = cluster.router.fleet.get(added.json()["id"])
    await settle(lambda: worker.healthy)
    served = await cluster.client.post("/generate", json=generate_body())
    assert served.status_code == 200
    assert engine.events.find("request_start", rid=served.headers["x-request-id"])

    names.set("flip.test", "0.0.0.0")
    await cluster.router.pool.aclose()  # the pooled connection would not connect again
    before = refused_count(cluster, "legs", "unspecified")
    failed = await cluster.client.post("/generate", json=generate_body())
    assert failed.status_code == 502, failed.text
    assert "refused to connect to flip.test" in failed.json()["error"]["message"]
    assert refused_count(cluster, "legs", "unspecified") == before + 1
    assert not engine.events.find("request_start", rid=failed.headers["x-request-id"])
    legs = cluster.router.metrics.registry.get_sample_value(
        "trio_pd_leg_failures_total", {"role": "decode", "kind": "transport"}
    )
    assert legs == 1.0
    assert names.guard.blocked == []
    await cluster.client.aclose()


async def test_a_connection_to_a_wildcard_listener_of_the_router_is_refused_once_connected() -> (
    None
):
    """The router bound to 0.0.0.0 is reached on any of the host's addresses, which no list
    knows: after the connect, a peer equal to the socket's own address on a router port is the
    router. (A real socket pair on loopback stands in for a host address here.)"""
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    destinations = Destinations()
    destinations.add_own("0.0.0.0", port)
    client = trio.socket.socket()
    await client.connect(("127.0.0.1", port))
    with pytest.raises(DestinationRefused, match="own listener"):
        destinations.check_connected(client, "legs")
    other = Destinations()
    other.add_own("0.0.0.0", port + 1 if port < 65535 else port - 1)
    other.check_connected(client, "legs")  # another port: a worker like any other
    client.close()
    listener.close()


def test_the_parents_metrics_listener_is_the_router_in_every_process(tmp_path: Any) -> None:
    """`--workers N`: the children do not bind the metrics port, the parent does; each child's
    rule still knows it (and its own data-plane port, from the config)."""
    from trio_pd.config import RouterConfig
    from trio_pd.edge.router import build_router
    from trio_pd.serve.supervisor import per_process

    config = RouterConfig(host="0.0.0.0", port=30123, prometheus_port=29123)
    child = per_process(config, 2, tmp_path)
    assert child.prometheus_port is None
    destinations = build_router(child).destinations
    for port in (29123, 30123):
        refused = destinations.refusal(ipaddress.ip_address("127.0.0.1"), port)
        assert refused is not None and refused.kind == "router_itself", port
    assert destinations.refusal(ipaddress.ip_address("127.0.0.1"), 29124) is None
