"""An engine-state probe: both engines' own `/v1/loads`, polled every few milliseconds.

The fault matrix and the chaos run ask the engines, not the router, whether a doomed request
was let go. SGLang's scheduler publishes its load snapshot to shared memory on every prefill
batch, at once on the busy-to-idle transition, and every 50 ms while it stalls with work queued
(`managers/scheduler.py` `on_idle`, `LOAD_STALL_REFRESH_S`); `/v1/loads` reads that snapshot.
So a release shows in the next poll after the scheduler's idle pass, and a frozen (SIGSTOPped)
scheduler keeps showing its last snapshot.

`held` counts what a snapshot still holds: running, waiting and every disaggregation queue
(`*_queue_reqs`: prefill bootstrap / inflight, decode prealloc / transfer / retracted), the same
sum as `scenarios.busy`. Tokens in use (`num_used_tokens`) are recorded beside it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import httpx2
import trio

POLL_SECS = 0.003


@dataclass(frozen=True)
class Sample:
    """One `/v1/loads` answer (or its failure) of one engine."""

    sent: float  # time.monotonic() when the GET went out
    received: float
    held: int | None  # None: the engine did not answer
    used_tokens: int | None = None
    queues: dict[str, int] = field(default_factory=dict)


def held_of(body: dict[str, Any]) -> tuple[int, int, dict[str, int]]:
    """(requests held, KV tokens in use, per-queue counts) summed over the DP ranks."""
    held = used = 0
    queues: dict[str, int] = {}
    for load in body["loads"]:
        disagg = load.get("disaggregation") or {}
        parts = {
            "running": load["num_running_reqs"],
            "waiting": load["num_waiting_reqs"],
            **{k: v for k, v in disagg.items() if k.endswith("_queue_reqs")},
        }
        for key, value in parts.items():
            queues[key] = queues.get(key, 0) + int(value)
            held += int(value)
        used += int(load.get("num_used_tokens", 0))
    return held, used, queues


class Probe:
    """Polls each engine's `/v1/loads` in its own task; keeps every sample in order.

    Run it with `nursery.start(probe.run)` and cancel the nursery (or `stop()`) when done.
    """

    def __init__(self, urls: dict[str, str], interval: float = POLL_SECS) -> None:
        self.urls = dict(urls)
        self.interval = interval
        self.samples: dict[str, list[Sample]] = {role: [] for role in urls}
        self._new = trio.Event()
        self._cancel = trio.CancelScope()

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        async with httpx2.AsyncClient(timeout=httpx2.Timeout(1.0)) as client:
            with self._cancel:
                async with trio.open_nursery() as nursery:
                    for role in self.urls:
                        nursery.start_soon(self._poll, client, role)
                    task_status.started()

    def stop(self) -> None:
        self._cancel.cancel()

    async def _poll(self, client: httpx2.AsyncClient, role: str) -> None:
        url = self.urls[role] + "/v1/loads"
        while True:
            sent = time.monotonic()
            try:
                response = await client.get(url)
                held, used, queues = held_of(response.json())
                sample = Sample(sent, time.monotonic(), held, used, queues)
            except (httpx2.HTTPError, OSError, ValueError, KeyError):
                sample = Sample(sent, time.monotonic(), None)
            self.samples[role].append(sample)
            self._new.set()
            self._new = trio.Event()
            await trio.sleep(max(0.0, self.interval - (time.monotonic() - sent)))

    def latest(self, role: str) -> Sample | None:
        return self.samples[role][-1] if self.samples[role] else None

    def peak(self, role: str, since: float, key: str | None = None) -> int:
        """The most a snapshot held (or one queue held) among samples sent after `since`."""
        values = [
            (s.held if key is None else s.queues.get(key, 0)) or 0
            for s in self.samples[role]
            if s.sent >= since
        ]
        return max(values, default=0)

    async def wait(
        self, role: str, predicate: Any, since: float | None = None, timeout: float = 10.0
    ) -> Sample:
        """The first sample sent at or after `since` that satisfies `predicate`."""
        since = time.monotonic() if since is None else since
        seen = 0
        with trio.fail_after(timeout):
            while True:
                samples = self.samples[role]
                for sample in samples[seen:]:
                    if sample.sent >= since and predicate(sample):
                        return sample
                seen = len(samples)
                await self._new.wait()

    async def wait_held(self, role: str, at_least: int, timeout: float = 10.0) -> Sample:
        return await self.wait(
            role, lambda s: s.held is not None and s.held >= at_least, timeout=timeout
        )

    async def released(self, role: str, since: float, timeout: float = 10.0) -> float:
        """Seconds from `since` until a poll sent after it answered nothing held."""
        sample = await self.wait(role, lambda s: s.held == 0, since=since, timeout=timeout)
        return sample.received - since
