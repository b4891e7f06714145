"""SMG 1.13's `prefix_hash` policy: the head of a prompt hashed onto a ring, with a load escape.

A light cache affinity: requests that share their first `--prefix-token-count` tokens (four
characters a token for the text the router routes on; token-id requests carry no text here and
are load-balanced) hash to one point of the consistent-hashing ring (`consistent_hashing.py`),
so they meet the same worker and its KV cache, with no tree to keep. The client's routing key,
when it sends one, is hashed instead of the prompt.

The ring's worker is taken unless it is overloaded: with `mean = (sum of candidate loads + 1) /
candidates` (the +1 is this request), a load above both `mean * --prefix-hash-load-factor` and
`mean + --prefix-hash-balance-abs-threshold` is too much; then the least loaded candidate that
is not overloaded gets it (the ring's worker after all when every one is). No text and no key:
the least loaded candidate. Loads are `Worker.load()`. SMG's `--cache-boundaries` (hash at the
deepest boundary a request reaches) is not implemented.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from trio_pd.config import PolicyConfig
from trio_pd.fleet.consistent_hashing import HashRing, key_position, position
from trio_pd.fleet.hints import RouteHints

if TYPE_CHECKING:
    from trio_pd.fleet.worker import Worker

CHARS_PER_TOKEN = 4


class PrefixHashPolicy:
    name = "prefix_hash"

    def __init__(self, config: PolicyConfig | None = None) -> None:
        config = config or PolicyConfig()
        self.prefix_chars = max(1, config.prefix_token_count) * CHARS_PER_TOKEN
        self.load_factor = config.prefix_hash_load_factor
        self.abs_threshold = config.prefix_hash_balance_abs_threshold
        self.ring = HashRing()

    def point(self, hints: RouteHints) -> int | None:
        if hints.key is not None:
            return key_position(hints.key)
        if hints.text:
            return position(hints.text[: self.prefix_chars].encode("utf-8", "surrogatepass"))
        return None

    def choose(self, candidates: Sequence[Worker], hints: RouteHints) -> Worker:
        loads = [w.load() for w in candidates]
        point = self.point(hints)
        target = None if point is None else self.ring.find(point, candidates)
        if target is None:
            return _least(candidates, loads)
        mean = (sum(loads) + 1) / len(candidates)
        limit = max(mean * self.load_factor, mean + self.abs_threshold)
        if target.load() <= limit:
            return target
        fine = [(w, load) for w, load in zip(candidates, loads, strict=True) if load <= limit]
        if not fine:
            return target
        return min(fine, key=lambda pair: pair[1])[0]

    def add_worker(self, worker: Worker) -> None:
        self.ring.add(worker)

    def remove_worker(self, worker: Worker) -> None:
        self.ring.remove(worker)

    def evict(self) -> None:
        pass


def _least(candidates: Sequence[Worker], loads: list[int]) -> Worker:
    """The least loaded candidate, the first on a tie (as SMG's `min_by_key`)."""
    return candidates[loads.index(min(loads))]
