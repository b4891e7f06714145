"""Admission of one generation request: its Call, or its refusal in the engine's shape.

In SGLang's order (`entrypoints/http_server.py`, `managers/tokenizer_manager.py`
`generate_request`): the body's schema (400 on every route, before any work: failures.py); a
/generate stream then sends its 200 and SSE headers, so everything after goes in-band; the
engine's normalization (rid rules, rids.py; sampling n) and `routed_dp_rank` range; the
registration of the rids (a rid already held: "Duplicate request ID detected"); the prompt
length against the context. A refused /generate stream still gets the engine's background
abort of its rids 2 s later (tokenizer.py), which aborts whoever holds them.

Simulator-only refusals, also before any work: a bad `sim_fault`, and a PD request without its
bootstrap fields (SGLang fails such a request later and less clearly). Every request logs
`request_start` here, refused or not; a refused one also logs its `request_end`.
"""

from __future__ import annotations

from typing import Any

import orjson

from trio_pd_testing.engine import failures
from trio_pd_testing.engine.asgi import BodyTooLarge, Responder, header, read_body
from trio_pd_testing.engine.bootstrap import FAKE_BOOTSTRAP_HOST
from trio_pd_testing.engine.dp import parse_pins, serving_ranks
from trio_pd_testing.engine.faults import FaultError, parse_many, plan_for
from trio_pd_testing.engine.responses import Output
from trio_pd_testing.engine.rids import UnhashableRid, new_rid, normalize_rids
from trio_pd_testing.engine.state import Call, EngineState, Item
from trio_pd_testing.engine.tokenizer import background_abort
from trio_pd_testing.engine.workload import BadRequest, Refused, Workload, parse_workload


class _Refusal(Exception):
    def __init__(self, kind: str, message: str, rids: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.kind, self.message, self.rids = kind, message, rids


async def admit(
    engine: EngineState, scope: dict[str, Any], receive: Any, send: Any, api: str
) -> Call | None:
    """The request's Call with its rids registered, or None once it was answered (refused, or
    the client left before sending its body)."""
    rid = header(scope, b"x-request-id") or new_rid()
    path = scope["path"]
    hdrs = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
    resp = Responder(
        send, rid, lambda status: engine.events.emit("response_start", rid=rid, status=status)
    )
    try:
        raw = await read_body(receive)
    except BodyTooLarge:
        await resp.error(413, "request body too large")
        return None
    if raw is None:
        return None  # the client left before sending its body
    body: Any = None
    try:
        if api != "generate" and hdrs.get("content-type", "").split(";")[0].strip().lower() != (
            "application/json"
        ):
            raise _Refusal("schema", "Unsupported Media Type: Only 'application/json' is allowed")
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise _Refusal("schema", f"JSON decode error: {exc}") from None
        if not isinstance(body, dict):
            raise _Refusal("schema", "the request body must be a JSON object")
        call = _build(engine, scope, body, api, rid, resp, hdrs)
    except _Refusal as refusal:
        await _refuse(engine, scope, rid, hdrs, body, api, resp, refusal)
        return None
    resp.on_start = lambda status: call.emit("response_start", status=status)
    w = call.workload
    call.emit(
        "request_start",
        path=path,
        stream=w.stream,
        rooms=list(w.rooms) if w.rooms else None,
        batch=w.is_batch,
        body=body,  # as parsed: lets router tests check injection and pass-through
        raw=raw.decode("utf-8", "surrogateescape"),  # as received, byte for byte
        headers=hdrs,
        sglang_rid=body.get("rid"),
        sglang_rids=list(call.sglang_rids),
        dp_ranks=list(call.dp_ranks) if w.is_batch else None,
        n=w.n,
    )
    # the n > 1 case registers batch_size x n (string rid) or batch_size rids: owner = the
    # item of the same position, so an abort of one reaches that item
    pairs = [(r, call.items[min(i, len(call.items) - 1)]) for i, r in enumerate(call.sglang_rids)]
    try:
        engine.rids.register(pairs)
    except Refused as exc:
        await _answer_refusal(engine, call, str(exc))
        return None
    try:
        _check_length(call)
    except Refused as exc:
        for sglang_rid, owner in pairs:
            engine.rids.release([sglang_rid], owner)
        await _answer_refusal(engine, call, str(exc))
        return None
    return call


def _build(
    engine: EngineState,
    scope: dict[str, Any],
    body: dict[str, Any],
    api: str,
    rid: str,
    resp: Responder,
    hdrs: dict[str, str],
) -> Call:
    try:
        workload = parse_workload(api, body)
        faults = parse_many(body.get("sim_fault"))
        pins = parse_pins(body, hdrs.get("x-data-parallel-rank") if api != "generate" else None)
    except BadRequest as exc:
        raise _Refusal("schema", str(exc)) from None
    except FaultError as exc:
        raise _Refusal("schema", str(exc)) from None
    except Refused as exc:
        raise _Refusal("value", str(exc), _raw_rids(body)) from None
    plan = plan_for(engine.role, (*engine.faults, *faults))
    output = Output(workload, resp, engine.config.model, engine.role)
    output.tag = body.get("sim_tag") is True
    output.multibyte = engine.config.multibyte_tokens
    output.defer_headers = plan.terminal is not None and plan.terminal.kind == "status"
    try:
        sglang_rids = normalize_rids(body.get("rid"), workload)
        rooms = tuple(workload.room_of(i) for i in range(workload.size))
        ranks = serving_ranks(rooms, pins, engine.config, engine.next_round_robin)
        _check_pd_fields(engine, workload)
    except BadRequest as exc:
        raise _Refusal("schema", str(exc)) from None
    except UnhashableRid as exc:
        raise _Refusal("internal", str(exc)) from None
    except Refused as exc:
        raise _Refusal("value", str(exc), _raw_rids(body)) from None
    call = Call(
        engine=engine,
        rid=rid,
        path=scope["path"],
        client=scope.get("client"),
        workload=workload,
        plan=plan,
        resp=resp,
        output=output,
        sglang_rids=sglang_rids,
        pins=pins,
    )
    call.items = [
        Item(
            call=call,
            index=k,
            rid=sglang_rids[k] if workload.n == 1 else new_rid(),
            room=rooms[k],
            rank=ranks[k],
            prompt_tokens=workload.prompt_len(k),
        )
        for k in range(workload.size)
    ]
    output.bind(call.items)
    return call


def _raw_rids(body: dict[str, Any]) -> tuple[str, ...]:
    rid = body.get("rid")
    if isinstance(rid, str):
        return (rid,)
    if isinstance(rid, list):
        return tuple(r for r in rid if isinstance(r, str))
    return ()


def _check_pd_fields(engine: EngineState, w: Workload) -> None:
    if w.bootstrap_host == FAKE_BOOTSTRAP_HOST:  # a fake transfer: no prefill involved
        if w.prompt_rooms is None:
            raise Refused(f"bootstrap_room is required by a {engine.role} engine (PD mode)")
        return
    if not w.prompt_rooms:
        raise Refused(f"bootstrap_room is required by a {engine.role} engine (PD mode)")
    if engine.role == "decode" and not w.bootstrap_host:
        raise Refused("bootstrap_host is required by a decode engine (PD mode)")


def _check_length(call: Call) -> None:
    context = call.config.context_length
    for prompt in call.workload.prompts:
        if len(prompt) >= context:
            raise Refused(
                f"The input ({len(prompt)} tokens) is longer than the model's context length "
                f"({context} tokens)."
            )


async def _refuse(
    engine: EngineState,
    scope: dict[str, Any],
    rid: str,
    hdrs: dict[str, str],
    body: Any,
    api: str,
    resp: Responder,
    refusal: _Refusal,
) -> None:
    sglang_rid = body.get("rid") if isinstance(body, dict) else None
    stream = isinstance(body, dict) and body.get("stream") is True
    engine.events.emit(
        "request_start",
        rid=rid,
        path=scope["path"],
        stream=stream if isinstance(body, dict) else None,
        body=None,
        headers=hdrs,
        sglang_rid=sglang_rid,
        dp_rank=None,
    )
    if refusal.kind == "schema":
        await failures.validation_error(resp, refusal.message)
    elif refusal.kind == "internal":  # SGLang raised TypeError: 500, or a stream cut short
        if stream and api == "generate":
            await resp.start_stream()
            await engine.connections.drop(scope.get("client"))
        else:
            await failures.internal_error(resp)
    else:
        await failures.refusal(resp, api, stream, refusal.message)
        if stream and api == "generate" and engine.background is not None:
            engine.background.start_soon(background_abort, engine, refusal.rids)
    engine.events.emit(
        "request_end", rid=rid, status=resp.status, dp_rank=None, error=refusal.message
    )


async def _answer_refusal(engine: EngineState, call: Call, message: str) -> None:
    w = call.workload
    await failures.refusal(call.resp, w.api, w.stream, message)
    if w.stream and w.api == "generate" and engine.background is not None:
        engine.background.start_soon(background_abort, engine, call.sglang_rids)
    call.emit("request_end", status=call.resp.status, error=message)
