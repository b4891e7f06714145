"""Retry arithmetic, as SMG counts it: `max_retries` is the total number of attempts.

Only the numbers live here; `outcome.py` says what may be retried (never once bytes reached the
client, docs/behaviour.md "Retries") and the dispatcher sleeps with
`trio.sleep(backoff_delay(...))`.
"""

from __future__ import annotations

import random

from trio_pd.config import RetryConfig


def attempts(config: RetryConfig) -> int:
    """Total attempts per request: 1 when retries are disabled, else max_retries (at least 1)."""
    if not config.enabled:
        return 1
    return max(1, config.max_retries)


def backoff_delay(attempt: int, config: RetryConfig, rng: random.Random | None = None) -> float:
    """Seconds to wait after attempt number `attempt` (1-based) failed, before the next one.

    initial * multiplier**(attempt - 1), capped at max_backoff, then scaled by a uniform factor
    in [1 - jitter, 1 + jitter].
    """
    exponent = max(0, attempt - 1)
    try:
        base_ms = config.initial_backoff_ms * config.backoff_multiplier**exponent
    except OverflowError:
        base_ms = float(config.max_backoff_ms)
    base_ms = min(base_ms, float(config.max_backoff_ms))
    jitter = max(0.0, config.jitter_factor)
    if jitter:
        base_ms *= (rng or random).uniform(1.0 - jitter, 1.0 + jitter)
    return max(0.0, base_ms) / 1000.0
