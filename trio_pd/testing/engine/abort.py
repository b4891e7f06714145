"""POST /abort_request (SGLang's way to stop a request at once) and an aborted request's answer.

Body: `{"rid": "<rid>"}` (or a list of rids) or `{"abort_all": true}`; rids are the body rids of
generation requests (rids.py), not x-request-id values. A matching request is cancelled at once:
its decode slots are freed with reason `aborted_request` without waiting for the disconnect-poll
tick, a queued decode item leaves its queue, a prefill request stops waiting for its registration
or computing. The engine answers 200 whether or not anything matched, because SGLang silently
drops an abort for a rid it does not (yet) hold. Every named rid logs `abort_request` with
`sglang_rid`, `matched` and, when matched, the request's event key (`rid`, its x-request-id),
room and dp_rank.

The aborted request, if its client is still connected, ends as an aborted SGLang request does:
200 with `finish_reason` `{"type": "abort", "message": ...}` (OpenAI routes: `"abort"` in each
choice), or on a stream one such event then `data: [DONE]`.

A batch is held as one request: aborting any of its item rids aborts every item (SGLang would
stop only that item; a router aborts whole requests).
"""

from __future__ import annotations

from typing import Any

import orjson

from trio_pd.testing.engine.asgi import BodyTooLarge, Responder, read_body
from trio_pd.testing.engine.state import Call, EngineState

ABORTED = "aborted_request"  # slot_freed reason, request_end `ended`


class _BadAbort(ValueError):
    pass


async def handle_abort(engine: EngineState, scope: dict[str, Any], receive: Any, send: Any):
    resp = Responder(send)
    if scope["method"] != "POST":
        await resp.error(405, "/abort_request takes POST")
        return
    try:
        raw = await read_body(receive)
    except BodyTooLarge:
        await resp.error(413, "request body too large")
        return
    if raw is None:
        return
    try:
        names, abort_all = _parse(raw)
    except (orjson.JSONDecodeError, _BadAbort) as exc:
        await resp.error(400, f"bad /abort_request body: {exc}")
        return
    if abort_all:
        _abort_all(engine)
    for name in names:
        call = engine.rids.get(name)
        if call is None:
            engine.events.emit("abort_request", sglang_rid=name, matched=False, dp_rank=None)
        else:
            call.emit("abort_request", sglang_rid=name, matched=True)
            call.cancel(ABORTED)
    await resp.empty()


def _parse(raw: bytes) -> tuple[list[str], bool]:
    body = orjson.loads(raw) if raw.strip() else {}
    if not isinstance(body, dict):
        raise _BadAbort("not a JSON object")
    rid, abort_all = body.get("rid"), body.get("abort_all", False)
    if not isinstance(abort_all, bool):
        raise _BadAbort("abort_all must be a boolean")
    if rid is None or rid == "":  # SGLang's AbortReq defaults rid to ""
        return [], abort_all
    if isinstance(rid, str):
        return [rid], abort_all
    if isinstance(rid, list) and all(isinstance(r, str) for r in rid):
        return [r for r in rid if r], abort_all
    raise _BadAbort("rid must be a string or a list of strings")


def _abort_all(engine: EngineState) -> None:
    calls = engine.rids.owners()
    if not calls:
        engine.events.emit(
            "abort_request", sglang_rid=None, matched=False, abort_all=True, dp_rank=None
        )
    for call in calls:
        call.emit("abort_request", sglang_rid=call.sglang_rids[0], matched=True, abort_all=True)
        call.cancel(ABORTED)


async def answer_aborted(call: Call) -> None:
    """End an aborted request's response, unless it is complete or its client is gone."""
    call.ended = ABORTED
    if call.resp.completed or call.disconnected:
        return
    message = "Aborted by POST /abort_request"
    call.buffered.clear()  # deferred stream events: the abort replaces them
    if call.workload.stream:
        await call.resp.event(call.shaper.abort_event(message))
        await call.resp.done()
    else:
        await call.resp.json(200, call.shaper.full(abort=message))
