"""The tokenizer manager's side of a request: registration, dispatch, and every abort path.

SGLang 0.5.23 (`managers/tokenizer_manager.py`):

- `_init_req_state` registers a request's rids before anything else; it then tokenizes and
  dispatches the request to the scheduler (`_send_one_request`, which sets `dispatched`). For a
  text prompt the async dynamic batch tokenizer (or multimodal processing) makes that a real
  wait: the simulator's `config.tokenize_window`. Ids given as input_ids need no tokenizing.
- `abort_request(rid)` drops an abort with an empty rid (unless abort_all), and one for a rid
  it has not registered (when tokenizer_worker_num == 1). For a registered rid it sends the
  abort at most ONCE: `abort_sent` latches. An abort that lands after registration but before
  dispatch reaches the scheduler before the request does, matches nothing, and is lost; the
  latch then drops every later abort of that rid, the engine's own disconnect abort included.
- the scheduler (`managers/scheduler.py` `abort_request`) aborts every live request whose rid
  STARTS WITH the given one (scheduler.py here).
- a client that leaves: a stream's handler is cancelled at once (the ASGI disconnect), which
  aborts its dispatched rids (`_release_req_states_on_failure`; an undispatched request is
  just dropped); a non-stream request notices at its next `is_disconnected()` poll, every
  SGLANG_REQUEST_STATE_WAIT_TIMEOUT (4) s of waiting (`_stream_one_response`), and aborts its
  rid. Every stream also runs a background abort of its rids 2 s after the response ended
  (`create_abort_task`), which aborts whoever holds those rids then.
"""

from __future__ import annotations

import math
from typing import Any

import trio

from trio_pd_testing.engine.scheduler import abort_matching
from trio_pd_testing.engine.state import Call, EngineState, Item

BACKGROUND_ABORT_DELAY = 2.0


async def dispatch(call: Call) -> None:
    """Wait out the tokenize window, then hand the items to the scheduler."""
    engine = call.engine
    window = call.config.tokenize_window if call.workload.text_prompt else 0.0
    if window > 0:
        await trio.sleep(window)
    if call.workload.n > 1:
        start_samples(call)
    first_stage = "prealloc" if engine.role == "decode" else "bootstrap"
    for item in call.items:
        state = engine.rids.get(item.rid)
        if state is not None and state.owner is item:
            state.dispatched = True
        item.stage = first_stage
        engine.live.append(item)
    call.dispatched_at = trio.current_time()
    call.dispatched.set()
    call.emit("dispatched", rooms=list(call.workload.rooms or []) or None)


def start_samples(call: Call) -> None:
    """n > 1: SGLang runs the samples under regenerated rids and forgets the registered ones."""
    engine = call.engine
    initial = [rid for rid in call.sglang_rids if rid in engine.rids]
    for rid in initial:
        state = engine.rids.get(rid)
        if state is not None and state.owner.call is call:
            engine.rids.release([rid], state.owner)
    engine.rids.register([(item.rid, item) for item in call.items])


def abort_request(
    engine: EngineState, rid: str, abort_all: bool = False, *, source: str = "http"
) -> list[Item]:
    """TokenizerManager.abort_request: the items it aborted.

    Logged as `abort_request` when it came as POST /abort_request (source "http"), else as
    `engine_abort` (the engine's own: "disconnect", "background", "cleanup").
    """
    reason = "aborted_request" if source == "http" else f"aborted_{source}"
    name = "abort_request" if source == "http" else "engine_abort"
    common: dict[str, Any] = {"sglang_rid": rid or None, "abort_all": abort_all, "source": source}
    if not abort_all and not rid:
        engine.events.emit(name, matched=False, dropped="empty", dp_rank=None, **common)
        return []
    state = None if abort_all else engine.rids.get(rid)
    if not abort_all:
        if state is not None:
            if state.abort_sent:
                state.owner.emit(name, matched=False, dropped="latched", **common)
                return []
            state.abort_sent = True
        elif engine.config.tokenizer_worker_num == 1:
            engine.events.emit(name, matched=False, dropped="unregistered", dp_rank=None, **common)
            return []
    matched = abort_matching(engine, rid, abort_all, reason)
    for item in matched:
        item.emit(name, matched=True, aborted_rid=item.rid, **common)
    if not matched:
        lost = state is not None and not state.dispatched
        fields: dict[str, Any] = {"dropped": "not_dispatched" if lost else "no_match", **common}
        if state is not None:
            state.owner.emit(name, matched=False, **fields)
        else:
            engine.events.emit(name, matched=False, dp_rank=None, **fields)
    return matched


def abort_call(call: Call, source: str) -> None:
    """The handler's own aborts: every rid this request still has registered."""
    engine = call.engine
    for rid in list(dict.fromkeys([*call.sglang_rids, *(i.rid for i in call.items)])):
        state = engine.rids.get(rid)
        if state is not None and state.owner.call is call and state.dispatched:
            abort_request(engine, rid, source=source)


def drop_undispatched(call: Call) -> None:
    """A handler cancelled before dispatch: its states are dropped, nothing reaches a queue."""
    engine = call.engine
    for rid in list(call.sglang_rids):
        state = engine.rids.get(rid)
        if state is not None and state.owner.call is call and not state.dispatched:
            engine.rids.release([rid], state.owner)


async def client_left(call: Call, disconnected_at: float) -> None:
    """The engine's reaction to a closed client connection (see the module docstring)."""
    if call.workload.stream:
        if not call.dispatched.is_set():
            drop_undispatched(call)
            call.cancel("aborted_disconnect")
            return
        abort_call(call, "disconnect")
        return
    await call.dispatched.wait()
    interval = call.config.disconnect_poll_secs
    start = call.dispatched_at
    ticks = max(1, math.floor((disconnected_at - start) / interval) + 1) if interval > 0 else 0
    await trio.sleep_until(start + ticks * interval)
    call.emit("disconnect_noticed", waited=trio.current_time() - disconnected_at)
    abort_call(call, "disconnect")


async def background_abort(engine: EngineState, rids: tuple[str, ...]) -> None:
    """create_abort_task: 2 s after a stream's response, abort its rids if still registered."""
    await trio.sleep(BACKGROUND_ABORT_DELAY)
    for rid in rids:
        if rid in engine.rids:
            abort_request(engine, rid, source="background")
