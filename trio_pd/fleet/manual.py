"""SGLang's `manual` policy: sticky routing by the client's routing key (`X-SMG-Routing-Key`).

A key gets a worker the first time it is seen and keeps it: adding workers moves no key, and a
key moves only when its worker is not among the candidates (unhealthy, removed, breaker open,
another model's, or avoided by a retry). Each key remembers its last two workers, the newest
last; a request goes to the first of them that is a candidate, so a key whose worker comes back
returns to it, and one that had to move three times has forgotten the first. Workers are named by
URL, as in SMG, so a worker re-registered under the same URL (a new pod id) keeps its keys.

Where a new key goes (`--assignment-mode`), and where a request without a key goes (it is placed
the same way and remembered nowhere):

- `random`: uniformly over the candidates. With a key, the draw is rendezvous hashing of the key
  over the candidates' URLs instead of a random number: just as uniform, but every process of
  `--workers N` (and every replica) that sees the same candidates places a new key on the same
  worker, where independent draws would scatter one session over N workers.
- `min_load`: the candidate with the lowest load (`Worker.load()`);
- `min_group`: the candidate with the fewest distinct routing keys in flight on it.
  Ties in both are broken as `random` places the key.

Keys unused for `--max-idle-secs` are forgotten when the periodic eviction runs (every
`--eviction-interval-secs`, the task that also trims cache-aware trees; `0` for either keeps
them). The table is kept in least-recently-used order, so eviction touches only the keys it
drops, and it holds at most `MAX_ROUTING_KEYS` keys and `MAX_ROUTING_KEY_BYTES` of memory (each
key charged `KEY_BYTES` plus its characters, `key_cost`): past either the least recently used key
is forgotten first (SMG bounds it by idle time only; 262144 keys of 128 bytes held ~98 MiB, beside
the memory budget, issue 26 N14). The table is per process, as SMG's is per replica.
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import trio

from trio_pd.config import AssignmentMode
from trio_pd.fleet.hints import RouteHints

if TYPE_CHECKING:
    from trio_pd.fleet.worker import Worker

log = logging.getLogger(__name__)

MAX_CANDIDATE_WORKERS = 2  # SMG: workers remembered per key, for failover and return
MAX_ROUTING_KEYS = 262_144
MAX_ROUTING_KEY_BYTES = 16 << 20  # a table's memory: beside the budget, fixed (behaviour.md)
# What a key holds beside its characters: its route, the route's list, the table's entry and
# the string's header (227 + 49 bytes measured with tracemalloc on CPython 3.11, rounded up).
KEY_BYTES = 288


def key_cost(key: str) -> int:
    """The memory a key of the table holds, in bytes (`str.isascii` is O(1))."""
    return KEY_BYTES + (len(key) if key.isascii() else 4 * len(key))


EVICT_BATCH = 16_384  # keys forgotten between two checkpoints (~12 ms)


class KeyRoute:
    """One key's workers (URLs, newest last) and when it was last used."""

    __slots__ = ("last_used", "urls")

    def __init__(self, url: str, now: float) -> None:
        self.urls = [url]
        self.last_used = now

    def remember(self, url: str) -> None:
        if len(self.urls) >= MAX_CANDIDATE_WORKERS:
            del self.urls[: len(self.urls) - MAX_CANDIDATE_WORKERS + 1]
        self.urls.append(url)


class ManualPolicy:
    name = "manual"

    def __init__(
        self,
        assignment_mode: AssignmentMode = "random",
        max_idle_secs: float = 14_400,
        rng: random.Random | None = None,
        max_keys: int = MAX_ROUTING_KEYS,
        max_bytes: int | None = None,
    ) -> None:
        self.assignment_mode = assignment_mode
        self.max_idle_secs = max_idle_secs
        self.rng = rng or random.Random()
        self.max_keys = max_keys
        self.max_bytes = MAX_ROUTING_KEY_BYTES if max_bytes is None else max_bytes
        self.routes: OrderedDict[str, KeyRoute] = OrderedDict()  # least recently used first
        self.bytes = 0  # key_cost of every key held
        self.branches: dict[str, int] = dict.fromkeys(
            ("occupied_hit", "occupied_miss", "vacant", "no_routing_id"), 0
        )  # SMG's names for what each selection did

    def choose(self, candidates: Sequence[Worker], hints: RouteHints) -> Worker:
        key = hints.key
        if key is None:
            self.branches["no_routing_id"] += 1
            return self._place(candidates, None)
        now = trio.current_time()
        route = self.routes.get(key)
        if route is None:
            chosen = self._place(candidates, key)
            self._add(key, KeyRoute(chosen.url, now))
            self.branches["vacant"] += 1
            return chosen
        route.last_used = now
        self.routes.move_to_end(key)
        for url in route.urls:
            for worker in candidates:
                if worker.url == url:
                    self.branches["occupied_hit"] += 1
                    return worker
        chosen = self._place(candidates, key)
        route.remember(chosen.url)
        self.branches["occupied_miss"] += 1
        return chosen

    def pinned(self, key: str, candidates: Sequence[Worker]) -> tuple[bool, Worker | None]:
        """(whether `key` has a route, its first remembered worker among `candidates`);
        marks the key used. The sticky override (`sticky.py`) reads the table through this."""
        route = self.routes.get(key)
        if route is None:
            return False, None
        route.last_used = trio.current_time()
        self.routes.move_to_end(key)
        for url in route.urls:
            for worker in candidates:
                if worker.url == url:
                    return True, worker
        return True, None

    def pin_first(self, key: str, worker: Worker) -> None:
        """Make `worker` the key's preferred worker (its previous one kept second)."""
        route = self.routes.get(key)
        if route is None:
            self._add(key, KeyRoute(worker.url, trio.current_time()))
            return
        others = [url for url in route.urls if url != worker.url]
        route.urls = [worker.url, *others[: MAX_CANDIDATE_WORKERS - 1]]

    def _add(self, key: str, route: KeyRoute) -> None:
        """Hold a new key, first forgetting the least recently used ones it would not fit
        beside (the count and the bytes)."""
        cost = key_cost(key)
        routes = self.routes
        while routes and (len(routes) >= self.max_keys or self.bytes + cost > self.max_bytes):
            self.bytes -= key_cost(routes.popitem(last=False)[0])
        routes[key] = route
        self.bytes += cost

    def place(self, candidates: Sequence[Worker], key: str | None) -> Worker:
        return self._place(candidates, key)

    def _place(self, candidates: Sequence[Worker], key: str | None) -> Worker:
        """Where a new key (or a request without one) goes, per the assignment mode."""
        if len(candidates) == 1:
            return candidates[0]
        mode = self.assignment_mode
        if mode == "min_load":
            candidates = _lowest(candidates, lambda w: w.load())
        elif mode == "min_group":
            candidates = _lowest(candidates, lambda w: len(w.active_keys))
        if len(candidates) == 1:
            return candidates[0]
        if key is None:
            return self.rng.choice(candidates)
        return max(candidates, key=lambda w: rendezvous_score(key, w.url))

    def add_worker(self, worker: Worker) -> None:
        pass  # a new worker takes new keys only

    def remove_worker(self, worker: Worker) -> None:
        pass  # its keys move on their next request (it is no candidate any more)

    def evict(self) -> bool:
        """Forget the keys unused for `max_idle_secs` (0: never), the oldest first, at most
        `EVICT_BATCH` at a time (a full table going idle at once would block the event loop
        for ~0.2 s); True when more are due, so `run_eviction` goes on after a checkpoint."""
        if self.max_idle_secs <= 0 or not self.routes:
            return False
        oldest_kept = trio.current_time() - self.max_idle_secs
        routes = self.routes
        dropped = 0
        more = False
        while routes:
            key, route = next(iter(routes.items()))
            if route.last_used > oldest_kept:
                break
            if dropped == EVICT_BATCH:
                more = True
                break
            del routes[key]
            self.bytes -= key_cost(key)
            dropped += 1
        if dropped:
            log.info("manual policy: forgot %d idle routing keys, %d kept", dropped, len(routes))
        return more


def _lowest(candidates: Sequence[Worker], measure: Callable[[Worker], int]) -> list[Worker]:
    values = [measure(w) for w in candidates]
    low = min(values)
    return [w for w, value in zip(candidates, values, strict=True) if value == low]


def rendezvous_score(key: str, url: str) -> int:
    """A stable pseudo-random score of (key, worker): the highest scoring candidate takes the
    key. Stable across processes (Python's own `hash` is salted per process)."""
    data = key.encode("utf-8", "surrogatepass") + b"\0" + url.encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")
