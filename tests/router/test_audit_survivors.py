"""Issue 28's audit survivors, through a real router over real sockets against the simulator:
each test failed with the one-line break the audit made (its docstring names it) and passes
without it. What the engines saw is the evidence.

Host names are answered by a resolver the test controls (trio's custom hostname resolver, which
every lookup of the router goes through, and only for this test's run): it can hold a lookup,
answer differently the second time, and counts what it was asked. Every answer is a loopback
address.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import httpx2
import pytest
import trio

from tests.cluster import ROUTER_DEFAULTS, wait_until_ready
from tests.conftest import Cluster, start_cluster, start_engine, start_router
from tests.router.fleet_tools import LOOSE
from tests.router.helpers import generate_body
from trio_pd.config import OverloadConfig, PolicyConfig, RouterConfig
from trio_pd.pd.aborts import AbortJob
from trio_pd.spec import WorkerSpec
from trio_pd_testing.engine import EngineHandle

GENERATION_KEY, ADMIN_KEY = "generation-key", "admin-key"


# -- aborts carry the worker's admin key --------------------------------------------------------


async def test_aborts_carry_the_admin_key_the_engine_demands(nursery: trio.Nursery) -> None:
    """Break: `abort_hook` sends the generation key (`generation_key(...)` for `admin_key(...)`):
    an engine started with `--admin-api-key` refuses it on `/abort_request` (SGLang's
    ADMIN_OPTIONAL), so nothing is aborted. Here a failed decode has its prefill aborted, and
    the abort lands."""
    keys = {"api_key": GENERATION_KEY, "admin_api_key": ADMIN_KEY}
    cluster = await start_cluster(
        nursery,
        prefill=keys,
        decode=keys,
        api_key=GENERATION_KEY,
        worker_admin_api_key=ADMIN_KEY,
    )
    response = await cluster.client.post(
        "/generate",
        json=generate_body(sim_fault="decode:500"),
        headers={"authorization": f"Bearer {GENERATION_KEY}"},  # --api-key: clients' too
    )
    assert response.status_code == 500  # the provoked failure: the prefill is abandoned
    rid = response.headers["x-request-id"]
    start = await cluster.prefill.events.wait_for("request_start", timeout=LOOSE, rid=rid)
    abort = await cluster.prefill.events.wait_for(
        "abort_request", timeout=LOOSE, sglang_rid=start["sglang_rid"]
    )
    assert abort["matched"] is True  # it found the request and aborted it
    assert not cluster.prefill.events.find("unauthorized")
    await cluster.client.aclose()


# -- the controlled resolver --------------------------------------------------------------------


class Names:
    """A hostname resolver the test controls; other names go to the system (/etc/hosts)."""

    def __init__(self) -> None:
        self.answers: dict[str, Callable[[], Any]] = {}
        self.asked: list[str] = []

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
        answer = self.answers[name]()
        if not isinstance(answer, list):
            answer = await answer  # a held lookup
        port = int(port) if port is not None else 0
        assert all(a.startswith("127.") for a in answer), answer  # nothing leaves this machine
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port)) for a in answer]

    async def getnameinfo(self, sockaddr: Any, flags: int) -> tuple[str, str]:
        raise OSError("no reverse lookups here")


@pytest.fixture
async def names() -> Names:
    resolver = Names()
    trio.socket.set_custom_hostname_resolver(resolver)  # for this test's trio run only
    return resolver


def port_of(engine: EngineHandle) -> int:
    return int(engine.url.rsplit(":", 1)[1])


async def named_cluster(
    nursery: trio.Nursery, prefill: EngineHandle, decode: EngineHandle, **options: Any
) -> Cluster:
    """A router that knows its prefill as `p.test` and its decode as `d.test`."""
    config = RouterConfig(
        prefill=(
            WorkerSpec(f"http://p.test:{port_of(prefill)}", "prefill", prefill.bootstrap_port),
        ),
        decode=(WorkerSpec(f"http://d.test:{port_of(decode)}", "decode"),),
        **{**ROUTER_DEFAULTS, **options},
    )
    router, url = await start_router(nursery, config)
    client = httpx2.AsyncClient(base_url=url, timeout=httpx2.Timeout(20.0))
    admin = httpx2.AsyncClient(base_url=router.access.admin_url, timeout=httpx2.Timeout(20.0))
    await wait_until_ready(client)
    return Cluster([prefill], [decode], router, url, client, admin)


def record_aborts(cluster: Cluster) -> list[AbortJob]:
    """Every abort the router asks its abort service for, recorded as it is asked."""
    service = cluster.router.aborts
    assert service is not None
    asked: list[AbortJob] = []
    request = service.request

    def recording(job: AbortJob) -> None:
        asked.append(job)
        request(job)

    service.request = recording  # type: ignore[method-assign]
    return asked


# -- only legs that wrote anything are aborted --------------------------------------------------


async def test_a_leg_cancelled_before_it_wrote_anything_is_not_aborted(
    nursery: trio.Nursery, names: Names
) -> None:
    """Break: `Leg.abandon` without `self.posted`: a decode leg cancelled while it was still
    connecting (it sent nothing; the engine holds nothing) would be aborted all the same, an
    `/abort_request` for a rid the engine never saw. The decode's lookup is held until the
    prefill has failed, so the order is what happened, not a timing."""
    names.set("p.test", "127.0.0.1")
    names.set("d.test", "127.0.0.1")
    prefill, decode = await start_engine(nursery, "prefill"), await start_engine(nursery, "decode")
    cluster = await named_cluster(nursery, prefill, decode)
    asked = record_aborts(cluster)
    await cluster.router.pool.aclose()  # the health checks' connections are not the legs'

    decode_held = trio.Event()

    async def hold_decode() -> list[str]:
        decode_held.set()
        await trio.sleep_forever()  # until the router cancels the leg
        raise AssertionError("unreachable")

    async def prefill_after_decode_held() -> list[str]:
        await decode_held.wait()
        return ["127.0.0.1"]

    names.answers["d.test"] = hold_decode
    names.answers["p.test"] = prefill_after_decode_held
    response = await cluster.client.post(
        "/generate", json=generate_body(sim_fault="prefill:400"), headers={"x-request-id": "r1"}
    )
    assert response.status_code == 400, response.text  # a 4xx: the prefill answers at once
    assert decode_held.is_set()  # the provoked state: the decode leg was connecting
    assert prefill.events.find("fault", rid="r1")  # and the prefill failed
    assert not decode.events.find("request_start", rid="r1")  # the decode got nothing
    assert [job.role for job in asked] == []  # so nothing to abort, on either side
    assert cluster.router.aborts is not None and cluster.router.aborts.pending == 0

    # The control: a decode leg that did write is aborted when the prefill fails (the
    # simulator's prefill fails a 500 only once the decode registered: the decode has posted).
    names.set("p.test", "127.0.0.1")
    names.set("d.test", "127.0.0.1")
    response = await cluster.client.post(
        "/generate", json=generate_body(sim_fault="prefill:500"), headers={"x-request-id": "r2"}
    )
    assert response.status_code == 502, response.text
    assert decode.events.find("request_start", rid="r2")
    assert [job.role for job in asked] == ["decode"]
    await cluster.client.aclose()


# -- the leg connects to the address it checked ------------------------------------------------


async def test_the_leg_connects_to_the_checked_address_without_looking_the_name_up_again(
    nursery: trio.Nursery, names: Names
) -> None:
    """Break: `_open_checked` connects by name (`trio.open_tcp_stream(host, port)`), which looks
    the name up a second time: what that answers was never checked (DNS rebinding). Here the
    name answers the engine's address to the check and another address (nobody listening) to
    any lookup after it; the leg reaches the engine, with one lookup per connect."""
    names.set("p.test", "127.0.0.1")
    names.set("d.test", "127.0.0.1")
    prefill, decode = await start_engine(nursery, "prefill"), await start_engine(nursery, "decode")
    cluster = await named_cluster(nursery, prefill, decode)
    await cluster.router.pool.aclose()  # the legs connect afresh

    answers = iter([["127.0.0.1"]])
    names.answers["d.test"] = lambda: next(answers, ["127.0.0.9"])  # a rebinding, after one
    before = names.asked.count("d.test")
    response = await cluster.client.post("/generate", json=generate_body())
    assert response.status_code == 200, response.text
    assert decode.events.find("request_start", rid=response.headers["x-request-id"])
    assert names.asked.count("d.test") - before == 1
    await cluster.client.aclose()


# -- every candidate over the overload thresholds: the least loaded takes it ---------------------


async def test_when_every_decode_is_overloaded_the_least_loaded_takes_the_requests(
    nursery: trio.Nursery,
) -> None:
    """Break: `least_loaded` returns the first candidate (or the most loaded): round robin's
    first decode, the busiest, would get the requests."""
    cluster = await start_cluster(
        nursery,
        n_decode=3,
        load_poll_interval_secs=0.2,
        policy=PolicyConfig(policy="round_robin"),
        overload=OverloadConfig(shed=False),
    )
    for engine, queued in zip(cluster.decodes, (30, 20, 9), strict=True):
        engine.state.saturate(queued=queued)  # other routers' requests, queued for compute
    decodes = cluster.router.fleet.workers("decode")

    def reported() -> bool:
        return all(w.engine_load is not None and w.engine_load.waiting >= 9 for w in decodes)

    with trio.fail_after(LOOSE):
        while not reported():
            await trio.sleep(0.02)
    for _ in range(4):
        response = await cluster.client.post("/generate", json=generate_body())
        assert response.status_code == 200, response.text
    started = [len(e.events.find("request_start")) for e in cluster.decodes]
    assert started == [0, 0, 4]
    fallback = cluster.router.metrics.registry.get_sample_value(
        "trio_pd_overload_decisions_total", {"role": "decode", "outcome": "fallback"}
    )
    assert fallback == 4  # every one was over: the fallback decided, not the veto
    await cluster.client.aclose()
