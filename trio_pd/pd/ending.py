"""What an attempt's end tells others: the legs it counts in the metrics (failed, cancelled
while their request was out, and how long the teardown took) and the error event that ends a
stream the client already started reading (docs/protocol.md §4)."""

from __future__ import annotations

from trio_pd.observe.metrics import RouterMetrics
from trio_pd.pd.frames import error_frame
from trio_pd.pd.outcome import AttemptOutcome, LegFailure


def stream_error_frame(outcome: AttemptOutcome) -> bytes:
    """The error event that ends a stream cut after it started (docs/protocol.md §4)."""
    failure = outcome.decode.result
    if isinstance(failure, LegFailure) and failure.kind != "timeout":
        return error_frame(f"decode worker failed: {failure.message}", "upstream_error", 502)
    message = failure.message if isinstance(failure, LegFailure) else "request deadline passed"
    return error_frame(message, "timeout_error", 504)


def account_cancelled_legs(metrics: RouterMetrics, outcome: AttemptOutcome) -> None:
    """Count each leg cancelled while its request was out, and how long its teardown took."""
    for leg in outcome.legs:
        if leg.cancel_cause is None or not leg.posted:
            continue
        metrics.legs_cancelled.labels(leg.role, leg.cancel_cause).inc()
        if leg.cancelled_at is not None and leg.ended_at is not None:
            metrics.teardown.labels(leg.role).observe(max(0.0, leg.ended_at - leg.cancelled_at))


def count_failures(metrics: RouterMetrics, outcome: AttemptOutcome) -> None:
    for leg in outcome.legs:
        if isinstance(leg.result, LegFailure):
            metrics.leg_failures.labels(leg.role, leg.result.kind).inc()
