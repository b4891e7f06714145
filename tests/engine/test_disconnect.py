"""A client that leaves (tokenizer_manager.py): a stream is aborted at once (the ASGI disconnect
cancels its handler), a non-stream request at its next is_disconnected() poll, every
disconnect_poll_secs (SGLANG_REQUEST_STATE_WAIT_TIMEOUT, 4 s) counted from its dispatch."""

from __future__ import annotations

import pytest
import trio

from .helpers import new_room, pd_body, raw_request, start_engine

POLL_SECS = 10.0  # the decode's disconnect poll: what "at once" must beat


@pytest.mark.parametrize("role", ["decode", "prefill"])
async def test_a_stream_is_aborted_at_once(nursery, role):
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode", disconnect_poll_secs=POLL_SECS)
    engine = decode if role == "decode" else prefill
    room = new_room()
    stream = await raw_request(engine, "/generate", pd_body(prefill, room, text="a", stream=True))
    waiting = "slot_acquired" if role == "decode" else "dispatched"
    await engine.events.wait_for(waiting, room=room)
    await trio.sleep(0.2)
    await stream.aclose()
    closed = await engine.events.wait_for("connection_closed", room=room)
    abort = await engine.events.wait_for("engine_abort", room=room, source="disconnect")
    # "At once": well before the disconnect poll would have found it (a bound relative to the
    # mechanism it rules out, not to a guess about how fast a loaded machine is).
    assert abort["matched"] is True and abort["t"] - closed["t"] < POLL_SECS / 2
    end = await engine.events.wait_for("request_end", room=room)
    assert end["ended"] == "aborted_disconnect" and end["t"] - closed["t"] < POLL_SECS / 2
    if role == "decode":
        freed = await decode.events.wait_for("slot_freed", room=room)
        assert freed["reason"] == "aborted_disconnect"
        assert freed["t"] - closed["t"] < POLL_SECS / 2
        assert decode.running == 0
    else:
        assert room not in prefill.rooms


@pytest.mark.parametrize("role", ["decode", "prefill"])
async def test_a_non_stream_request_notices_at_its_next_poll(nursery, role):
    prefill = await start_engine(nursery, "prefill", disconnect_poll_secs=1.0)
    decode = await start_engine(nursery, "decode", disconnect_poll_secs=1.0)
    engine = decode if role == "decode" else prefill
    room = new_room()
    stream = await raw_request(engine, "/generate", pd_body(prefill, room, text="a"))
    dispatched = await engine.events.wait_for("dispatched", room=room)
    # close just after dispatch, so the abort must wait for most of a poll interval
    await trio.sleep_until(trio.current_time() + 0.1)
    await stream.aclose()
    closed = await engine.events.wait_for("connection_closed", room=room, timeout=0.5)
    await trio.sleep(0.3)
    assert not engine.events.find("engine_abort", room=room)  # not yet: it polls
    if role == "decode":
        assert decode.running == 1
    noticed = await engine.events.wait_for("disconnect_noticed", room=room, timeout=3)
    # The first poll after its dispatch (1 s), not the second (2 s): the gap between the two
    # polls is the margin, not a guess at the machine's speed.
    assert 0.5 < noticed["t"] - closed["t"] < 1.9
    assert 0.9 < noticed["t"] - dispatched["t"] < 1.9
    abort = engine.events.find("engine_abort", room=room, source="disconnect")[0]
    assert abort["matched"] is True
    end = await engine.events.wait_for("request_end", room=room)
    assert end["ended"] == "aborted_disconnect"
    if role == "decode":
        freed = await decode.events.wait_for("slot_freed", room=room)
        assert freed["reason"] == "aborted_disconnect"
        assert decode.running == 0
    else:
        assert room not in prefill.rooms


async def test_a_queued_request_leaves_its_queue_at_the_poll(nursery):
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode", max_running=1, disconnect_poll_secs=0.2)
    first, second = new_room(), new_room()
    s1 = await raw_request(decode, "/generate", pd_body(prefill, first, text="a"))
    await decode.events.wait_for("slot_acquired", room=first)
    s2 = await raw_request(decode, "/generate", pd_body(prefill, second, text="a"))
    await decode.events.wait_for("room_registered", room=second)
    await s2.aclose()
    await decode.events.wait_for("request_end", room=second, timeout=2)
    assert decode.queued == 0 and not decode.events.find("slot_acquired", room=second)
    await s1.aclose()
    await decode.events.wait_for("slot_freed", room=first, timeout=2)


async def test_a_stream_that_leaves_before_dispatch_never_reaches_the_scheduler(nursery):
    prefill = await start_engine(nursery, "prefill", tokenize_delay_ms=500.0)
    room = new_room()
    body = pd_body(prefill, room, text="a", stream=True, rid="early")
    stream = await raw_request(prefill, "/generate", body)
    await prefill.events.wait_for("request_start", room=room)
    await stream.aclose()
    end = await prefill.events.wait_for("request_end", room=room)
    assert end["ended"] == "aborted_disconnect"
    await trio.sleep(0.6)
    assert not prefill.events.find("dispatched", room=room)
    assert not prefill.events.find("engine_abort")  # dropped locally, nothing to abort
    assert "early" not in prefill.state.rids
