"""Kubernetes discovery through a real `trio-pd serve --service-discovery` (issue 13): the fake
API server, simulator engines on 127.0.0.1, pods naming the engines' ports.

Scripted lifecycles, observed through `GET /workers` and through which engine serves the
router's requests: Pending -> Running (not Ready) -> Ready joins; NotReady leaves (and comes
back); selector drift leaves (and comes back); a graceful delete leaves at once while a slow
stream on that worker keeps going to its end; a force delete leaves; a new pod on the freed IP
and port joins under its own name.

That something did *not* happen (a Pending pod is no worker) is only meaningful once the router
has seen the event: `synced` adds a marker pod after it and waits for the marker's worker, as a
watch delivers events in order.
"""

from __future__ import annotations

import functools
import itertools
from pathlib import Path
from typing import Any

import httpx2
import trio

from tests.conftest import start_engine
from tests.k8s.engine_pods import (
    DECODE,
    SELECTOR_FLAGS,
    create_engine_pod,
    ready_engine_pod,
    served,
    served_through,
    untouched,
    workers,
)
from tests.k8s.fake_apiserver import FakeApiServer, serve_fake_apiserver
from tests.ops.serve import clients_per_process, free_port, start_serve
from tests.router.helpers import eventually, generate_body, read_sse

PROPAGATION_SECS = 10.0  # a hang guard: a watch delivers in milliseconds, and the fallback it would
# hide is the 30 s resync; the 1 s figure of the design is not asserted (a busy machine breaks it)
SERVE_SECS = 15.0  # a joining worker passes its first health check and takes a request
STREAM_TOKENS = 120  # at 25 ms a token: a 3 s stream


class Markers:
    """Barrier pods: a worker whose URL nothing listens on (never healthy, never routed)."""

    def __init__(self, fake: FakeApiServer, client: httpx2.AsyncClient) -> None:
        self.fake = fake
        self.client = client
        self.port = free_port()
        self.numbers = itertools.count()

    async def synced(self) -> None:
        """Once this returns, the router has applied every change the fake made before."""
        name = f"marker-{next(self.numbers)}"
        annotations = {"smg.ai/worker-ports": str(self.port)}
        self.fake.create_pod(name, labels=DECODE, annotations=annotations)
        self.fake.run_pod(name, ip="127.0.0.1")
        await eventually(lambda: self.has(f"decode-{name}"), PROPAGATION_SECS, f"{name} joins")
        self.fake.force_delete_pod(name)
        await eventually(lambda: self.lacks(f"decode-{name}"), PROPAGATION_SECS, f"{name} left")

    async def has(self, worker_id: str) -> bool:
        return worker_id in await workers(self.client)

    async def lacks(self, worker_id: str) -> bool:
        return worker_id not in await workers(self.client)


async def test_pod_lifecycles_through_a_real_router(nursery: trio.Nursery, tmp_path: Path) -> None:
    fake: FakeApiServer = await nursery.start(
        functools.partial(serve_fake_apiserver, bookmark_interval=1.0)
    )
    token_file = tmp_path / "token"
    token_file.write_text(fake.token + "\n")
    prefill = await start_engine(nursery, "prefill")
    d1 = await start_engine(nursery, "decode", inter_token_ms=25)
    d2 = await start_engine(nursery, "decode", inter_token_ms=25)
    ready_engine_pod(fake, "p0", prefill)
    ready_engine_pod(fake, "d1", d1)
    fake.add_ready_pod("unrelated", labels={"app": "nginx"}, ip="127.0.0.1")
    router = await start_serve(
        [], [], str(tmp_path / "router.log"),
        "--service-discovery", *SELECTOR_FLAGS,
        "--service-discovery-namespace", "default",
        "--kube-api-server", fake.url, "--kube-token-file", str(token_file),
        "--policy", "round_robin", "--health-check-interval-secs", "1", "--disable-retries",
    )  # fmt: skip
    try:
        async with httpx2.AsyncClient(base_url=router.url, timeout=20) as client:
            await router.wait_ready(client)
            await lifecycles(fake, client, nursery, prefill, d1, d2)
    finally:
        await router.stop()


async def lifecycles(
    fake: FakeApiServer,
    client: httpx2.AsyncClient,
    nursery: trio.Nursery,
    prefill: Any,
    d1: Any,
    d2: Any,
) -> None:
    markers = Markers(fake, client)
    # What the router asked: the pods of one namespace, by the labels both selectors share,
    # with the token of the file; then a watch from the list's resourceVersion.
    first_list = fake.requests_of("list")[0]
    assert first_list.path == "/api/v1/namespaces/default/pods"
    assert first_list.params["labelSelector"] == "app=sglang"
    assert first_list.token == fake.token
    found = await workers(client)
    assert set(found) == {"prefill-p0", "decode-d1"}  # not the nginx pod
    assert found["decode-d1"]["url"] == d1.url and found["decode-d1"]["source"] == "kubernetes"
    assert found["decode-d1"]["meta"]["uid"] == fake.pod("d1")["metadata"]["uid"]
    assert found["prefill-p0"]["bootstrap_port"] == prefill.bootstrap_port

    # Pending, then Running but not Ready: no worker. Ready: joins and serves.
    create_engine_pod(fake, "d2", d2)
    await markers.synced()
    assert await markers.lacks("decode-d2")
    fake.run_pod("d2", ip="127.0.0.1", ready=False)
    await markers.synced()
    assert await markers.lacks("decode-d2")
    await untouched(client, [d2], 3)
    fake.set_ready("d2", True)
    await eventually(lambda: markers.has("decode-d2"), PROPAGATION_SECS, "d2 joins when Ready")
    await eventually(lambda: served_through(client, d2), SERVE_SECS, "d2 serves")

    # Ready=False: out of rotation at once (the kubelet's verdict); Ready again: back.
    fake.set_ready("d2", False)
    await eventually(lambda: markers.lacks("decode-d2"), PROPAGATION_SECS, "NotReady leaves")
    await untouched(client, [d2], 4)
    fake.set_ready("d2", True)
    await eventually(lambda: served_through(client, d2), SERVE_SECS, "d2 back after Ready")

    # Selector drift: relabelled away, it leaves; labelled back, it returns.
    fake.set_labels("d2", {"app": "sglang", "role": "canary"})
    await eventually(lambda: markers.lacks("decode-d2"), PROPAGATION_SECS, "drift leaves")
    await untouched(client, [d2], 4)
    fake.set_labels("d2", DECODE)
    await eventually(lambda: served_through(client, d2), SERVE_SECS, "d2 back after relabel")

    # A graceful delete while a slow stream runs on that pod's worker: the worker leaves at once
    # and the stream still ends normally.
    pods = [("d1", d1), ("d2", d2)]
    before = {name: served(engine) for name, engine in pods}
    done = trio.Event()
    result: dict[str, Any] = {}

    async def slow_stream() -> None:
        body = generate_body(stream=True, max_new_tokens=STREAM_TOKENS)
        async with client.stream("POST", "/generate", json=body) as response:
            result["status"] = response.status_code
            result["events"] = await read_sse(response)
        done.set()

    nursery.start_soon(slow_stream)

    async def stream_started() -> bool:
        return any(served(engine) > before[name] for name, engine in pods)

    await eventually(stream_started, 5.0, "the stream reaches a decode")
    name, engine = next((n, e) for n, e in pods if served(e) > before[n])
    other_name, other = next((n, e) for n, e in pods if n != name)
    await trio.sleep(0.3)  # some tokens out
    fake.delete_pod(name)
    await eventually(lambda: markers.lacks(f"decode-{name}"), PROPAGATION_SECS, "delete leaves")
    assert not done.is_set(), "the stream ended before its worker was removed: nothing tested"
    await untouched(client, [engine], 3)
    with trio.fail_after(STREAM_TOKENS * 0.025 + 10):
        await done.wait()
    assert result["status"] == 200
    events = result["events"]
    assert events[-1] == "[DONE]"
    assert not any(isinstance(e, dict) and "error" in e for e in events), events[-3:]
    assert events[-2]["meta_info"]["completion_tokens"] == STREAM_TOKENS
    fake.finish_delete(name)
    await markers.synced()
    assert await markers.lacks(f"decode-{name}")

    # A force delete: DELETED with no warning; no decode is left, so the router is not ready.
    fake.force_delete_pod(other_name)
    await eventually(lambda: markers.lacks(f"decode-{other_name}"), PROPAGATION_SECS, "forced")
    assert (await client.get("/readiness")).status_code == 503

    # A new pod (new name, new uid) on the freed IP and port joins, and serves.
    ready_engine_pod(fake, "d3", other)
    await eventually(lambda: markers.has("decode-d3"), PROPAGATION_SECS, "the new pod joins")
    assert (await workers(client))["decode-d3"]["url"] == other.url
    await eventually(lambda: served_through(client, other), SERVE_SECS, "d3 serves")
    assert set(await workers(client)) == {"prefill-p0", "decode-d3"}


async def test_every_process_of_workers_2_watches_the_pods(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """`--workers 2` with Kubernetes discovery: each process runs its own watch and they agree
    (same pods, same ids, each routes to a pod that joined); an admin's worker goes through the
    shared membership file beside the pods; a deleted pod leaves both."""
    fake: FakeApiServer = await nursery.start(
        functools.partial(serve_fake_apiserver, bookmark_interval=1.0)
    )
    token_file = tmp_path / "token"
    token_file.write_text(fake.token + "\n")
    prefill = await start_engine(nursery, "prefill")
    d1 = await start_engine(nursery, "decode")
    d2 = await start_engine(nursery, "decode")
    extra = await start_engine(nursery, "decode")
    ready_engine_pod(fake, "p0", prefill)
    ready_engine_pod(fake, "d1", d1)
    router = await start_serve(
        [], [], str(tmp_path / "router.log"), "--workers", "2",
        "--service-discovery", *SELECTOR_FLAGS,
        "--service-discovery-namespace", "default",
        "--kube-api-server", fake.url, "--kube-token-file", str(token_file),
        "--policy", "round_robin", "--health-check-interval-secs", "1", "--disable-retries",
    )  # fmt: skip
    clients: dict[int, httpx2.AsyncClient] = {}
    try:
        await router.wait_ready()
        clients = await clients_per_process(router)
        assert len(clients) == 2
        # Each process listed the pods itself (two watches, not one shared).
        await eventually(
            lambda: _true(len(fake.requests_of("list")) >= 2), PROPAGATION_SECS, "two lists"
        )
        for client in clients.values():
            found = await workers(client)
            assert set(found) == {"prefill-p0", "decode-d1"}
            assert found["decode-d1"]["source"] == "kubernetes"

        ready_engine_pod(fake, "d2", d2)
        for client in clients.values():
            await eventually(lambda c=client: _has(c, "decode-d2"), PROPAGATION_SECS, "d2 joins")
            await eventually(lambda c=client: served_through(c, d2), SERVE_SECS, "d2 serves")

        # An admin's worker through one process is in the other's membership too.
        admins = await clients_per_process(router, url=router.admin_url)
        first_pid, second_pid = clients
        added = await admins[first_pid].post(
            "/workers", json={"url": extra.url, "worker_type": "decode"}
        )
        for admin in admins.values():
            await admin.aclose()
        second = clients[second_pid]
        assert added.status_code in (200, 201, 202), added.text
        extra_id = added.json()["id"]
        await eventually(lambda: _has(second, extra_id), PROPAGATION_SECS * 3, "shared")
        assert (await workers(second))["decode-d2"]["source"] == "kubernetes"

        fake.force_delete_pod("d2")
        for client in clients.values():
            await eventually(lambda c=client: _lacks(c, "decode-d2"), PROPAGATION_SECS, "d2 left")
            await untouched(client, [d2], 4)
    finally:
        for client in clients.values():
            await client.aclose()
        await router.stop()


async def _true(value: bool) -> bool:
    return value


async def _has(client: httpx2.AsyncClient, worker_id: str) -> bool:
    return worker_id in await workers(client)


async def _lacks(client: httpx2.AsyncClient, worker_id: str) -> bool:
    return worker_id not in await workers(client)
