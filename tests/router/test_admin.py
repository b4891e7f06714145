"""Runtime membership over the wire: POST/GET/DELETE /workers, the API key, and what the engines
see when a worker joins (after its first health pass) or leaves (in-flight work finishes)."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from tests.conftest import start_cluster
from tests.router.fleet_tools import FAST_HEALTH, LOOSE, start_stoppable, who_started
from tests.router.helpers import generate_body, read_sse, settle
from trio_pd_testing.ports import free_port

KEY = "s3cret-key"


def assert_envelope(response: Any, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert error["code"] == status
    assert error["message"] and error["type"]
    return error


async def test_add_list_get_delete(nursery: trio.Nursery) -> None:
    cluster = await start_cluster(nursery, health=FAST_HEALTH)
    client, admin = cluster.client, cluster.admin  # without keys, changes go to the admin door
    listed = (await client.get("/workers")).json()
    assert listed["total"] == 2
    assert [(w["id"], w["url"]) for w in listed["workers"]] == [
        ("prefill-1", cluster.prefill.url),
        ("decode-1", cluster.decode.url),
    ]
    assert all(w["is_healthy"] for w in listed["workers"])

    extra = await start_stoppable(nursery, "prefill")
    spec = {
        "url": extra.handle.url,
        "worker_type": "prefill",
        "bootstrap_port": extra.handle.bootstrap_port,
    }
    added = await admin.post("/workers", json=spec)
    assert added.status_code == 202
    worker = added.json()
    assert worker["id"] == "prefill-2"
    assert added.headers["location"] == "/workers/prefill-2"
    assert (worker["url"], worker["worker_type"]) == (extra.handle.url, "prefill")
    assert worker["bootstrap_port"] == extra.handle.bootstrap_port
    assert worker["is_healthy"] is False  # until the health checker's first pass
    assert [w.id for w in cluster.router.fleet.workers("prefill")] == ["prefill-1", "prefill-2"]

    duplicate = await admin.post("/workers", json={**spec, "url": extra.handle.url + "/"})
    assert "already registered" in assert_envelope(duplicate, 409)["message"]

    got = await client.get("/workers/prefill-2")
    assert got.status_code == 200
    assert got.json()["url"] == extra.handle.url
    await settle(lambda: cluster.router.fleet.get("prefill-2").healthy, LOOSE)
    assert (await client.get("/workers/prefill-2")).json()["is_healthy"] is True

    deleted = await admin.delete("/workers/prefill-2")
    assert deleted.status_code == 202
    assert deleted.json()["removed"] is True
    assert [w.id for w in cluster.router.fleet.workers()] == ["prefill-1", "decode-1"]
    assert_envelope(await client.get("/workers/prefill-2"), 404)
    assert_envelope(await admin.delete("/workers/prefill-2"), 404)
    assert_envelope(await client.get("/workers/nope"), 404)
    assert_envelope(await client.put("/workers"), 405)

    # Ids are never reused: a worker added again gets a new one.
    again = await admin.post("/workers", json=spec)
    assert again.status_code == 202
    assert again.json()["id"] == "prefill-3"
    await client.aclose()
    await admin.aclose()


BAD_BODIES = [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    (b'{"url": "http://127.0.0.1:1"}', "worker_type is required"),
    (b'{"url": "http://127.0.0.1:1", "worker_type": "both"}', "worker_type must be"),
    (b'{"worker_type": "decode"}', "url is required"),
    (b'{"url": 5, "worker_type": "decode"}', "url is required"),
    (b'{"url": "ftp://127.0.0.1:1", "worker_type": "decode"}', "http:// or https://"),
    (b'{"url": "127.0.0.1:30000", "worker_type": "decode"}', "http:// or https://"),
    (b'{"url": "http://", "worker_type": "decode"}', "no host"),
    (b'{"url": "http://h:99999", "worker_type": "decode"}', "not a valid URL"),
    (b'{"url": "http://h:1/?x=1", "worker_type": "decode"}', "query"),
    (b'{"url": "http://h:1", "worker_type": "prefill", "bootstrap_port": "x"}', "bootstrap_port"),
    (b'{"url": "http://h:1", "worker_type": "prefill", "bootstrap_port": true}', "bootstrap_port"),
    (b'{"url": "http://h:1", "worker_type": "decode", "bootstrap_port": 8998}', "prefill workers"),
]


async def test_bad_input_is_400_and_changes_nothing(nursery: trio.Nursery) -> None:
    cluster = await start_cluster(nursery, health=FAST_HEALTH)
    version = cluster.router.fleet.version
    for body, words in BAD_BODIES:
        response = await cluster.admin.post(
            "/workers", content=body, headers={"content-type": "application/json"}
        )
        assert words in assert_envelope(response, 400)["message"], body
    assert cluster.router.fleet.version == version
    assert len(cluster.router.fleet.workers()) == 2
    await cluster.client.aclose()


async def test_added_worker_takes_traffic_only_after_its_first_health_pass(
    nursery: trio.Nursery,
) -> None:
    cluster = await start_cluster(nursery, health=FAST_HEALTH)
    port, bootstrap_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    added = await cluster.admin.post(
        "/workers", json={"url": url, "worker_type": "prefill", "bootstrap_port": bootstrap_port}
    )
    assert added.status_code == 202
    worker = cluster.router.fleet.get(added.json()["id"])

    # Nothing listens there yet: the worker never passes, and every request goes to prefill-1.
    for _ in range(4):
        response = await cluster.client.post("/generate", json=generate_body())
        assert response.status_code == 200
        rid = response.headers["x-request-id"]
        assert who_started(cluster.prefills, rid) == [0]
    assert not worker.healthy
    assert worker.in_flight == 0

    engine = await start_stoppable(nursery, "prefill", port=port, bootstrap_port=bootstrap_port)
    await settle(lambda: worker.healthy, LOOSE)
    rids = []
    for _ in range(4):
        response = await cluster.client.post("/generate", json=generate_body())
        assert response.status_code == 200
        rids.append(response.headers["x-request-id"])
    # Round robin over two healthy prefills: the new engine got half of them.
    got = [r for r in rids if engine.handle.events.find("request_start", rid=r)]
    assert len(got) == 2
    for rid in got:
        assert engine.handle.events.find("kv_sent", rid=rid)
        assert not cluster.prefill.events.find("request_start", rid=rid)
    await cluster.client.aclose()


@pytest.mark.parametrize("role", ["prefill", "decode"])
async def test_remove_worker_under_load(nursery: trio.Nursery, role: str) -> None:
    """Removing a worker with requests in flight: they all finish 200, no new one reaches it."""
    if role == "prefill":
        cluster = await start_cluster(nursery, n_prefill=2, health=FAST_HEALTH)
        engines, body = cluster.prefills, generate_body(sim_fault="prefill:slow:1500")
        stream = False
    else:
        cluster = await start_cluster(
            nursery, n_decode=2, health=FAST_HEALTH, decode={"inter_token_ms": 30.0}
        )
        engines, body = cluster.decodes, generate_body(stream=True, max_new_tokens=50)
        stream = True
    victim = cluster.router.fleet.workers(role)[1]
    results: dict[str, tuple[int, int]] = {}  # rid -> (status, token events)

    async def one(rid: str) -> None:
        headers = {"x-request-id": rid}
        if not stream:
            response = await cluster.client.post("/generate", json=body, headers=headers)
            results[rid] = (response.status_code, 0)
            return
        async with cluster.client.stream(
            "POST", "/generate", json=body, headers=headers
        ) as response:
            events = await read_sse(response)
        assert events[-1] == "[DONE]"
        assert all("error" not in e for e in events[:-1])
        results[rid] = (response.status_code, len(events) - 1)

    async with trio.open_nursery() as load:
        for i in range(6):
            load.start_soon(one, f"load-{i}")
        # Round robin: three of them run on the victim; remove it while they are in flight.
        await settle(lambda: victim.in_flight == 3, LOOSE)
        working = "first_token" if stream else "room_registered"
        await settle(lambda: len(engines[1].events.find(working)) == 3, LOOSE)
        removed = await cluster.admin.delete(f"/workers/{victim.id}")
        assert removed.status_code == 202
        assert victim.in_flight == 3  # still running: removal does not cancel anything
        after = []
        for i in range(4):
            rid = f"after-{i}"
            response = await cluster.client.post(
                "/generate", json=generate_body(), headers={"x-request-id": rid}
            )
            assert response.status_code == 200
            after.append(rid)

    assert sorted(results) == [f"load-{i}" for i in range(6)]
    on_victim = [rid for rid in results if engines[1].events.find("request_start", rid=rid)]
    assert len(on_victim) == 3
    for rid, (status, tokens) in results.items():
        assert status == 200, rid
        if stream:
            assert tokens == 50, rid
    for rid in on_victim:  # the victim finished its work instead of being cut off
        ended = engines[1].events.find("request_end", rid=rid)
        assert ended and ended[0]["status"] == 200 and not ended[0]["ended"]
    for rid in after:
        assert who_started(engines, rid) == [0], rid
    await settle(lambda: victim.in_flight == 0)  # the legs end just after the client's last byte
    assert victim.removed and victim not in cluster.router.fleet.workers()
    await cluster.client.aclose()


async def test_a_worker_body_that_never_ends_is_a_408(nursery: trio.Nursery) -> None:
    """`POST /workers` reads its body within `--client-body-timeout-secs`, as generation does:
    a client sending one byte a minute holds the admin door for that long at most."""
    from trio_pd.config import TimeoutConfig

    cluster = await start_cluster(nursery, timeouts=TimeoutConfig(client_body_secs=1.0))
    host, port = cluster.router.access.admin_url.removeprefix("http://").rsplit(":", 1)
    conn = await trio.open_tcp_stream(host, int(port))
    await conn.send_all(
        b"POST /workers HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b'content-length: 1000\r\n\r\n{"url": '
    )
    data = b""
    with trio.fail_after(LOOSE):
        while not data.rstrip().endswith(b"}"):
            piece = await conn.receive_some(65536)
            assert piece, data
            data += piece
    assert data.startswith(b"HTTP/1.1 408")
    assert b'"type":"timeout_error"' in data
    assert len(cluster.router.fleet.workers()) == 2
    await conn.aclose()
    await cluster.client.aclose()
    await cluster.admin.aclose()
