"""Firing a terminal fault on a request (the timing is decided by the role flows).

`status`, `sse_error`, `close` and `hang` are the simulator's own failures (no engine sends a
`sim_fault` answer; `status` and `sse_error` use the `{"error": {"message", "type", "code"}}`
envelope). `abort` is what SGLang sends for an aborted request: without a code a graceful
abort (finish_reason abort, no status: 200), with one an abort with that status (responses.py:
an HTTP error without a stream, an in-band abort event or error chunk in one).
"""

from __future__ import annotations

import logging

import trio

from trio_pd_testing.engine.asgi import error_body
from trio_pd_testing.engine.faults import Fault
from trio_pd_testing.engine.responses import abort_finish
from trio_pd_testing.engine.state import Call

log = logging.getLogger("trio_pd_testing.engine")


async def fire(call: Call, fault: Fault) -> None:
    call.emit("fault", spec=fault.spec, kind=fault.kind, status=fault.status)
    message = f"simulated {call.engine.role} fault {fault.spec!r}"
    stream = call.workload.stream
    output = call.output
    if fault.kind == "status":
        assert fault.status is not None
        if call.resp.started:  # a stream already answered 200: the status can only go in-band
            await call.resp.error(fault.status, message)
        else:
            await call.resp.json(fault.status, error_body(message, fault.status))
    elif (
        fault.kind == "sse_error"
    ):  # an error inside a 200 answer, with its code (500 unless given)
        code = fault.status or 500
        if stream:
            await call.resp.event(error_body(message, code))
            await call.resp.done()
        else:
            await call.resp.json(200, error_body(message, code))
    elif fault.kind == "abort":
        for item in call.items:
            if item.index in output.finished or item.index in output.failed:
                continue
            if fault.status is not None:
                await output.fail(item, fault.status, message)
            else:
                await output.finish(item, abort_finish(message))
        await output.close()
    elif fault.kind == "close":
        call.ended = "closed"
        if not await call.engine.connections.drop(call.client):
            log.warning("%s: close fault: connection %s not found", call.rid, call.client)
    elif fault.kind == "die":
        call.ended = "died"
        await call.engine.die()
    elif fault.kind == "hang":
        call.ended = "hang"
        call.hanging = True
        await trio.sleep_forever()  # until the client goes away (work_scope is cancelled)
    else:  # pragma: no cover - slow/refuse never reach here
        raise AssertionError(fault.kind)
