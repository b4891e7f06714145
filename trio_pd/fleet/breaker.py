"""Per-worker circuit breaker (docs/protocol.md §5), timed with `trio.current_time()` only.

closed -> open after `failure_threshold` consecutive failures; open -> half_open once
`timeout_duration_secs` have passed since it opened (evaluated lazily, whenever `state` is read);
half_open -> closed after `success_threshold` successes; any failure in half_open reopens it.
A disabled breaker stays closed and always allows requests; it still counts outcomes.

`--cb-window-duration-secs` ("sliding window duration in seconds for tracking failures") is
deliberately not read here. In SMG 0.3.2 it reaches `CircuitBreakerConfig.window_duration`
(`src/core/circuit_breaker.rs`) and is checked to be > 0 (`src/config/validation.rs`), but no
code reads it: SMG's breaker opens after `failure_threshold` consecutive failures however far
apart they are, and so does this one. A window would also be the weaker rule here: a worker that
fails every request but gets few of them would never collect enough failures inside it.
"""

from __future__ import annotations

from typing import Literal

import attrs
import trio

from trio_pd.config import BreakerConfig

BreakerState = Literal["closed", "open", "half_open"]


@attrs.define
class CircuitBreaker:
    config: BreakerConfig = attrs.field(factory=BreakerConfig)
    consecutive_failures: int = attrs.field(default=0, init=False)
    consecutive_successes: int = attrs.field(default=0, init=False)
    total_failures: int = attrs.field(default=0, init=False)
    total_successes: int = attrs.field(default=0, init=False)
    opened_at: float | None = attrs.field(default=None, init=False)  # trio time of last opening
    _state: BreakerState = attrs.field(default="closed", init=False)

    @property
    def state(self) -> BreakerState:
        if (
            self._state == "open"
            and self.opened_at is not None
            and trio.current_time() - self.opened_at >= self.config.timeout_duration_secs
        ):
            self._to("half_open")
        return self._state

    def allows_request(self) -> bool:
        if not self.config.enabled:
            return True
        return self.state != "open"

    def record_success(self) -> None:
        state = self.state  # settle a lazy open -> half_open first, so this success counts
        self.total_successes += 1
        self.consecutive_failures = 0
        self.consecutive_successes += 1
        if (
            self.config.enabled
            and state == "half_open"
            and self.consecutive_successes >= self.config.success_threshold
        ):
            self._to("closed")

    def record_failure(self) -> None:
        state = self.state
        self.total_failures += 1
        self.consecutive_successes = 0
        self.consecutive_failures += 1
        if not self.config.enabled:
            return
        if state == "half_open" or (
            state == "closed" and self.consecutive_failures >= self.config.failure_threshold
        ):
            self._to("open")

    def to_json(self) -> dict[str, object]:
        return {
            "state": self.state,
            "consecutive_failures": self.consecutive_failures,
            "consecutive_successes": self.consecutive_successes,
            "total_failures": self.total_failures,
            "total_successes": self.total_successes,
            "opened_at": self.opened_at,
        }

    def _to(self, state: BreakerState) -> None:
        self._state = state
        if state == "open":
            self.opened_at = trio.current_time()
            self.consecutive_successes = 0
        elif state == "half_open":
            self.consecutive_successes = 0
            self.consecutive_failures = 0
        else:
            self.opened_at = None
            self.consecutive_successes = 0
            self.consecutive_failures = 0
