"""Prometheus metrics of one router, in a registry of its own (two routers can share a process).

The PD story in numbers: requests by status, leg failures by kind, legs cancelled by cause
(prefill_failed, decode_failed, client_gone, deadline, stall, shutdown), the router-side
teardown time (the decision to cancel a leg -> its connection closed), time to first token and
gaps between relayed chunks, events relayed, the admission queue, aborts sent to engines, and
per-worker gauges.

One process: fleet, pool and queue gauges are read at scrape time from the objects themselves,
so the hot path only bumps counters. `--workers N` (PROMETHEUS_MULTIPROC_DIR set by the parent):
every process writes its values to the shared directory and `/metrics` on any process renders
the sum over all of them (prometheus-client's multiprocess mode); the gauges are then copied into
multiprocess gauges once a second (`sync_gauges`): in-flight legs and connections summed over
processes, breaker state the worst, health the worst.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from trio_pd.fleet.registry import Fleet
    from trio_pd.respond import RequestOutcome
    from trio_pd.upstream.pool import UpstreamPool

BREAKER_STATES = {"closed": 0, "half_open": 1, "open": 2}
WORKER_LABELS = ["worker", "role", "url"]
FAST_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1, 5)
TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


CONTENT_TYPE = b"text/plain; version=0.0.4"  # what generate_latest writes
REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
DURATION_SUFFIX = "duration_seconds"  # SMG's matcher for --prometheus-duration-buckets


class RouterMetrics:
    """``duration_buckets`` (`--prometheus-duration-buckets`) replace the buckets of every
    histogram named `*duration_seconds`, the rule SMG applies (`Matcher::Suffix`); the
    others (teardown, first token, chunk gaps, admission waits) keep their own scales."""

    def __init__(
        self,
        multiprocess_dir: str | None = None,
        duration_buckets: tuple[float, ...] | None = None,
    ) -> None:
        if multiprocess_dir is None:
            multiprocess_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None
        self.multiprocess_dir = multiprocess_dir
        self.duration_buckets = duration_buckets
        self.registry = CollectorRegistry()
        self._gauges: SyncedGauges | None = None
        self._per_request: dict[tuple[str, int], tuple[Counter, Histogram]] = {}
        # One family of metrics per method, each an area of the router.
        self._requests(self.registry)
        self._legs(self.registry)
        self._services(self.registry)
        self._vllm(self.registry)

    def _requests(self, r: CollectorRegistry) -> None:
        """What clients got: requests by status, latency, first token, chunk gaps, queueing."""
        self.requests = Counter(
            "trio_pd_requests",
            "Client requests answered, by path and status (499: client went away).",
            ["path", "status"],
            registry=r,
        )
        self.model_requests = Counter(
            "trio_pd_model_requests",
            "Generation requests by model and status, when the router serves several models.",
            ["model", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "trio_pd_request_duration_seconds",
            "Time from request start to the end of the response.",
            ["path"],
            registry=r,
            buckets=self.buckets_for("trio_pd_request_duration_seconds", REQUEST_BUCKETS),
        )
        self.first_token = Histogram(
            "trio_pd_time_to_first_token_seconds",
            "Streams: from the request's start to decode's first event going to the client.",
            registry=r,
            buckets=self.buckets_for("trio_pd_time_to_first_token_seconds", TOKEN_BUCKETS),
        )
        self.chunk_gap = Histogram(
            "trio_pd_stream_chunk_gap_seconds",
            "Streams: time between two relayed decode chunks (inter-token gaps).",
            registry=r,
            buckets=self.buckets_for("trio_pd_stream_chunk_gap_seconds", TOKEN_BUCKETS),
        )
        self.connections_refused = Counter(
            "trio_pd_client_connections_refused",
            "Client connections the data port refused at once: --max-client-connections were "
            "open (issue 26, N6).",
            registry=r,
        )
        self.events_relayed = Counter(
            "trio_pd_events_relayed", "SSE events relayed from decode to clients.", registry=r
        )
        self.admission_waits = Histogram(
            "trio_pd_admission_wait_seconds",
            "Time requests waited in the admission queue (--max-concurrent-requests).",
            ["outcome"],
            registry=r,
            buckets=self.buckets_for("trio_pd_admission_wait_seconds", TOKEN_BUCKETS),
        )

    def _legs(self, r: CollectorRegistry) -> None:
        """What happened to the legs: failures, retries, cancellations, teardown, aborts."""
        self.leg_failures = Counter(
            "trio_pd_leg_failures",
            "Failed legs by role and kind (status, inband, transport, timeout).",
            ["role", "kind"],
            registry=r,
        )
        self.retries = Counter("trio_pd_retries", "Attempts beyond the first.", registry=r)
        self.retries_declined = Counter(
            "trio_pd_retries_declined",
            "Retries the policy allowed and the router did not make, by reason (no_fresh_decode: "
            "a vLLM retry would lease another prefill's KV for a decode that already failed).",
            ["reason"],
            registry=r,
        )
        self.migrations = Counter(
            "trio_pd_migrations",
            "Streams whose decode broke after prefill succeeded, by what broke (transport, "
            "timeout, inband) and what the router did: resumed on a fresh pair, refused_<rule> "
            "(resuming would change the answer, pd/migration.py), limit (--migration-limit "
            "spent), context (over the engine's context), failed (the resume could not start).",
            ["reason", "outcome"],
            registry=r,
        )
        self.legs_cancelled = Counter(
            "trio_pd_legs_cancelled",
            "Legs cancelled while their request was out, by role and cause (prefill_failed, "
            "decode_failed, client_gone, deadline, stall, shutdown).",
            ["role", "cause"],
            registry=r,
        )
        self.teardown = Histogram(
            "trio_pd_leg_teardown_seconds",
            "From the decision to cancel a leg to its upstream connection being closed.",
            ["role"],
            registry=r,
            buckets=self.buckets_for("trio_pd_leg_teardown_seconds", FAST_BUCKETS),
        )
        self.aborts = Counter(
            "trio_pd_aborts",
            "POST /abort_request sent to engines for cancelled legs, by role and result (sent, "
            "failed, coalesced: already pending, dropped: the abort queue was full).",
            ["role", "result"],
            registry=r,
        )
        self.release_audits = Counter(
            "trio_pd_release_audits",
            "Reads of a worker's /v1/loads after aborts were sent to it, by role and result "
            "(released: it held nothing beyond this router's legs; held; failed: not read). "
            "docs/operations.md says what it can and cannot see.",
            ["role", "result"],
            registry=r,
        )
        self.panic_selections = Counter(
            "trio_pd_panic_selections",
            "Workers chosen while every healthy worker of the role had its breaker open.",
            ["role"],
            registry=r,
        )
        self.load_reports_rejected = Counter(
            "trio_pd_load_reports_rejected",
            "Engine load reports refused as impossible (a worker fault: negative, absurd or "
            "contradictory figures); the worker's load is unknown until a believable one.",
            ["worker", "role", "reason"],
            registry=r,
        )
        self.overload_decisions = Counter(
            "trio_pd_overload_decisions",
            "Selections the overload veto changed (docs/overload.md), by role and outcome: "
            "vetoed (over-threshold workers left out), fallback (all over: the least loaded), "
            "shed (all over: 503).",
            ["role", "outcome"],
            registry=r,
        )
        self.gate_waits = Histogram(
            "trio_pd_gate_wait_seconds",
            "Waits for a prefill slot (gate=prefill) or a place in the decode's running window "
            "(gate=decode), by how they ended (admitted, full, timeout, cancelled).",
            ["gate", "outcome"],
            registry=r,
            buckets=self.buckets_for("trio_pd_gate_wait_seconds", REQUEST_BUCKETS),
        )

    def _services(self, r: CollectorRegistry) -> None:
        """The router's own health: internal errors, restarts, health checks, membership."""
        self.internal_errors = Counter(
            "trio_pd_internal_errors",
            "Unexpected exceptions inside the router, answered 500 (or an error frame).",
            registry=r,
        )
        self.background_restarts = Counter(
            "trio_pd_background_restarts",
            "Long-lived tasks restarted after an unexpected exception, by task.",
            ["task"],
            registry=r,
        )
        self.health_check_failures = Counter(
            "trio_pd_health_check_failures",
            "Failed health checks of workers, by worker id, role and kind (status, connect, "
            "tls, timeout, error); the reason is logged and shown by GET /workers.",
            ["worker", "role", "kind"],
            registry=r,
        )
        self.membership_errors = Counter(
            "trio_pd_membership_errors",
            "Errors of membership sources (Kubernetes, etcd, the shared file), by source and kind.",
            ["source", "kind"],
            registry=r,
        )
        self.destinations_refused = Counter(
            "trio_pd_upstream_connects_refused",
            "Connections to workers refused because the address cannot be a worker (cloud "
            "metadata, link-local, this router itself...), by client (legs, control) and reason.",
            ["client", "reason"],
            registry=r,
        )

    def _vllm(self, r: CollectorRegistry) -> None:
        """vLLM pairs (docs/vllm.md §4): handoffs missing, prompts recomputed, KV reads failed."""
        self.vllm_kv_params_missing = Counter(
            "trio_pd_vllm_kv_params_missing",
            "vLLM prefills that answered 200 without kv_transfer_params, by what the router did "
            "(--vllm-missing-kv-params: decode-local, fail).",
            ["action"],
            registry=r,
        )
        self.vllm_prompts_recomputed = Counter(
            "trio_pd_vllm_prompts_recomputed",
            "vLLM decodes the router sent without KV, so they compute the prompt again, by why.",
            ["reason"],
            registry=r,
        )
        self.vllm_kv_read_failures = Counter(
            "trio_pd_vllm_kv_read_failures",
            "vLLM decodes that failed reading the prefill's KV blocks (kv_transfer_failed), by "
            "whether the client's stream had started.",
            ["stream"],
            registry=r,
        )

    def buckets_for(self, name: str, default: tuple[float, ...]) -> tuple[float, ...]:
        if self.duration_buckets and name.endswith(DURATION_SUFFIX):
            return self.duration_buckets
        return default

    def count_request(self, path: str, outcome: RequestOutcome, seconds: float) -> None:
        """One answered request, by its outcome (the hot path: its labelled children are looked
        up once); by model too when the router serves several."""
        status = outcome.status
        children = self._per_request.get((path, status))
        if children is None:
            children = (self.requests.labels(path, str(status)), self.latency.labels(path))
            self._per_request[(path, status)] = children
        children[0].inc()
        children[1].observe(seconds)
        if outcome.model not in (None, "-"):
            self.model_requests.labels(outcome.model, str(status)).inc()

    def attach(self, fleet: Fleet, pool: UpstreamPool, queue_depth: Callable[[], int]) -> None:
        """Add the fleet, pool and queue gauges (read at scrape time, or synced)."""
        collector = FleetCollector(fleet, pool, queue_depth)
        if self.multiprocess_dir:
            self._gauges = SyncedGauges(collector, self.registry)
        else:
            self.registry.register(collector)

    def sync_gauges(self) -> None:
        """Multiprocess mode: copy this process's gauges to the shared directory."""
        if self._gauges is not None:
            self._gauges.sync()

    def render(self) -> bytes:
        if self.multiprocess_dir:
            self.sync_gauges()
            return render_multiprocess(self.multiprocess_dir)
        return generate_latest(self.registry)


def render_multiprocess(path: str) -> bytes:
    """The sum over the processes that write to `path` (any process may render it: the
    supervisor of `--workers N` does, for the metrics listener)."""
    merged = CollectorRegistry()
    MultiProcessCollector(merged, path=path)
    return generate_latest(merged)


class FleetCollector(Collector):
    def __init__(self, fleet: Fleet, pool: UpstreamPool, queue_depth: Callable[[], int]) -> None:
        self.fleet = fleet
        self.pool = pool
        self.queue_depth = queue_depth

    def collect(self) -> Iterator[GaugeMetricFamily]:
        in_flight = GaugeMetricFamily(
            "trio_pd_worker_in_flight", "Active legs.", labels=WORKER_LABELS
        )
        healthy = GaugeMetricFamily("trio_pd_worker_healthy", "1 if healthy.", labels=WORKER_LABELS)
        breaker = GaugeMetricFamily(
            "trio_pd_worker_breaker_state", "0 closed, 1 half-open, 2 open.", labels=WORKER_LABELS
        )
        held_beyond = GaugeMetricFamily(
            "trio_pd_worker_held_beyond_router",
            "Requests the engine held beyond this router's legs at the last release audit "
            "(after aborts; other routers' requests count too: docs/operations.md).",
            labels=WORKER_LABELS,
        )
        for worker in self.fleet.workers():
            key = [worker.id, worker.role, worker.url]
            in_flight.add_metric(key, worker.in_flight)
            held_beyond.add_metric(key, worker.held_beyond_router)
            healthy.add_metric(key, 1.0 if worker.healthy else 0.0)
            breaker.add_metric(key, BREAKER_STATES.get(worker.breaker.state, -1))
        pool = GaugeMetricFamily(
            "trio_pd_upstream_connections", "Pooled upstream connections.", labels=["state"]
        )
        counts = {"idle": 0, "active": 0}
        for _, state in self.pool.connections():
            counts[state] += 1
        for state, count in counts.items():
            pool.add_metric([state], count)
        queue = GaugeMetricFamily(
            "trio_pd_admission_queue_depth", "Requests waiting for admission right now."
        )
        queue.add_metric([], self.queue_depth())
        sources = GaugeMetricFamily(
            "trio_pd_membership_source_up",
            "1 when the membership source can be read, by source.",
            labels=["source"],
        )
        for source, (ok, _) in self.fleet.sources.items():
            sources.add_metric([source], 1.0 if ok else 0.0)
        members = GaugeMetricFamily(
            "trio_pd_membership_workers",
            "Registered workers by the membership source that added them and role.",
            labels=["source", "role"],
        )
        counted: dict[tuple[str, str], int] = {}
        info = GaugeMetricFamily(
            "trio_pd_worker_info",
            "1 per registered worker, labelled with its membership source (join on worker).",
            labels=[*WORKER_LABELS, "source"],
        )
        for worker in self.fleet.workers():
            counted[worker.source, worker.role] = counted.get((worker.source, worker.role), 0) + 1
            info.add_metric([worker.id, worker.role, worker.url, worker.source], 1.0)
        for (source, role), count in sorted(counted.items()):
            members.add_metric([source, role], count)
        yield from (in_flight, held_beyond, healthy, breaker, pool, queue, sources, members, info)
        yield from self._vllm_leases()
        yield from self._kv()

    def _vllm_leases(self) -> Iterator[GaugeMetricFamily]:
        """vLLM prefills: what their own /metrics say of their KV leases (counts since the
        router started, `control/vllm_leases.py`; docs/vllm.md §8 says what they mean)."""
        late = GaugeMetricFamily(
            "trio_pd_vllm_kv_reads_after_lease",
            "KV reads a vLLM prefill was told of after the request's lease expired (its "
            "vllm:nixl_num_notifications_after_expiry): the decode may have answered 200 from "
            "another request's blocks. Counted since the router started, every decode's.",
            labels=WORKER_LABELS,
        )
        expired = GaugeMetricFamily(
            "trio_pd_vllm_kv_leases_expired",
            "KV leases a vLLM prefill let expire (its vllm:nixl_num_kv_expired_reqs): blocks "
            "no decode read, held until the lease. Counted since the router started.",
            labels=WORKER_LABELS,
        )
        for worker in self.fleet.workers("prefill"):
            if worker.spec.engine == "vllm":
                key = [worker.id, worker.role, worker.url]
                late.add_metric(key, worker.vllm_reads_after_lease)
                expired.add_metric(key, worker.vllm_leases_expired)
        yield from (late, expired)

    def _kv(self) -> Iterator[GaugeMetricFamily]:
        """kv_aware: per prefill, whether its KV events route it, and its self-check."""
        kv = self.fleet.kv_policy()
        if kv is None:
            return
        precise = GaugeMetricFamily(
            "trio_pd_kv_events_precise",
            "1 while kv_aware routes the prefill by its KV events, 0 while it falls back to "
            "the approximate tree (GET /workers kv_events.state says why).",
            labels=WORKER_LABELS,
        )
        error = GaugeMetricFamily(
            "trio_pd_kv_self_check_error",
            "Smoothed |predicted - engine-reported cached tokens| / prompt tokens.",
            labels=WORKER_LABELS,
        )
        hits = GaugeMetricFamily(
            "trio_pd_kv_hit_ratio",
            "Cached tokens / prompt tokens since start, by who says it (index or engine).",
            labels=[*WORKER_LABELS, "source"],
        )
        blocks = GaugeMetricFamily(
            "trio_pd_kv_index_blocks", "KV blocks the index holds for it.", labels=WORKER_LABELS
        )
        gaps = GaugeMetricFamily(
            "trio_pd_kv_events_recoveries",
            "KV-event sequence gaps, replays, resyncs and restarts seen (counts since start).",
            labels=[*WORKER_LABELS, "kind"],
        )
        for worker in self.fleet.workers("prefill"):
            found = kv.feeds.get(worker)
            if found is None:
                continue
            key = [worker.id, worker.role, worker.url]
            report = found.to_json()
            check = found.check.to_json()
            precise.add_metric(key, 1.0 if report["state"] == "precise" else 0.0)
            error.add_metric(key, float(check["error"]))  # type: ignore[arg-type]
            hits.add_metric([*key, "index"], float(check["predicted_hit_ratio"]))  # type: ignore[arg-type]
            hits.add_metric([*key, "engine"], float(check["engine_hit_ratio"]))  # type: ignore[arg-type]
            blocks.add_metric(key, float(report["blocks"]))  # type: ignore[arg-type]
            for kind in ("gaps", "replayed", "resyncs", "restarts", "lost", "cleared"):
                gaps.add_metric([*key, kind], float(report[kind]))  # type: ignore[arg-type]
        yield from (precise, error, hits, blocks, gaps)


# How each gauge combines over processes in multiprocess mode.
MULTIPROCESS_MODES = {
    "trio_pd_worker_in_flight": "livesum",
    "trio_pd_worker_held_beyond_router": "livemax",  # each process audits the same engine
    "trio_pd_worker_healthy": "livemin",
    "trio_pd_worker_breaker_state": "livemax",
    "trio_pd_upstream_connections": "livesum",
    "trio_pd_admission_queue_depth": "livesum",
    "trio_pd_membership_source_up": "livemin",
    "trio_pd_membership_workers": "livemax",  # every process registers the same workers
    "trio_pd_worker_info": "livemax",
    # each process reads the same vLLM prefill's counters (`control/vllm_leases.py`)
    "trio_pd_vllm_kv_reads_after_lease": "livemax",
    "trio_pd_vllm_kv_leases_expired": "livemax",
    # kv_aware: each process follows the events itself (`fleet/kv_feeds.py`)
    "trio_pd_kv_events_precise": "livemin",  # one process falling back shows
    "trio_pd_kv_self_check_error": "livemax",
    "trio_pd_kv_hit_ratio": "livemax",
    "trio_pd_kv_index_blocks": "livemax",
    "trio_pd_kv_events_recoveries": "livesum",
}


class SyncedGauges:
    """The collector's families, mirrored into multiprocess gauges on each sync."""

    def __init__(self, collector: FleetCollector, registry: CollectorRegistry) -> None:
        self.collector = collector
        self.registry = registry
        self.gauges: dict[str, Gauge] = {}
        self.seen: dict[str, set[tuple[str, ...]]] = {}

    def sync(self) -> None:
        for family in self.collector.collect():
            name = family.name.removesuffix("_total")
            gauge = self.gauges.get(name)
            labels = list(family.samples[0].labels) if family.samples else None
            if gauge is None:
                if labels is None:
                    continue
                gauge = self.gauges[name] = Gauge(
                    name,
                    family.documentation,
                    labels,
                    registry=self.registry,
                    multiprocess_mode=MULTIPROCESS_MODES[name],  # type: ignore[arg-type]
                )
            current: set[tuple[str, ...]] = set()
            for sample in family.samples:
                key = tuple(sample.labels[k] for k in gauge._labelnames)
                current.add(key)
                (gauge.labels(*key) if key else gauge).set(sample.value)
            for gone in self.seen.get(name, set()) - current:  # a removed worker: zero it
                gauge.labels(*gone).set(0)
            self.seen[name] = current
