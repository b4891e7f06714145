"""`n > 1` streams with a failing sample (issue 28's survivor: no test had one), through a real
router against the simulator. What the client gets: a real status while its stream has not
started (headers go out only once every sample has its first event), else the failing sample's
error event and one `[DONE]`, every event whole. What the engines saw: every other sample's
legs cut and aborted, none run to its end.

Each failure is provoked by what happened, never by a clock: the failing decode's host name is
held by a resolver the test controls until another sample has its first event (the header
rule), or the failing decode's connection is dropped once the client holds events of every
sample (mid-stream)."""

from __future__ import annotations

import socket
from typing import Any

import httpx2
import orjson
import pytest
import trio

from tests.cluster import wait_until_ready
from tests.conftest import ROUTER_DEFAULTS, Cluster, start_engine, start_router
from tests.router.fleet_tools import LOOSE
from tests.router.helpers import CANCELLED
from trio_pd.config import RouterConfig
from trio_pd.pd import samples
from trio_pd.pd.aborts import AbortJob
from trio_pd.spec import WorkerSpec
from trio_pd_testing.engine import EngineHandle

CHAT = {"messages": [{"role": "user", "content": "say many things"}], "max_tokens": 1000}
SLOW = {"inter_token_ms": 20.0}  # 1000 tokens: 20 s of stream, cut long before its end


class HeldName:
    """A resolver answering 127.0.0.1 for `name` once `release` is set (other names: the
    system's /etc/hosts)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.release = trio.Event()
        self.held = trio.Event()

    async def getaddrinfo(
        self, host: bytes | str | None, port: Any, family: int = 0, type: int = 0,
        proto: int = 0, flags: int = 0,
    ) -> list[Any]:  # fmt: skip
        name = host.decode() if isinstance(host, bytes) else host
        if name != self.name:
            return await trio.to_thread.run_sync(
                socket.getaddrinfo, host, port, family, type, proto, flags
            )
        if not self.release.is_set():
            self.held.set()
            await self.release.wait()
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", int(port or 0)))]

    async def getnameinfo(self, sockaddr: Any, flags: int) -> tuple[str, str]:
        raise OSError("no reverse lookups here")


def record_aborts(cluster: Cluster) -> list[AbortJob]:
    service = cluster.router.aborts
    assert service is not None
    asked: list[AbortJob] = []
    request = service.request

    def recording(job: AbortJob) -> None:
        asked.append(job)
        request(job)

    service.request = recording  # type: ignore[method-assign]
    return asked


async def two_pairs(
    nursery: trio.Nursery, failing_decode: dict[str, Any], second_name: str | None = None
) -> Cluster:
    """One prefill, two decodes (round robin): a sample on each. The second decode is
    `failing_decode`, named `second_name` when given."""
    prefill = await start_engine(nursery, "prefill")
    healthy = await start_engine(nursery, "decode", **SLOW)
    failing = await start_engine(nursery, "decode", **failing_decode)
    second_url = failing.url
    if second_name is not None:
        second_url = f"http://{second_name}:{failing.url.rsplit(':', 1)[1]}"
    config = RouterConfig(
        prefill=(WorkerSpec(prefill.url, "prefill", prefill.bootstrap_port),),
        decode=(WorkerSpec(healthy.url, "decode"), WorkerSpec(second_url, "decode")),
        **ROUTER_DEFAULTS,
    )
    router, url = await start_router(nursery, config)
    client = httpx2.AsyncClient(base_url=url, timeout=httpx2.Timeout(20.0))
    admin = httpx2.AsyncClient(base_url=router.access.admin_url, timeout=httpx2.Timeout(20.0))
    await wait_until_ready(client)
    return Cluster([prefill], [healthy, failing], router, url, client, admin)


async def cut_and_aborted(engine: EngineHandle, rid: str, asked: list[AbortJob]) -> None:
    """The sample on `engine` was cut (its slot freed by a cancel, never finished) and the
    router asked for its abort."""
    freed = await engine.events.wait_for("slot_freed", timeout=LOOSE, rid=rid)
    assert freed["reason"] in CANCELLED, freed
    assert not engine.events.find("request_end", rid=rid, status=200, ended=None)
    assert engine.url in [job.url for job in asked]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/generate"])
async def test_a_sample_failing_before_every_sample_started_gets_a_real_status(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    """Break: the client's headers go out once the first sample has its first event (not
    every sample): the failure that follows would reach a client already answered 200."""
    names = HeldName("failing.test")
    trio.socket.set_custom_hostname_resolver(names)
    names.release.set()  # the health checks resolve it; the legs' connect is held below
    cluster = await two_pairs(nursery, {"faults": ("decode:500",)}, "failing.test")
    asked = record_aborts(cluster)
    started = samples.SampleStreams.on_start

    async def on_start(self: samples.SampleStreams, sample: samples.Sample) -> None:
        await started(self, sample)
        names.release.set()  # one sample has its first event: now the other may fail

    monkeypatch.setattr(samples.SampleStreams, "on_start", on_start)
    names.release = trio.Event()
    await cluster.router.pool.aclose()
    if path == "/generate":
        body: dict[str, Any] = {
            "text": "say many things",
            "sampling_params": {"max_new_tokens": 1000, "n": 2},
            "stream": True,
        }
    else:
        body = {**CHAT, "n": 2, "stream": True}
    async with cluster.client.stream("POST", path, json=body) as response:
        raw = await response.aread()
    assert names.held.is_set()  # provoked: the failing sample waited for the other's start
    rid = response.headers["x-request-id"]
    assert cluster.decodes[1].events.find("fault", rid=rid)  # and then failed
    assert response.status_code == 500, raw
    assert not response.headers["content-type"].startswith("text/event-stream")
    error = orjson.loads(raw)["error"]
    assert set(error) >= {"message", "type", "code"}
    await cut_and_aborted(cluster.decodes[0], rid, asked)
    await cluster.client.aclose()


async def test_a_sample_failing_mid_stream_ends_it_with_its_error_event_and_one_done(
    nursery: trio.Nursery,
) -> None:
    """Once the client's stream is on, a sample whose decode dies ends it: the error event,
    one `[DONE]`, every event valid JSON; the other sample is cut and aborted."""
    cluster = await two_pairs(nursery, SLOW)
    asked = record_aborts(cluster)
    failing = cluster.decodes[1]
    body = {**CHAT, "n": 2, "stream": True}
    events: list[Any] = []
    async with cluster.client.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        rid = response.headers["x-request-id"]
        lines = response.aiter_lines()
        seen: set[int] = set()
        async for line in lines:
            if line.startswith("data:"):
                events.append(line[5:].strip())
                if events[-1] != "[DONE]":
                    seen |= {c["index"] for c in orjson.loads(events[-1]).get("choices", [])}
            if seen == {0, 1}:
                break
        # Provoked: both samples streamed, neither ended; now the failing decode's dies.
        assert not failing.events.find("request_end", rid=rid)
        for item in list(failing.state.live):
            await failing.state.connections.drop(item.call.client)
        async for line in lines:
            if line.startswith("data:"):
                events.append(line[5:].strip())
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    parsed = [orjson.loads(e) for e in events[:-1]]  # each one whole
    assert "error" in parsed[-1], parsed[-1]
    assert all("error" not in p for p in parsed[:-1])
    await cut_and_aborted(cluster.decodes[0], rid, asked)
    await cluster.client.aclose()
