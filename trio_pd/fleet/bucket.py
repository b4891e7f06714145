"""SGLang's `bucket` prefill policy: each prefill worker owns a range of prompt lengths.

Prompts of similar length batch well together on one prefill engine, so the prefill workers of a
model split the lengths between them (in registration order: the first takes the shortest), and
the split follows the traffic. What SGLang's router (SMG 0.3.2) does, and so does this module:

- Length is the prompt's size in characters (`RouteHints.length`); a request without text
  (token ids) has length 0.
- The load window holds every request routed in the last `--bucket-adjust-interval-secs`, with
  its length and worker; expired entries are dropped when the next request is recorded. A
  worker's load is the characters routed to it within the window.
- Selection: when the loads are imbalanced (max - min > `--balance-abs-threshold` and max >
  min * `--balance-rel-threshold`, SMG's cache-aware flags), the least loaded worker; otherwise
  the worker whose range holds the length.
- Initial ranges split [0, 4096) evenly, the last range open-ended. Every
  `--bucket-adjust-interval-secs` the ranges are recomputed from the lengths in the window
  (`adjusted_uppers`), unless the per-worker load moved by less than a factor of two since the
  last adjustment.

Where this module differs, on purpose (SMG's behaviour would fail or misroute requests):

- Only candidates are chosen (healthy, breaker allowing, not avoided by a retry). SMG may pick
  the least loaded or range-owning worker even when it is unhealthy, which fails the request;
  here the imbalance is judged and the least loaded picked among candidates, and a range whose
  owner is no candidate goes to a random candidate (SMG's fallback when no range matches).
- A membership change resets the ranges to the even split of [0, 4096) over the new members
  and forces the next adjustment to recompute them from the window. SMG's re-initialisation
  splits [0, 2**64) instead (it overwrites its 4096 on first use), which sends every prompt to
  the first worker until load changes twofold; it also zeroes every worker's load, here the
  survivors keep theirs (a new worker starts at 0).
- Adjustment runs lazily, at the first selection due (the ranges are read only there), against
  `trio.current_time()`, instead of on a timer thread: no task to supervise, and MockClock
  drives it in tests.

One set of ranges per model (None: the router's only model). Per process, as SMG's are per
replica: with `--workers N` each process balances the share of traffic it receives.
"""

from __future__ import annotations

import logging
import math
import random
from bisect import bisect_left
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

import trio

from trio_pd.config import PolicyConfig
from trio_pd.fleet.hints import RouteHints

if TYPE_CHECKING:
    from trio_pd.fleet.worker import Worker

log = logging.getLogger(__name__)

INITIAL_SPAN = 4096  # SMG: initial ranges split [0, 4096) evenly
OPEN = math.inf  # the last range's upper bound


def even_uppers(count: int) -> list[float]:
    """Inclusive upper bounds splitting [0, INITIAL_SPAN) over `count` workers, the last open."""
    if count == 0:
        return []
    gap = INITIAL_SPAN // count
    return [float((i + 1) * gap - 1) for i in range(count - 1)] + [OPEN]


def adjusted_uppers(lengths: Sequence[int], count: int, share: int) -> list[float]:
    """SMG's boundary adjustment: new inclusive upper bounds for `count` workers from the
    window's request `lengths`, each worker taking about `share` characters.

    Walking the sorted lengths, each worker but the last takes lengths until their sum reaches
    `share`; its range ends at the length that reached it (or `share` past the range's start,
    when that length lies below the start). Lengths running out leaves the remaining ranges
    `share` wide; the last range is open-ended.
    """
    ordered = sorted(lengths)
    uppers: list[float] = []
    start = 0
    used = 0
    for index in range(count):
        last = index == count - 1
        if last:
            uppers.append(OPEN)
            break
        total = 0
        closed = False
        for length in ordered[used:]:
            total += length
            used += 1
            if total >= share:
                end = start + share if length <= start else length
                uppers.append(float(end))
                start = end + 1
                closed = True
                break
        if not closed:
            uppers.append(float(start + share))
            start += share + 1
    return uppers


class LengthBuckets:
    """One model's prefill workers, the length range each owns, and the load window."""

    def __init__(self, members: Sequence[Worker], window_secs: float, now: float) -> None:
        self.window_secs = window_secs
        self.members: list[Worker] = list(members)
        self.uppers = even_uppers(len(self.members))
        self.chars: dict[Worker, int] = dict.fromkeys(self.members, 0)
        self.window: deque[tuple[float, int, Worker]] = deque()
        self.total = 0  # characters in the window
        self.share = 0  # per-worker characters the ranges were last computed for
        self.next_adjust = now + window_secs

    def set_members(self, members: Sequence[Worker]) -> None:
        self.members = list(members)
        self.uppers = even_uppers(len(self.members))
        self.chars = {w: self.chars.get(w, 0) for w in self.members}
        self.share = 0  # the next adjustment recomputes the ranges whatever the load

    def owner(self, length: int) -> Worker | None:
        index = bisect_left(self.uppers, length)
        return self.members[index] if index < len(self.members) else None

    def ranges(self) -> list[tuple[Worker, int, float]]:
        """(worker, first length, last length) of each range, in order; the last ends at inf."""
        starts = [0, *(int(u) + 1 for u in self.uppers[:-1])]
        return list(zip(self.members, starts, self.uppers, strict=True))

    def expire(self, now: float) -> None:
        """Drop the requests older than the window: before anything reads it (after an idle
        spell, the imbalance check and the ranges must not see an hour-old request)."""
        chars = self.chars
        horizon = now - self.window_secs
        window = self.window
        while window and window[0][0] < horizon:
            _, old, owner = window.popleft()
            self.total = max(0, self.total - old)
            if owner in chars:
                chars[owner] = max(0, chars[owner] - old)

    def record(self, length: int, worker: Worker, now: float) -> None:
        """Count a routed request."""
        self.chars[worker] = self.chars.get(worker, 0) + length
        self.window.append((now, length, worker))
        self.total += length

    def adjust_if_due(self, now: float) -> None:
        """Recompute the ranges once an interval, from the window as it stood when the
        adjustment fell due (SMG's timer would have run then; here the first request after
        it does the work)."""
        if now < self.next_adjust:
            return
        self.expire(self.next_adjust)
        self.next_adjust = now + self.window_secs
        if not self.window or not self.members:
            return
        share = self.total // len(self.members)
        old = self.share
        if old != 0 and share <= 2 * old and old <= 2 * share:
            return  # the load per worker moved less than twofold: the ranges still fit
        self.share = share
        before = self.uppers
        self.uppers = adjusted_uppers([n for _, n, _ in self.window], len(self.members), share)
        log.debug("bucket ranges %s -> %s (share %d)", before, self.uppers, share)


class BucketPolicy:
    name = "bucket"

    def __init__(self, config: PolicyConfig | None = None, rng: random.Random | None = None):
        self.config = config or PolicyConfig()
        self.rng = rng or random.Random()
        self.workers: list[Worker] = []  # registration order: the order of the ranges
        self.buckets: dict[str | None, LengthBuckets] = {}

    def choose(self, candidates: Sequence[Worker], hints: RouteHints) -> Worker:
        now = trio.current_time()
        buckets = self.buckets_for(hints.model, now)
        buckets.adjust_if_due(now)
        buckets.expire(now)
        chosen = self._pick(buckets, candidates, hints.length)
        buckets.record(hints.length, chosen, now)
        return chosen

    def _pick(self, buckets: LengthBuckets, candidates: Sequence[Worker], length: int) -> Worker:
        if len(candidates) == 1:
            return candidates[0]
        cfg = self.config
        loads = [buckets.chars.get(w, 0) for w in candidates]
        high, low = max(loads), min(loads)
        if high - low > cfg.balance_abs_threshold and high > low * cfg.balance_rel_threshold:
            least = [w for w, load in zip(candidates, loads, strict=True) if load == low]
            return least[0] if len(least) == 1 else self.rng.choice(least)
        owner = buckets.owner(length)
        if owner is not None and owner in candidates:
            return owner
        return self.rng.choice(candidates)

    def buckets_for(self, model: str | None, now: float) -> LengthBuckets:
        """The ranges of `model`'s workers (created on first use; reset when they changed,
        also when a worker learned which model it serves)."""
        members = [w for w in self.workers if model is None or w.model == model]
        buckets = self.buckets.get(model)
        if buckets is None:
            buckets = self.buckets[model] = LengthBuckets(
                members, self.config.bucket_adjust_interval_secs, now
            )
        elif buckets.members != members:
            buckets.set_members(members)
        return buckets

    def add_worker(self, worker: Worker) -> None:
        self.workers.append(worker)

    def remove_worker(self, worker: Worker) -> None:
        self.workers = [w for w in self.workers if w is not worker]
        for buckets in self.buckets.values():
            if worker in buckets.members:
                buckets.set_members([w for w in buckets.members if w is not worker])

    def evict(self) -> None:
        pass  # the window is trimmed before every choice
