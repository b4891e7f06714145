"""The decode role: register rooms, take a slot, wait for the KV (WaitingForInput), generate.

Faults fire at once (before registration) unless `@MS` is given; then the request runs normally
and the fault interrupts it MS after the start (freeing its slots with reason `error`) unless it
already completed. A status fault on a stream holds the headers back so the status is real.

Data parallel: each item takes a slot of its own rank (Call.dp_ranks; max_running slots and a
FIFO queue per rank) and registers with the prefill rank named by `disagg_prefill_dp_rank`, else
the one the prefill's bootstrap server picks (`room % prefill dp_size`, reported back).
"""

from __future__ import annotations

import logging
from functools import partial

import trio

from trio_pd.testing.engine.bootstrap import BootstrapError, register_room
from trio_pd.testing.engine.inject import fire
from trio_pd.testing.engine.state import Call
from trio_pd.testing.engine.workload import DEFAULT_BOOTSTRAP_PORT

log = logging.getLogger("trio_pd.testing.engine")


async def run_decode(call: Call) -> None:
    w = call.workload
    if not w.rooms or not w.bootstrap_host:
        await call.resp.error(
            400, "bootstrap_room and bootstrap_host are required by a decode engine (PD mode)"
        )
        return
    fault = call.plan.terminal
    if fault is not None and fault.delay == 0:
        await fire(call, fault)
        return
    call.defer_headers = fault is not None and fault.kind == "status"
    if w.stream and not call.defer_headers:
        await call.resp.start_stream()  # like SGLang: 200 + SSE headers before any work
    if fault is None:
        await _decode(call)
        return
    with trio.move_on_after(fault.delay) as timer:
        await _decode(call)
    if timer.cancelled_caught and not call.resp.completed:
        await fire(call, fault)


async def _decode(call: Call) -> None:
    w, cfg, engine = call.workload, call.config, call.engine
    assert w.rooms is not None and w.bootstrap_host is not None
    assert engine.bootstrap_client is not None
    port = w.bootstrap_port if w.bootstrap_port is not None else DEFAULT_BOOTSTRAP_PORT
    rooms = list(dict.fromkeys(w.rooms))
    kv = {room: trio.Event() for room in rooms}
    failures: list[str] = []
    bootstrap_error: str | None = None
    try:
        async with trio.open_nursery() as registrations:
            for room in rooms:
                prefill_rank = await registrations.start(
                    partial(
                        register_room,
                        engine.bootstrap_client,
                        w.bootstrap_host,
                        port,
                        room,
                        kv[room],
                        connect_timeout=cfg.bootstrap_timeout,
                        request_id=call.rid,
                        prefill_rank=call.pins.prefill,
                    )
                )
                call.emit("room_registered", room=room, prefill_dp_rank=prefill_rank)
            generation = _Generation(call)
            async with trio.open_nursery() as items:
                for index in range(w.size):
                    items.start_soon(generation.run_item, index, kv[w.rooms[index]], failures)
            registrations.cancel_scope.cancel()
    except* BootstrapError as group:
        bootstrap_error = str(group.exceptions[0])
    if bootstrap_error is not None:
        log.warning("%s: %s", call.rid, bootstrap_error)
        call.emit("bootstrap_failed", error=bootstrap_error)
        await call.resp.error(500, bootstrap_error)
        return
    if failures:
        await call.resp.error(500, failures[0])
        return
    if not w.stream:
        await call.resp.json(200, call.shaper.full())
        return
    for event in call.shaper.stream_end():
        await call.stream_event(event)
    await call.flush_stream()
    await call.resp.done()


class _Generation:
    def __init__(self, call: Call) -> None:
        self.call = call
        self.stream_opened = False

    async def run_item(self, index: int, kv_ready: trio.Event, failures: list[str]) -> None:
        call = self.call
        w, cfg = call.workload, call.config
        assert w.rooms is not None
        room = w.rooms[index]
        slots = call.engine.slots[call.dp_ranks[index] or 0]
        await slots.acquire()
        call.stages[index] = "transfer"
        call.emit("slot_acquired", room=room, running=slots.running, queued=slots.queued)
        reason = "error"
        try:
            with trio.move_on_after(cfg.waiting_timeout) as waited:
                await kv_ready.wait()
            if waited.cancelled_caught:
                reason = "kv_wait_timeout"
                call.emit("kv_wait_timeout", room=room, waited=cfg.waiting_timeout)
                failures.append(
                    f"KV transfer for bootstrap_room {room} timed out after "
                    f"{cfg.waiting_timeout}s (the prefill never sent it)"
                )
                return
            call.emit("kv_ready", room=room)
            call.stages[index] = "running"
            await trio.sleep(call.plan.slow)
            await self._generate(index, room)
            reason = "finished"
        except BaseException:
            reason = call.cancel_reason or "error"
            raise
        finally:
            call.stages[index] = "done"
            slots.release()
            call.emit("slot_freed", room=room, reason=reason)

    async def _generate(self, index: int, room: int) -> None:
        call = self.call
        shaper, stream = call.shaper, call.workload.stream
        for k in range(1, shaper.out_tokens + 1):
            if k == 1:
                call.emit("first_token", room=room)
                if stream and not self.stream_opened:
                    self.stream_opened = True
                    for event in shaper.stream_start():
                        await call.stream_event(event)
            else:
                await trio.sleep(call.config.inter_token_ms / 1000.0)
            if stream:
                await call.stream_event(shaper.token_event(index, k))
            else:
                await trio.lowlevel.checkpoint()
