"""Engine-aware admission through a real router over real sockets (docs/overload.md): the
overload veto from the engines' /v1/loads, its shed, the per-prefill cap with its FIFO line,
and the decode's running-window gate. What the engines saw is the evidence: which worker got
each request, and that nothing reached a shed or saturated worker."""

from __future__ import annotations

from functools import partial

import httpx2
import trio

from tests.conftest import start_cluster
from tests.router.fleet_tools import LOOSE, who_started
from tests.router.helpers import generate_body, leave_when, settle
from trio_pd.config import OverloadConfig, PolicyConfig
from trio_pd.fleet.overload import overload_reason

POLL = 0.2  # --worker-startup-check-interval: the load polls of these tests
ROUND_ROBIN = PolicyConfig(policy="round_robin")


def decisions(cluster, role: str, outcome: str) -> float:
    labels = {"role": role, "outcome": outcome}
    value = cluster.router.metrics.registry.get_sample_value(
        "trio_pd_overload_decisions_total", labels
    )
    return value or 0.0


def peak_in_flight(engine) -> int:
    """The most requests the engine held at once, from its own start and end records."""
    held = peak = 0
    for record in engine.events.find():
        if record["event"] == "request_start":
            held += 1
            peak = max(peak, held)
        elif record["event"] == "request_end":
            held -= 1
    return peak


async def post(cluster, rid: str, **body) -> httpx2.Response:
    return await cluster.client.post(
        "/generate", json=generate_body(**body), headers={"x-request-id": rid}
    )


def reported(cluster, role: str, index: int, check) -> bool:
    worker = cluster.router.fleet.workers(role)[index]
    return worker.engine_load is not None and check(worker.engine_load)


async def test_a_decode_with_a_compute_queue_is_left_out(nursery: trio.Nursery) -> None:
    cluster = await start_cluster(
        nursery, n_decode=2, policy=ROUND_ROBIN, load_poll_interval_secs=POLL
    )
    busy = cluster.decodes[1]
    busy.state.saturate(queued=8)  # another router's requests, queued for compute
    await settle(lambda: reported(cluster, "decode", 1, lambda load: load.waiting >= 8), LOOSE)
    for i in range(6):
        response = await post(cluster, f"veto-{i}")
        assert response.status_code == 200, response.text
    assert not busy.events.find("request_start")  # round robin would have sent it three
    assert len(cluster.decodes[0].events.find("request_start")) == 6
    assert decisions(cluster, "decode", "vetoed") == 6

    busy.state.saturate()  # its queue drained: back in rotation after the next poll
    await settle(lambda: reported(cluster, "decode", 1, lambda load: load.waiting == 0), LOOSE)
    for i in range(2):
        assert (await post(cluster, f"back-{i}")).status_code == 200
    assert len(busy.events.find("request_start")) == 1
    await cluster.client.aclose()


async def test_token_usage_vetoes_a_prefill(nursery: trio.Nursery) -> None:
    cluster = await start_cluster(
        nursery, n_prefill=2, policy=ROUND_ROBIN, load_poll_interval_secs=POLL
    )
    full = cluster.prefills[0]
    full.state.saturate(used_tokens=int(full.config.max_total_tokens * 0.85))
    await settle(
        lambda: reported(cluster, "prefill", 0, lambda load: load.ranks[0].token_usage >= 0.8),
        LOOSE,
    )
    for i in range(4):
        assert (await post(cluster, f"kv-{i}")).status_code == 200
    assert not full.events.find("request_start")
    assert decisions(cluster, "prefill", "vetoed") == 4
    await cluster.client.aclose()


async def test_kv_waiters_on_a_decode_are_normal_pd_operation(nursery: trio.Nursery) -> None:
    """A decode holding 9 requests whose KV is still coming (slow prefills) reports
    num_waiting_reqs 9, over the threshold of 8: yet it is not overloaded, and no request is
    steered or counted as vetoed (SMG 1.13 would veto it)."""
    cluster = await start_cluster(
        nursery,
        prefill={"prefill_ms_per_token": 150.0},
        load_poll_interval_secs=POLL,
    )

    async def slow(rid: str) -> None:
        assert (await post(cluster, rid)).status_code == 200

    async with trio.open_nursery() as load:
        for i in range(9):
            load.start_soon(slow, f"kv-wait-{i}")
        await settle(
            lambda: reported(
                cluster, "decode", 0, lambda load: load.waiting >= 8 and load.ranks[0].queued == 0
            ),
            LOOSE,
        )
        decode = cluster.router.fleet.workers("decode")[0]
        assert overload_reason(decode, cluster.router.config.overload, trio.current_time()) is None
    assert decisions(cluster, "decode", "vetoed") == decisions(cluster, "decode", "fallback") == 0
    await cluster.client.aclose()


async def test_all_overloaded_falls_back_or_sheds(nursery: trio.Nursery) -> None:
    for shed in (False, True):
        async with trio.open_nursery() as scope:
            cluster = await start_cluster(
                scope, load_poll_interval_secs=POLL, overload=OverloadConfig(shed=shed)
            )
            cluster.decode.state.saturate(queued=20)
            await settle(
                lambda c=cluster: reported(c, "decode", 0, lambda load: load.waiting >= 20), LOOSE
            )
            response = await post(cluster, f"all-over-{shed}")
            if not shed:  # the least loaded of them takes it: a busy fleet is still a fleet
                assert response.status_code == 200, response.text
                assert decisions(cluster, "decode", "fallback") == 1
            else:
                assert response.status_code == 503
                assert response.headers["retry-after"] == "1"
                assert response.json()["error"]["code"] == "worker_overload_protection_shed"
                assert decisions(cluster, "decode", "shed") == 1
                # Never reached an engine, and was not retried.
                assert not who_started(cluster.prefills, f"all-over-{shed}")
                assert not who_started(cluster.decodes, f"all-over-{shed}")
            await cluster.client.aclose()
            scope.cancel_scope.cancel()


async def test_protection_off_routes_to_the_saturated_worker(nursery: trio.Nursery) -> None:
    cluster = await start_cluster(
        nursery,
        n_decode=2,
        policy=ROUND_ROBIN,
        load_poll_interval_secs=POLL,
        overload=OverloadConfig(protection=False, shed=True),
    )
    cluster.decodes[1].state.saturate(queued=50)
    await trio.sleep(3 * POLL)
    for i in range(4):
        assert (await post(cluster, f"off-{i}")).status_code == 200
    assert len(cluster.decodes[1].events.find("request_start")) == 2
    await cluster.client.aclose()


# -- the prefill gate ---------------------------------------------------------------------------

CAP_ONE = OverloadConfig(prefill_max_inflight=1, prefill_queue_size=1)


async def test_prefill_cap_queues_then_refuses(nursery: trio.Nursery) -> None:
    cluster = await start_cluster(nursery, prefill={"prefill_ms_per_token": 40.0}, overload=CAP_ONE)
    results: dict[str, int] = {}

    async def send(rid: str) -> None:
        results[rid] = (await post(cluster, rid)).status_code

    gate = cluster.router.dispatch.gates.prefill
    async with trio.open_nursery() as load:
        load.start_soon(send, "first")
        await cluster.prefill.events.wait_for("request_start", rid="first")
        load.start_soon(send, "second")
        await settle(lambda: gate.waiting == 1)
        full = await post(cluster, "third")
        assert full.status_code == 429
        assert full.json()["error"]["code"] == "prefill_queue_rejected"
    assert results == {"first": 200, "second": 200}
    assert not who_started(cluster.prefills, "third") and not who_started(cluster.decodes, "third")
    assert peak_in_flight(cluster.prefill) == 1  # the cap held on the engine
    assert gate.held == {} and gate.waiting == 0  # nothing leaked
    await cluster.client.aclose()


async def test_prefill_queue_timeout_is_429(nursery: trio.Nursery) -> None:
    config = OverloadConfig(prefill_max_inflight=1, prefill_queue_timeout_secs=0.3)
    cluster = await start_cluster(nursery, prefill={"prefill_ms_per_token": 80.0}, overload=config)
    async with trio.open_nursery() as load:
        load.start_soon(post, cluster, "slow")
        await cluster.prefill.events.wait_for("request_start", rid="slow")
        late = await post(cluster, "late")
        assert late.status_code == 429 and "no prefill slot" in late.json()["error"]["message"]
    assert not who_started(cluster.prefills, "late")
    await cluster.client.aclose()


async def test_the_prefill_slot_frees_when_the_prefill_phase_ends(nursery: trio.Nursery) -> None:
    """With one slot, a second request starts its prefill while the first still decodes."""
    cluster = await start_cluster(
        nursery, decode={"inter_token_ms": 50.0}, overload=OverloadConfig(prefill_max_inflight=1)
    )
    async with trio.open_nursery() as load:
        load.start_soon(partial(post, cluster, "long", max_new_tokens=60))  # about 3 s of decode
        await cluster.decode.events.wait_for("first_token", rid="long")
        await cluster.prefill.events.wait_for("request_end", rid="long")
        with trio.fail_after(2):  # long before the first request ends
            response = await post(cluster, "short", max_new_tokens=1)
        assert response.status_code == 200
        assert not cluster.decode.events.find("request_end", rid="long")
    await cluster.client.aclose()


async def test_a_client_gone_while_queued_frees_its_place(nursery: trio.Nursery) -> None:
    cluster = await start_cluster(nursery, prefill={"prefill_ms_per_token": 60.0}, overload=CAP_ONE)
    gate = cluster.router.dispatch.gates.prefill
    async with trio.open_nursery() as load:
        load.start_soon(post, cluster, "holder")
        await cluster.prefill.events.wait_for("request_start", rid="holder")
        # The client gives up while queued (once it is in the line, not after a guessed delay).
        await leave_when(
            lambda: post(cluster, "impatient"), lambda: settle(lambda: gate.waiting == 1)
        )
        await settle(lambda: gate.waiting == 0)
        # Its place is free: the next one queues (not 429) and is served.
        assert (await post(cluster, "next")).status_code == 200
    assert not who_started(cluster.prefills, "impatient")
    assert gate.held == {} and gate.waiting == 0
    await cluster.client.aclose()


# -- the decode window --------------------------------------------------------------------------


async def test_the_decode_window_holds_dispatches_back(nursery: trio.Nursery) -> None:
    """A decode reporting max_running_requests 2 never holds more than 2 of this router's
    requests: the others wait in the router, not parked in the engine's queues."""
    cluster = await start_cluster(
        nursery, decode={"max_running": 2, "inter_token_ms": 20.0}, load_poll_interval_secs=POLL
    )
    codes: list[int] = []

    async def send(i: int) -> None:
        codes.append((await post(cluster, f"win-{i}", max_new_tokens=20)).status_code)

    async with trio.open_nursery() as load:
        for i in range(5):
            load.start_soon(send, i)
    assert codes == [200] * 5
    assert peak_in_flight(cluster.decode) == 2
    assert peak_in_flight(cluster.prefill) <= 2  # held before the pair is dispatched at all
    assert cluster.router.dispatch.gates.decode.held == {}
    await cluster.client.aclose()


async def test_a_full_window_past_the_wait_is_503(nursery: trio.Nursery) -> None:
    cluster = await start_cluster(
        nursery,
        decode={"max_running": 1, "inter_token_ms": 50.0},
        overload=OverloadConfig(pd_admission_wait_secs=0.3),
    )
    async with trio.open_nursery() as load:
        load.start_soon(partial(post, cluster, "running", max_new_tokens=40))
        await cluster.decode.events.wait_for("request_start", rid="running")
        refused = await post(cluster, "refused")
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "worker_overload_protection_shed"
        assert "running window of 1" in refused.json()["error"]["message"]
    assert not who_started(cluster.prefills, "refused") and not who_started(
        cluster.decodes, "refused"
    )
    await cluster.client.aclose()


async def test_a_zero_wait_turns_the_decode_gate_off(nursery: trio.Nursery) -> None:
    """0 is no gate (SMG 1.13: shed at once): the engine queues what its window cannot run."""
    cluster = await start_cluster(
        nursery,
        decode={"max_running": 1, "inter_token_ms": 20.0},
        overload=OverloadConfig(pd_admission_wait_secs=0),
    )
    codes: list[int] = []

    async def send(i: int) -> None:
        codes.append((await post(cluster, f"nogate-{i}", max_new_tokens=10)).status_code)

    async with trio.open_nursery() as load:
        for i in range(3):
            load.start_soon(send, i)
    assert codes == [200] * 3
    assert peak_in_flight(cluster.decode) == 3  # all three reached it; it ran one at a time
    await cluster.client.aclose()
