"""Subscribing to an engine's KV events (SGLang 0.5.23 `srt/disaggregation/kv_events.py`).

Each DP rank of a prefill engine started with `--kv-events-config` publishes on a ZMQ PUB
socket (`ZmqEventPublisher`): multipart messages `(topic, seq, payload)`, `seq` an 8-byte
big-endian counter from 0 per publisher (a restarted engine starts again at 0), `payload` a
msgpack `KVEventBatch` array `[ts, events, attn_dp_rank]` whose events are tagged maps
(`type`: `BlockStored` with `block_hashes` and `parent_block_hash`, `BlockRemoved` with
`block_hashes`, `AllBlocksCleared`). A ROUTER socket replays its last `buffer_steps` (10,000)
batches: send `(b"", start_seq)` from a DEALER and get `(b"", topic, seq, payload)` for each
buffered batch with seq >= start, then `(b"", b"", -1, b"")` (`_service_replay`).

One `RankFeed` per (worker, rank) keeps that rank's `BlockIndex` true:
- on start, and after a restart (a sequence number going back), it replays from 0 and rebuilds
  the index from scratch (`resync`); history older than the engine's buffer is unknown, so the
  index may hold less than the engine: `partial`, which only makes predictions low;
- a gap (a sequence number skipped) is filled from the replay socket; when the buffer no longer
  has it, the index is cleared and rebuilt from what comes (removals may have been lost);
- `AllBlocksCleared` (an engine's `/flush_cache`) clears it.
The sockets are non-blocking and driven by `trio.lowlevel.wait_readable` on `zmq.FD`; the FD is
edge-triggered, so a socket is read until `zmq.EVENTS` shows nothing more before waiting.
"""

from __future__ import annotations

import logging
from typing import Any

import attrs
import msgspec
import trio
import trio.lowlevel
import zmq

from trio_pd.fleet.kv_index import BlockIndex

log = logging.getLogger(__name__)

REPLAY_TIMEOUT_SECS = 5.0  # a replay socket that answers nothing this long is given up on
BATCHES_PER_CHECKPOINT = 64  # a flood of batches yields to requests this often
END_SEQ = -1


class BlockStored(msgspec.Struct, tag=True):
    block_hashes: list[int]
    parent_block_hash: int | None = None
    block_size: int = 0
    medium: str | None = None


class BlockRemoved(msgspec.Struct, tag=True):
    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class Batch(msgspec.Struct, array_like=True):
    """`KVEventBatch`: `[ts, events, attn_dp_rank]` (the rank may be absent)."""

    ts: float
    events: list[msgspec.Raw]
    attn_dp_rank: int | None = None


_batch = msgspec.msgpack.Decoder(Batch)
_event = msgspec.msgpack.Decoder(Event)


def decode_batch(payload: bytes) -> tuple[list[Event], int]:
    """The batch's events it understands, and how many it did not (an event type of a newer
    engine is skipped and counted, never fatal)."""
    raw = _batch.decode(payload)
    events: list[Event] = []
    unknown = 0
    for part in raw.events:
        try:
            events.append(_event.decode(part))
        except msgspec.DecodeError:
            unknown += 1
    return events, unknown


@attrs.define
class FeedCounters:
    batches: int = 0
    gaps: int = 0  # sequence numbers skipped on the live socket
    replayed: int = 0  # batches recovered through the replay socket
    resyncs: int = 0  # index rebuilt from scratch (start, restart, lost gap, cleared)
    restarts: int = 0  # the publisher's sequence went back: the engine restarted
    cleared: int = 0  # AllBlocksCleared received
    removed: int = 0  # blocks the engine said it evicted (BlockRemoved)
    lost: int = 0  # gaps the replay buffer could no longer fill
    bad: int = 0  # batches or events that did not decode


async def recv(sock: zmq.Socket[bytes]) -> list[bytes]:
    """The next multipart message, without blocking the trio loop (zmq's FD is edge-triggered:
    `EVENTS` is asked after every receive, and waited on only once it shows nothing)."""
    while True:
        if int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            try:
                return sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                continue
        await trio.lowlevel.wait_readable(int(sock.getsockopt(zmq.FD)))


class RankFeed:
    """One rank's publisher, followed into `index` (see the module docstring)."""

    def __init__(
        self, endpoint: str, replay_endpoint: str | None, topic: str, max_blocks: int
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.index = BlockIndex(max_blocks)
        self.counters = FeedCounters()
        self.next_seq: int | None = None
        self.dup_below: int | None = None  # after a replay: live seqs under this are repeats
        self.partial = True  # the index may miss blocks the engine holds (history unknown)
        self.synced = trio.Event()  # the first resync is done
        self.last_batch_at: float | None = None
        self._pending_replay: int | None = 0  # start with a resync from seq 0

    async def run(self, context: zmq.Context[Any]) -> None:
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
        try:
            done = 0
            while True:
                if self._pending_replay is not None:
                    start, self._pending_replay = self._pending_replay, None
                    await self._replay(context, start)
                    self.synced.set()
                frames = await recv(sub)
                self._on_live(frames)
                done += 1
                if done % BATCHES_PER_CHECKPOINT == 0:
                    await trio.lowlevel.checkpoint()
        finally:
            sub.close(linger=0)

    # -- the live socket -------------------------------------------------------------------------

    def _on_live(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            self.counters.bad += 1
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        expected = self.next_seq
        if expected is None or seq == expected:
            self.dup_below = None
            self._apply(seq, frames[2])
        elif seq > expected:
            self.counters.gaps += 1
            log.warning(
                "kv events %s: gap, got %d expecting %d: replaying", self.endpoint, seq, expected
            )
            self._pending_replay = expected
            self.dup_below = expected
        elif self.dup_below is not None:
            pass  # already applied from the replay
        else:  # the sequence went back: a new publisher (the engine restarted)
            self.counters.restarts += 1
            log.warning(
                "kv events %s: sequence went back to %d: engine restarted, resyncing",
                self.endpoint,
                seq,
            )
            self._reset()
            self._pending_replay = 0

    def _reset(self) -> None:
        self.index.clear()
        self.next_seq = None
        self.partial = True
        self.counters.resyncs += 1

    # -- the replay socket -----------------------------------------------------------------------

    async def _replay(self, context: zmq.Context[Any], start: int) -> None:
        """Fill from `start` through the replay socket; without one (or no answer), the history
        before the next live batch is unknown."""
        if start == 0:
            self._reset()
        if self.replay_endpoint is None:
            self._lost(start)
            return
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        first: int | None = None
        try:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            with trio.move_on_after(REPLAY_TIMEOUT_SECS) as waited:
                while True:
                    frames = await recv(dealer)
                    if len(frames) != 4:
                        self.counters.bad += 1
                        continue
                    seq = int.from_bytes(frames[2], "big", signed=True)
                    if seq == END_SEQ:
                        break
                    if first is None:
                        first = seq
                        if seq != start:
                            self._lost(start)
                        elif start == 0:
                            self.partial = False  # the whole history: the index is exact
                    if self.next_seq is not None and seq < self.next_seq:
                        continue
                    self.counters.replayed += 1
                    self._apply(seq, frames[3])
            if waited.cancelled_caught:
                log.warning("kv events %s: replay socket did not answer", self.replay_endpoint)
                self._lost(start)
            elif first is None and start > 0:
                self._lost(start)
            elif first is None:
                self.partial = False  # nothing published yet: an empty cache, known exactly
                self.next_seq = 0
        finally:
            dealer.close(linger=0)

    def _lost(self, start: int) -> None:
        """Batches from `start` cannot be had: after a gap removals may be lost, so the index is
        rebuilt from what comes next (it can only hold less than the engine then)."""
        if start > 0:
            self.counters.lost += 1
            self._reset()
        self.partial = True
        self.dup_below = None

    # -- applying a batch ------------------------------------------------------------------------

    def _apply(self, seq: int, payload: bytes) -> None:
        self.next_seq = seq + 1
        self.counters.batches += 1
        self.last_batch_at = trio.current_time()
        try:
            events, unknown = decode_batch(payload)
        except msgspec.DecodeError:
            self.counters.bad += 1
            return
        self.counters.bad += unknown
        index = self.index
        for event in events:
            if isinstance(event, BlockStored):
                if event.medium in (None, "GPU"):
                    index.store(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                if event.medium in (None, "GPU"):
                    index.remove(event.block_hashes)
                    self.counters.removed += len(event.block_hashes)
            else:
                index.clear()
                self.counters.cleared += 1
