"""The vLLM simulator's KV blocks: a finite pool, and the blocks a prefill holds for a decode.

What NixlConnector does with a remote-decode request's blocks (vLLM 0.33.0,
`distributed/kv_transfer/kv_connector/v1/nixl/`), as bookkeeping on trio time:

- A request that finished normally (`FINISHED_LENGTH_CAPPED` / `FINISHED_STOPPED`) keeps its
  blocks for the decode to read: `request_finished` returns `delay_free_blocks` and the worker
  puts them in `_reqs_to_send` with an expiry, the **lease** (`kv_lease_duration`, 30 s by
  default, `pull_scheduler.py`). Any other end (an abort: the client closed its connection
  first) frees them at once.
- The decode's heartbeats (`HB:<remote request ids>` every `kv_lease_duration // 6`, from the
  request's admission, `base_scheduler.on_new_request`) push the expiry to at least
  `now + kv_lease_duration * 2 // 3` (`base_worker._handle_heartbeat`).
- The decode's read, and the notification a decode sends when it will not read (a request
  aborted before it was scheduled, `request_finished` with `do_remote_prefill` still set; or a
  local prefix hit, an empty read), free the blocks (`_get_new_notifs`).
- An expired lease frees them (`_reap_expired_send_leases`).
- Older engines held them for a fixed `VLLM_NIXL_ABORT_REQUEST_TIMEOUT` (480 s) with no
  heartbeat; `legacy_fixed_lease` models that (heartbeats are then ignored; Mooncake's
  connector still has the fixed `VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT`, `envs.py`).

The pool is what a leak shows in: `held` must come back to 0 once every request ended.
"""

from __future__ import annotations

import math

import attrs
import trio

FREE_REASONS = ("read", "notified", "aborted", "expired", "finished")


@attrs.define(eq=False)
class Lease:
    request_id: str
    blocks: int
    expires_at: float  # math.inf while the request still computes


@attrs.define(eq=False)
class BlockPool:
    """`num_blocks` KV blocks; `acquire` waits (FIFO) while too few are free."""

    num_blocks: int
    lease_secs: float = 30.0
    fixed_lease: bool = False  # the old fixed lease: heartbeats extend nothing
    leases: dict[str, Lease] = attrs.Factory(dict)  # finished, held for a decode
    computing: dict[str, int] = attrs.Factory(dict)  # blocks of requests still running
    freed: dict[str, int] = attrs.Factory(lambda: dict.fromkeys(FREE_REASONS, 0))
    _changed: trio.Event = attrs.Factory(trio.Event)

    @property
    def held(self) -> int:
        """Blocks held for decodes (finished prefills under a lease)."""
        return sum(lease.blocks for lease in self.leases.values())

    @property
    def in_use(self) -> int:
        return self.held + sum(self.computing.values())

    @property
    def free(self) -> int:
        return self.num_blocks - self.in_use

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def acquire(self, request_id: str, blocks: int) -> None:
        """Take `blocks` for a running request (vLLM's scheduler keeps it waiting meanwhile)."""
        blocks = min(blocks, self.num_blocks)
        while self.free < blocks:
            await self._changed.wait()
        self.computing[request_id] = blocks

    def release_running(self, request_id: str, reason: str) -> int:
        """A running request ended without handing its blocks to a decode."""
        blocks = self.computing.pop(request_id, 0)
        if blocks:
            self.freed[reason] += 1
            self._notify()
        return blocks

    def hold(self, request_id: str, now: float) -> Lease:
        """The request finished: its blocks wait for the decode under a lease."""
        blocks = self.computing.pop(request_id, 0)
        lease = Lease(request_id, blocks, now + self.lease_secs)
        self.leases[request_id] = lease
        self._notify()
        return lease

    def heartbeat(self, request_ids: list[str], now: float) -> int:
        """Extend the leases named (none on the old fixed lease); how many were found."""
        if self.fixed_lease:
            return 0
        extension = now + self.lease_secs * 2 / 3  # vLLM: kv_lease_duration * 2 // 3 (ints)
        found = 0
        for request_id in request_ids:
            lease = self.leases.get(request_id)
            if lease is not None:
                lease.expires_at = max(lease.expires_at, extension)
                found += 1
        return found

    def take(self, request_id: str, reason: str) -> Lease | None:
        """Free a held request's blocks (read, notified); None when nothing was held."""
        lease = self.leases.pop(request_id, None)
        if lease is not None:
            self.freed[reason] += 1
            self._notify()
        return lease

    def expire(self, now: float) -> list[Lease]:
        gone = [lease for lease in self.leases.values() if now >= lease.expires_at]
        for lease in gone:
            del self.leases[lease.request_id]
            self.freed["expired"] += 1
        if gone:
            self._notify()
        return gone

    def next_expiry(self) -> float:
        return min((lease.expires_at for lease in self.leases.values()), default=math.inf)

    async def wait_changed(self) -> None:
        await self._changed.wait()

    def to_json(self, now: float) -> dict[str, object]:
        return {
            "num_blocks": self.num_blocks,
            "held_blocks": self.held,
            "computing_blocks": sum(self.computing.values()),
            "free_blocks": self.free,
            "lease_secs": self.lease_secs,
            "fixed_lease": self.fixed_lease,
            "leases": [
                {
                    "request_id": lease.request_id,
                    "blocks": lease.blocks,
                    "expires_in": round(lease.expires_at - now, 3),
                }
                for lease in self.leases.values()
            ],
            "freed": dict(self.freed),
        }
