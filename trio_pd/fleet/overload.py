"""The overload veto: a worker whose engine reports too much queued work or too full a KV
cache is left out of selection while another candidate is under the thresholds (SMG 1.13's
`--worker-overload-*`, docs/overload.md).

Read from the last `/v1/loads` the fleet holds (`fleet/loads.py` polls every role while the
protection is on), and only while that report is fresh (`Worker.load_fresh_secs`): a poll that
failed or stopped lets the veto lapse, so a stale figure never keeps a worker out for good.

On a PD decode, SGLang's `num_waiting_reqs` counts the requests whose KV cache has not arrived
(prealloc and transfer queues: every request passes there while its prefill runs, normal PD
operation) beside those queued for compute; the veto reads the second alone
(`RankLoad.queued`, docs/protocol.md §12). A decode answering the old `/get_load`, which has
no such split, is judged on token usage only.

When every candidate is over, the least loaded of them takes the request (a uniformly busy
fleet is still a fleet), or with `--worker-overload-shed` the request is refused: `Overloaded`,
a 503 with Retry-After, never retried.
"""

from __future__ import annotations

import trio

from trio_pd.config import OverloadConfig
from trio_pd.fleet.worker import Worker
from trio_pd.spec import Role


class Overloaded(Exception):
    """Every candidate of `role` is over the thresholds and `--worker-overload-shed` is on."""

    def __init__(self, role: Role, count: int) -> None:
        super().__init__(f"all {count} {role} workers are overloaded")
        self.role = role


def overload_reason(worker: Worker, config: OverloadConfig, now: float) -> str | None:
    """Why `worker` is over the thresholds ("waiting", "token_usage"), or None: under them,
    or its last report is too old to speak."""
    load = worker.engine_load
    at = worker.reported_at
    if load is None or at is None or now - at >= worker.load_fresh_secs or not load.ranks:
        return None
    legacy_decode = worker.role == "decode" and load.endpoint == "/get_load"
    if not legacy_decode:
        queued = sum(rank.queued for rank in load.ranks)
        if queued >= config.waiting_requests:
            return "waiting"
    usage = sum(rank.token_usage for rank in load.ranks) / len(load.ranks)
    if usage >= config.token_usage:
        return "token_usage"
    return None


def least_loaded(workers: list[Worker]) -> Worker:
    """The fallback when all are over: the fewest requests held (ties: the first)."""
    return min(workers, key=lambda w: w.load())


def veto(
    role: Role, candidates: list[Worker], config: OverloadConfig
) -> tuple[list[Worker], list[Worker], bool]:
    """(the candidates left, the workers vetoed, whether it fell back to the least loaded).
    Raises Overloaded when all are over and shedding is on."""
    if not config.protection or all(w.engine_load is None for w in candidates):
        return candidates, [], False
    now = trio.current_time()
    over = [w for w in candidates if overload_reason(w, config, now) is not None]
    if not over:
        return candidates, [], False
    under = [w for w in candidates if w not in over]
    if under:
        return under, over, False
    if config.shed:
        raise Overloaded(role, len(candidates))
    return [least_loaded(candidates)], over, True
