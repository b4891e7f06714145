"""The prefill role: wait for the decode's registration, "compute", send the KV, answer 1 token.

Fault timing: 4xx faults fire at once (validation, before any registration); every other fault
fires once the rooms' decode registrations arrived (or the bootstrap timeout passed), plus the
spec's `@MS` delay. A fault never marks the KV as sent, so the decode side keeps waiting, except
a `+kv` fault, which fires after the KV was sent (decode then finishes normally).

Data parallel: each room is served on this engine's rank for it (Call.dp_ranks) and meets only a
decode registration for that same rank; a registration already waiting on another rank of the
room logs `rank_mismatch` (the bootstrap server logs the opposite order).
"""

from __future__ import annotations

import trio

from trio_pd.testing.engine.inject import fire
from trio_pd.testing.engine.state import Call


async def run_prefill(call: Call) -> None:
    w = call.workload
    if not w.rooms:
        await call.resp.error(400, "bootstrap_room is required by a prefill engine (PD mode)")
        return
    fault = call.plan.terminal
    if fault is not None and fault.after_kv:
        fault, late_fault = None, fault
    else:
        late_fault = None
    if fault is not None and fault.is_client_error:
        await trio.sleep(fault.delay)
        await fire(call, fault)
        return
    if w.stream and not (fault is not None and fault.kind == "status"):
        await call.resp.start_stream()  # like SGLang: 200 + SSE headers before any work
    table = call.engine.rooms
    rooms = list(dict.fromkeys(w.rooms))
    ranks = [call.rank_of(room) or 0 for room in rooms]
    states = [table.acquire(room, rank, call.rid) for room, rank in zip(rooms, ranks, strict=True)]
    for room, rank in zip(rooms, ranks, strict=True):
        _check_rank(call, room, rank)
    try:
        with trio.move_on_after(call.config.bootstrap_timeout):
            for room, state in zip(rooms, states, strict=True):
                await state.registered.wait()
                call.emit("room_registered", room=room)
        missing = [r for r, s in zip(rooms, states, strict=True) if not s.registered.is_set()]
        if fault is not None:
            await trio.sleep(fault.delay)
            await fire(call, fault)
            return
        if missing:
            call.emit("bootstrap_timeout", missing=missing)
            await call.resp.error(
                500,
                f"bootstrap timeout: no decode registered room(s) {missing} "
                f"within {call.config.bootstrap_timeout}s",
            )
            return
        call.stages[:] = ["running"] * w.size
        await trio.sleep(call.plan.slow)
        tokens = sum(len(i) for i in w.inputs)
        await trio.sleep(call.config.prefill_ms_per_token * tokens / 1000.0)
        call.stages[:] = ["done"] * w.size
        for room, state in zip(rooms, states, strict=True):
            state.kv.set()
            call.emit("kv_sent", room=room)
        if late_fault is not None:
            await trio.sleep(late_fault.delay)
            await fire(call, late_fault)
            return
        await answer(call)
    finally:
        for room, rank in zip(rooms, ranks, strict=True):
            table.release(room, rank, call.rid)


def _check_rank(call: Call, room: int, rank: int) -> None:
    """A decode already registered `room` for another prefill rank: its KV will never come."""
    for other, state in call.engine.rooms.other_ranks(room, rank).items():
        if state.registered.is_set():
            call.emit("rank_mismatch", room=room, dp_rank=rank, registered_rank=other)


async def answer(call: Call) -> None:
    """Prefill's own answer: a one-token generation (stream: one event per item, then [DONE])."""
    shaper = call.shaper
    if not call.workload.stream:
        await call.resp.json(200, shaper.full())
        return
    for event in shaper.stream_start():
        await call.resp.event(event)
    for index in range(call.workload.size):
        await call.resp.event(shaper.token_event(index, 1))
    for event in shaper.stream_end():
        await call.resp.event(event)
    await call.resp.done()
