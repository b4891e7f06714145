"""The prefill role: wait for the decode's registration, "compute", send the KV, answer 1 token.

Per item (`disaggregation/prefill.py`, `disaggregation/common/conn.py`):
1. bootstrap queue: wait for the decode's registration of the room, up to `bootstrap_timeout`
   (SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT, 300 s), else 500 "... timed out ... in
   KVPoll.Bootstrapping". On a data-parallel prefill balancing by follow_bootstrap_room, a
   request pinned (routed_dp_rank) to another rank than `room % N`, without a
   disagg_prefill_dp_rank, fails at once ("follow_bootstrap_room conflict").
2. running: compute (`prefill_ms_per_token` per prompt token), then send the KV. An abort here
   lets the computation finish and answers finish_reason abort, without sending the KV.
3. inflight (only with `kv_transfer_ms`): the KV on its way for that long; an abort here fails
   the transfer ("Prefill transfer failed"), and the decode never gets the KV.
A decode that aborts the room (its ABORT notification, bootstrap.py) fails the request: in the
bootstrap queue at once, after its computation otherwise ("Prefill transfer failed").

Fault timing: 4xx faults fire at once (validation, before any registration); every other fault
fires once the rooms' decode registrations arrived (or the bootstrap timeout passed), plus the
spec's `@MS` delay. A fault never marks the KV as sent, so the decode side keeps waiting, except
a `+kv` fault, which fires after the KV was sent (decode then finishes normally).

Data parallel: each room is served on this engine's rank for it and meets only a decode
registration for that same rank; a registration already waiting on another rank of the room
logs `rank_mismatch` (the bootstrap server logs the opposite order).
"""

from __future__ import annotations

import time

import trio

from trio_pd_testing.engine.bootstrap import FAKE_BOOTSTRAP_HOST, RoomState
from trio_pd_testing.engine.inject import fire
from trio_pd_testing.engine.responses import abort_finish, length_finish
from trio_pd_testing.engine.scheduler import ABORTED_BY_ABORTREQ
from trio_pd_testing.engine.state import Call, Item

FROM_ANOTHER_RANK = "Failed due to an unknown reason from another rank"


def _failed(stage: str, item: Item, detail: str) -> str:
    room = item.room
    return (
        f"Prefill {stage} failed for request rank=0 req.rid='{item.rid}' "
        f"req.bootstrap_room={room} with exception KVTransferError(bootstrap_room={room}): {detail}"
    )


def _conflict(call: Call, item: Item) -> str | None:
    """The follow_bootstrap_room conflict of a pinned rank, if any (common/conn.py)."""
    cfg = call.config
    ranks = cfg.num_dp_ranks
    if ranks <= 1 or call.pins.prefill is not None or item.room is None:
        return None
    if cfg.load_balance_method_resolved != "follow_bootstrap_room":
        return None
    implied = item.room % ranks
    if item.rank == implied:
        return None
    return (
        f"follow_bootstrap_room conflict: dispatched to dp_rank {item.rank} but "
        f"bootstrap_room {item.room} implies dp_rank {implied}. "
        "Set SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK=1 to allow mixed routing."
    )


async def run_prefill(call: Call) -> None:
    fault = call.plan.terminal
    late_fault = None
    if fault is not None and fault.after_kv:
        fault, late_fault = None, fault
    if fault is not None and fault.is_client_error:
        await trio.sleep(fault.delay)
        await fire(call, fault)
        return
    table = call.engine.rooms
    fake = call.workload.bootstrap_host == FAKE_BOOTSTRAP_HOST
    keys = list(dict.fromkeys((item.room, item.rank or 0) for item in call.items))
    states = {key: table.acquire(key[0], key[1], call.rid) for key in keys}  # type: ignore[arg-type]
    for room, rank in keys:
        _check_rank(call, room, rank)  # type: ignore[arg-type]
    try:
        if fault is not None:
            await _wait_registrations(call, states, fake)
            await trio.sleep(fault.delay)
            await fire(call, fault)
            return
        async with trio.open_nursery() as nursery:
            for item in call.items:
                state = states[(item.room, item.rank or 0)]
                nursery.start_soon(_item, call, item, state, fake)
        if late_fault is not None and any(s.kv.is_set() for s in states.values()):
            if late_fault.after_release:
                await call.engine.released.wait()
            await trio.sleep(late_fault.delay)
            await fire(call, late_fault)
    finally:
        for room, rank in keys:
            table.release(room, rank, call.rid)  # type: ignore[arg-type]


async def _wait_registrations(call: Call, states: dict, fake: bool) -> None:
    if fake:
        return
    with trio.move_on_after(call.config.bootstrap_timeout):
        for (room, _rank), state in states.items():
            await state.registered.wait()
            call.emit("room_registered", room=room)
    missing = [room for (room, _), s in states.items() if not s.registered.is_set()]
    if missing:
        call.emit("bootstrap_timeout", missing=missing)


async def _item(call: Call, item: Item, state: RoomState, fake: bool) -> None:
    engine, cfg, output = call.engine, call.config, call.output
    try:
        conflict = _conflict(call, item)
        if conflict is not None:
            item.emit("rank_conflict", implied=item.room % cfg.num_dp_ranks)  # type: ignore[operator]
            await output.fail(item, 500, _failed("bootstrap", item, conflict))
            return
        with item.scope:
            if not fake:
                with trio.move_on_after(cfg.bootstrap_timeout) as waited:
                    await state.registered.wait()
                if waited.cancelled_caught:
                    item.emit("bootstrap_timeout", missing=[item.room])
                    detail = (
                        f"Request {item.room} timed out after {cfg.bootstrap_timeout:.1f}s "
                        "in KVPoll.Bootstrapping"
                    )
                    await output.fail(item, 500, _failed("bootstrap", item, detail))
                    return
                item.emit("room_registered")
            if state.failed.is_set():
                await output.fail(item, 500, _failed("bootstrap", item, FROM_ANOTHER_RANK))
                return
            item.stage = "running"
        if item.scope.cancelled_caught:
            detail = item.interrupt_detail or ABORTED_BY_ABORTREQ
            await output.fail(item, 500, _failed("bootstrap", item, detail))
            return
        item.held_tokens = item.prompt_tokens
        prompt = call.workload.prompts[call.workload.prompt_of(item.index)]
        item.cached_tokens = engine.kv.prefill(item.rank or 0, prompt)
        state.start_computing()
        started = time.monotonic()
        try:
            await trio.sleep(call.plan.slow)
            await trio.sleep(
                cfg.prefill_ms_per_token * (item.prompt_tokens - item.cached_tokens) / 1e3
            )
        finally:
            state.stop_computing()
            engine.prefill_uncached_tokens += item.prompt_tokens
            engine.prefill_busy_us += int((time.monotonic() - started) * 1e6)
            item.held_tokens = 0
        if state.failed.is_set():
            await output.fail(item, 500, _failed("transfer", item, FROM_ANOTHER_RANK))
            return
        if item.to_finish:  # aborted while computing: no KV goes out
            await output.token(item, 1, abort_finish())
            return
        if cfg.kv_transfer_ms > 0:
            # The KV in flight (the inflight queue): an abort here fails the transfer, and the
            # decode never gets the KV (`disagg_kv_sender.abort()`, "Prefill transfer failed").
            item.stage = "inflight"
            item.held_tokens = item.prompt_tokens
            with item.new_scope():
                await trio.sleep(cfg.kv_transfer_ms / 1e3)
            item.held_tokens = 0
            if item.scope.cancelled_caught:
                detail = item.interrupt_detail or ABORTED_BY_ABORTREQ
                await output.fail(item, 500, _failed("transfer", item, detail))
                return
        if not state.kv.is_set():
            state.kv.set()
            item.emit("kv_sent")
        if call.plan.terminal is not None and call.plan.terminal.after_kv:
            item.generated = 1
            return  # the +kv fault answers for the request
        await output.token(item, 1, length_finish(1))
    finally:
        engine.retire(item)


def _check_rank(call: Call, room: int, rank: int) -> None:
    """A decode already registered `room` for another prefill rank: its KV will never come."""
    for other, state in call.engine.rooms.other_ranks(room, rank).items():
        if state.registered.is_set():
            call.emit("rank_mismatch", room=room, dp_rank=rank, registered_rank=other)
