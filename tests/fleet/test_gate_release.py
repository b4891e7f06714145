"""The decode running-window gate ignores an engine figure older than the router's own last
release on that decode (docs/overload.md, "The decode window"): that figure still counts the
request the router just released, so reading it would keep a free place closed until the next
poll, or for the whole `--pd-admission-wait-secs`. Under MockClock; issue 28."""

import random

import pytest
import trio

from trio_pd.config import OverloadConfig, PolicyConfig, RouterConfig
from trio_pd.fleet.gates import DecodeGate, WindowFull
from trio_pd.fleet.registry import Fleet
from trio_pd.fleet.reports import EngineLoad, RankLoad, ServerInfo
from trio_pd.fleet.worker import Worker
from trio_pd.spec import WorkerSpec

WAIT_SECS = 30.0  # --pd-admission-wait-secs' default


def one_decode(window: int) -> Worker:
    config = RouterConfig(
        prefill=(WorkerSpec("http://p:1", "prefill"),),
        decode=(WorkerSpec("http://d:1", "decode"),),
        policy=PolicyConfig(policy="round_robin"),
        load_poll_interval_secs=10.0,
        overload=OverloadConfig(),
    )
    decode = Fleet(config, random.Random(0)).workers("decode")[0]
    decode.healthy = True
    decode.learn(ServerInfo(max_running_requests=window), None)
    return decode


def running(n: int) -> EngineLoad:
    return EngineLoad((RankLoad(running=n),), "/v1/loads")


async def test_a_figure_older_than_the_routers_release_is_ignored(autojump_clock) -> None:
    decode = one_decode(window=2)
    gate = DecodeGate(wait_secs=WAIT_SECS)
    first, second = await gate.admit(decode, 1), await gate.admit(decode, 1)
    assert first is not None and second is not None
    await trio.sleep(1.0)
    decode.report_load(running(2))  # the engine runs our two: the window is full, and fresh
    assert gate.used(decode) == 2
    await trio.sleep(1.0)
    first.release()  # ours ended after that report: the engine's 2 still counts it
    assert gate.released_at[decode] > decode.reported_at  # the provoked order

    started = trio.current_time()
    with trio.move_on_after(WAIT_SECS + 1) as waited:
        third = await gate.admit(decode, 1)
    assert not waited.cancelled_caught
    assert third is not None
    assert trio.current_time() == started  # a free place is taken at once, not after 30 s
    assert gate.held[decode] == 2


async def test_a_waiting_claim_is_admitted_by_the_release(autojump_clock) -> None:
    """The waiter queued while the fresh report filled the window goes in at the release, not
    when the report goes stale or the wait ends in a 503."""
    decode = one_decode(window=2)
    gate = DecodeGate(wait_secs=WAIT_SECS)
    first, second = await gate.admit(decode, 1), await gate.admit(decode, 1)
    assert first is not None and second is not None
    decode.report_load(running(2))
    admitted_at: list[float] = []

    async def third() -> None:
        slot = await gate.admit(decode, 1)
        assert slot is not None
        admitted_at.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(third)
        await trio.sleep(5.0)
        assert not admitted_at  # it waited: the window was full
        released = trio.current_time()
        first.release()
    assert admitted_at and admitted_at[0] - released < 0.1


async def test_a_report_after_the_release_counts_again(autojump_clock) -> None:
    """Other routers' requests: a figure taken after our release is the engine's word."""
    decode = one_decode(window=2)
    gate = DecodeGate(wait_secs=WAIT_SECS)
    first = await gate.admit(decode, 1)
    assert first is not None
    first.release()
    await trio.sleep(1.0)
    decode.report_load(running(2))  # two requests of another router, reported after ours ended
    assert gate.used(decode) == 2
    started = trio.current_time()
    try:
        await gate.admit(decode, 1)
    except WindowFull:
        pass
    else:
        raise AssertionError("a full window admitted a claim")
    assert trio.current_time() - started == pytest.approx(WAIT_SECS)
