"""The prefill's radix cache, reduced to its KV blocks, and SGLang's KV-event publisher.

SGLang 0.5.23 with `--kv-events-config` (`srt/disaggregation/kv_events.py` `ZmqEventPublisher`,
`srt/mem_cache/events.py` `KVCacheEventRecorder`): each DP rank's scheduler publishes
`(topic, seq, msgpack [ts, events, attn_dp_rank])` on a PUB socket, `seq` an 8-byte big-endian
counter from 0, and keeps its last `buffer_steps` batches for a ROUTER replay socket (a request
`(id, b"", start)` gets `(id, b"", topic, seq, payload)` per batch with seq >= start, then
`(id, b"", b"", -1, b"")`). Blocks are named by the chained SHA-256 of their pages
(`mem_cache/cpp_utils/hash_binding.cpp`): the first 8 bytes of SHA-256(previous digest + page
ids as little-endian uint32), a signed big-endian int64.

The cache model: a prompt's full pages are matched from the first (SGLang reuses at most
`len - 1` tokens, page-aligned: `cached_tokens`), its new pages stored (`BlockStored`), and
the least recently used blocks evicted past `max_total_tokens` (`BlockRemoved`); parents are
kept more recent than their children, so a chain is evicted from its leaf as in the radix tree.
`/flush_cache` clears it (`AllBlocksCleared`). Test hooks: `drop_live(n)` drops the next n
batches on the live socket only (a subscriber that fell behind its high-water mark), `pause()`
stops publishing, `restart()` is a new engine process on the same ports (empty cache, sequence
from 0, no replay history).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import struct
import time
from collections import OrderedDict, deque
from typing import Any

import msgspec
import trio
import trio.lowlevel
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)
ATTEMPTS = 20  # ephemeral bases tried before the simulator gives up


def page_hashes(token_ids: tuple[int, ...] | list[int], page_size: int) -> list[int]:
    out: list[int] = []
    prior = b""
    for start in range(0, len(token_ids) // page_size * page_size, page_size):
        page = token_ids[start : start + page_size]
        prior = hashlib.sha256(prior + struct.pack(f"<{page_size}I", *page)).digest()
        out.append(int.from_bytes(prior[:8], "big", signed=True))
    return out


class RankCache:
    """One DP rank's blocks, least recently used first."""

    def __init__(self, capacity_blocks: int, page_size: int) -> None:
        self.capacity = max(1, capacity_blocks)
        self.page_size = page_size
        self.blocks: OrderedDict[int, None] = OrderedDict()

    def prefill(self, token_ids: tuple[int, ...]) -> tuple[int, list[dict[str, Any]]]:
        """(cached tokens reported, events) for a prompt prefilled on this rank."""
        ps = self.page_size
        hashes = page_hashes(token_ids, ps)
        matched = 0
        for h in hashes:
            if h not in self.blocks:
                break
            matched += 1
        cached = min(matched * ps, (len(token_ids) - 1) // ps * ps) if token_ids else 0
        events: list[dict[str, Any]] = []
        new = hashes[matched:]
        if new:
            events.append({
                "type": "BlockStored",
                "block_hashes": new,
                "parent_block_hash": hashes[matched - 1] if matched else None,
                "token_ids": list(token_ids[matched * ps : len(hashes) * ps]),
                "block_size": ps,
                "lora_id": None,
                "medium": "GPU",
            })  # fmt: skip
        for h in reversed(hashes):  # the leaf first: parents end up the more recent
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        evicted = []
        while len(self.blocks) > self.capacity:
            h, _ = self.blocks.popitem(last=False)
            evicted.append(h)
        if evicted:
            events.append({"type": "BlockRemoved", "block_hashes": evicted, "medium": "GPU"})
        return cached, events


class RankPublisher:
    """`ZmqEventPublisher` of one rank: PUB + ROUTER, a replay buffer, the sequence."""

    def __init__(
        self, context: zmq.Context[Any], host: str, port: int, replay_port: int | None,
        topic: str, rank: int, buffer_steps: int,
    ) -> None:  # fmt: skip
        self.topic = topic.encode()
        self.rank = rank
        self.pub = context.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.port = _bind(self.pub, host, port)
        self.replay: zmq.Socket[bytes] | None = None
        self.replay_port: int | None = None
        if replay_port is not None:
            self.replay = context.socket(zmq.ROUTER)
            self.replay.setsockopt(zmq.LINGER, 0)
            try:
                self.replay_port = _bind(self.replay, host, replay_port)
            except zmq.ZMQError:
                self.close()  # the caller retries with another base: leave no socket bound
                raise
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.seq = 0
        self.drop = 0  # next batches not sent live (still buffered)
        self.paused = False
        self.published = 0

    def publish(self, events: list[dict[str, Any]]) -> None:
        if self.paused or not events:
            return
        payload = msgspec.msgpack.encode([time.time(), events, self.rank])
        seq, self.seq = self.seq, self.seq + 1
        self.buffer.append((seq, payload))
        self.published += 1
        if self.drop > 0:
            self.drop -= 1
            return
        with contextlib.suppress(zmq.Again):  # PUB drops past its high-water mark, as SGLang's
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload], zmq.NOBLOCK)

    async def serve_replay(self) -> None:
        sock = self.replay
        if sock is None:
            return
        while True:
            if not int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
                await trio.lowlevel.wait_readable(int(sock.getsockopt(zmq.FD)))
                continue
            frames = sock.recv_multipart(zmq.NOBLOCK)
            if len(frames) != 3:
                continue
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self.buffer):
                if seq >= first:
                    sock.send_multipart([client, b"", self.topic, seq.to_bytes(8, "big"), payload])
            sock.send_multipart([client, b"", b"", END_SEQ, b""])

    def close(self) -> None:
        self.pub.close(linger=0)
        if self.replay is not None:
            self.replay.close(linger=0)


def _bind(sock: zmq.Socket[bytes], host: str, port: int) -> int:
    if port == 0:
        return sock.bind_to_random_port(f"tcp://{host}")
    sock.bind(f"tcp://{host}:{port}")
    return port


class KvEvents:
    """The engine's KV cache model and its publishers (one per DP rank)."""

    def __init__(self, config_json: str | None, page_size: int, ranks: int, capacity_tokens: int):
        cfg = json.loads(config_json) if config_json else {}
        self.enabled = cfg.get("publisher") == "zmq"
        self.page_size = page_size
        self.ranks = ranks
        self.capacity_tokens = capacity_tokens
        self.caches = [RankCache(capacity_tokens // page_size, page_size) for _ in range(ranks)]
        self.topic = cfg.get("topic", "")
        self.endpoint = cfg.get("endpoint", "tcp://*:5557")
        self.replay_endpoint = cfg.get("replay_endpoint")
        self.buffer_steps = int(cfg.get("buffer_steps", 10_000))
        self.publishers: list[RankPublisher] = []
        self.context: zmq.Context[Any] | None = None
        self.prompt_tokens = 0  # totals over prefills: the benchmark's hit ratio
        self.cached_tokens = 0

    def start(self, nursery: trio.Nursery) -> None:
        if not self.enabled:
            return
        self.context = zmq.Context()
        host, port = _split(self.endpoint)
        replay = _split(self.replay_endpoint) if self.replay_endpoint else None
        # An ephemeral base takes rank 0's random port; base + r for the other ranks may be
        # taken by then (other processes' ephemeral ports): choose another base and try again.
        for _ in range(ATTEMPTS if port == 0 else 1):
            try:
                self._bind_ranks(self.context, host, port, replay)
                break
            except zmq.ZMQError as exc:
                for publisher in self.publishers:
                    publisher.close()
                self.publishers.clear()
                if port != 0 or exc.errno != errno.EADDRINUSE:
                    raise
        else:
            raise RuntimeError(f"no free run of {self.ranks} ports for the KV event publishers")
        for publisher in self.publishers:
            nursery.start_soon(publisher.serve_replay)

    def _bind_ranks(
        self, context: zmq.Context[Any], host: str, port: int, replay: tuple[str, int] | None
    ) -> None:
        for rank in range(self.ranks):
            # Rank r on base + r; an ephemeral base (port 0, a simulator-only spelling) picks
            # rank 0's port and offsets the others from it, as the engine does.
            base = self.publishers[0].port if self.publishers else port
            rbase = (
                self.publishers[0].replay_port
                if self.publishers
                else (replay[1] if replay else None)
            )
            publisher = RankPublisher(
                context, host, base + rank if base else 0,
                (rbase + rank if rbase else 0) if replay else None,
                self.topic, rank, self.buffer_steps,
            )  # fmt: skip
            self.publishers.append(publisher)

    def close(self) -> None:
        for publisher in self.publishers:
            publisher.close()
        if self.context is not None:
            self.context.destroy(linger=0)

    def prefill(self, rank: int, token_ids: tuple[int, ...]) -> int:
        """The cached tokens SGLang reports for this prompt; its events are published. Without
        a publisher the simulator models no cache (0, as before: other tests rely on it)."""
        if not self.enabled:
            return 0
        cached, events = self.caches[rank % self.ranks].prefill(token_ids)
        self.prompt_tokens += len(token_ids)
        self.cached_tokens += cached
        if self.publishers:
            self.publishers[rank % self.ranks].publish(events)
        return cached

    def flush(self) -> None:
        for rank, cache in enumerate(self.caches):
            cache.blocks.clear()
            if self.publishers:
                self.publishers[rank].publish([{"type": "AllBlocksCleared"}])

    # -- test hooks ------------------------------------------------------------------------------

    def drop_live(self, batches: int, rank: int = 0) -> None:
        self.publishers[rank].drop += batches

    def pause(self, paused: bool = True) -> None:
        for publisher in self.publishers:
            publisher.paused = paused

    def restart(self) -> None:
        for cache in self.caches:
            cache.blocks.clear()
        for publisher in self.publishers:
            publisher.seq = 0
            publisher.buffer.clear()

    def describe(self) -> dict[str, Any] | None:
        """`kv_events` of /server_info (`describe_kv_events_publisher`)."""
        if not self.publishers:
            return None
        host, _ = _split(self.endpoint)
        info: dict[str, Any] = {
            "publisher": "zmq",
            "endpoint_host": host,
            "endpoint_port_base": self.publishers[0].port,
            "topic": self.topic,
            "block_size": self.page_size,
            "dp_size": self.ranks,
        }
        if self.publishers[0].replay_port is not None:
            info["replay_endpoint_port_base"] = self.publishers[0].replay_port
        return info


def _split(endpoint: str) -> tuple[str, int]:
    rest = endpoint.removeprefix("tcp://")
    host, _, port = rest.rpartition(":")
    return host, int(port)
