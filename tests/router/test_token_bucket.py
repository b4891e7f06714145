"""SMG's token bucket and the admission line in front of it, on trio's MockClock (no sleeping)."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from trio_pd.admission import Admission
from trio_pd.cli import build_parser, router_config
from trio_pd.config import RouterConfig
from trio_pd.errors import RouterError
from trio_pd.processes import per_process
from trio_pd.token_bucket import TokenBucket


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


async def test_a_token_given_back_is_there_at_once_but_never_beyond_capacity(
    autojump_clock,
) -> None:
    bucket = TokenBucket(capacity=2, rate=1)
    assert bucket.try_take() and bucket.try_take() and not bucket.try_take()
    bucket.give_back()  # a request ended: SMG's TokenGuardBody returns its token
    assert bucket.try_take()
    assert not bucket.try_take()
    await trio.sleep(10)
    bucket.give_back()
    assert bucket.tokens == 2.0  # full already: the returned token is lost, as in SMG


async def test_rate_zero_is_a_semaphore(autojump_clock) -> None:
    bucket = TokenBucket(capacity=1, rate=0)
    assert bucket.try_take()
    await trio.sleep(3600)
    assert not bucket.try_take()  # no refill, ever
    bucket.give_back()
    assert bucket.try_take()


async def test_take_waits_exactly_for_the_next_token(autojump_clock) -> None:
    bucket = TokenBucket(capacity=1, rate=4)
    assert bucket.try_take()
    start = trio.current_time()
    await bucket.take()
    assert trio.current_time() - start == pytest.approx(0.25)
    assert bucket.tokens == pytest.approx(0.0)


async def test_take_wakes_when_a_token_is_given_back(autojump_clock) -> None:
    bucket = TokenBucket(capacity=1, rate=0)
    assert bucket.try_take()
    took_at: list[float] = []

    async def wait() -> None:
        await bucket.take()
        took_at.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait)
        await trio.sleep(3)
        assert took_at == []
        bucket.give_back()
    assert took_at == [pytest.approx(3.0)]


def test_bucket_refuses_nonsense() -> None:
    with pytest.raises(ValueError):
        TokenBucket(capacity=0, rate=1)
    with pytest.raises(ValueError):
        TokenBucket(capacity=1, rate=-1)


# -- admission -----------------------------------------------------------------------------


async def admit(admission: Admission, outcomes: dict[str, object], name: str, hold: float) -> None:
    """One request: admitted (holding its token for `hold` seconds) or refused."""
    try:
        async with admission.slot():
            outcomes[name] = trio.current_time()
            await trio.sleep(hold)
    except RouterError as error:
        outcomes[name] = error


async def test_default_refill_lets_requests_in_beside_those_still_running(
    autojump_clock,
) -> None:
    # SMG: --max-concurrent-requests 2 and no rate: the bucket refills 2 tokens a second, so
    # long requests do not keep later ones out (the cap holds for the first second only).
    admission = Admission(2, queue_size=10, queue_timeout_secs=60)
    assert admission.bucket is not None and admission.bucket.rate == 2.0
    outcomes: dict[str, object] = {}
    async with trio.open_nursery() as nursery:
        for name in ("a", "b", "c", "d"):
            nursery.start_soon(admit, admission, outcomes, name, 100.0)
            await trio.sleep(0.01)
    assert outcomes == {"a": 0.0, "b": 0.01, "c": pytest.approx(0.5), "d": pytest.approx(1.0)}


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
            await trio.sleep(100)

    async with trio.open_nursery() as nursery:
        for name in ("first", "second", "third", "fourth"):
            nursery.start_soon(request, name)
            await trio.sleep(0.01)
        await trio.sleep(5)
        nursery.cancel_scope.cancel()
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
    assert outcomes["next"] == pytest.approx(10.0)  # had a place in line, got the token


async def test_no_limit_means_no_bucket(autojump_clock) -> None:
    admission = Admission(-1, queue_size=0, queue_timeout_secs=1)
    assert admission.bucket is None
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
    ("limit", "rate", "each_limit", "each_rate"),
    [
        (10, None, 3, 2.5),  # the default rate is the whole capacity, shared out
        (10, 4, 3, 1.0),
        (10, 0, 3, 0.0),  # a semaphore in every process
        (-1, None, -1, None),  # no limit: nothing to share
    ],
)
def test_workers_share_the_capacity_and_the_rate(
    limit: int, rate: float | None, each_limit: int, each_rate: float | None
) -> None:
    config = RouterConfig(max_concurrent_requests=limit, rate_limit_tokens_per_second=rate)
    child = per_process(config, 4, Path("/tmp/unused"))
    assert child.max_concurrent_requests == each_limit
    assert child.rate_limit_tokens_per_second == each_rate
