"""Sticky sessions on any policy: SMG 1.13's routing-key override (`--routing-key-override`,
alias `--sticky-sessions`).

A request with a routing key (a header of `--routing-key-headers`, else its `rid` lineage:
`edge/routing_key.py`) goes to the worker its key is pinned to; the role's own policy decides
only for requests without a key and, in `delegate` mode (the default here), where a new key is
pinned. The other `--assignment-mode`s place a new key as the manual policy does (random by
rendezvous hash, min_load, min_group). A key whose worker is not a candidate (down, removed,
breaker open, avoided by a retry) is placed again and pinned to its new worker, its old one kept
second. A key with `STICKY_INFLIGHT_CAP` of its own legs already running on its worker is placed
again for this request (one conversation must not stack up on one engine), and re-pinned only
when that found another worker under the cap. `manual` and `consistent_hashing` read the key
themselves and are not wrapped (`config.KEYED_POLICIES`).

The pins are a manual policy's table (`manual.py`): at most `MAX_ROUTING_KEYS` and
`MAX_ROUTING_KEY_BYTES`, least recently used dropped first, idle keys forgotten after
`--max-idle-secs` by the periodic eviction. Keys are namespaced by model (the policy is per role
already), so one key sticks per model and leg.

A key read from the body's `rid` (a `RidKey`, no header named it) is pinned only when it is seen
a second time: most rids are one request's own, and pinning each for `--max-idle-secs` (4 hours)
filled the table with keys never asked again, pushing out real sessions (issue 26 N14). Its first
request is placed as any new key is and the worker remembered in a small table of its own
(`FIRST_SIGHTS`, a digest and a worker URL each, oldest dropped first); the second goes to that
worker when it can take it and pins it there, so a conversation's turns still meet one worker. A
header key is the client's explicit session and is pinned at once, as before.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from trio_pd.config import AssignmentMode
from trio_pd.fleet.hints import RidKey, RouteHints
from trio_pd.fleet.manual import MAX_ROUTING_KEYS, ManualPolicy

if TYPE_CHECKING:
    from trio_pd.fleet.worker import Worker

STICKY_INFLIGHT_CAP = 2  # SMG: a key's own legs on its pinned worker before it respills
FIRST_SIGHTS = 32_768  # rid keys seen once, remembered (~3 MiB); the oldest forgotten first


class _Inner(Protocol):
    """The wrapped policy (`policies.Policy`, named here so this module imports no sibling
    that imports it)."""

    name: str

    def choose(self, candidates: Sequence[Worker], hints: RouteHints) -> Worker: ...

    def add_worker(self, worker: Worker) -> None: ...

    def remove_worker(self, worker: Worker) -> None: ...

    def evict(self) -> bool | None: ...


class StickyPolicy:
    def __init__(
        self,
        inner: _Inner,
        assignment_mode: AssignmentMode = "delegate",
        max_idle_secs: float = 14_400,
        rng: random.Random | None = None,
        max_keys: int = MAX_ROUTING_KEYS,
    ) -> None:
        self.inner = inner
        self.name = inner.name  # metrics and logs name the real policy, as SMG
        self.delegate = assignment_mode == "delegate"
        mode: AssignmentMode = "random" if self.delegate else assignment_mode
        self.pins = ManualPolicy(mode, max_idle_secs, rng, max_keys)
        self.first_sights: dict[int, str] = {}  # hash of a rid key seen once -> its worker URL
        self.branches: dict[str, int] = dict.fromkeys(
            ("occupied_hit", "occupied_miss", "vacant", "cap_respill", "no_routing_id",
             "first_sight"), 0,
        )  # fmt: skip

    def _assign(self, candidates: Sequence[Worker], hints: RouteHints, key: str) -> Worker:
        if self.delegate:
            return self.inner.choose(candidates, hints)
        return self.pins.place(candidates, key)

    def choose(self, candidates: Sequence[Worker], hints: RouteHints) -> Worker:
        raw = hints.key
        if raw is None:
            self.branches["no_routing_id"] += 1
            return self.inner.choose(candidates, hints)
        model = hints.model or ""
        key = f"{len(model)}:{model}:{raw}"
        known, pinned = self.pins.pinned(key, candidates)
        if pinned is not None:
            if pinned.active_keys.get(raw, 0) < STICKY_INFLIGHT_CAP:
                self.branches["occupied_hit"] += 1
                return pinned
            chosen = self._assign(candidates, hints, raw)
            if chosen is not pinned and chosen.active_keys.get(raw, 0) < STICKY_INFLIGHT_CAP:
                self.pins.pin_first(key, chosen)
            self.branches["cap_respill"] += 1
            return chosen
        if isinstance(raw, RidKey) and not known:
            seen = self.first_sights.pop(hash(key), None)
            if seen is None:  # a rid's first request: placed, remembered, not pinned
                chosen = self._assign(candidates, hints, raw)
                self._first_sight(key, chosen)
                self.branches["first_sight"] += 1
                return chosen
            first = next((w for w in candidates if w.url == seen), None)
            if first is not None and first.active_keys.get(raw, 0) < STICKY_INFLIGHT_CAP:
                self.pins.pin_first(key, first)  # seen again: pinned where it went first
                self.branches["vacant"] += 1
                return first
        chosen = self._assign(candidates, hints, raw)
        self.pins.pin_first(key, chosen)
        self.branches["occupied_miss" if known else "vacant"] += 1
        return chosen

    def _first_sight(self, key: str, worker: Worker) -> None:
        sights = self.first_sights
        if len(sights) >= FIRST_SIGHTS:
            del sights[next(iter(sights))]
        sights[hash(key)] = worker.url

    def add_worker(self, worker: Worker) -> None:
        self.inner.add_worker(worker)

    def remove_worker(self, worker: Worker) -> None:
        self.inner.remove_worker(worker)

    def evict(self) -> bool:
        more = bool(self.inner.evict())
        return self.pins.evict() or more
