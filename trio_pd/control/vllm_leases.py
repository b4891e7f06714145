"""What vLLM prefills say of their KV leases: reads after a lease expired (issue 27 finding 4).

A vLLM prefill holds a request's KV blocks for the decode until the decode's read, or until
its lease expires (`kv_lease_duration`, 30 s by default; docs/vllm.md §3). A decode that reads
after the lease expired reads blocks the prefill may have given to another request, and
answers 200 with ordinary output: the router sees nothing wrong. Only the prefill knows. When
a decode's "done reading" notification names a request the prefill no longer holds, vLLM 0.32
logs "Potentially invalid KV blocks ... They may have expired" and counts it in
`vllm:nixl_num_notifications_after_expiry` (`nixl/pull_worker.py` `_get_new_notifs`); every
expired lease counts in `vllm:nixl_num_kv_expired_reqs` (`base_worker._reap_expired_send_leases`).

So every `--health-check-interval-secs` each vLLM prefill's `GET /metrics` is read and the
increases of those two counters are added to the worker's `vllm_reads_after_lease` and
`vllm_leases_expired` (exported as `trio_pd_vllm_kv_reads_after_lease` and
`trio_pd_vllm_kv_leases_expired`, counts since the router started, docs/vllm.md §8).

Limits (docs/operations.md): the engine counts every decode's notifications, other routers'
too; a count is per prefill, never per request (the router cannot tell which answer was
wrong); a notification for a request the prefill never had (a stale or forged handoff) counts
alike; it lags by up to the interval; the first read is the baseline (what happened before
the router started is not counted), and a counter that went down is an engine restart (its new
value is counted). A decode that read after the lease and never notified is not seen.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

from trio_pd.fleet.registry import Fleet
from trio_pd.fleet.worker import Worker

log = logging.getLogger(__name__)

READS_AFTER_LEASE = "vllm:nixl_num_notifications_after_expiry_total"
LEASES_EXPIRED = "vllm:nixl_num_kv_expired_reqs_total"
COUNTED = (READS_AFTER_LEASE, LEASES_EXPIRED)
MAX_PAGE = 8 << 20  # a metrics page larger than this is not read (vLLM's are ~100 KB)

FetchMetrics = Callable[[Worker], Awaitable[str]]


def engine_counts(page: str) -> dict[str, float]:
    """The two counters from a Prometheus text page, summed over their labels (one sample per
    engine); a counter the page lacks is absent (an engine without the NIXL connector)."""
    out: dict[str, float] = {}
    for line in page.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in COUNTED:
            try:
                value = float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
            out[name] = out.get(name, 0.0) + value
    return out


class LeaseWatch:
    """Reads every vLLM prefill's counters at an interval; see the module docstring."""

    def __init__(self, fleet: Fleet, fetch: FetchMetrics, interval: float) -> None:
        self.fleet = fleet
        self.fetch = fetch
        self.interval = interval
        self._last: dict[str, dict[str, float]] = {}  # worker id -> counters last read

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            await self.read_all()
            await trio.sleep(self.interval)

    async def read_all(self) -> None:
        prefills = [
            w for w in self.fleet.workers("prefill") if w.spec.engine == "vllm" and not w.removed
        ]
        for gone in self._last.keys() - {w.id for w in prefills}:
            del self._last[gone]
        for worker in prefills:
            try:
                page = await self.fetch(worker)
            except Exception as exc:  # a sick engine's page: not read this time, never fatal
                log.debug("vLLM lease counters of %s not read: %r", worker.id, exc)
                continue
            self.account(worker, engine_counts(page))

    def account(self, worker: Worker, counts: dict[str, float]) -> None:
        last = self._last.get(worker.id)
        self._last[worker.id] = counts
        if last is None:
            return  # the baseline
        increases = {}
        for name in COUNTED:
            now, before = counts.get(name), last.get(name)
            if now is None or before is None:
                continue
            increases[name] = int(now - before if now >= before else now)  # down: a restart
        worker.vllm_reads_after_lease += increases.get(READS_AFTER_LEASE, 0)
        worker.vllm_leases_expired += increases.get(LEASES_EXPIRED, 0)
        if increases.get(READS_AFTER_LEASE):
            log.warning(
                "vLLM prefill %s: %d KV read(s) after their lease expired (the decodes may "
                "have answered from another request's blocks)",
                worker.id,
                increases[READS_AFTER_LEASE],
            )
