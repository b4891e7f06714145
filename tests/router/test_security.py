"""Secure by default, with SGLang's router meanings (issue 10): `--api-key` goes TO the workers,
`--control-plane-api-keys` guards the router's own control plane by role, changes are audited,
an optional data-plane key, worker URLs that cannot be workers are refused."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import trio

from tests.conftest import start_cluster
from tests.router.fleet_tools import FAST_HEALTH
from tests.router.helpers import generate_body, settle
from trio_pd.cli.main import build_parser, router_config
from trio_pd.config import ControlKey, parse_keys
from trio_pd.edge.auth import Access
from trio_pd_testing.ports import free_port

ADMIN = ControlKey("k1", "ops", "admin", "admin:secret")  # a key may hold colons
USER = ControlKey("k2", "dash", "user", "user-secret")
WORKER_KEY = "worker-secret"

READS = [
    ("GET", "/workers"),
    ("GET", "/workers/decode-1"),
    ("GET", "/get_loads"),
    ("GET", "/get_server_info"),
    ("GET", "/get_model_info"),
    ("GET", "/health_generate"),
]
WRITES = [("POST", "/flush_cache"), ("DELETE", "/workers/nope")]


def envelope(response: Any, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and error["message"]
    return error


async def test_control_plane_keys_by_role(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    cluster = await start_cluster(
        nursery, health=FAST_HEALTH, control_plane_api_keys=(ADMIN, USER),
        control_plane_audit_enabled=True,
    )  # fmt: skip
    client = cluster.client
    spec = {"url": "http://127.0.0.1:9", "worker_type": "decode"}
    admin = {"authorization": "Bearer admin:secret"}
    user = {"x-api-key": "user-secret"}
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "admin:secret"}):
        for method, path in [*READS, *WRITES, ("POST", "/workers")]:
            response = await client.request(method, path, json=spec, headers=headers)
            envelope(response, 401)
            assert response.headers["www-authenticate"].startswith("Bearer")
    for method, path in READS:
        assert (await client.request(method, path, headers=user)).status_code == 200, path
    for method, path in [*WRITES, ("POST", "/workers")]:
        envelope(await client.request(method, path, json=spec, headers=user), 403)
    assert [w.id for w in cluster.router.fleet.workers()] == ["prefill-1", "decode-1"]

    # The data plane stays open (no data-plane key configured).
    assert (await client.post("/generate", json=generate_body())).status_code == 200
    assert (await client.get("/v1/models")).status_code == 200

    caplog.set_level(logging.INFO, logger="trio_pd.audit")
    added = await client.post("/workers", json=spec, headers=admin)
    assert added.status_code == 202
    worker_id = added.json()["id"]
    assert (await client.delete(f"/workers/{worker_id}", headers=admin)).status_code == 202

    def audit_lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "trio_pd.audit"]

    await settle(lambda: len(audit_lines()) == 2)  # written once the answer went out
    audit = audit_lines()
    assert "key_id=k1 name=ops role=admin POST /workers -> 202 added " + worker_id in audit[0]
    assert f"DELETE /workers/{worker_id} -> 202 removed {worker_id}" in audit[1]
    assert not any("secret" in line for line in audit)  # keys never reach the log
    await client.aclose()


def test_without_keys_changes_go_through_the_admin_door_only() -> None:
    """The rule as a unit (end to end through a real proxy and a foreign peer: test_door.py):
    no peer address is trusted on the data plane, the admin door needs no key, keys once
    configured are needed on both doors, and the admin door answers no browser."""
    access = Access(admin_url="http://127.0.0.1:29001")
    for write in (access.check, lambda a, h: access.check(a, h, "data")):
        with pytest.raises(Exception) as refused:
            write("write", [])
        assert refused.value.status == 403
        assert "29001" not in refused.value.message  # the flags, never the address (N14)
        assert "--admin-port" in refused.value.message
        assert "--control-plane-api-keys" in refused.value.message
    assert access.check("read", [], "data") is None  # reads stay open
    assert access.check("write", [], "admin") is not None
    with pytest.raises(Exception) as browser:
        access.check("write", [(b"origin", b"http://evil.example")], "admin")
    assert browser.value.status == 403
    keyed = Access(router_key="k")
    for door in ("data", "admin"):
        with pytest.raises(Exception) as unkeyed:
            keyed.check("write", [], door)
        assert unkeyed.value.status == 401
        assert keyed.check("write", [(b"x-api-key", b"k")], door) is not None
    no_listener = Access()
    with pytest.raises(Exception) as nowhere:
        no_listener.check("write", [], "data")
    assert "--admin-port" in nowhere.value.message


def test_control_plane_key_flags() -> None:
    keys = parse_keys(["k1:ops:ADMIN:a:b:c", "k2:dash:user:x;k3:ci:user:y"])
    assert [(k.id, k.role, k.key) for k in keys] == [
        ("k1", "admin", "a:b:c"), ("k2", "user", "x"), ("k3", "user", "y"),
    ]  # fmt: skip
    with pytest.raises(ValueError, match="admin or user"):
        parse_keys(["k1:ops:root:x"])
    with pytest.raises(ValueError, match="id:name:role:key"):
        parse_keys(["k1:ops:admin"])
    args = build_parser().parse_args(
        ["serve", "--control-plane-api-keys", "k1:ops:admin:a", "k2:d:user:b",
         "--control-plane-audit-enabled", "--api-key", "wk-secret-123"]
    )  # fmt: skip
    config = router_config(args)
    assert [k.id for k in config.control_plane_api_keys] == ["k1", "k2"]
    assert config.control_plane_audit_enabled and config.api_key == "wk-secret-123"
    assert "wk-secret-123" not in repr(config)  # keys stay out of logs and tracebacks
    assert "k1" in repr(config.control_plane_api_keys[0])


def test_worker_api_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRIO_PD_API_KEY", "from-env")
    assert router_config(build_parser().parse_args(["serve"])).api_key == "from-env"
    args = build_parser().parse_args(["serve", "--api-key", "flag"])
    assert router_config(args).api_key == "flag"


async def test_api_key_is_sent_to_workers_and_required_of_clients(nursery: trio.Nursery) -> None:
    """SMG's `--api-key`: the workers get it, and clients must present it on the data plane."""
    cluster = await start_cluster(
        nursery,
        prefill={"api_key": WORKER_KEY},
        decode={"api_key": WORKER_KEY},
        api_key=WORKER_KEY,
        control_plane_api_keys=(ADMIN,),
    )
    for headers in ({}, {"authorization": "Bearer client-token"}):
        refused = await cluster.client.post("/generate", json=generate_body(), headers=headers)
        envelope(refused, 401)
    for engine in (cluster.prefill, cluster.decode):
        assert not engine.events.find("request_start")  # refused before any worker
    response = await cluster.client.post(
        "/generate", json=generate_body(), headers={"authorization": f"Bearer {WORKER_KEY}"}
    )
    assert response.status_code == 200
    rid = response.headers["x-request-id"]
    for engine in (cluster.prefill, cluster.decode):
        seen = engine.events.find("request_start", rid=rid)[0]["headers"]
        assert seen["authorization"] == f"Bearer {WORKER_KEY}"
    # The admin's key never reaches a worker: fan-out calls carry the worker key.
    loads = await cluster.client.get("/get_loads", headers={"authorization": "Bearer admin:secret"})
    assert loads.status_code == 200 and loads.json()["failed"] == 0
    assert (
        await cluster.client.get("/get_server_info", headers={"x-api-key": "admin:secret"})
    ).status_code == 200
    for engine in (cluster.prefill, cluster.decode):
        assert not engine.events.find("unauthorized")
    assert (await cluster.client.get("/health")).status_code == 200  # open, as in SMG
    await cluster.client.aclose()


async def test_api_key_guards_the_control_plane_without_control_keys(
    nursery: trio.Nursery,
) -> None:
    """SMG: without --control-plane-api-keys the admin and worker routes take --api-key."""
    cluster = await start_cluster(nursery, api_key=WORKER_KEY)
    body = {"url": "http://127.0.0.1:9", "worker_type": "decode"}
    for headers in ({}, {"authorization": "Bearer wrong"}):
        envelope(await cluster.client.post("/workers", json=body, headers=headers), 401)
        envelope(await cluster.client.get("/workers", headers=headers), 401)
    assert [w.id for w in cluster.router.fleet.workers()] == ["prefill-1", "decode-1"]
    key = {"authorization": f"Bearer {WORKER_KEY}"}
    added = await cluster.client.post("/workers", json=body, headers=key)
    assert added.status_code == 202
    listed = await cluster.client.get("/workers", headers=key)
    assert added.json()["id"] in {w["id"] for w in listed.json()["workers"]}
    await cluster.client.aclose()


async def test_a_worker_needing_a_key_the_router_lacks_refuses_with_401(
    nursery: trio.Nursery,
) -> None:
    cluster = await start_cluster(nursery, prefill={"api_key": WORKER_KEY})
    response = await cluster.client.post("/generate", json=generate_body())
    assert response.status_code == 401  # the prefill's 4xx, relayed as it came
    assert cluster.prefill.events.find("unauthorized")
    await cluster.client.aclose()


async def test_a_per_worker_key_overrides_the_router_key(nursery: trio.Nursery) -> None:
    from tests.conftest import start_engine

    cluster = await start_cluster(nursery, health=FAST_HEALTH, api_key="router-wide")
    cluster.client.headers["authorization"] = "Bearer router-wide"  # the router's key: changes
    # on the data plane with it, as in SMG
    special = await start_engine(nursery, "decode", api_key="its-own")
    added = await cluster.client.post(
        "/workers", json={"url": special.url, "worker_type": "decode", "api_key": "its-own"}
    )
    assert added.status_code == 202 and "api_key" not in added.json()
    await cluster.client.delete("/workers/decode-1")
    with trio.fail_after(5):
        while not cluster.router.fleet.get(added.json()["id"]).healthy:
            await trio.sleep(0.05)
    response = await cluster.client.post("/generate", json=generate_body())
    assert response.status_code == 200
    seen = special.events.find("request_start")[0]["headers"]
    assert seen["authorization"] == "Bearer its-own"
    await cluster.client.aclose()


async def test_data_plane_key_guards_generation(nursery: trio.Nursery) -> None:
    cluster = await start_cluster(nursery, data_plane_api_keys=("dp-1", "dp-2"))
    for headers in ({}, {"authorization": "Bearer nope"}):
        response = await cluster.client.post("/generate", json=generate_body(), headers=headers)
        envelope(response, 401)
        assert (await cluster.client.get("/v1/models", headers=headers)).status_code == 401
    ok = await cluster.client.post(
        "/generate", json=generate_body(), headers={"authorization": "Bearer dp-2"}
    )
    assert ok.status_code == 200
    # The client's key is the router's credential: it does not travel on to the workers.
    seen = cluster.prefill.events.find("request_start", rid=ok.headers["x-request-id"])[0]
    assert "authorization" not in seen["headers"]
    assert (await cluster.client.get("/health")).status_code == 200
    await cluster.client.aclose()


@pytest.mark.parametrize(
    "url",
    [
        "http://169.254.169.254/latest/meta-data",
        "http://[fd00:ec2::254]:80",
        "http://[fe80::1]:8000",
        "http://0.0.0.0:8000",
        "http://224.0.0.1:8000",
    ],
)
async def test_worker_urls_that_cannot_be_workers_are_refused(cluster, url: str) -> None:
    response = await cluster.admin.post("/workers", json={"url": url, "worker_type": "decode"})
    error = envelope(response, 400)
    assert "--worker-url-allow" in error["message"]
    assert len(cluster.router.fleet.workers()) == 2


async def test_the_router_itself_is_refused_and_allow_lists_work(nursery: trio.Nursery) -> None:
    """`--worker-url-allow` lets a refused range in (0.0.0.0 here: a connect to it stays on
    this machine), in its embedded spellings too; nothing lets the router itself in: its
    data-plane port, named as the admin door is asked, nor the admin door itself."""
    cluster = await start_cluster(nursery, worker_url_allow=("0.0.0.0/32",))
    router_port = cluster.url.rsplit(":", 1)[1]
    for own in (cluster.url, cluster.router.access.admin_url):
        for url in (own, own.replace("127.0.0.1", "localhost")):
            body = {"url": url, "worker_type": "decode"}
            response = await cluster.admin.post("/workers", json=body)
            assert "this router itself" in envelope(response, 400)["message"]
    body = {"url": f"http://0.0.0.0:{router_port}", "worker_type": "decode"}
    response = await cluster.admin.post("/workers", json=body)
    assert "this router itself" in envelope(response, 400)["message"]
    port = free_port()
    for url in (f"http://0.0.0.0:{port}", f"http://[::ffff:0.0.0.0]:{port}"):
        allowed = await cluster.admin.post("/workers", json={"url": url, "worker_type": "decode"})
        assert allowed.status_code == 202, allowed.text
    refused = await cluster.admin.post(
        "/workers", json={"url": f"http://0.0.0.1:{port}", "worker_type": "decode"}
    )
    assert "--worker-url-allow" in envelope(refused, 400)["message"]  # outside the range
    await cluster.client.aclose()


async def test_a_worker_key_that_would_inject_headers_is_refused(nursery: trio.Nursery) -> None:
    """A per-worker api_key goes into an Authorization header on every leg: CR/LF (or any
    control character) in it is a 400, and no worker is added."""
    cluster = await start_cluster(nursery, health=FAST_HEALTH)
    before = len((await cluster.client.get("/workers")).json()["workers"])
    url = f"http://127.0.0.1:{free_port()}"
    for key in ("k\r\nx-injected: 1", "k\x00", "two words", "clé"):
        body = {"url": url, "worker_type": "decode", "api_key": key}
        response = await cluster.admin.post("/workers", json=body)
        assert response.status_code == 400, key
        assert "api_key" in response.json()["error"]["message"]
    assert len((await cluster.client.get("/workers")).json()["workers"]) == before
    body = {"url": url, "worker_type": "decode", "api_key": "sk-fine_key.1"}
    assert (await cluster.admin.post("/workers", json=body)).status_code in (200, 201, 202)
    with pytest.raises(SystemExit):
        router_config(build_parser().parse_args(["serve", "--api-key", "a\nb"]))
    await cluster.client.aclose()


SECRETS = ("admin:secret", "user-secret", "dp-secret")


def secrets_seen(engine: Any) -> list[tuple[str, str, str]]:
    """(event, header, value) of every header an engine saw that carries one of SECRETS."""
    found = []
    for event in engine.events.find("request_start") + engine.events.find("info_request"):
        for name, value in event["headers"].items():
            if any(secret in value for secret in SECRETS):
                found.append((event.get("path", ""), name, value))
    return found


async def test_the_routers_own_keys_never_reach_a_worker(nursery: trio.Nursery) -> None:
    """Control-plane keys (and data-plane keys) are the router's: sent by a client on any
    route, in the Authorization header or in a forwarded one, no worker sees them, on the
    generation legs, in fan-out or in probes. A client's own token still passes through to
    workers (SGLang's meaning, with no --api-key)."""
    cluster = await start_cluster(nursery, health=FAST_HEALTH, control_plane_api_keys=(ADMIN, USER))
    client = cluster.client
    passed = await client.post(
        "/generate", json=generate_body(), headers={"authorization": "Bearer client-token"}
    )
    assert passed.status_code == 200
    seen = cluster.prefill.events.find("request_start", rid=passed.headers["x-request-id"])[0]
    assert seen["headers"]["authorization"] == "Bearer client-token"  # passthrough is kept
    for authorization in ("Bearer admin:secret", "bearer  admin:secret", "admin:secret",
                          "Bearer user-secret", "Basic user-secret"):  # fmt: skip
        headers = {
            "authorization": authorization,
            "x-correlation-id": "admin:secret",
            "traceparent": "Bearer user-secret",
            "x-request-id-team": "user-secret",
        }
        response = await client.post("/generate", json=generate_body(), headers=headers)
        assert response.status_code == 200, response.text
        rid = response.headers["x-request-id"]
        for engine in (cluster.prefill, cluster.decode):
            assert engine.events.find("request_start", rid=rid)  # the request did go through
    admin = {"authorization": "Bearer admin:secret", "x-correlation-id": "user-secret"}
    for method, path in [("GET", "/get_loads"), ("POST", "/flush_cache"),
                         ("GET", "/get_server_info"), ("GET", "/health_generate"),
                         ("GET", "/v1/models")]:  # fmt: skip
        assert (await client.request(method, path, headers=admin)).status_code == 200, path
    paths = {e["path"] for e in cluster.decode.events.find("info_request")}
    called = {"/health", "/v1/loads", "/flush_cache", "/health_generate"}
    assert called & paths == called  # all called
    for engine in (cluster.prefill, cluster.decode):
        assert secrets_seen(engine) == []
    await client.aclose()


async def test_data_plane_keys_never_reach_a_worker_in_forwarded_headers(
    nursery: trio.Nursery,
) -> None:
    cluster = await start_cluster(nursery, data_plane_api_keys=("dp-secret",))
    headers = {"authorization": "Bearer dp-secret", "x-correlation-id": "dp-secret"}
    response = await cluster.client.post("/generate", json=generate_body(), headers=headers)
    assert response.status_code == 200
    seen = cluster.decode.events.find("request_start", rid=response.headers["x-request-id"])
    assert seen and secrets_seen(cluster.decode) == []
    await cluster.client.aclose()
