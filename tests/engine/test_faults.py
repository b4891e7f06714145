"""Every fault kind on both roles, with its timing rules."""

from __future__ import annotations

from functools import partial

import httpx2
import pytest
import trio
import trio.testing

from trio_pd_testing.engine.faults import FaultError, parse_fault, plan_for

from .helpers import new_room, pd_body, pd_post, sse_events, start_engine


@pytest.fixture
async def quick_pair(nursery):
    """Both sides give up on each other quickly, so a failed leg does not stall the test."""
    prefill = await start_engine(nursery, "prefill", bootstrap_timeout=0.5)
    decode = await start_engine(nursery, "decode", waiting_timeout=0.5)
    return prefill, decode


def test_parse_fault_specs():
    f = parse_fault("prefill:503@200")
    assert (f.role, f.kind, f.status, f.delay_ms) == ("prefill", "status", 503, 200.0)
    f = parse_fault("slow:150")
    assert (f.role, f.kind, f.arg_ms) == (None, "slow", 150.0)
    assert parse_fault("decode:close").kind == "close"
    for bad in ("prefill:nope", "prefill:700", "slow", "decode:500:1", "", "x@y"):
        with pytest.raises(FaultError):
            parse_fault(bad)
    assert parse_fault("decode:close@3tok").after_tokens == 3
    assert parse_fault("close@1tok").after_tokens == 1
    for bad in ("decode:close@0tok", "prefill:close@2tok", "decode:close@xtok"):
        with pytest.raises(FaultError):
            parse_fault(bad)
    held = parse_fault("prefill:500@held+kv")
    assert (held.status, held.after_kv, held.after_release, held.delay_ms) == (500, True, True, 0)
    for bad in ("prefill:500@held", "decode:500@held+kv", "500@held+kv"):
        with pytest.raises(FaultError):
            parse_fault(bad)
    plan = plan_for("decode", [parse_fault(s) for s in ("prefill:500", "slow:10", "decode:hang")])
    assert plan.terminal.kind == "hang" and plan.slow_ms == 10.0


@pytest.mark.parametrize("status", [500, 503, 400, 429])
async def test_prefill_status_faults(quick_pair, client, status):
    prefill, decode = quick_pair
    room = new_room()
    body = pd_body(prefill, room, text="a", sim_fault=f"prefill:{status}")
    p, d = await pd_post(client, prefill, decode, "/generate", body)
    assert p.status_code == status
    assert p.json()["error"]["code"] == status and p.json()["error"]["message"]
    fault = prefill.events.find("fault", room=room)[0]
    registered = prefill.events.find("room_registered", room=room)
    if status >= 500:  # fires only after the decode registered: the decode is surely waiting
        assert registered and registered[0]["t"] <= fault["t"]
    else:  # 4xx: validation, at once
        assert not registered
    assert not prefill.events.find("kv_sent", room=room)
    # the prefill fault never sent the KV: the decode hits its waiting timeout
    assert d.status_code == 500
    freed = await decode.events.wait_for("slot_freed", room=room)
    assert freed["reason"] == "kv_wait_timeout"


@pytest.mark.parametrize("status", [500, 503, 400, 429])
async def test_decode_status_faults_fire_at_once(quick_pair, client, status):
    prefill, decode = quick_pair
    room = new_room()
    for stream in (False, True):
        body = pd_body(prefill, room, text="a", stream=stream, sim_fault=f"decode:{status}")
        d = await client.post(decode.url + "/generate", json=body)
        assert d.status_code == status and d.json()["error"]["code"] == status
        assert d.headers["content-type"] == "application/json"
    assert not decode.events.find("room_registered", room=room)


async def test_stream_status_fault_on_prefill_is_a_real_status(quick_pair, client):
    prefill, decode = quick_pair
    body = pd_body(prefill, new_room(), text="a", stream=True, sim_fault="prefill:503")
    p, _ = await pd_post(client, prefill, decode, "/generate", body)
    assert p.status_code == 503 and p.json()["error"]["code"] == 503


@pytest.mark.parametrize("role", ["prefill", "decode"])
async def test_sse_error(quick_pair, client, role):
    prefill, decode = quick_pair
    engine = prefill if role == "prefill" else decode
    body = pd_body(prefill, new_room(), text="a", stream=True, sim_fault=f"{role}:sse_error")
    p, d = await pd_post(client, prefill, decode, "/generate", body)
    r = p if role == "prefill" else d
    assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream"
    events = sse_events(r.text)
    assert events[0]["error"]["code"] == 500 and events[-1] == "[DONE]"
    body = pd_body(prefill, new_room(), text="a", sim_fault=f"{role}:sse_error")
    r = (await pd_post(client, prefill, decode, "/generate", body))[0 if role == "prefill" else 1]
    assert r.status_code == 200 and r.json()["error"]["code"] == 500
    assert len(engine.events.find("fault", kind="sse_error")) == 2


@pytest.mark.parametrize("role", ["prefill", "decode"])
async def test_abort(quick_pair, client, role):
    """`abort` is what SGLang sends for an aborted request: graceful (no status) in-band."""
    prefill, decode = quick_pair
    idx = 0 if role == "prefill" else 1
    body = pd_body(prefill, new_room(), text="a", sim_fault=f"{role}:abort")
    r = (await pd_post(client, prefill, decode, "/generate", body))[idx]
    assert r.status_code == 200
    finish = r.json()["meta_info"]["finish_reason"]
    assert finish["type"] == "abort" and finish["status_code"] is None
    body = pd_body(prefill, new_room(), text="a", stream=True, sim_fault=f"{role}:abort")
    r = (await pd_post(client, prefill, decode, "/generate", body))[idx]
    first = sse_events(r.text)[0]
    assert first["meta_info"]["finish_reason"]["type"] == "abort"
    for stream in (False, True):
        body = pd_body(prefill, new_room(), prompt="a", stream=stream, sim_fault=f"{role}:abort")
        r = (await pd_post(client, prefill, decode, "/v1/completions", body))[idx]
        assert r.status_code == 200
        doc = sse_events(r.text)[0] if stream else r.json()
        assert doc["choices"][0]["finish_reason"] == "abort"
        assert "meta_info" not in doc  # OpenAI routes: the finish reason is all there is


@pytest.mark.parametrize("stream", [False, True])
async def test_abort_with_a_status(quick_pair, client, stream):
    """An abort with a status is an HTTP error without a stream, in-band in one."""
    prefill, _ = quick_pair
    body = pd_body(prefill, new_room(), text="a", stream=stream, sim_fault="prefill:abort:422")
    r = await client.post(prefill.url + "/generate", json=body)
    if stream:
        assert r.status_code == 200
        finish = sse_events(r.text)[0]["meta_info"]["finish_reason"]
        assert finish["type"] == "abort" and finish["status_code"] == 422
    else:
        assert r.status_code == 422 and r.json()["object"] == "error"
        assert r.json()["type"] == "422" and r.json()["code"] == 422
    body = pd_body(prefill, new_room(), prompt="a", stream=stream, sim_fault="prefill:abort:422")
    r = await client.post(prefill.url + "/v1/completions", json=body)
    if stream:
        events = sse_events(r.text)
        assert r.status_code == 200 and events[-1] == "[DONE]"
        assert events[0]["error"]["code"] == 422
        assert events[0]["error"]["type"] == "UNPROCESSABLE_ENTITY"
    else:
        assert r.status_code == 422 and r.json()["code"] == 422


@pytest.mark.parametrize("role", ["prefill", "decode"])
async def test_close_drops_the_connection(quick_pair, role):
    prefill, decode = quick_pair
    engine = prefill if role == "prefill" else decode
    room = new_room()
    body = pd_body(prefill, room, text="a", sim_fault=f"{role}:close")
    outcome = {}
    async with httpx2.AsyncClient(trust_env=False, timeout=10) as c:

        async def post(name, eng):
            try:
                outcome[name] = (await c.post(eng.url + "/generate", json=body)).status_code
            except httpx2.TransportError as exc:
                outcome[name] = exc

        async with trio.open_nursery() as nursery:
            nursery.start_soon(post, "prefill", prefill)
            nursery.start_soon(post, "decode", decode)
    assert isinstance(outcome[role], (httpx2.RemoteProtocolError, httpx2.ReadError))
    end = engine.events.find("request_end", room=room)[0]
    assert end["status"] is None and end["ended"] == "closed"
    await engine.wait_open_connections(0, timeout=3)


@pytest.mark.parametrize("role", ["prefill", "decode"])
async def test_hang_until_client_leaves(quick_pair, client, role):
    prefill, decode = quick_pair
    engine = prefill if role == "prefill" else decode
    room = new_room()
    body = pd_body(prefill, room, text="a", sim_fault=f"{role}:hang")
    with trio.move_on_after(0.7) as waited:
        await client.post(engine.url + "/generate", json=body)
    assert waited.cancelled_caught  # no answer came
    await engine.events.wait_for("connection_closed", room=room, timeout=2)
    await engine.events.wait_for("request_end", room=room, timeout=3)
    assert engine.running == 0


async def test_slow_delays_the_answer(quick_pair, client):
    prefill, decode = quick_pair
    for spec in ("prefill:slow:300", "decode:slow:300"):
        body = pd_body(prefill, new_room(), text="a", sim_fault=spec)
        start = trio.current_time()
        p, d = await pd_post(client, prefill, decode, "/generate", body)
        assert p.status_code == d.status_code == 200
        assert trio.current_time() - start >= 0.3


async def test_delayed_decode_fault_interrupts_the_work(quick_pair, client):
    prefill, decode = quick_pair
    room = new_room()
    body = pd_body(prefill, room, text="a", sim_fault="decode:502@300")
    start = trio.current_time()
    d = await client.post(decode.url + "/generate", json={**body, "stream": True})
    assert d.status_code == 502 and trio.current_time() - start >= 0.25
    freed = decode.events.find("slot_freed", room=room)[0]
    assert freed["reason"] == "error"  # registered, held a slot, then failed
    assert decode.events.find("room_registered", room=room)


async def test_a_decode_fault_after_n_tokens_fires_once_they_went_out(pair, client):
    """`@Ntok`: exactly N tokens reach the client, then the fault, whatever the clock says
    (a slow token pace changes nothing)."""
    prefill, decode = pair
    for fault, tokens in (("decode:close@3tok", 3), ("decode:sse_error@5tok", 5)):
        room = new_room()
        body = pd_body(prefill, room, text="a", max_new_tokens=50, sim_fault=fault, stream=True)
        async with trio.open_nursery() as both:
            both.start_soon(partial(client.post, prefill.url + "/generate", json=body))
            async with client.stream("POST", decode.url + "/generate", json=body) as d:
                assert d.status_code == 200
                text = b""
                try:
                    async for chunk in d.aiter_bytes():
                        text += chunk
                except httpx2.RemoteProtocolError:  # `close`: the connection dropped
                    assert fault.startswith("decode:close")
        events = [e for e in sse_events(text.decode()) if e != "[DONE]"]
        sent = [e for e in events if "error" not in e]
        assert [e["meta_info"]["completion_tokens"] for e in sent] == list(range(1, tokens + 1))
        assert decode.events.find("fault", room=room)
        if fault.startswith("decode:sse_error"):
            assert "error" in events[-1]


async def test_a_held_stream_pauses_after_n_tokens_until_released(pair, client):
    """`hold@Ntok`: N tokens out, then the stream waits (its slot held) until the test calls
    `release_held()`; then the rest."""
    prefill, decode = pair
    room = new_room()
    body = pd_body(
        prefill, room, text="a", sampling_params={"max_new_tokens": 5}, sim_fault="decode:hold@2tok"
    )
    async with trio.open_nursery() as both:
        both.start_soon(partial(client.post, prefill.url + "/generate", json={**body}))
        async with client.stream(
            "POST", decode.url + "/generate", json={**body, "stream": True}
        ) as d:
            lines = d.aiter_lines()
            seen = 0
            while seen < 2:
                if (await lines.__anext__()).startswith("data:"):
                    seen += 1
            await decode.events.wait_for("kv_ready", room=room)
            # Every task on the loop (the engine's generation too) has run as far as it can:
            # scheduling steps, not a clock, decide that it stopped.
            await trio.testing.wait_all_tasks_blocked()
            assert [e["event"] for e in decode.events.find(room=room)].count("first_token") == 1
            assert not decode.events.find("request_end", room=room)  # paused, not done
            assert decode.running == 1
            decode.state.release_held()
            rest = [line async for line in lines if line.startswith("data:")]
    assert len(rest) == 3 + 1  # tokens 3-5, then [DONE]
    await decode.events.wait_for("request_end", room=room)


async def test_delayed_prefill_fault(quick_pair, client):
    prefill, decode = quick_pair
    room = new_room()
    body = pd_body(prefill, room, text="a", sim_fault=["prefill:500@300", "decode:slow:0"])
    p, _ = await pd_post(client, prefill, decode, "/generate", body)
    registered = prefill.events.find("room_registered", room=room)[0]
    fault = prefill.events.find("fault", room=room)[0]
    assert p.status_code == 500 and fault["t"] - registered["t"] >= 0.25


async def test_engine_faults_flag_and_runtime_replacement(nursery, client):
    prefill = await start_engine(nursery, "prefill", faults=("503",))  # role omitted: applies
    decode = await start_engine(nursery, "decode", waiting_timeout=0.3, faults=("prefill:500",))
    body = pd_body(prefill, new_room(), text="a")
    p, d = await pd_post(client, prefill, decode, "/generate", body)
    assert p.status_code == 503 and d.status_code == 500  # decode ignores a prefill-only fault
    assert decode.events.find("kv_wait_timeout")
    prefill.set_faults(())
    p, d = await pd_post(
        client, prefill, decode, "/generate", pd_body(prefill, new_room(), text="a")
    )
    assert p.status_code == d.status_code == 200
    with pytest.raises(ValueError):
        prefill.set_faults(("bogus",))


async def test_refuse_keeps_bootstrap_running(nursery, client):
    prefill = await start_engine(nursery, "prefill", faults=("prefill:refuse",))
    decode = await start_engine(nursery, "decode", waiting_timeout=0.3)
    with pytest.raises(httpx2.ConnectError):
        await client.get(prefill.url + "/health")
    room = new_room()
    d = await client.post(decode.url + "/generate", json=pd_body(prefill, room, text="a"))
    assert d.status_code == 500  # registered fine, then no KV ever came
    assert decode.events.find("room_registered", room=room)
    freed = await decode.events.wait_for("slot_freed", room=room)
    assert freed["reason"] == "kv_wait_timeout" and freed["acked"] is True


async def test_bad_sim_fault_is_400(quick_pair, client):
    prefill, _ = quick_pair
    body = pd_body(prefill, new_room(), text="a", sim_fault="prefill:explode")
    r = await client.post(prefill.url + "/generate", json=body)
    assert r.status_code == 400 and "explode" in r.json()["message"]
