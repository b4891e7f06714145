"""Engine rids owned by the router (issue 18 finding 4, issue 19 findings 1 and 6).

SGLang aborts every live rid that *starts with* the one given (`managers/scheduler.py`), refuses
a rid it holds, and takes a client's `rid` as is. So the router never lets a client's rid reach
an engine: each attempt gets a fixed-length random rid (one per batch item, zero-padded), and no
rid it hands out is a prefix of another. Two clients using the same `rid` therefore neither
collide nor abort each other, and the abort service cannot be fed two equal jobs."""

from __future__ import annotations

import random

import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import start_cluster
from tests.router.fleet_tools import FAST_HEALTH, LOOSE
from tests.router.helpers import CANCELLED, generate_body, leave_when, read_sse, settle
from trio_pd.pd.injection import MAX_ROOM, RID_LENGTH, attempt_rids, rooms_for


@settings(max_examples=200, deadline=None)
@given(batches=st.lists(st.one_of(st.none(), st.integers(1, 120)), min_size=2, max_size=12))
def test_no_rid_the_router_hands_out_is_a_prefix_of_another(batches: list[int | None]) -> None:
    rids: list[str] = []
    for batch in batches:
        made = attempt_rids(batch)
        items = [made] if isinstance(made, str) else made
        assert len(items) == (batch or 1)
        rids.extend(items)
    assert len(set(rids)) == len(rids)
    for a in rids:
        assert len(a) >= RID_LENGTH
        for b in rids:
            assert a == b or not b.startswith(a), (a, b)


def test_rooms_are_never_zero_even_when_the_draw_is_the_lowest() -> None:
    class Lowest(random.Random):
        def randint(self, a: int, b: int) -> int:
            return a

        def randrange(self, start: int, stop: int | None = None, step: int = 1) -> int:
            return start if stop is not None else 0

    low = Lowest()
    assert rooms_for(None, low) == 1  # room 0 is the decode's "metadata not yet" sentinel
    assert rooms_for(None, low, dp_size=4, rank=0) == 4  # aligned: 4 % 4 == 0, and not 0
    assert rooms_for(None, low, dp_size=4, rank=3) == 3
    rooms = rooms_for(3, random.Random(7))
    assert all(1 <= r <= MAX_ROOM for r in rooms) and len(set(rooms)) == 3


async def test_two_clients_with_one_rid_neither_collide_nor_abort_each_other(
    nursery: trio.Nursery,
) -> None:
    """Finding 6: client B knows client A's rid, sends it, then leaves. Before, B's request was
    refused by the engine (a duplicate rid) and the router's abort of B hit A's request."""
    cluster = await start_cluster(
        nursery, decode={"inter_token_ms": 20.0, "disconnect_poll_secs": 30.0},
        abort_on_cancel=True,
    )  # fmt: skip
    victim_body = generate_body(stream=True, max_new_tokens=40, rid="shared")
    async with trio.open_nursery() as inner:

        async def victim() -> list:
            async with cluster.client.stream(
                "POST", "/generate", json=victim_body, headers={"x-request-id": "victim"}
            ) as response:
                assert response.status_code == 200
                return await read_sse(response)

        result: dict[str, list] = {}

        async def run_victim() -> None:
            result["events"] = await victim()

        inner.start_soon(run_victim)
        await cluster.decode.events.wait_for("first_token", timeout=LOOSE, rid="victim")

        # The attacker: same client rid, then gone mid-stream.
        async def attack() -> None:
            async with cluster.client.stream(
                "POST", "/generate", json=victim_body, headers={"x-request-id": "attacker"}
            ) as response:
                assert response.status_code == 200  # not a duplicate-rid refusal
                await read_sse(response)

        gone = await leave_when(  # mid-stream: once its first token went out
            attack,
            lambda: cluster.decode.events.wait_for("first_token", timeout=LOOSE, rid="attacker"),
        )
        assert gone.cancelled_caught
        freed = await cluster.decode.events.wait_for("slot_freed", timeout=LOOSE, rid="attacker")
        assert freed["reason"] in CANCELLED  # provoked: the attacker's leg was aborted
    events = result["events"]
    assert events[-1] == "[DONE]" and len(events) == 41  # the victim got every token
    victim_rid = cluster.decode.events.find("request_start", rid="victim")[0]["sglang_rid"]
    attacker_rid = cluster.decode.events.find("request_start", rid="attacker")[0]["sglang_rid"]
    assert victim_rid != attacker_rid and "shared" not in (victim_rid, attacker_rid)
    aborted = {e["sglang_rid"] for e in cluster.decode.events.find("abort_request")}
    assert attacker_rid in aborted and victim_rid not in aborted
    await cluster.client.aclose()


async def test_equal_client_rids_abandoned_together_leave_the_services_alive(
    nursery: trio.Nursery,
) -> None:
    """Finding 1: two abandoned legs of requests with the same client rid made two equal abort
    jobs, which killed the lifespan (no more health checks, /health still 200)."""
    cluster = await start_cluster(
        nursery, decode={"inter_token_ms": 50.0}, abort_on_cancel=True, health=FAST_HEALTH,
    )  # fmt: skip
    body = generate_body(stream=True, max_new_tokens=100, rid="same")
    async with trio.open_nursery() as clients:
        for name in ("one", "two"):

            async def leave(name: str = name) -> None:
                async def stream() -> None:
                    async with cluster.client.stream(
                        "POST", "/generate", json=body, headers={"x-request-id": name}
                    ) as response:
                        await read_sse(response)

                await leave_when(  # mid-stream: once its first token went out
                    stream,
                    lambda: cluster.decode.events.wait_for("first_token", timeout=LOOSE, rid=name),
                )

            clients.start_soon(leave)
    for name in ("one", "two"):  # provoked: both legs were abandoned and aborted
        freed = await cluster.decode.events.wait_for("slot_freed", timeout=LOOSE, rid=name)
        assert freed["reason"] in CANCELLED
    sent = cluster.router.metrics.aborts.labels("decode", "sent")
    await settle(lambda: sent._value.get() >= 2, LOOSE)
    assert cluster.router.guard.failed is None

    # The services still run: the health checker goes on probing the engines.
    def probes() -> int:
        return len(cluster.decode.events.find("info_request", path="/health"))

    before = probes()
    await settle(lambda: probes() >= before + 2, LOOSE)
    await cluster.client.aclose()
