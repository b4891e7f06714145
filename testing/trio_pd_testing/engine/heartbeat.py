"""The decode's heartbeat to the prefill bootstrap servers it talks to.

SGLang's decode (`disaggregation/common/conn.py` `_start_heartbeat_checker_thread`) keeps every
prefill bootstrap address it has contacted and GETs `http://<addr>/health` every
SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL (5 s, at least 2) with a (2 s, 3 s) timeout. After
SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE (2) misses in a row it forgets that prefill and
fails its rooms that have not got their KV ("Lost connection with prefill instance
(bootstrap_addr: ...)"): a dead prefill's decode requests end in about 10 s instead of the
300 s waiting timeout. A prefill that is alive but never sends (it refused the request) is not
caught: its heartbeat answers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import httpx2
import trio

from trio_pd_testing.engine.config import EngineConfig
from trio_pd_testing.engine.events import EventLog

LOST = "Lost connection with prefill instance (bootstrap_addr: {addr})"


class Heartbeat:
    """`items()` gives the engine's live items (state.Item: bootstrap_addr, stage, room,
    interrupt)."""

    def __init__(
        self,
        config: EngineConfig,
        events: EventLog,
        client: httpx2.AsyncClient,
        items: Callable[[], Iterable[Any]],
    ) -> None:
        self.config, self.events, self.client, self.items = config, events, client, items
        self.failures: dict[str, int] = {}  # bootstrap address -> misses in a row

    def track(self, addr: str) -> None:
        self.failures.setdefault(addr, 0)

    async def run(self) -> None:
        cfg, client = self.config, self.client
        while True:
            await trio.sleep(cfg.heartbeat_interval)
            for addr in list(self.failures):
                ok = await self._probe(client, addr)
                if ok:
                    self.failures[addr] = 0
                    continue
                self.failures[addr] = self.failures.get(addr, 0) + 1
                self.events.emit(
                    "heartbeat_failed", addr=addr, failures=self.failures[addr], dp_rank=None
                )
                if self.failures[addr] >= cfg.heartbeat_max_failures:
                    self.fail(addr)

    async def _probe(self, client: httpx2.AsyncClient, addr: str) -> bool:
        try:
            response = await client.get(
                f"http://{addr}/health",
                timeout=httpx2.Timeout(connect=2.0, read=3.0, write=3.0, pool=3.0),
            )
        except httpx2.HTTPError:
            return False
        return response.status_code == 200

    def fail(self, addr: str) -> None:
        """_handle_node_failure: forget the prefill, fail its unfinished rooms."""
        self.failures.pop(addr, None)
        affected = [
            item
            for item in self.items()
            if item.bootstrap_addr == addr and item.stage in ("prealloc", "transfer")
        ]
        self.events.emit(
            "prefill_lost", addr=addr, rooms=sorted({i.room for i in affected}), dp_rank=None
        )
        for item in affected:
            item.interrupt("lost", LOST.format(addr=addr))
