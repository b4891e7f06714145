import random

import pytest

from trio_pd.config import RetryConfig
from trio_pd.fleet.retry import attempts, backoff_delay
from trio_pd.pd.outcome import RETRYABLE_STATUSES

NO_JITTER = RetryConfig(
    initial_backoff_ms=100, max_backoff_ms=1000, backoff_multiplier=2.0, jitter_factor=0.0
)


def test_backoff_grows_geometrically():
    delays = [backoff_delay(a, NO_JITTER, random.Random(0)) for a in (1, 2, 3, 4)]
    assert delays == [0.1, 0.2, 0.4, 0.8]


def test_backoff_is_capped():
    assert backoff_delay(5, NO_JITTER, random.Random(0)) == 1.0
    assert backoff_delay(50, NO_JITTER, random.Random(0)) == 1.0
    assert backoff_delay(100_000, NO_JITTER, random.Random(0)) == 1.0  # no overflow


def test_backoff_jitter_bounds_and_spread():
    cfg = RetryConfig(initial_backoff_ms=50, backoff_multiplier=1.5, jitter_factor=0.2)
    rng = random.Random(7)
    samples = [backoff_delay(3, cfg, rng) for _ in range(2000)]
    base = 0.05 * 1.5**2
    assert all(base * 0.8 <= s <= base * 1.2 for s in samples)
    assert min(samples) < base * 0.85 and max(samples) > base * 1.15


def test_backoff_jitter_applies_to_the_cap():
    cfg = RetryConfig(initial_backoff_ms=50, max_backoff_ms=200, jitter_factor=0.2)
    samples = [backoff_delay(40, cfg, random.Random(i)) for i in range(200)]
    assert all(0.16 <= s <= 0.24 for s in samples)


def test_backoff_deterministic_with_seeded_rng():
    cfg = RetryConfig()
    a = [backoff_delay(i, cfg, random.Random(3)) for i in range(1, 6)]
    b = [backoff_delay(i, cfg, random.Random(3)) for i in range(1, 6)]
    assert a == b


@pytest.mark.parametrize(
    ("cfg", "expected"),
    [
        (RetryConfig(), 5),
        (RetryConfig(max_retries=2), 2),
        (RetryConfig(max_retries=0), 1),
        (RetryConfig(max_retries=5, enabled=False), 1),
    ],
)
def test_attempts(cfg, expected):
    assert attempts(cfg) == expected


def test_retryable_statuses():
    assert frozenset({408, 429, 500, 502, 503, 504}) == RETRYABLE_STATUSES
    assert 400 not in RETRYABLE_STATUSES and 501 not in RETRYABLE_STATUSES
