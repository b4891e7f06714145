import trio

from trio_pd.config import BreakerConfig
from trio_pd.fleet.breaker import CircuitBreaker

CFG = BreakerConfig(failure_threshold=3, success_threshold=2, timeout_duration_secs=10.0)


async def test_closed_to_open_after_consecutive_failures(autojump_clock):
    b = CircuitBreaker(CFG)
    assert b.state == "closed" and b.allows_request()
    b.record_failure()
    b.record_failure()
    assert b.state == "closed"
    b.record_failure()
    assert b.state == "open"
    assert not b.allows_request()
    assert b.opened_at == trio.current_time()


async def test_success_resets_consecutive_failures(autojump_clock):
    b = CircuitBreaker(CFG)
    b.record_failure()
    b.record_failure()
    b.record_success()
    assert b.consecutive_failures == 0
    b.record_failure()
    b.record_failure()
    assert b.state == "closed"
    b.record_failure()
    assert b.state == "open"


async def test_open_becomes_half_open_after_timeout(autojump_clock):
    b = CircuitBreaker(CFG)
    for _ in range(3):
        b.record_failure()
    await trio.sleep(9.9)
    assert b.state == "open"
    assert not b.allows_request()
    await trio.sleep(0.1)
    assert b.state == "half_open"
    assert b.allows_request()


async def test_half_open_closes_after_success_threshold(autojump_clock):
    b = CircuitBreaker(CFG)
    for _ in range(3):
        b.record_failure()
    await trio.sleep(10)
    # The first success is counted even though nobody read `state` after the timeout.
    b.record_success()
    assert b.state == "half_open"
    b.record_success()
    assert b.state == "closed"
    assert b.opened_at is None
    assert b.allows_request()


async def test_half_open_failure_reopens_with_fresh_timeout(autojump_clock):
    b = CircuitBreaker(CFG)
    for _ in range(3):
        b.record_failure()
    await trio.sleep(10)
    assert b.state == "half_open"
    b.record_success()
    b.record_failure()
    assert b.state == "open"
    assert b.opened_at == trio.current_time()
    await trio.sleep(5)
    assert b.state == "open"
    await trio.sleep(5)
    assert b.state == "half_open"


async def test_success_while_open_does_not_close(autojump_clock):
    b = CircuitBreaker(CFG)
    for _ in range(3):
        b.record_failure()
    for _ in range(5):
        b.record_success()  # late answers of requests sent before it opened
    assert b.state == "open"


async def test_disabled_breaker_always_allows(autojump_clock):
    b = CircuitBreaker(BreakerConfig(failure_threshold=1, enabled=False))
    for _ in range(20):
        b.record_failure()
    assert b.state == "closed"
    assert b.allows_request()
    assert b.consecutive_failures == 20
    assert b.to_json()["total_failures"] == 20


async def test_window_does_not_age_out_failures_as_in_smg(autojump_clock):
    # SMG 0.3.2 stores --cb-window-duration-secs but no breaker reads it: failures far apart
    # (here each one more than a whole window after the last) still open it when consecutive.
    cfg = BreakerConfig(failure_threshold=3, timeout_duration_secs=10.0, window_duration_secs=5)
    b = CircuitBreaker(cfg)
    for _ in range(2):
        b.record_failure()
        await trio.sleep(cfg.window_duration_secs * 3)
    assert b.state == "closed" and b.consecutive_failures == 2
    b.record_failure()
    assert b.state == "open"
    assert BreakerConfig().window_duration_secs == 120
