"""The admission cap, the rate limit's token bucket and the line in front of both, on trio's
MockClock (no sleeping)."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from trio_pd.cli.main import build_parser, router_config
from trio_pd.config import RouterConfig
from trio_pd.edge.admission import Admission
from trio_pd.edge.token_bucket import TokenBucket
from trio_pd.errors import RouterError
from trio_pd.serve.supervisor import per_process, process_config


async def test_bucket_starts_full_and_refills_at_its_rate_up_to_capacity(autojump_clock) -> None:
    bucket = TokenBucket(capacity=4, rate=2)
    assert [bucket.try_take() for _ in range(5)] == [True] * 4 + [False]
    await trio.sleep(0.25)
    assert bucket.tokens == pytest.approx(0.5)
    assert not bucket.try_take()
    await trio.sleep(0.25)
    assert bucket.try_take()  # one token after half a second at 2/s
    await trio.sleep(60)
    assert bucket.tokens == 4.0  # never more than the capacity


async def test_take_waits_exactly_for_the_next_token(autojump_clock) -> None:
    bucket = TokenBucket(capacity=1, rate=4)
    assert bucket.try_take()
    start = trio.current_time()
    await bucket.take()
    assert trio.current_time() - start == pytest.approx(0.25)
    assert bucket.tokens == pytest.approx(0.0)


def test_bucket_refuses_nonsense() -> None:
    with pytest.raises(ValueError):
        TokenBucket(capacity=0, rate=1)
    with pytest.raises(ValueError):
        TokenBucket(capacity=1, rate=-1)
    with pytest.raises(ValueError):
        TokenBucket(capacity=1, rate=0)  # no rate limit: admission makes no bucket


# -- admission -----------------------------------------------------------------------------


async def admit(admission: Admission, outcomes: dict[str, object], name: str, hold: float) -> None:
    """One request: admitted (holding its token for `hold` seconds) or refused."""
    try:
        async with admission.slot():
            outcomes[name] = trio.current_time()
            await trio.sleep(hold)
    except RouterError as error:
        outcomes[name] = error


async def test_the_cap_holds_however_long_requests_run(autojump_clock) -> None:
    # --max-concurrent-requests 2 without a rate: two run, the others wait for them to end
    # (SMG 0.3.2's refill would let one more in every half second beside them).
    admission = Admission(2, queue_size=10, queue_timeout_secs=60)
    assert admission.bucket is None
    outcomes: dict[str, object] = {}
    async with trio.open_nursery() as nursery:
        for name in ("a", "b", "c", "d"):
            nursery.start_soon(admit, admission, outcomes, name, 5.0)
            await trio.sleep(0.01)
        await trio.sleep(1)
        assert set(outcomes) == {"a", "b"}  # c and d are waiting, not refused
        assert admission.waiting == 2
    assert outcomes == {
        "a": 0.0,
        "b": pytest.approx(0.01),
        "c": pytest.approx(5.0),
        "d": pytest.approx(5.01),
    }


async def test_a_rate_limits_admissions_even_with_the_cap_free(autojump_clock) -> None:
    # Cap 3, 1 token a second: a burst of three, then one a second, though each request ends
    # at once (its slot is free again; a spent token is not).
    admission = Admission(3, queue_size=10, queue_timeout_secs=60, tokens_per_second=1)
    assert admission.bucket is not None
    outcomes: dict[str, object] = {}
    async with trio.open_nursery() as nursery:
        for name in ("a", "b", "c", "d", "e"):
            nursery.start_soon(admit, admission, outcomes, name, 0.0)
            await trio.sleep(0.001)
    assert admission.limiter is not None and admission.limiter.borrowed_tokens == 0
    assert [outcomes[n] for n in "abc"] == pytest.approx([0.0, 0.001, 0.002])
    assert outcomes["d"] == pytest.approx(1.0)
    assert outcomes["e"] == pytest.approx(2.0)


async def test_queue_full_is_429_and_a_wait_that_runs_out_is_408(autojump_clock) -> None:
    admission = Admission(1, queue_size=1, queue_timeout_secs=5, tokens_per_second=0)
    outcomes: dict[str, object] = {}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(admit, admission, outcomes, "running", 100.0)
        await trio.sleep(1)
        nursery.start_soon(admit, admission, outcomes, "queued", 0.0)
        await trio.sleep(1)
        assert admission.waiting == 1
        nursery.start_soon(admit, admission, outcomes, "rejected", 0.0)
        await trio.sleep(0.5)
        rejected = outcomes["rejected"]
        assert isinstance(rejected, RouterError) and rejected.status == 429
        assert trio.current_time() == pytest.approx(2.5)  # at once, not after a wait
    queued = outcomes["queued"]
    assert isinstance(queued, RouterError)
    assert queued.status == 408  # SMG's queue answers REQUEST_TIMEOUT
    assert queued.error_type == "timeout_error"
    assert dict(queued.headers)[b"retry-after"] == b"1"
    assert admission.waiting == 0


async def test_no_queue_rejects_at_once(autojump_clock) -> None:
    admission = Admission(1, queue_size=0, queue_timeout_secs=60)
    outcomes: dict[str, object] = {}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(admit, admission, outcomes, "running", 0.1)
        await trio.sleep(0.01)
        nursery.start_soon(admit, admission, outcomes, "rejected", 0.0)
    rejected = outcomes["rejected"]
    assert isinstance(rejected, RouterError) and rejected.status == 429
    assert "no queue" in rejected.message


async def test_the_line_is_first_come_first_served(autojump_clock) -> None:
    admission = Admission(1, queue_size=10, queue_timeout_secs=60, tokens_per_second=1)
    admitted: list[str] = []

    async def request(name: str) -> None:
        async with admission.slot():
            admitted.append(name)
            await trio.sleep(1.5)

    async with trio.open_nursery() as nursery:
        for name in ("first", "second", "third", "fourth"):
            nursery.start_soon(request, name)
            await trio.sleep(0.01)
        await trio.sleep(2)
        assert admitted == ["first", "second"]
    assert admitted == ["first", "second", "third", "fourth"]


async def test_a_request_leaving_the_line_frees_its_place(autojump_clock) -> None:
    admission = Admission(1, queue_size=1, queue_timeout_secs=60, tokens_per_second=0)
    outcomes: dict[str, object] = {}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(admit, admission, outcomes, "running", 10.0)
        await trio.sleep(0.01)
        with trio.move_on_after(1):  # the client goes away while in line
            await admit(admission, outcomes, "gone", 0.0)
        assert "gone" not in outcomes and admission.waiting == 0
        nursery.start_soon(admit, admission, outcomes, "next", 0.0)
    assert outcomes["next"] == pytest.approx(10.0)  # had a place in line, got the slot


async def test_no_limit_means_no_cap_and_no_bucket(autojump_clock) -> None:
    admission = Admission(-1, queue_size=0, queue_timeout_secs=1, tokens_per_second=5)
    assert admission.limiter is None and admission.bucket is None  # SMG: no bucket without a cap
    async with admission.slot(), admission.slot():
        pass


# -- flags and --workers N ------------------------------------------------------------------


def test_rate_flag_defaults_to_none_and_is_validated() -> None:
    parser = build_parser()
    assert router_config(parser.parse_args(["serve"])).rate_limit_tokens_per_second is None
    config = router_config(parser.parse_args(["serve", "--rate-limit-tokens-per-second", "7"]))
    assert config.rate_limit_tokens_per_second == 7
    with pytest.raises(SystemExit):
        router_config(parser.parse_args(["serve", "--rate-limit-tokens-per-second", "-1"]))


@pytest.mark.parametrize(
    ("limit", "rate", "queue", "caps", "rates", "queues"),
    [
        (10, None, 100, [3, 3, 2, 2], [None] * 4, [25] * 4),  # no rate limit in any process
        (10, 4, 10, [3, 3, 2, 2], [1.2, 1.2, 0.8, 0.8], [3, 3, 2, 2]),
        (10, 0, 0, [3, 3, 2, 2], [0] * 4, [0] * 4),  # 0: no rate limit either
        (-1, None, 5, [-1] * 4, [None] * 4, [2, 1, 1, 1]),  # no cap: nothing to share but the line
    ],
)
def test_workers_share_the_cap_the_rate_and_the_line_exactly(
    limit: int,
    rate: float | None,
    queue: int,
    caps: list[int],
    rates: list[float | None],
    queues: list[int],
) -> None:
    config = RouterConfig(
        max_concurrent_requests=limit, rate_limit_tokens_per_second=rate, queue_size=queue,
        workers=4,
    )  # fmt: skip
    child = per_process(config, 4, Path("/tmp/unused"))
    each = [process_config(child, config, index) for index in range(4)]
    assert [c.max_concurrent_requests for c in each] == caps
    assert [c.rate_limit_tokens_per_second for c in each] == pytest.approx(rates)
    assert [c.queue_size for c in each] == queues
    if limit > 0:  # the totals are the flags'
        assert sum(caps) == limit and sum(queues) == queue
        if rate:
            assert sum(c.rate_limit_tokens_per_second for c in each) == pytest.approx(rate)


def test_a_cap_below_the_process_count_is_refused() -> None:
    parser = build_parser()
    argv = ["serve", "--workers", "4", "--max-concurrent-requests"]
    with pytest.raises(SystemExit):
        router_config(parser.parse_args([*argv, "3"]))
    assert router_config(parser.parse_args([*argv, "4"])).max_concurrent_requests == 4


@pytest.mark.parametrize("limit", [10, -1])
def test_workers_share_the_memory_budget_exactly(limit: int) -> None:
    """--max-buffered-bytes is the router's, not each process's: the shares add up to it."""
    config = RouterConfig(
        max_buffered_bytes=10 * 2**30 + 3, max_concurrent_requests=limit, workers=4
    )
    child = per_process(config, 4, Path("/tmp/unused"))
    shares = [process_config(child, config, i).max_buffered_bytes for i in range(4)]
    assert sum(shares) == config.max_buffered_bytes
    assert max(shares) - min(shares) <= 1
    off = RouterConfig(max_buffered_bytes=0, workers=4)
    assert process_config(per_process(off, 4, Path("/tmp/unused")), off, 0).max_buffered_bytes == 0
