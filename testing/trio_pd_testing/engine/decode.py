"""The decode role: register rooms, take a slot, wait for the KV (WaitingForInput), generate.

Per item (`disaggregation/decode.py`, `disaggregation/common/conn.py`):
1. prealloc: register the room with the prefill's bootstrap server. An unreachable server is
   retried `bootstrap_retries` times, `bootstrap_retry_interval` apart (SGLang: 15 x 1 s,
   then the request fails as aborted); a refusal (4xx) fails at once. Then wait for a slot
   (KV memory, `max_running` per DP rank, FIFO).
2. transfer: the slot is held (KV metadata published), waiting for the KV up to
   `waiting_timeout`, counted from here. Room 0 is the decode's "metadata not yet written"
   sentinel (`disaggregation/utils.py` `_apply_metadata_gate`): a real request with room 0
   gets its KV but is never committed, and waits until it is aborted (no timeout applies).
3. waiting (the scheduler's waiting queue, the `slow` fault's delay here): an abort pops it at
   once, a graceful abort "Abort in waiting queue" (no status);
4. running: one token per `inter_token_ms`; an abort here stops after one more token.

Several items waiting on ONE room (the n samples of a prompt, parallel sampling): SGLang's PD
path hands the KV to all but one; the last waits for a KV that never comes, until the waiting
timeout (measured with n = 2 against SGLang 0.5.23: prefill answered both choices, the decode
hung). The simulator does the same for any n: the last sample of each room waits.

A failure (abort in a queue, waiting timeout, lost prefill) after the room was registered sends
the prefill an ABORT notification (bootstrap.py); in the transfer stage the slot and its KV
pages are then held until the prefill acknowledges, or `deferred_kv_release_timeout` (30 s):
`kv_release_deferred`, later `slot_freed` with `deferred: true`.

Faults fire at once (before registration) unless `@MS` is given; then the request runs normally
and the fault interrupts it MS after the start (freeing its slots with reason `error`) unless it
already completed. A status fault on a stream holds the headers back so the status is real.
"""

from __future__ import annotations

import logging
from functools import partial

import attrs
import trio

from trio_pd_testing.engine.bootstrap import (
    FAKE_BOOTSTRAP_HOST,
    BootstrapError,
    notify_abort,
    register_room,
)
from trio_pd_testing.engine.inject import fire
from trio_pd_testing.engine.responses import abort_finish, length_finish
from trio_pd_testing.engine.scheduler import ABORTED_BY_ABORTREQ
from trio_pd_testing.engine.slots import SlotPool
from trio_pd_testing.engine.state import Call, EngineState, Item
from trio_pd_testing.engine.workload import DEFAULT_BOOTSTRAP_PORT

log = logging.getLogger("trio_pd_testing.engine")


# tokenizer_manager._handle_abort_req: what an abort of a waiting-queue request answers
WAITING_QUEUE_ABORT = {"type": "abort", "message": "Abort in waiting queue"}


def handshake_failed(item: Item, detail: str) -> str:
    room = item.room
    return (
        f"Decode handshake failed for request rank=0 decode_req.req.rid='{item.rid}' "
        f"decode_req.req.bootstrap_room={room} with exception "
        f"KVTransferError(bootstrap_room={room}): {detail}"
    )


def transfer_failed(item: Item, detail: str) -> str:
    room = item.room
    return (
        f"Decode transfer failed for request rank=0 decode_req.req.rid='{item.rid}' "
        f"decode_req.req.bootstrap_room={room} with exception "
        f"KVTransferError(bootstrap_room={room}): {detail}"
    )


@attrs.define(eq=False)
class Room:
    """One room of one request on the decode: its registration and KV."""

    number: int
    items: list[Item]
    registered: trio.Event = attrs.Factory(trio.Event)
    kv: trio.Event = attrs.Factory(trio.Event)
    prefill_rank: int | None = None
    fake: bool = False


async def run_decode(call: Call) -> None:
    fault = call.plan.terminal
    start = call.workload.start_of(0)
    if fault is not None and fault.after_tokens is not None and start >= fault.after_tokens:
        fault = None  # `@Ntok` counts the answer's tokens: a resumed request is past it
    if fault is not None and fault.delay == 0 and fault.after_tokens is None:
        await fire(call, fault)
        return
    if fault is None:
        await _decode(call)
        return
    if fault.after_tokens is not None:
        with trio.CancelScope() as trigger:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_cancel_once_sent, call, fault.after_tokens - start, trigger)
                await _decode(call)
                nursery.cancel_scope.cancel()
        fired = trigger.cancelled_caught
    else:
        with trio.move_on_after(fault.delay) as timer:
            await _decode(call)
        fired = timer.cancelled_caught
    if fired and not call.resp.completed:
        await fire(call, fault)


async def _cancel_once_sent(call: Call, tokens: int, scope: trio.CancelScope) -> None:
    """The `@Ntok` trigger: the decode's work stops right after its N-th token went out."""
    await call.output.tokens_sent(tokens)
    scope.cancel()


async def _decode(call: Call) -> None:
    groups: dict[int, list[Item]] = {}
    for item in call.items:
        assert item.room is not None
        groups.setdefault(item.room, []).append(item)
    async with trio.open_nursery() as nursery:
        for number, items in groups.items():
            nursery.start_soon(_room, call, Room(number, items))


async def _room(call: Call, room: Room) -> None:
    w = call.workload
    assert w.bootstrap_host is not None
    port = w.bootstrap_port if w.bootstrap_port is not None else DEFAULT_BOOTSTRAP_PORT
    room.fake = w.bootstrap_host == FAKE_BOOTSTRAP_HOST
    addr = f"{w.bootstrap_host}:{port}"
    for item in room.items:
        item.bootstrap_addr = None if room.fake else addr
    async with trio.open_nursery() as registration:
        if room.fake:
            room.registered.set()
            room.kv.set()
        else:
            registration.start_soon(_register, call, room, w.bootstrap_host, port)
        async with trio.open_nursery() as items:
            for item in room.items:
                shadowed = len(room.items) > 1 and item is room.items[-1]
                items.start_soon(_item, call, item, room, shadowed)
        registration.cancel_scope.cancel()


async def _register(call: Call, room: Room, host: str, port: int) -> None:
    """Register the room (retrying an unreachable server), then hold the KV wait open."""
    engine, cfg = call.engine, call.config
    assert engine.bootstrap_client is not None and engine.heartbeat is not None
    addr = f"{host}:{port}"
    known = addr in engine.heartbeat.failures  # its parallel info is cached: no retries
    error = ""
    attempts = 1 if known else max(1, cfg.bootstrap_retries)
    async with trio.open_nursery() as nursery:
        for attempt in range(attempts):
            try:
                rank = await nursery.start(
                    partial(
                        register_room,
                        engine.bootstrap_client,
                        host,
                        port,
                        room.number,
                        room.kv,
                        connect_timeout=cfg.bootstrap_retry_interval or 1.0,
                        request_id=call.rid,
                        prefill_rank=call.pins.prefill,
                    )
                )
            except BootstrapError as exc:
                error = str(exc)
                if "answered 4" in error:  # refused: no retry helps
                    break
                if attempt + 1 < attempts:
                    await trio.sleep(cfg.bootstrap_retry_interval)
                continue
            engine.heartbeat.track(addr)
            room.prefill_rank = rank
            call.emit("room_registered", room=room.number, prefill_dp_rank=rank)
            room.registered.set()
            return
    if known:  # the heartbeat will tell (SGLang sends its registration over ZMQ, unanswered)
        log.info("%s: registration with %s failed: %s", call.rid, addr, error)
        return
    log.warning("%s: %s", call.rid, error)
    call.emit("bootstrap_failed", room=room.number, error=error)
    detail = error if "answered 4" in error else ABORTED_BY_ABORTREQ
    for item in room.items:
        item.interrupt("handshake", detail)


async def _item(call: Call, item: Item, room: Room, shadowed: bool) -> None:
    engine, cfg = call.engine, call.config
    slots = engine.slots[item.rank or 0]
    acquired = False
    reason = "error"
    deferred = False
    try:
        with item.scope:
            await room.registered.wait()
            item.waiting_for_input = True
            await slots.acquire()
            acquired = True
            item.waiting_for_input = False
            item.stage = "transfer"
            item.held_tokens = item.prompt_tokens
            item.emit("slot_acquired", running=slots.running, queued=slots.queued)
            if item.room == 0 and not room.fake:
                item.emit("metadata_gate", note="room 0 reads as 'not yet written'")
                await trio.sleep_forever()
            with trio.move_on_after(cfg.waiting_timeout) as waited:
                if shadowed:
                    await trio.sleep_forever()
                await room.kv.wait()
        if item.scope.cancelled_caught:
            reason, deferred = await _interrupted(call, item, room, acquired)
            return
        if waited.cancelled_caught:
            reason = "kv_wait_timeout"
            item.emit("kv_wait_timeout", waited=cfg.waiting_timeout)
            deferred = _hold(call, item, room, reason)
            detail = (
                f"Request {item.room} timed out after {cfg.waiting_timeout:.1f}s "
                "in KVPoll.WaitingForInput"
            )
            await call.output.fail(item, 500, transfer_failed(item, detail))
            return
        item.emit("kv_ready")
        item.stage = "waiting"  # the scheduler's waiting queue: KV here, not yet running
        with item.new_scope():
            await trio.sleep(call.plan.slow)
            if call.plan.hold and call.plan.hold_after_tokens is None:
                await call.engine.released.wait()
        if item.interrupted is not None:  # scheduler.py: popped from the waiting queue
            reason = item.abort_reason or "error"
            await call.output.finish(item, WAITING_QUEUE_ABORT)
            return
        item.stage = "running"
        await _generate(call, item)
        reason = (item.abort_reason or "error") if item.to_finish else "finished"
    except BaseException:
        reason = call.cancel_reason or "error"
        deferred = False
        raise
    finally:
        engine.retire(item)
        if acquired:
            if deferred and engine.background is not None:
                engine.background.start_soon(_release_later, engine, item, room, slots, reason)
            else:
                _free(item, slots, reason)


async def _interrupted(call: Call, item: Item, room: Room, acquired: bool) -> tuple[str, bool]:
    """An abort or a lost prefill stopped the item in a queue: (slot_freed reason, deferred)."""
    reason = item.abort_reason or ("prefill_lost" if item.interrupted == "lost" else "error")
    if acquired:  # the transfer queue: the request leaves now, its KV pages stay held
        deferred = _hold(call, item, room, reason)
        await call.output.fail(item, 500, transfer_failed(item, item.interrupt_detail))
        return reason, deferred
    if room.registered.is_set():
        _notify(call, room)
    await call.output.fail(item, 500, handshake_failed(item, item.interrupt_detail))
    return reason, False


def _hold(call: Call, item: Item, room: Room, reason: str) -> bool:
    """A failed transfer: keep its KV pages (and slot) until the prefill's ACK (True), or
    notify the prefill and let them go now (False: deferred release off, or a fake room)."""
    cfg = call.config
    if room.fake or not cfg.deferred_kv_release or call.engine.background is None:
        _notify(call, room)
        return False
    call.engine.deferred.append(item)
    item.emit("kv_release_deferred", reason=reason)
    return True


def _notify(call: Call, room: Room) -> None:
    """The ABORT notification to the prefill, fire and forget (a deferred release sends its
    own and waits for the ACK)."""
    engine = call.engine
    if not room.fake and engine.background is not None:
        engine.background.start_soon(_send_notification, call, room)


async def _send_notification(call: Call, room: Room) -> None:
    w, engine = call.workload, call.engine
    assert engine.bootstrap_client is not None and w.bootstrap_host is not None
    port = w.bootstrap_port if w.bootstrap_port is not None else DEFAULT_BOOTSTRAP_PORT
    with trio.move_on_after(call.config.deferred_kv_release_timeout):
        await notify_abort(
            engine.bootstrap_client,
            w.bootstrap_host,
            port,
            room.number,
            room.prefill_rank,
            request_id=call.rid,
        )


async def _release_later(
    engine: EngineState, item: Item, room: Room, slots: SlotPool, reason: str
) -> None:
    """Deferred KV release: hold the pages until the prefill ACKs the abort, or the timeout."""
    call, cfg = item.call, engine.config
    w = call.workload
    assert engine.bootstrap_client is not None and w.bootstrap_host is not None
    port = w.bootstrap_port if w.bootstrap_port is not None else DEFAULT_BOOTSTRAP_PORT
    acked = False
    try:
        with trio.move_on_after(cfg.deferred_kv_release_timeout):
            acked = await notify_abort(
                engine.bootstrap_client,
                w.bootstrap_host,
                port,
                room.number,
                room.prefill_rank,
                request_id=call.rid,
            )
            if not acked:
                await trio.sleep_forever()
    finally:
        if item in engine.deferred:
            engine.deferred.remove(item)
        _free(item, slots, reason, deferred=True, acked=acked)


def _free(item: Item, slots: SlotPool, reason: str, **extra: bool) -> None:
    slots.release()
    item.held_tokens = 0
    item.emit("slot_freed", reason=reason, **extra)


def _count_step(call: Call, k: int) -> None:
    """A decode step of one request (batch size 1) into the engine's moment sums, as the
    scheduler's `_accumulate_decode_moment` does (the first token came with the KV: no step)."""
    if k == 1:
        return
    step_us = max(1.0, call.config.inter_token_ms * 1000.0)
    moments = call.engine.decode_moments
    for i, add in enumerate((1.0, 1.0, step_us, 1.0, step_us, 1.0)):
        moments[i] += add


async def _generate(call: Call, item: Item) -> None:
    """Tokens until max_new_tokens, or one more step after an abort reached it."""
    output, total = call.output, call.workload.max_new_tokens
    if total == 0:
        await output.finish(item, length_finish(0))
        return
    for k in range(1, total + 1):
        if k == 1:
            item.emit("first_token")
        else:
            await trio.sleep(call.config.inter_token_ms / 1000.0)
        item.held_tokens = item.prompt_tokens + k
        _count_step(call, k)
        if k == total:
            finish = length_finish(k)
        elif item.to_finish:
            finish = abort_finish()
        else:
            finish = None
        await output.token(item, k, finish)
        if finish is not None:
            return
        # `hold@Ntok`: paused mid-stream after the answer's N-th token until released
        if k + call.workload.start_of(item.index) == call.plan.hold_after_tokens:
            await call.engine.released.wait()
        await trio.lowlevel.checkpoint()
