"""SMG 1.13's `consistent_hashing` policy: a routing key always lands on the same worker.

Every worker of the role sits on a hash ring at `VNODES` positions (a hash of `url#n`); a key
hashes to a point and walks clockwise to the first worker that is a candidate. So a key keeps
its worker while that worker takes traffic, a worker that leaves (unhealthy, removed, breaker
open, avoided by a retry) hands only its own keys to the next worker on the ring, and one that
joins takes about 1/N of the keys. Workers are named by URL, so a worker re-registered under the
same URL keeps its keys; positions are blake2b digests, the same in every process and replica.

The key is the client's routing key (`X-SMG-Routing-Key`, `--routing-key-headers`; with the
sticky override also the `rid` lineage: `edge/routing_key.py`), else, as in SMG, the client's
`x-forwarded-for` or its `cookie` (`RouteHints.affinity`); a request with none of them goes to
a random candidate. SMG's `X-SMG-Target-Worker` (a worker by index) is not implemented.
"""

from __future__ import annotations

import bisect
import hashlib
import random
from collections.abc import Sequence
from typing import TYPE_CHECKING

from trio_pd.fleet.hints import RouteHints

if TYPE_CHECKING:
    from trio_pd.fleet.worker import Worker

VNODES = 150  # SMG's VIRTUAL_NODES_PER_WORKER


def position(data: bytes) -> int:
    """A point on the ring: stable across processes (Python's `hash` is salted)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def key_position(key: str) -> int:
    return position(key.encode("utf-8", "surrogatepass"))


class HashRing:
    """Workers at `VNODES` points each (placed by URL); rebuilt lazily after a membership
    change. A lookup is a bisection and a walk over identity checks."""

    def __init__(self) -> None:
        self._workers: list[Worker] = []
        self._points: list[int] = []
        self._owners: list[Worker] = []
        self._dirty = False

    def add(self, worker: Worker) -> None:
        self._workers.append(worker)
        self._dirty = True

    def remove(self, worker: Worker) -> None:
        if worker in self._workers:
            self._workers.remove(worker)
            self._dirty = True

    def _rebuild(self) -> None:
        ring = sorted(
            (position(f"{w.url}#{n}".encode("utf-8", "surrogatepass")), i)
            for i, w in enumerate(self._workers)
            for n in range(VNODES)
        )
        self._points = [point for point, _ in ring]
        self._owners = [self._workers[i] for _, i in ring]
        self._dirty = False

    def find(self, point: int, candidates: Sequence[Worker]) -> Worker | None:
        """The first candidate clockwise from `point`, or None when no candidate is on it."""
        if self._dirty:
            self._rebuild()
        owners = self._owners
        if not owners:
            return None
        wanted = set(candidates)
        start = bisect.bisect_left(self._points, point)
        size = len(owners)
        for step in range(size):
            worker = owners[(start + step) % size]
            if worker in wanted:
                return worker
        return None


class ConsistentHashingPolicy:
    name = "consistent_hashing"

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()
        self.ring = HashRing()

    def choose(self, candidates: Sequence[Worker], hints: RouteHints) -> Worker:
        key = hints.key if hints.key is not None else hints.affinity
        if key is None:
            return self.rng.choice(candidates)
        found = self.ring.find(key_position(key), candidates)
        return found if found is not None else self.rng.choice(candidates)

    def add_worker(self, worker: Worker) -> None:
        self.ring.add(worker)

    def remove_worker(self, worker: Worker) -> None:
        self.ring.remove(worker)

    def evict(self) -> None:
        pass
