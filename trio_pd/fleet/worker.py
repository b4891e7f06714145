"""One upstream engine as the fleet sees it: health, breaker, load, DP ranks, and the
bookkeeping of a leg running on it.

Pure bookkeeping on trio time; nothing here knows HTTP. Hashes by identity.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import attrs
import trio

from trio_pd.fleet.breaker import CircuitBreaker
from trio_pd.fleet.reports import EngineLoad, ServerInfo
from trio_pd.spec import Role, WorkerSpec


class NoWorkerAvailable(Exception):
    """No worker of `role` can take a request. `reason` is "none_registered" or
    "all_unhealthy" (open breakers alone never leave a role without workers: panic routing)."""

    def __init__(self, role: Role, reason: str, message: str) -> None:
        super().__init__(message)
        self.role = role
        self.reason = reason
        self.message = message


@attrs.define(eq=False)
class Worker:
    """One upstream engine. Hashes by identity, so it can key sets and dicts.

    `load()` is the router's own `in_flight` count, raised to the engine's reported load while
    that report is fresh (younger than `load_fresh_secs`, which the Fleet sets to twice the health
    interval): the engine also counts requests from other routers, the router's count is exact
    for its own legs and never stale.
    """

    spec: WorkerSpec
    id: str
    source: str = "static"  # the membership source that added it (only it may remove it)
    meta: dict[str, str] = attrs.field(factory=dict)  # the source's own names for it
    breaker: CircuitBreaker = attrs.field(factory=CircuitBreaker)
    healthy: bool = False  # unhealthy until the first health pass
    startup_timed_out: bool = False  # no pass within --worker-startup-timeout-secs: given up
    removed: bool = False
    in_flight: int = 0
    dp_size: int = 1  # DP ranks behind the URL: dp_size x attn_dp_size of its /server_info
    served_model: str | None = None  # learned from /v1/models when the spec names none
    server_info: ServerInfo = attrs.Factory(ServerInfo)  # what its /server_info said last
    info_at: float | None = None  # when dp_size / served_model were last learned
    engine_load: EngineLoad | None = None  # its last /v1/loads (or /get_load) answer
    legacy_load: bool = False  # it answered /v1/loads 404: an engine before 0.5.23
    health_error: str | None = None  # why its last health check failed (None: it passed)
    rank_in_flight: list[int] = attrs.Factory(lambda: [0])  # legs per DP rank (--dp-aware)
    rank_turn: int = 0  # where the next tie between ranks starts
    # What its engine still held beyond this router's legs at the last release audit
    # (`control/release_audit.py`).
    held_beyond_router: int = 0
    reported_load: int | None = None
    reported_at: float | None = None
    load_fault: str | None = None  # why its last load report was refused (None: believed)
    load_fresh_secs: float = 120.0
    # Legs in flight per routing key (only counted when a policy reads keys): min_group places a
    # new key where the fewest distinct keys are active; the sticky override respills a key
    # with two legs already on its worker (`sticky.py`).
    active_keys: dict[str, int] = attrs.Factory(dict)
    # kv_aware: what the router knows of its KV events (`fleet/kv_feeds.py`), for GET /workers.
    kv_report: Callable[[], dict[str, object]] | None = None

    @property
    def url(self) -> str:
        return self.spec.url

    @property
    def role(self) -> Role:
        return self.spec.role

    @property
    def bootstrap_port(self) -> int | None:
        return self.spec.bootstrap_port

    @property
    def model(self) -> str | None:
        """The model it serves: its spec's `model_id`, else what it reported."""
        return self.spec.model_id or self.served_model

    @property
    def abort_latch_hazard(self) -> bool:
        """Its engine awaits between registering a rid and scheduling it (docs/protocol.md
        §10): a leg's first abort then waits a little (`pd/engines/sglang.abort_hook`)."""
        return self.server_info.abort_latch_hazard

    def learn(self, info: ServerInfo | None, served_model: str | None) -> bool:
        """Record what the worker reported about itself (health checks refresh it); True when
        the model it serves changed. None: it did not say (what was known stays)."""
        if info is not None:
            self.server_info = info
            if info.dp_width != self.dp_size:
                self.dp_size = info.dp_width
                self.rank_in_flight = [0] * info.dp_width
        changed = bool(served_model) and served_model != self.served_model
        if served_model:
            self.served_model = served_model
        self.info_at = trio.current_time()
        return changed

    def least_loaded_rank(self) -> int:
        """The DP rank with the fewest of this router's legs; ties go round the ranks, so a
        burst chosen before any of its legs started still spreads evenly."""
        counts = self.rank_in_flight
        low = min(counts)
        size = len(counts)
        start = self.rank_turn
        for step in range(size):
            rank = (start + step) % size
            if counts[rank] == low:
                self.rank_turn = rank + 1
                return rank
        return 0  # unreachable: some rank holds the minimum

    def report_load(self, load: int | EngineLoad) -> None:
        """Record the engine's own load (its /v1/loads, or a bare count), stamped now."""
        if isinstance(load, EngineLoad):
            self.engine_load = load
            self.legacy_load = load.endpoint == "/get_load"
            load = load.requests
        self.reported_load = load
        self.reported_at = trio.current_time()
        self.load_fault = None

    def reject_load(self, reason: str) -> bool:
        """Its engine reported a load that cannot be true (`control/engine_info.py`): forget
        every figure it reported, so its load is unknown (the router's own legs alone count,
        no veto reads it) until a report that could be true. True the first time in a row
        (the caller logs once)."""
        first = self.load_fault is None
        self.load_fault = reason
        self.engine_load = None
        self.reported_load = None
        self.reported_at = None
        return first

    def load(self) -> int:
        reported = self.reported_load
        if (
            reported is not None
            and reported > self.in_flight
            and self.reported_at is not None
            and trio.current_time() - self.reported_at < self.load_fresh_secs
        ):
            return reported
        return self.in_flight

    def available(self) -> bool:
        return self.healthy and not self.removed and self.breaker.allows_request()

    @property
    def status(self) -> str:
        """SMG's worker lifecycle names: pending (never passed a check), ready, not_ready
        (passed once, failing now), failed (given up at start-up)."""
        if self.startup_timed_out:
            return "failed"
        if self.healthy:
            return "ready"
        return "not_ready" if self.info_at is not None else "pending"

    def to_json(self) -> dict[str, object]:
        """SMG 1.13's `WorkerInfo` fields (`id`, `url`, `worker_type`, `is_healthy`, `status`,
        `load`, `model_id`, `bootstrap_port`, `dp_size`, `engine_load`), and trio_pd's own."""
        return {
            "id": self.id,
            "url": self.url,
            "worker_type": self.role,
            "bootstrap_port": self.bootstrap_port,
            "is_healthy": self.healthy,
            "status": self.status,
            "http2": False,
            **({"health_error": self.health_error} if self.health_error else {}),
            **({"startup_timed_out": True} if self.startup_timed_out else {}),
            "circuit_breaker": self.breaker.state,
            "load": self.load(),
            "in_flight": self.in_flight,
            "source": self.source,
            **({"model_id": self.model} if self.model else {}),
            **({"engine": self.spec.engine} if self.spec.engine != "sglang" else {}),
            **({"dp_size": self.dp_size} if self.dp_size > 1 else {}),
            **({"engine_load": self.engine_load.to_json()} if self.engine_load else {}),
            **({"load_fault": self.load_fault} if self.load_fault else {}),
            **({"meta": self.meta} if self.meta else {}),
            **({"kv_events": self.kv_report()} if self.kv_report is not None else {}),
        }


class RankHold:
    """One leg's claim on a DP rank of its worker, counted from the moment the rank is chosen
    (so a burst chosen before any of its legs started still spreads) until `release()`, which
    the leg calls when it ends and its attempt calls again in case it never started."""

    __slots__ = ("_rank", "_worker")

    def __init__(self, worker: Worker, rank: int) -> None:
        self._worker: Worker | None = worker
        self._rank = rank
        worker.rank_in_flight[rank] += 1

    def release(self) -> None:
        worker, self._worker = self._worker, None
        if worker is not None and self._rank < len(worker.rank_in_flight):
            worker.rank_in_flight[self._rank] -= 1


class Hold(Protocol):
    """A claim a leg gives back when it ends: a DP rank, a gate's slot (`fleet/gates.py`)."""

    def release(self) -> None: ...


class Holds:
    """Several holds of one leg, released together (each release is idempotent)."""

    __slots__ = ("_holds",)

    def __init__(self, *holds: Hold) -> None:
        self._holds = holds

    def release(self) -> None:
        for hold in self._holds:
            hold.release()


def joined(*holds: Hold | None) -> Hold | None:
    """One hold for all of `holds` (None when there are none)."""
    present = [hold for hold in holds if hold is not None]
    if not present:
        return None
    return present[0] if len(present) == 1 else Holds(*present)


class Tracked:
    """A leg counted on its worker while it runs, under its routing key when it has one (and its
    rank hold released when it ends); a class, not a generator: it is on every leg's path."""

    __slots__ = ("_hold", "_key", "_worker")

    def __init__(self, worker: Worker, hold: Hold | None, key: str | None = None) -> None:
        self._worker = worker
        self._hold = hold
        self._key = key

    def __enter__(self) -> Worker:
        worker = self._worker
        worker.in_flight += 1
        if self._key is not None:
            worker.active_keys[self._key] = worker.active_keys.get(self._key, 0) + 1
        return worker

    def __exit__(self, *exc_info: object) -> None:
        worker = self._worker
        worker.in_flight -= 1
        key = self._key
        if key is not None:
            left = worker.active_keys.pop(key, 1) - 1
            if left > 0:
                worker.active_keys[key] = left
        if self._hold is not None:
            self._hold.release()
