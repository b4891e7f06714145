"""The overload veto and the admission gates under MockClock: a stale report stops vetoing, the
prefill line is FIFO and times out, the decode window frees on release and reads fresh engine
figures only. Over real sockets: tests/router/test_overload.py."""

import random

import pytest
import trio

from trio_pd.config import OverloadConfig, PolicyConfig, RouterConfig
from trio_pd.fleet.gates import AtCapacity, DecodeGate, PrefillGate, QueueTimeout
from trio_pd.fleet.loads import polled_roles
from trio_pd.fleet.overload import overload_reason
from trio_pd.fleet.registry import Fleet
from trio_pd.fleet.reports import EngineLoad, RankLoad, ServerInfo
from trio_pd.spec import WorkerSpec


def fleet_of(n_decode: int = 2, **overload) -> Fleet:
    config = RouterConfig(
        prefill=(WorkerSpec("http://p:1", "prefill"),),
        decode=tuple(WorkerSpec(f"http://d:{i}", "decode") for i in range(n_decode)),
        policy=PolicyConfig(policy="round_robin"),
        load_poll_interval_secs=10.0,
        overload=OverloadConfig(**overload),
    )
    fleet = Fleet(config, random.Random(0))
    for worker in fleet.workers():
        worker.healthy = True
    return fleet


def load(waiting: int = 0, for_kv: int = 0, running: int = 0, usage: float = 0.0) -> EngineLoad:
    rank = RankLoad(running=running, waiting=waiting, waiting_for_kv=for_kv, token_usage=usage)
    return EngineLoad((rank,), "/v1/loads")


def test_protection_polls_every_role() -> None:
    assert polled_roles(PolicyConfig(), OverloadConfig()) == ("prefill", "decode")
    assert polled_roles(PolicyConfig(), OverloadConfig(protection=False)) == ()


async def test_a_stale_report_stops_vetoing(autojump_clock) -> None:
    fleet = fleet_of()
    busy = fleet.workers("decode")[1]
    busy.report_load(load(waiting=9))
    assert fleet.load_fresh_secs == 120.0  # twice the larger of health and poll intervals
    picks = {fleet.select("decode").id for _ in range(4)}
    assert picks == {"decode-1"}
    await trio.sleep(fleet.load_fresh_secs)  # no poll answered since
    assert overload_reason(busy, fleet.config.overload, trio.current_time()) is None
    picks = {fleet.select("decode").id for _ in range(4)}
    assert picks == {"decode-1", "decode-2"}


async def test_thresholds_are_at_or_above_and_kv_waiters_do_not_count(autojump_clock) -> None:
    fleet = fleet_of()
    decode = fleet.workers("decode")[0]
    config = fleet.config.overload
    now = trio.current_time()
    for report, reason in (
        (load(waiting=7), None),
        (load(waiting=8), "waiting"),
        (load(waiting=40, for_kv=33), None),  # 7 queued for compute
        (load(usage=0.79), None),
        (load(usage=0.8), "token_usage"),
    ):
        decode.report_load(report)
        assert overload_reason(decode, config, now) == reason, report
    decode.report_load(EngineLoad((RankLoad(waiting=40),), "/get_load"))  # no KV split known
    assert overload_reason(decode, config, now) is None


async def test_the_prefill_line_is_fifo_and_times_out(autojump_clock) -> None:
    gate = PrefillGate(cap=1, size=10, timeout_secs=5.0)
    worker = fleet_of().workers("prefill")[0]
    order: list[str] = []

    def select(has_room):
        if not has_room(worker):
            raise AtCapacity("prefill")
        return worker

    first = await gate.admit(select)

    async def wait(name: str) -> None:
        slot = await gate.admit(select)
        order.append(name)
        await trio.sleep(1.0)
        slot.release()

    async with trio.open_nursery() as nursery:
        for name in ("a", "b", "c"):
            nursery.start_soon(wait, name)
            await trio.sleep(0.01)
        await trio.sleep(2.0)
        first.release()
    assert order == ["a", "b", "c"]
    held = await gate.admit(select)
    started = trio.current_time()
    with pytest.raises(QueueTimeout):
        await gate.admit(select)
    assert trio.current_time() - started == pytest.approx(5.0)
    assert gate.waiting == 0
    held.release()
    assert gate.held == {}


async def test_the_decode_window_frees_on_release_and_reads_fresh_figures(autojump_clock) -> None:
    fleet = fleet_of(n_decode=1)
    decode = fleet.workers("decode")[0]
    decode.learn(ServerInfo(max_running_requests=2), None)
    gate = DecodeGate(wait_secs=30.0)
    one, two = await gate.admit(decode, 1), await gate.admit(decode, 1)
    released_at = []

    async def third() -> None:
        slot = await gate.admit(decode, 1)
        released_at.append(trio.current_time())
        assert slot is not None
        slot.release()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(third)
        await trio.sleep(3.0)
        assert not released_at
        assert one is not None and two is not None
        one.release()
    assert released_at and released_at[0] == pytest.approx(trio.current_time(), abs=0.1)
    assert two is not None
    two.release()
    decode.report_load(load(running=2))  # another router's two requests fill the window
    with trio.move_on_after(1.0) as waited:
        await gate.admit(decode, 1)
    assert waited.cancelled_caught
    await trio.sleep(fleet.load_fresh_secs)  # the figure went stale: it no longer counts
    slot = await gate.admit(decode, 1)
    assert slot is not None
