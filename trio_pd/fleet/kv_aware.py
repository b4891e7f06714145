"""`kv_aware`: prefill chosen by what the engines' own KV events say they hold.

vllm-router's name for it. Before selection the prompt's ids are made as the engine makes them
(`kv_tokens.py`, a worker thread: text tokenized, chat through the model's chat template,
token ids as given) and hashed at each advertised block size (`kv_hash.py`):
a `KvProbe` in the request's hints. Among candidates that are all `precise` (`kv_feeds.py`):
1. loads imbalanced by both `--balance-abs-threshold` and `--balance-rel-threshold`: the least
   loaded (as cache_aware);
2. else the candidate holding the longest prefix of the prompt's blocks, if that prefix is more
   than `--cache-threshold` of the prompt (ties: least loaded, then at random);
3. else (no engine holds enough of it) the approximate tree's choice: where this text went
   before, else the prefill with the least routed text. Routing history keeps a tenant on one
   prefill while its prefix is evicted and comes back; the least loaded would spread it over
   all of them and multiply the working set (measured on real engines with small KV pools:
   docs/benchmarks.md).
When any candidate is not precise (no publisher, syncing, stale, or its self-check tripped), or
the prompt's ids could not be known (too long, a batch, tools or media in a chat), the
approximate tree (`cache_aware`) chooses, and `kv_feeds` says why per worker. The tree gets
every routed text either way, so it is warm when needed. After the request, `observe` feeds the
engine's reported cached tokens to the chosen worker's self-check (`kv_check.py`).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import trio

from trio_pd.config import PolicyConfig
from trio_pd.fleet.hints import KvProbe, RouteHints
from trio_pd.fleet.kv_feeds import KvFeeds, Membership, WorkerKv
from trio_pd.fleet.kv_hash import block_hashes, cacheable_tokens
from trio_pd.fleet.kv_tokens import PromptTokenizer

if TYPE_CHECKING:
    from trio_pd.fleet.worker import Worker


class Approximate(Protocol):
    """The approximate tree's policy (`policies.CacheAwarePolicy`) kv_aware falls back to."""

    def choose(self, candidates: Sequence[Worker], hints: RouteHints) -> Worker: ...

    def record(self, text: str, chosen: Worker) -> None: ...

    def add_worker(self, worker: Worker) -> None: ...

    def remove_worker(self, worker: Worker) -> None: ...

    def evict(self) -> None: ...


MAX_BLOCKS = 65_536  # blocks of a prompt hashed at most (the tokenizer's bound: 64k tokens)


def _held_by(indexes: list[dict[int, None]]) -> Callable[[int], bool]:
    def held(block: int) -> bool:
        return any(block in index for index in indexes)

    return held


class KvAwarePolicy:
    name = "kv_aware"

    def __init__(
        self, approximate: Approximate, config: PolicyConfig, rng: random.Random | None = None
    ) -> None:
        self.config = config
        self.rng = rng or random.Random()
        self.approximate = approximate
        self.feeds = KvFeeds(config.kv_index_max_blocks, config.kv_events_stale_secs)
        self.tokenizer = PromptTokenizer(config.tokenizer_path) if config.tokenizer_path else None
        self.precise_choices = 0  # choices made by the index
        self.fallback_choices = 0  # choices the approximate tree made instead
        self.probes = 0  # prompts tokenized and hashed

    # -- before selection ----------------------------------------------------------------------

    async def probe(self, path: str, body: bytes) -> KvProbe | None:
        """The prompt's ids as the engine will make them (`kv_tokens.py`: text tokenized, a
        chat rendered by the model's template, token ids taken as given) and their block hashes
        at every block size a subscribed worker uses; None when it cannot be known (the
        approximate tree routes it)."""
        # Each block size's indexes (the dicts themselves: a thread's `in` is atomic under the
        # GIL), so hashing stops at the first block no worker holds.
        indexes: dict[int, list[dict[int, None]]] = {}
        for kv in self.feeds.by_id.values():
            indexes.setdefault(kv.block_size, []).extend(f.index.blocks for f in kv.feeds)
        if self.tokenizer is None or not indexes:
            return None
        started = trio.current_time()
        self.probes += 1
        tokens = await self.tokenizer.tokens(path, body)
        if not tokens:
            return None

        def hash_all() -> dict[int, list[int]]:
            return {
                size: block_hashes(tokens, size, MAX_BLOCKS, _held_by(ds))
                for size, ds in indexes.items()
            }

        hashes = await trio.to_thread.run_sync(hash_all, limiter=self.tokenizer.limiter)
        return KvProbe(len(tokens), hashes, started)

    # -- selection -----------------------------------------------------------------------------

    def choose(self, candidates: Sequence[Worker], hints: RouteHints) -> Worker:
        probe = hints.kv
        chosen: Worker | None = None
        if probe is not None and len(candidates) > 1:
            kvs = [self.feeds.get(w) for w in candidates]
            if all(kv is not None and kv.state() == "precise" for kv in kvs):
                chosen = self._pick(candidates, kvs, probe)  # type: ignore[arg-type]
                self.precise_choices += 1
                if chosen is None:  # nothing held worth it: by routing history (rule 3)
                    chosen = self.approximate.choose(candidates, hints)
                elif hints.text:
                    self.approximate.record(hints.text, chosen)
        if chosen is None:
            if len(candidates) > 1:
                self.fallback_choices += 1
            chosen = self.approximate.choose(candidates, hints)
        if probe is not None:
            kv = self.feeds.get(chosen)
            if kv is not None:
                held = kv.prefix(probe.hashes.get(kv.block_size, ())) * kv.block_size
                probe.predicted[chosen.id] = min(
                    held, cacheable_tokens(probe.tokens, kv.block_size)
                )
                # Another of this router's prefills running there may store or evict blocks
                # before this one is scheduled: its comparison would blame the index for a race.
                probe.quiet = chosen.in_flight == 0
        return chosen

    def _pick(
        self, candidates: Sequence[Worker], kvs: Sequence[WorkerKv], probe: KvProbe
    ) -> Worker | None:
        cfg = self.config
        loads = [w.load() for w in candidates]
        low, high = min(loads), max(loads)
        if high - low > cfg.balance_abs_threshold and high > low * cfg.balance_rel_threshold:
            return self._least_loaded(candidates, loads)
        matched = [kv.prefix(probe.hashes.get(kv.block_size, ())) * kv.block_size for kv in kvs]
        best = max(matched)
        if best > 0 and best / max(probe.tokens, 1) > cfg.cache_threshold:
            holders = [i for i, m in enumerate(matched) if m == best]
            return self._least_loaded([candidates[i] for i in holders], [loads[i] for i in holders])
        return None

    def _least_loaded(self, candidates: Sequence[Worker], loads: Sequence[int]) -> Worker:
        low = min(loads)
        best = [w for w, load in zip(candidates, loads, strict=True) if load == low]
        return best[0] if len(best) == 1 else self.rng.choice(best)

    # -- after the request ---------------------------------------------------------------------

    def observe(self, probe: KvProbe, worker: Worker, reported: int | None) -> None:
        """The engine reused `reported` tokens of the prompt: the chosen worker's self-check,
        and (when the engine stored new blocks) the event now due from it."""
        predicted = probe.predicted.get(worker.id)
        kv = self.feeds.get(worker)
        if predicted is None or kv is None or reported is None:
            return
        if probe.quiet:
            kv.check.observe(predicted, reported, probe.tokens)
        if reported < probe.tokens // kv.block_size * kv.block_size:
            kv.expect_event(probe.started)

    # -- the Policy protocol -------------------------------------------------------------------

    async def run(self, fleet: Membership) -> None:
        await self.feeds.run(fleet)

    def add_worker(self, worker: Worker) -> None:
        self.approximate.add_worker(worker)

    def remove_worker(self, worker: Worker) -> None:
        self.approximate.remove_worker(worker)

    def evict(self) -> None:
        self.approximate.evict()
