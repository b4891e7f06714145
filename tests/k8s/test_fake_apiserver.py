"""The fake API server speaks the wire format discovery relies on (raw HTTP, no discovery)."""

from __future__ import annotations

import functools
from typing import Any

import httpx2
import orjson
import trio

from tests.k8s.fake_apiserver import FakeApiServer, serve_fake_apiserver

LABELS = {"app": "sglang", "role": "prefill"}


async def client_for(fake: FakeApiServer) -> httpx2.AsyncClient:
    headers = {"Authorization": f"Bearer {fake.token}"}
    return httpx2.AsyncClient(base_url=fake.url, headers=headers, timeout=5.0, trust_env=False)


async def watch_lines(
    client: httpx2.AsyncClient, params: dict[str, str], count: int, path: str = "/api/v1/pods"
) -> list[dict[str, Any]]:
    """The first ``count`` events of a watch (fewer if the stream ends first)."""
    out: list[dict[str, Any]] = []
    with trio.fail_after(5):
        async with client.stream("GET", path, params={"watch": "1", **params}) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line:
                    out.append(orjson.loads(line))
                if len(out) == count:
                    break
    return out


async def test_auth_and_errors_are_status_objects(nursery: trio.Nursery) -> None:
    fake = await nursery.start(serve_fake_apiserver)
    async with httpx2.AsyncClient(base_url=fake.url, trust_env=False) as anon:
        response = await anon.get("/api/v1/pods")
    assert response.status_code == 401
    assert response.json() == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": "Unauthorized",
        "reason": "Unauthorized",
        "code": 401,
    }
    async with await client_for(fake) as client:
        assert (await client.get("/api/v1/nodes")).json()["reason"] == "NotFound"
        bad = await client.get("/api/v1/pods", params={"labelSelector": "a in (b)"})
        assert bad.status_code == 400 and bad.json()["reason"] == "BadRequest"
        fake.fail_next(1, code=503, kind="list")
        assert (await client.get("/api/v1/pods")).status_code == 503
        assert (await client.get("/api/v1/pods")).status_code == 200


async def test_list_shape_selector_and_paging(nursery: trio.Nursery) -> None:
    fake = await nursery.start(serve_fake_apiserver)
    for i in range(3):
        fake.add_ready_pod(f"p{i}", labels=LABELS, namespace="ns1")
    fake.add_ready_pod("x", labels={"app": "other"}, namespace="ns2")
    async with await client_for(fake) as client:
        body = (await client.get("/api/v1/pods", params={"labelSelector": "app=sglang"})).json()
        assert body["kind"] == "PodList" and body["metadata"] == {"resourceVersion": str(fake.rv)}
        assert [p["metadata"]["name"] for p in body["items"]] == ["p0", "p1", "p2"]
        item = body["items"][0]
        assert "kind" not in item and item["status"]["phase"] == "Running"
        assert {"type": "Ready", "status": "True"}.items() <= item["status"]["conditions"][
            1
        ].items()
        assert item["status"]["podIP"] and item["metadata"]["uid"]
        neg = await client.get("/api/v1/pods", params={"labelSelector": "app!=sglang"})
        assert [p["metadata"]["name"] for p in neg.json()["items"]] == ["x"]
        scoped = await client.get("/api/v1/namespaces/ns2/pods")
        assert [p["metadata"]["name"] for p in scoped.json()["items"]] == ["x"]
        first = (await client.get("/api/v1/pods", params={"limit": "2"})).json()
        assert first["metadata"]["remainingItemCount"] == 2 and len(first["items"]) == 2
        fake.force_delete_pod("p2", namespace="ns1")  # after page 1: the snapshot keeps it
        token = first["metadata"]["continue"]
        second = (await client.get("/api/v1/pods", params={"limit": "2", "continue": token})).json()
        assert [p["metadata"]["name"] for p in second["items"]] == ["p2", "x"]
        assert "continue" not in second["metadata"]
        assert second["metadata"]["resourceVersion"] == first["metadata"]["resourceVersion"]
        fake.compact()
        expired = await client.get("/api/v1/pods", params={"limit": "2", "continue": token})
        assert expired.status_code == 410 and expired.json()["reason"] == "Expired"


async def test_watch_semantics(nursery: trio.Nursery) -> None:
    fake = await nursery.start(functools.partial(serve_fake_apiserver, bookmark_interval=0.2))
    fake.add_ready_pod("p0", labels=LABELS)
    rv = str(fake.rv)
    async with await client_for(fake) as client:
        # No resourceVersion: a synthetic ADDED per existing object first.
        initial = await watch_lines(client, {}, 1)
        assert initial[0]["type"] == "ADDED" and initial[0]["object"]["kind"] == "Pod"
        # From a version: only what came after it, in order, with growing versions.
        fake.set_ready("p0", False)
        fake.set_labels("p0", {"app": "other"})
        fake.set_labels("p0", LABELS)
        fake.force_delete_pod("p0")
        params = {"resourceVersion": rv, "labelSelector": "app=sglang"}
        events = await watch_lines(client, params, 4)
        # Leaving the selector reads as DELETED, coming back as ADDED (watch-cache filtering).
        assert [e["type"] for e in events] == ["MODIFIED", "DELETED", "ADDED", "DELETED"]
        versions = [int(e["object"]["metadata"]["resourceVersion"]) for e in events]
        assert versions == sorted(versions) and versions[-1] == fake.rv
        # Bookmarks carry only the version.
        bookmark = await watch_lines(
            client, {"resourceVersion": str(fake.rv), "allowWatchBookmarks": "true"}, 1
        )
        assert bookmark == [
            {
                "type": "BOOKMARK",
                "object": {
                    "kind": "Pod",
                    "apiVersion": "v1",
                    "metadata": {"resourceVersion": str(fake.rv)},
                },
            }
        ]
        # timeoutSeconds ends the stream cleanly.
        with trio.fail_after(3):
            assert (
                await watch_lines(
                    client, {"resourceVersion": str(fake.rv), "timeoutSeconds": "1"}, 99
                )
                == []
            )
        assert fake.requests[-1].note == "timeout"
        # Too old: 200, then one ERROR event holding a 410 Status.
        fake.compact()
        fake.create_pod("p1", labels=LABELS)
        gone = await watch_lines(client, {"resourceVersion": rv}, 99)
        assert len(gone) == 1 and gone[0]["type"] == "ERROR"
        status = gone[0]["object"]
        assert (status["kind"], status["code"], status["reason"]) == ("Status", 410, "Expired")
        assert status["message"].startswith(f"too old resource version: {rv} (")


async def test_severed_and_stalled_watches(nursery: trio.Nursery) -> None:
    fake = await nursery.start(serve_fake_apiserver)
    errors: list[Exception] = []
    async with await client_for(fake) as client:

        async def watcher() -> None:
            try:
                async with client.stream("GET", "/api/v1/pods", params={"watch": "1"}) as response:
                    async for _ in response.aiter_lines():
                        pass
            except httpx2.TransportError as exc:
                errors.append(exc)

        with trio.fail_after(5):
            async with trio.open_nursery() as inner:
                inner.start_soon(watcher)
                await fake.wait_for(lambda: len(fake.watches) == 1)
                assert fake.sever_watches() == 1
        assert len(errors) == 1  # the client saw a broken stream, not a clean end
        assert isinstance(errors[0], httpx2.RemoteProtocolError)

    fake2 = await nursery.start(serve_fake_apiserver)
    fake2.stall_next_watches(1)
    async with await client_for(fake2) as client:
        fake2.create_pod("p0", labels=LABELS)
        with trio.move_on_after(0.5) as waited:
            await watch_lines(client, {}, 1)
        assert waited.cancelled_caught  # answered 200 and then nothing, not even the ADDED
        assert fake2.requests_of("watch")[0].note == "stalled"
