"""What engines report about themselves, as the fleet keeps it: loads per DP rank and the server
info the router acts on. Pure values; `control/engine_info.py` fetches and parses them."""

from __future__ import annotations

from typing import Any

import attrs


@attrs.frozen
class RankLoad:
    """One DP rank's load. `waiting` is the engine's `num_waiting_reqs`; `waiting_for_kv` the
    part of it a PD decode holds for KV caches still to arrive (0 elsewhere, or unknown)."""

    dp_rank: int = 0
    running: int = 0
    waiting: int = 0
    waiting_for_kv: int = 0
    # A PD prefill's KV transfers still in flight (`prefill_inflight_queue_reqs`): requests it
    # holds that `num_waiting_reqs` leaves out.
    sending: int = 0
    # A PD prefill's requests waiting for their decode's handshake (`prefill_bootstrap_queue_reqs`):
    # the part of `waiting` that is the hand-off, not a queue for compute.
    bootstrapping: int = 0
    used_tokens: int = 0
    token_usage: float = 0.0
    max_running: int = 0
    # least_load's expected wait (SGLang's `num_waiting_uncached_tokens`, `gen_throughput`).
    waiting_tokens: int = 0
    gen_throughput: float = 0.0

    @property
    def requests(self) -> int:
        """Requests the rank holds: what `num_reqs` of the old `/get_load` counted."""
        return self.running + self.waiting

    @property
    def held(self) -> int:
        """Every request the rank holds, its KV transfers out included (the release audit)."""
        return self.running + self.waiting + self.sending

    @property
    def queued(self) -> int:
        """Requests queued for compute, not for a KV transfer or its handshake."""
        return max(0, self.waiting - self.waiting_for_kv - self.bootstrapping)


@attrs.frozen
class EngineLoad:
    ranks: tuple[RankLoad, ...]
    endpoint: str  # which endpoint answered: "/v1/loads", or "/get_load" on older engines

    @property
    def requests(self) -> int:
        return sum(rank.requests for rank in self.ranks)

    @property
    def waiting(self) -> int:
        return sum(rank.waiting for rank in self.ranks)

    @property
    def used_tokens(self) -> int:
        return sum(rank.used_tokens for rank in self.ranks)

    @property
    def running(self) -> int:
        return sum(rank.running for rank in self.ranks)

    @property
    def waiting_tokens(self) -> int:
        return sum(rank.waiting_tokens for rank in self.ranks)

    @property
    def gen_throughput(self) -> float:
        return sum(rank.gen_throughput for rank in self.ranks)

    @property
    def token_usage(self) -> float:
        """The ranks' mean KV usage (0-1): what least_load's KV barrier reads."""
        return sum(rank.token_usage for rank in self.ranks) / len(self.ranks) if self.ranks else 0.0

    def to_json(self) -> dict[str, Any]:
        """`GET /get_loads`'s figures for one worker: the old `/get_load` names, summed over
        ranks, and every rank's own."""
        return {
            "num_reqs": self.requests,
            "num_waiting_reqs": self.waiting,
            "num_tokens": self.used_tokens,
            "load_endpoint": self.endpoint,
            "dp_loads": [attrs.asdict(rank) for rank in self.ranks],
        }


WILDCARD_HOSTS = ("*", "0.0.0.0", "::")  # SGLang's bind-all hosts (`_BIND_WILDCARD_HOSTS`)


@attrs.frozen
class KvEventsInfo:
    """The KV-event publisher an engine advertises under `kv_events` in `/server_info` (SGLang
    0.5.23 `srt/runtime_context.py` `describe_kv_events_publisher`): rank r publishes on
    `endpoint_port_base + r` and replays on `replay_endpoint_port_base + r`, at the worker
    URL's host when `endpoint_host` is a wildcard; prompts are hashed at `block_size`."""

    host: str
    port_base: int
    topic: str
    block_size: int
    dp_size: int
    replay_port_base: int | None = None

    def endpoints(self, worker_host: str) -> list[tuple[str, str | None]]:
        """(PUB endpoint, replay endpoint or None) for each rank."""
        host = worker_host if self.host in WILDCARD_HOSTS else self.host
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return [
            (
                f"tcp://{host}:{self.port_base + rank}",
                None
                if self.replay_port_base is None
                else f"tcp://{host}:{self.replay_port_base + rank}",
            )
            for rank in range(self.dp_size)
        ]


@attrs.frozen
class ServerInfo:
    dp_width: int = 1
    transfer_backend: str | None = None  # `disaggregation_transfer_backend`
    max_running_requests: int | None = None  # per DP rank
    # The async dynamic batch tokenizer awaits between registering a rid and scheduling it: the
    # window in which an abort is lost and latches (docs/protocol.md §10).
    abort_latch_hazard: bool = False
    version: str | None = None
    kv_events: KvEventsInfo | None = None  # its KV-event publisher, when it has one
