"""SMG 1.13's `least_load` policy: the candidate with the shortest expected wait, in seconds.

For a worker whose engine load report is fresh (`/v1/loads`, polled as for power_of_two):

    wait = (queued + running * p + unaccounted * p + since_poll) / throughput + w * k / (1 - k)

- `queued`: the engine's waiting token-work (`num_waiting_uncached_tokens`), or its waiting
  requests times `p` (`--least-load-mean-prefill-tokens`) when it reports no token count;
- `running * p`: its running requests, each priced as a mean prefill (a report does not say
  what is left of them);
- `since_poll`: the token-work this router sent it since that report (`p` a request: the HTTP
  path has no token count), so a whole poll interval of arrivals is not handed to one worker;
- `unaccounted`: requests this router holds on it beyond what the report and the since-poll
  tally account for (in transit to the engine): the router's own count is the floor;
- `throughput`: its `gen_throughput`, else `--least-load-default-throughput`;
- `k`: its KV usage (`token_usage`, clamped below 0.999), `w` `--least-load-kv-pressure-weight`:
  a barrier that diverges as the KV cache fills.

A worker without a fresh report while others have one scores as the best reporting candidate
plus its own in-flight at the candidates' mean throughput (unknown load is neither idle nor
starved); with no report anywhere the fleet is joined on the shortest queue (`Worker.load()`).
Scores within a microsecond are one tie, drawn uniformly. `--least-load-max-waiting-requests N`
(0: off) leaves out a worker whose reported waiting requests, plus what it was sent since and
what is unaccounted, reached N; when that leaves out every candidate, all stay (SMG hands the
request to its admission queue instead; trio_pd has none there).

power_of_two's `expected_wait` and its ties use this scorer too (`fleet/policies.py`).
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

import trio

from trio_pd.config import PolicyConfig
from trio_pd.fleet.hints import RouteHints
from trio_pd.fleet.reports import EngineLoad

if TYPE_CHECKING:
    from trio_pd.fleet.worker import Worker

TIE_EPSILON_SECS = 1e-6
SINCE_POLL_KEPT = 8_192  # dispatches remembered per worker between two reports (SMG's bound)
KV_CLAMP = 0.999


def fresh_load(worker: Worker, now: float) -> EngineLoad | None:
    """The worker's engine load report while it is fresh at `now`, else None."""
    load, at = worker.engine_load, worker.reported_at
    if load is None or at is None or now - at >= worker.load_fresh_secs:
        return None
    return load


class SincePoll:
    """The dispatches a worker's last report has not seen yet: (when, tokens), oldest first."""

    __slots__ = ("dispatches", "tokens")

    def __init__(self) -> None:
        self.dispatches: deque[tuple[float, int]] = deque()
        self.tokens = 0

    def record(self, at: float, tokens: int) -> None:
        self.dispatches.append((at, tokens))
        self.tokens += tokens
        if len(self.dispatches) > SINCE_POLL_KEPT:
            self.tokens -= self.dispatches.popleft()[1]

    def release_through(self, reported_at: float | None) -> None:
        """Forget the dispatches made before the report (it counted them); one made at the
        very instant of the report is kept (it may not have reached the engine)."""
        if reported_at is None:
            return
        dispatches = self.dispatches
        while dispatches and dispatches[0][0] < reported_at:
            self.tokens -= dispatches.popleft()[1]

    @property
    def requests(self) -> int:
        return len(self.dispatches)


class ExpectedWait:
    """The expected-wait scorer shared by least_load and power_of_two."""

    def __init__(self, config: PolicyConfig, rng: random.Random) -> None:
        self.weight = max(0.0, config.least_load_kv_pressure_weight)
        self.mean_tokens = max(1, config.least_load_mean_prefill_tokens)
        self.default_throughput = config.least_load_default_throughput
        self.max_waiting = config.least_load_max_waiting_requests
        self.rng = rng
        self.since_poll: dict[Worker, SincePoll] = {}

    def forget(self, worker: Worker) -> None:
        self.since_poll.pop(worker, None)

    def _tally(self, worker: Worker) -> SincePoll:
        tally = self.since_poll.get(worker)
        if tally is None:
            tally = self.since_poll[worker] = SincePoll()
        tally.release_through(worker.reported_at)
        return tally

    def _unaccounted(self, worker: Worker, load: EngineLoad, tally: SincePoll) -> int:
        return max(0, worker.in_flight - (load.requests + tally.requests))

    def _known(self, worker: Worker, load: EngineLoad) -> float:
        tally = self._tally(worker)
        p = self.mean_tokens
        queued = load.waiting_tokens or load.waiting * p
        work = queued + load.running * p + self._unaccounted(worker, load, tally) * p
        throughput = load.gen_throughput if load.gen_throughput > 0 else self.default_throughput
        k = min(max(load.token_usage, 0.0), KV_CLAMP)
        return (work + tally.tokens) / throughput + self.weight * k / (1.0 - k)

    def eligible(self, candidates: Sequence[Worker]) -> Sequence[Worker]:
        """The candidates under the waiting-queue cap (all of them when none is)."""
        if self.max_waiting <= 0:
            return candidates
        now = trio.current_time()
        kept = []
        for worker in candidates:
            load = fresh_load(worker, now)
            if load is not None:
                tally = self._tally(worker)
                queued = load.waiting + tally.requests + self._unaccounted(worker, load, tally)
                if queued >= self.max_waiting:
                    continue
            kept.append(worker)
        return kept or candidates

    def scores(self, candidates: Sequence[Worker], now: float) -> list[float]:
        loads = [fresh_load(w, now) for w in candidates]
        known = [self._known(w, load) for w, load in zip(candidates, loads, strict=True) if load]
        if not known:  # a dark fleet: join the shortest queue
            return [float(w.load()) for w in candidates]
        rates = [load.gen_throughput for load in loads if load and load.gen_throughput > 0]
        nominal = sum(rates) / len(rates) if rates else self.default_throughput
        baseline = min(known)
        scores = []
        it = iter(known)
        for worker, load in zip(candidates, loads, strict=True):
            if load is not None:
                scores.append(next(it))
            else:
                scores.append(baseline + worker.load() * self.mean_tokens / nominal)
        return scores

    def pick(self, candidates: Sequence[Worker]) -> Worker:
        """The argmin (ties within TIE_EPSILON_SECS drawn uniformly), credited with one
        request's token-work until its engine's next report."""
        now = trio.current_time()
        scores = self.scores(candidates, now)
        low = min(scores)
        tied = [w for w, s in zip(candidates, scores, strict=True) if s <= low + TIE_EPSILON_SECS]
        chosen = tied[0] if len(tied) == 1 else self.rng.choice(tied)
        self._tally(chosen).record(now, self.mean_tokens)
        return chosen


class LeastLoadPolicy:
    name = "least_load"

    def __init__(self, config: PolicyConfig | None = None, rng: random.Random | None = None):
        self.scorer = ExpectedWait(config or PolicyConfig(), rng or random.Random())

    def choose(self, candidates: Sequence[Worker], hints: RouteHints) -> Worker:
        eligible = self.scorer.eligible(candidates)
        if len(eligible) == 1:
            return eligible[0]
        return self.scorer.pick(eligible)

    def add_worker(self, worker: Worker) -> None:
        pass

    def remove_worker(self, worker: Worker) -> None:
        self.scorer.forget(worker)

    def evict(self) -> None:
        pass
