"""The control plane's own door (issue 19, item 2), on real `trio-pd serve` processes.

Without keys, the changing routes (`POST /workers`, `DELETE /workers/{id}`, `POST /flush_cache`)
are served on the admin listener only (`--admin-host`:`--admin-port`, loopback), never on the
data-plane port, whoever the TCP peer is. Shown here end to end:
- through a REAL local proxy in front of the data plane, connecting from 127.0.0.6 as Istio's
  inbound sidecar does (a peer that is loopback, which the old "loopback may change" rule let
  through: a remote client added its own worker);
- from a peer in another network namespace (a veth pair), which cannot even reach the admin
  listener while the data plane listens on every address;
- with `--workers 2` (each process serves a copy of the admin socket, changes land in the
  shared membership file), over HTTPS (the admin listener stays plain HTTP), through the drain
  (it answers until the process exits), and a taken admin port stopping the start.
"""

from __future__ import annotations

import json
import os
import signal
import ssl
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import httpx2
import pytest
import trio
import trustme

from tests.conftest import start_cluster, start_engine
from tests.ops.serve import PROCESSES_SECS, clients_per_process, free_port, start_serve
from tests.ops.sockets import listeners
from tests.router.helpers import generate_body, read_sse
from trio_pd.cli.main import build_parser, router_config
from trio_pd.config import ControlKey
from trio_pd_testing.engine import EngineHandle

LOOSE = 10.0
SIDECAR_SOURCE = "127.0.0.6"  # where Istio's inbound sidecar connects to the app from


@attrs.define
class LocalProxy:
    """A TCP forwarder on 127.0.0.1 in front of the router, as nginx or a sidecar would be."""

    port: int
    sources: list[tuple[str, int]] = attrs.Factory(list)  # its upstream connections' addresses

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


async def pump(source: trio.SocketStream, sink: trio.SocketStream) -> None:
    try:
        while data := await source.receive_some(65536):
            await sink.send_all(data)
        await sink.send_eof()
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass


async def run_proxy(
    target_port: int, *, task_status: trio.TaskStatus[LocalProxy] = trio.TASK_STATUS_IGNORED
) -> None:
    (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
    proxy = LocalProxy(listener.socket.getsockname()[1])

    async def forward(client: trio.SocketStream) -> None:
        sock = trio.socket.socket()
        await sock.bind((SIDECAR_SOURCE, 0))
        await sock.connect(("127.0.0.1", target_port))
        proxy.sources.append(sock.getsockname())
        upstream = trio.SocketStream(sock)
        async with client, upstream, trio.open_nursery() as both:
            both.start_soon(pump, client, upstream)
            both.start_soon(pump, upstream, client)

    task_status.started(proxy)
    await trio.serve_listeners(forward, [listener])


def refused_here(response: httpx2.Response, admin_url: str) -> None:
    """The data plane's answer to a keyless change: a 403 envelope naming the flags, never the
    admin listener's address (issue 26, N14: anyone may reach the data port)."""
    assert response.status_code == 403, response.text
    error = response.json()["error"]
    assert error["type"] == "permission_error" and error["code"] == 403
    assert "--admin-port" in error["message"] and "--control-plane-api-keys" in error["message"]
    assert admin_url not in response.text and admin_url.rsplit(":", 1)[1] not in response.text


async def worker_ids(client: httpx2.AsyncClient) -> list[str]:
    return [w["id"] for w in (await client.get("/workers")).json()["workers"]]


def flushes(engine: EngineHandle) -> int:
    return len(engine.events.find("info_request", path="/flush_cache"))


@pytest.mark.parametrize("workers", [1, 2])
async def test_a_local_proxy_cannot_pass_a_remote_change_through(
    nursery: trio.Nursery, tmp_path: Path, workers: int
) -> None:
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode")
    attacker = await start_engine(nursery, "decode")  # the worker a remote client would add
    router = await start_serve(
        [prefill], [decode], str(tmp_path / "router.log"), "--workers", str(workers)
    )
    try:
        await router.wait_ready()
        proxy: LocalProxy = await nursery.start(run_proxy, router.port)
        async with httpx2.AsyncClient(base_url=proxy.url, timeout=LOOSE) as remote:
            # The proxy works: generation and reads pass through it.
            assert (await remote.post("/generate", json=generate_body())).status_code == 200
            assert await worker_ids(remote) == ["prefill-1", "decode-1"]
            asked: set[int] = set()  # the router processes that refused
            with trio.fail_after(PROCESSES_SECS):
                while len(asked) < workers:  # new connections until every process was asked
                    async with httpx2.AsyncClient(base_url=proxy.url, timeout=LOOSE) as each:
                        asked.add((await each.get("/liveness")).json()["pid"])
                        body = {"url": attacker.url, "worker_type": "decode"}
                        refused_here(await each.post("/workers", json=body), router.admin_url)
                        refused_here(await each.delete("/workers/decode-1"), router.admin_url)
                        refused_here(await each.post("/flush_cache"), router.admin_url)
            assert await worker_ids(remote) == ["prefill-1", "decode-1"]  # nothing changed
        # Every refused request did come from the sidecar's loopback address.
        assert len(proxy.sources) >= 1 + workers
        assert {host for host, _ in proxy.sources} == {SIDECAR_SOURCE}
        assert flushes(prefill) == flushes(decode) == 0
        await trio.sleep(0.5)
        assert not attacker.events.find("info_request")  # never probed: never a worker

        # The operator on the router's host changes it through the admin listener.
        async with httpx2.AsyncClient(base_url=router.admin_url, timeout=LOOSE) as admin:
            added = await admin.post(
                "/workers", json={"url": attacker.url, "worker_type": "decode"}
            )
            assert added.status_code == 202, added.text
            assert (await admin.post("/flush_cache")).status_code == 200
            assert flushes(prefill) == flushes(decode) == 1
            assert (await admin.delete(f"/workers/{added.json()['id']}")).status_code == 202
        router.signal(signal.SIGTERM)
        assert await router.wait_exit() == 0
    finally:
        await router.stop()


# -- a peer in another network namespace -------------------------------------------------------

PEER_CLIENT = r"""
import http.client, json, socket, sys
host, port, admin_port, url = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
def call(method, path, body=None):
    conn = http.client.HTTPConnection(host, port, timeout=10)
    data = None if body is None else json.dumps(body)
    conn.request(method, path, body=data, headers={"content-type": "application/json"})
    response = conn.getresponse()
    return [response.status, json.loads(response.read() or b"null")]
def reach(where, p):
    try:
        socket.create_connection((where, p), timeout=5).close()
        return "connected"
    except OSError as exc:
        return type(exc).__name__
print(json.dumps({
    "list": call("GET", "/workers"),
    "add": call("POST", "/workers", {"url": url, "worker_type": "decode"}),
    "delete": call("DELETE", "/workers/decode-1"),
    "flush": call("POST", "/flush_cache"),
    "admin": reach(host, admin_port),
    "own_loopback": reach("127.0.0.1", port),
}))
"""


@asynccontextmanager
async def network_namespace() -> AsyncIterator[tuple[str, str, str]]:
    """A private network namespace joined to this one by a veth pair: (its name, the address
    on our side, the address on its side). Needs root, as the box the suite runs on has."""
    pid = os.getpid()
    name, host_if, peer_if = f"trio-pd-door-{pid}", f"tpdh{pid % 100000}", f"tpdc{pid % 100000}"
    subnet = f"10.213.{pid % 250}"
    ours, theirs = f"{subnet}.1", f"{subnet}.2"
    steps = [
        ["ip", "netns", "add", name],
        ["ip", "link", "add", host_if, "type", "veth", "peer", "name", peer_if],
        ["ip", "link", "set", peer_if, "netns", name],
        ["ip", "addr", "add", f"{ours}/30", "dev", host_if],
        ["ip", "link", "set", host_if, "up"],
        ["ip", "netns", "exec", name, "ip", "addr", "add", f"{theirs}/30", "dev", peer_if],
        ["ip", "netns", "exec", name, "ip", "link", "set", peer_if, "up"],
        ["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"],
    ]
    try:
        for step in steps:
            await trio.run_process(step, capture_stdout=True, capture_stderr=True)
        yield name, ours, theirs
    finally:
        await trio.run_process(["ip", "link", "del", host_if], check=False, capture_stderr=True)
        await trio.run_process(["ip", "netns", "del", name], check=False, capture_stderr=True)


async def test_a_peer_in_another_network_namespace_cannot_change_the_router(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode")
    attacker = await start_engine(nursery, "decode")
    async with network_namespace() as (name, ours, theirs):
        # The data plane on every address (the veth's included); the admin listener on its
        # default, loopback.
        port = free_port()
        router = await start_serve(
            [prefill], [decode], str(tmp_path / "router.log"), port=port, host="0.0.0.0"
        )
        try:
            await router.wait_ready()
            assert list(listeners(router.admin_port)) == ["127.0.0.1"]
            command = ["ip", "netns", "exec", name, sys.executable, "-c", PEER_CLIENT]
            command += [ours, str(port), str(router.admin_port), attacker.url]
            ran = await trio.run_process(command, capture_stdout=True, capture_stderr=True)
            seen = json.loads(ran.stdout)
            assert seen["own_loopback"] == "ConnectionRefusedError"  # it is really elsewhere
            status, listed = seen["list"]
            assert status == 200 and [w["id"] for w in listed["workers"]] == [
                "prefill-1", "decode-1"
            ]  # fmt: skip
            for what in ("add", "delete", "flush"):
                status, body = seen[what]
                assert status == 403, (what, body)
                assert body["error"]["type"] == "permission_error"
            assert seen["admin"] == "ConnectionRefusedError"  # no admin door on that address
            async with httpx2.AsyncClient(base_url=router.url, timeout=LOOSE) as local:
                assert await worker_ids(local) == ["prefill-1", "decode-1"]
            assert flushes(prefill) == flushes(decode) == 0
            assert not attacker.events.find("info_request")
            assert theirs  # the peer's address: not loopback, not ours
        finally:
            await router.stop()


# -- --workers 2, HTTPS and the drain -----------------------------------------------------------


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


async def test_the_admin_listener_with_two_processes_https_and_a_drain(
    nursery: trio.Nursery, tmp_path: Path, ca: trustme.CA
) -> None:
    cert = ca.issue_cert("127.0.0.1")
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.cert_chain_pems[0].write_to_path(cert_path)
    cert.private_key_pem.write_to_path(key_path)
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode", inter_token_ms=40)
    extra = await start_engine(nursery, "decode")
    router = await start_serve(
        [prefill], [decode], str(tmp_path / "router.log"), "--workers", "2",
        "--tls-cert-path", str(cert_path), "--tls-key-path", str(key_path),
        "--shutdown-grace-period-secs", "30",
    )  # fmt: skip
    context = ssl.create_default_context()
    ca.configure_trust(context)
    https = f"https://127.0.0.1:{router.port}"
    admins: dict[int, httpx2.AsyncClient] = {}
    try:
        async with httpx2.AsyncClient(base_url=https, verify=context, timeout=LOOSE * 3) as data:
            await router.wait_ready(data)
            # Each process serves its own copy of the admin socket, in plain HTTP.
            admins = await clients_per_process(router, url=router.admin_url)
            assert len(admins) == 2
            admin_a, admin_b = admins.values()
            added = await admin_a.post("/workers", json={"url": extra.url, "worker_type": "decode"})
            assert added.status_code == 202, added.text
            new_id = added.json()["id"]
            with trio.fail_after(LOOSE):  # the shared file: the other process sees it
                while new_id not in await worker_ids(admin_b):
                    await trio.sleep(0.05)
            # Not the data plane's: generation is refused there, and so are browsers.
            assert (await admin_a.post("/generate", json=generate_body())).status_code == 404
            from_page = await admin_a.post("/flush_cache", headers={"origin": "http://evil.test"})
            assert from_page.status_code == 403 and "access-control-allow-origin" not in (
                from_page.headers
            )
            assert "trio_pd_requests_total" in (await admin_a.get("/metrics")).text

            # A stream that is surely running through the drain: paused after its first token
            # until the test lets it go (`hold@1tok`), whatever the machine's speed.
            body = generate_body(stream=True, max_new_tokens=80, sim_fault="decode:hold@1tok")
            async with data.stream("POST", "/generate", json=body) as stream:
                assert stream.status_code == 200
                router.signal(signal.SIGTERM)
                with trio.fail_after(LOOSE):  # the drain closes the data plane's socket...
                    while listeners(router.port):
                        await trio.sleep(0.05)
                # ...the admin listener stays, and a change made now still lands.
                assert (await admin_a.get("/readiness")).status_code == 503  # draining
                removed = await admin_a.delete(f"/workers/{new_id}")
                assert removed.status_code == 202, removed.text
                assert not decode.events.find("request_end")  # the stream is still running
                decode.state.release_held()
                events = await read_sse(stream)
            assert events[-1] == "[DONE]"
        assert await router.wait_exit() == 0
    finally:
        for client in admins.values():
            await client.aclose()
        await router.stop()
    assert router.admin_port is not None and not listeners(router.admin_port)
    assert f"admin API on http://127.0.0.1:{router.admin_port}" in router.log()


async def test_without_an_admin_listener_the_refusal_says_how_to_get_one(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode")
    router = await start_serve(
        [prefill], [decode], str(tmp_path / "router.log"), "--admin-port", "none"
    )
    try:
        await router.wait_ready()
        async with httpx2.AsyncClient(base_url=router.url, timeout=LOOSE) as client:
            refused = await client.post("/flush_cache")
        assert refused.status_code == 403
        assert "--admin-port" in refused.json()["error"]["message"]
        assert "admin API on" not in router.log()
    finally:
        await router.stop()


# -- in one process: both doors, keys, IPv6 ----------------------------------------------------


async def test_keys_are_needed_on_both_doors_once_configured(nursery: trio.Nursery) -> None:
    admin_key = ControlKey("k1", "ops", "admin", "admin-secret")
    cluster = await start_cluster(nursery, control_plane_api_keys=(admin_key,))
    key = {"authorization": "Bearer admin-secret"}
    for client in (cluster.client, cluster.admin):  # SMG's way on the data plane, kept
        assert (await client.post("/flush_cache")).status_code == 401
        assert (await client.post("/flush_cache", headers=key)).status_code == 200
    await cluster.client.aclose()
    await cluster.admin.aclose()


async def test_an_ipv6_router_takes_local_ipv4_changes_on_its_admin_door(
    nursery: trio.Nursery,
) -> None:
    """`--host ::` once refused local IPv4 admin (a peer ::ffff:127.0.0.1 is not "loopback" to
    Python); no peer address counts now: the data plane refuses, the admin door takes it."""
    cluster = await start_cluster(nursery, host="::")
    v4 = cluster.url.replace("[::]", "127.0.0.1")
    async with httpx2.AsyncClient(base_url=v4, timeout=LOOSE) as client:
        assert (await client.get("/health")).status_code == 200  # ::ffff:127.0.0.1 reaches it
        refused_here(await client.post("/flush_cache"), str(cluster.router.access.admin_url))
    assert (await cluster.admin.post("/flush_cache")).status_code == 200
    await cluster.client.aclose()
    await cluster.admin.aclose()


def test_the_admin_listener_flags() -> None:
    parse = build_parser().parse_args
    config = router_config(parse(["serve"]))
    assert (config.admin_host, config.admin_port) == ("127.0.0.1", 29001)
    assert router_config(parse(["serve", "--admin-port", "none"])).admin_port is None
    assert router_config(parse(["serve", "--admin-port", "0"])).admin_port == 0
    for bad in (["--admin-port", "30000"], ["--admin-port", "x"], ["--admin-port", "70000"]):
        with pytest.raises(SystemExit):
            router_config(parse(["serve", *bad]))
