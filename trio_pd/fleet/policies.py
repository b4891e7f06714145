"""Worker selection policies, named as in SGLang's router.

A policy chooses one worker among `candidates` (already filtered by the fleet: healthy, not
removed, breaker allowing, preferably not avoided; never empty), knowing of the request only its
`RouteHints`. Policies hold no references to the fleet; the fleet tells them about membership
through `add_worker` / `remove_worker`. `manual`, `bucket`, `least_load`,
`consistent_hashing`, `prefix_hash` and `kv_aware` live in their own modules;
`--routing-key-override` wraps any other policy in `sticky.py`'s sticky sessions.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import trio
import trio.lowlevel

from trio_pd.config import KEYED_POLICIES, LoadMetric, PolicyConfig
from trio_pd.fleet.bucket import BucketPolicy
from trio_pd.fleet.consistent_hashing import ConsistentHashingPolicy
from trio_pd.fleet.hints import RouteHints
from trio_pd.fleet.least_load import ExpectedWait, LeastLoadPolicy
from trio_pd.fleet.manual import ManualPolicy
from trio_pd.fleet.prefix_hash import PrefixHashPolicy
from trio_pd.fleet.prefix_tree import PrefixTree
from trio_pd.fleet.sticky import StickyPolicy

if TYPE_CHECKING:
    from trio_pd.fleet.worker import Worker


class Policy(Protocol):
    name: str

    def choose(self, candidates: Sequence[Worker], hints: RouteHints) -> Worker: ...

    def add_worker(self, worker: Worker) -> None: ...

    def remove_worker(self, worker: Worker) -> None: ...

    def evict(self) -> bool | None: ...  # True: more to drop (after a checkpoint)


class _Stateless:
    name = "base"

    def add_worker(self, worker: Worker) -> None:
        pass

    def remove_worker(self, worker: Worker) -> None:
        pass

    def evict(self) -> None:
        pass


def _least_loaded(candidates: Sequence[Worker], rng: random.Random) -> Worker:
    """Lowest `load()`; ties broken at random so idle fleets still spread."""
    loads = [w.load() for w in candidates]
    low = min(loads)
    best = [w for w, load in zip(candidates, loads, strict=True) if load == low]
    return best[0] if len(best) == 1 else rng.choice(best)


class RandomPolicy(_Stateless):
    name = "random"

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()

    def choose(self, candidates: Sequence[Worker], hints: RouteHints) -> Worker:
        return self.rng.choice(candidates)


class RoundRobinPolicy(_Stateless):
    """Cycles an index over whatever candidate list it gets (as SGLang: index mod count)."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, candidates: Sequence[Worker], hints: RouteHints) -> Worker:
        worker = candidates[self._next % len(candidates)]
        self._next += 1
        return worker


class PowerOfTwoPolicy:
    """SMG 1.13's power of two choices, by `--power-of-two-load-metric`:

    - `expected_wait` (the default): two distinct random candidates, the shorter expected wait
      wins (least_load's score, `fleet/least_load.py`, ties drawn at random);
    - `requests`: of the two, the one with fewer of this router's legs in flight
      (`Worker.in_flight`), the expected wait breaking a tie;
    - `least_requests`: no sampling: the candidates with the fewest legs in flight, the
      expected wait choosing among them.
    """

    name = "power_of_two"

    def __init__(
        self,
        rng: random.Random | None = None,
        metric: LoadMetric = "expected_wait",
        config: PolicyConfig | None = None,
    ) -> None:
        self.rng = rng or random.Random()
        self.metric = metric
        self.scorer = ExpectedWait(config or PolicyConfig(), self.rng)

    def choose(self, candidates: Sequence[Worker], hints: RouteHints) -> Worker:
        if len(candidates) == 1:
            return candidates[0]
        if self.metric == "least_requests":
            return self.scorer.pick(_fewest_in_flight(candidates))
        pair = self.rng.sample(candidates, 2)
        if self.metric == "requests":
            return self.scorer.pick(_fewest_in_flight(pair))
        return self.scorer.pick(pair)

    def add_worker(self, worker: Worker) -> None:
        pass

    def remove_worker(self, worker: Worker) -> None:
        self.scorer.forget(worker)

    def evict(self) -> None:
        pass


def _fewest_in_flight(candidates: Sequence[Worker]) -> list[Worker]:
    low = min(w.in_flight for w in candidates)
    return [w for w in candidates if w.in_flight == low]


class CacheAwarePolicy:
    """SGLang's cache-aware policy over one shared approximate prefix tree.

    1. Loads imbalanced (max - min > balance_abs_threshold AND max > min * balance_rel_threshold):
       the least loaded candidate, and the text is still inserted for it.
    2. Otherwise the candidate with the longest prefix match wins if matched / len(text) >
       cache_threshold (ties: least loaded); else the candidate with the smallest tree (ties:
       least loaded, then candidate order). The text is inserted for the chosen worker.
    3. No text (None or ""): the least loaded candidate; the tree is not touched.
    Trees grow between evictions; `evict()` trims every worker to max_tree_size bytes (its nodes'
    memory, `prefix_tree.node_cost`), and a worker whose tree passes twice that is trimmed at
    once on insert.
    """

    name = "cache_aware"

    def __init__(self, config: PolicyConfig | None = None, rng: random.Random | None = None):
        self.config = config or PolicyConfig()
        self.rng = rng or random.Random()
        self.tree: PrefixTree[Worker] = PrefixTree()

    def choose(self, candidates: Sequence[Worker], hints: RouteHints) -> Worker:
        text = hints.text
        if len(candidates) == 1:
            chosen = candidates[0]
        elif not text:
            return _least_loaded(candidates, self.rng)
        else:
            chosen = self._pick(candidates, text)
        if text:
            self.record(text, chosen)
        return chosen

    def record(self, text: str, chosen: Worker) -> None:
        """`text` went to `chosen` (kv_aware records its own choices here too)."""
        self.tree.insert(text, chosen)
        if self.tree.size(chosen) > 2 * self.config.max_tree_size:
            # A flood of long prompts must not grow the tree without bound between two
            # periodic evictions; trimming one tenant costs only the nodes it drops.
            self.tree.evict_tenant(chosen, self.config.max_tree_size)

    def _pick(self, candidates: Sequence[Worker], text: str) -> Worker:
        cfg = self.config
        loads = [w.load() for w in candidates]
        max_load, min_load = max(loads), min(loads)
        if (
            max_load - min_load > cfg.balance_abs_threshold
            and max_load > min_load * cfg.balance_rel_threshold
        ):
            return _least_loaded(candidates, self.rng)
        matched, holders = self.tree.match(text, candidates)
        if holders and matched / len(text) > cfg.cache_threshold:
            if len(holders) == 1:
                return holders[0]
            return min(holders, key=lambda w: w.load())
        size = self.tree.size
        return min(candidates, key=lambda w: (size(w), w.load()))

    def add_worker(self, worker: Worker) -> None:
        pass

    def remove_worker(self, worker: Worker) -> None:
        self.tree.remove_tenant(worker)

    def evict(self) -> None:
        self.tree.evict(self.config.max_tree_size)


def make_policy(
    name: str, config: PolicyConfig | None = None, rng: random.Random | None = None
) -> Policy:
    """The policy `name` with its knobs; with `--routing-key-override`, wrapped in sticky
    sessions unless it reads the routing key itself (manual, consistent_hashing)."""
    config = config or PolicyConfig()
    policy = _bare_policy(name, config, rng)
    if config.routing_key_override and name not in KEYED_POLICIES:
        return StickyPolicy(policy, config.sticky_assignment_mode, config.max_idle_secs, rng)
    return policy


def _bare_policy(name: str, config: PolicyConfig, rng: random.Random | None) -> Policy:
    if name == "random":
        return RandomPolicy(rng)
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "power_of_two":
        return PowerOfTwoPolicy(rng, config.power_of_two_load_metric, config)
    if name == "least_load":
        return LeastLoadPolicy(config, rng)
    if name == "cache_aware":
        return CacheAwarePolicy(config, rng)
    if name == "manual":
        return ManualPolicy(config.manual_assignment_mode, config.max_idle_secs, rng)
    if name == "consistent_hashing":
        return ConsistentHashingPolicy(rng)
    if name == "prefix_hash":
        return PrefixHashPolicy(config)
    if name == "bucket":
        return BucketPolicy(config, rng)
    if name == "kv_aware":
        from trio_pd.fleet.kv_aware import KvAwarePolicy  # pyzmq, msgspec: only when used

        return KvAwarePolicy(CacheAwarePolicy(config, rng), config, rng)
    raise ValueError(f"unknown policy {name!r}")


class _Evictable(Protocol):
    def evict(self) -> bool | None: ...


async def run_eviction(policy: _Evictable, interval_secs: float) -> None:
    """Call `policy.evict()` every `interval_secs`, forever (a Fleet works too: it evicts all).

    An interval of 0 (or less) turns periodic eviction off, as SMG's manual policy reads it,
    rather than spinning: cache-aware trees are still trimmed at twice their bound on insert."""
    if interval_secs <= 0:
        await trio.sleep_forever()
    while True:
        await trio.sleep(interval_secs)
        while policy.evict():  # a batch at a time, letting requests run in between
            await trio.lowlevel.checkpoint()
