"""Prometheus metrics of one router, in a registry of its own (two routers can share a process).

Fleet gauges are read at scrape time from the Fleet itself, so the hot path only bumps counters.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from trio_pd.fleet.workers import Fleet
    from trio_pd.upstream import UpstreamPool

BREAKER_STATES = {"closed": 0, "half_open": 1, "open": 2}


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "trio_pd_requests",
            "Client requests answered, by path and status (499: client went away).",
            ["path", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "trio_pd_request_duration_seconds",
            "Time from request start to the end of the response.",
            ["path"],
            registry=self.registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
        )
        self.leg_failures = Counter(
            "trio_pd_leg_failures",
            "Failed legs by role and kind (status, inband, transport, timeout).",
            ["role", "kind"],
            registry=self.registry,
        )
        self.retries = Counter(
            "trio_pd_retries", "Attempts beyond the first.", registry=self.registry
        )
        self.legs_cancelled = Counter(
            "trio_pd_legs_cancelled",
            "Legs cancelled while their request was out, by role and cause (prefill_failed, "
            "decode_failed, client_gone, deadline, stall, shutdown).",
            ["role", "cause"],
            registry=self.registry,
        )
        self.teardown = Histogram(
            "trio_pd_leg_teardown_seconds",
            "From the decision to cancel a leg to its upstream connection being closed.",
            ["role"],
            registry=self.registry,
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5),
        )
        self.internal_errors = Counter(
            "trio_pd_internal_errors",
            "Unexpected exceptions inside the router, answered 500 (or an error frame).",
            registry=self.registry,
        )
        self.background_restarts = Counter(
            "trio_pd_background_restarts",
            "Long-lived tasks restarted after an unexpected exception, by task.",
            ["task"],
            registry=self.registry,
        )

    def attach(self, fleet: Fleet, pool: UpstreamPool) -> None:
        """Add the scrape-time fleet and pool gauges."""
        self.registry.register(FleetCollector(fleet, pool))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class FleetCollector(Collector):
    def __init__(self, fleet: Fleet, pool: UpstreamPool) -> None:
        self.fleet = fleet
        self.pool = pool

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        labels = ["worker", "role", "url"]
        in_flight = GaugeMetricFamily("trio_pd_worker_in_flight", "Active legs.", labels=labels)
        healthy = GaugeMetricFamily("trio_pd_worker_healthy", "1 if healthy.", labels=labels)
        breaker = GaugeMetricFamily(
            "trio_pd_worker_breaker_state", "0 closed, 1 half-open, 2 open.", labels=labels
        )
        for worker in self.fleet.workers():
            key = [worker.id, worker.role, worker.url]
            in_flight.add_metric(key, worker.in_flight)
            healthy.add_metric(key, 1.0 if worker.healthy else 0.0)
            breaker.add_metric(key, BREAKER_STATES.get(worker.breaker.state, -1))
        pool = GaugeMetricFamily(
            "trio_pd_upstream_connections", "Pooled upstream connections.", labels=["state"]
        )
        counts: dict[str, int] = {}
        for _, state in self.pool.connections():
            counts[state] = counts.get(state, 0) + 1
        for state, count in counts.items():
            pool.add_metric([state], count)
        panics = CounterMetricFamily(
            "trio_pd_panic_selections",
            "Workers chosen while every healthy worker of the role had its breaker open.",
            labels=["role"],
        )
        for role, count in self.fleet.panics.items():
            panics.add_metric([role], count)
        yield from (in_flight, healthy, breaker, pool, panics)
