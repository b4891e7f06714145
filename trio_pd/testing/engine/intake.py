"""Admission of one generation request: its Call, or its 4xx answer.

Everything an engine refuses before it touches slots or rooms is refused here: an unreadable or
invalid body, a bad fault spec, bad `rid` or rank fields (an out-of-range `routed_dp_rank`), and
a body rid the engine already holds (SGLang's "Duplicate request ID: <rid>", 400). Every request
logs `request_start` here, refused or not; a refused one also logs its `request_end`.
"""

from __future__ import annotations

from typing import Any

import orjson

from trio_pd.testing.engine.asgi import BodyTooLarge, Responder, header, read_body
from trio_pd.testing.engine.dp import parse_pins, serving_ranks
from trio_pd.testing.engine.faults import FaultError, parse_many, plan_for
from trio_pd.testing.engine.responses import Shaper
from trio_pd.testing.engine.rids import DuplicateRid, parse_rids
from trio_pd.testing.engine.state import Call, EngineState
from trio_pd.testing.engine.workload import BadRequest, parse_workload


async def admit(
    engine: EngineState, scope: dict[str, Any], receive: Any, send: Any, api: str
) -> Call | None:
    """The request's Call with its body rids held (release them when it ends), or None once
    it was answered (refused, or the client left before sending its body)."""
    rid = header(scope, b"x-request-id") or engine.new_rid()
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
        body = orjson.loads(raw)
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        call = _build(engine, scope, body, api, rid, resp)
    except (orjson.JSONDecodeError, BadRequest, FaultError) as exc:
        bad_json = isinstance(exc, orjson.JSONDecodeError)
        message = f"invalid JSON: {exc}" if bad_json else str(exc)
        sglang_rid = body.get("rid") if isinstance(body, dict) else None
        engine.events.emit(
            "request_start",
            rid=rid,
            path=path,
            stream=None,
            body=None,
            headers=hdrs,
            sglang_rid=sglang_rid,
            dp_rank=None,
        )
        await resp.error(400, message)
        engine.events.emit("request_end", rid=rid, status=400, dp_rank=None, error=message)
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
        dp_ranks=list(call.dp_ranks) if w.is_batch else None,
    )
    try:
        engine.rids.claim(call.sglang_rids, call)
    except DuplicateRid as exc:
        await resp.error(400, str(exc))
        call.emit("request_end", status=400, error=str(exc))
        return None
    return call


def _build(
    engine: EngineState, scope: dict[str, Any], body: dict[str, Any], api: str, rid: str, resp: Any
) -> Call:
    workload = parse_workload(api, body)
    faults = parse_many(body.get("sim_fault"))
    sglang_rids = parse_rids(body.get("rid"), workload.size, workload.is_batch)
    pins = parse_pins(body)
    ranks = serving_ranks(workload.rooms, workload.size, pins, engine.config.num_dp_ranks)
    given = body.get("rid")
    first = "prealloc" if engine.role == "decode" else "bootstrap"
    return Call(
        engine=engine,
        rid=rid,
        path=scope["path"],
        client=scope.get("client"),
        workload=workload,
        plan=plan_for(engine.role, (*engine.faults, *faults)),
        resp=resp,
        shaper=Shaper(
            workload, rid, engine.config.model, engine.role, sglang_rids if given else None
        ),
        sglang_rids=sglang_rids,
        pins=pins,
        dp_ranks=ranks,
        stages=[first] * workload.size,
    )
