"""POST /abort_request (SGLang's way to stop a request at once).

The body is SGLang's `AbortReq` (`managers/io_struct.py`), validated by FastAPI: `rid` a
string (a list, or any other type, is refused with the engine's validation error: 400), or
absent/null (then ""); `abort_all` a bool; `abort_message` a string, accepted and not used by
the HTTP handler (it passes only rid and abort_all on); other fields ignored. The answer is 200
with an empty body whether or not anything matched (`entrypoints/http_server.py`).

What happens then is tokenizer.abort_request (the tokenizer manager's drop and latch rules) and
scheduler.abort_matching (the prefix match); every abort logs `abort_request` events. Auth is
ADMIN_OPTIONAL (auth.py). An aborted request answers as SGLang does (responses.py,
scheduler.py: depending on the queue it was in).
"""

from __future__ import annotations

from typing import Any

import orjson
import trio

from trio_pd_testing.engine.asgi import Responder
from trio_pd_testing.engine.failures import read_post_body, validation_error
from trio_pd_testing.engine.state import EngineState
from trio_pd_testing.engine.tokenizer import abort_request

_TRUE = {"1", "true", "t", "yes", "y", "on"}
_FALSE = {"0", "false", "f", "no", "n", "off"}


class _Invalid(ValueError):
    pass


async def handle_abort(engine: EngineState, scope: dict[str, Any], receive: Any, send: Any):
    resp = Responder(send)
    raw = await read_post_body(scope, receive, resp)
    if raw is None:
        return
    try:
        rid, abort_all = parse_abort(raw)
    except _Invalid as exc:
        engine.events.emit("abort_refused", error=str(exc), dp_rank=None)
        await validation_error(resp, str(exc))
        return
    if engine.abort_hangs:  # a fault of the simulator's (state.py), not SGLang's behaviour
        engine.events.emit("abort_hung", sglang_rid=rid or None, dp_rank=None)
        await trio.sleep_forever()
    abort_request(engine, rid, abort_all, source="http")
    await resp.empty()


def _error(kind: str, loc: str, msg: str, value: Any) -> _Invalid:
    return _Invalid(
        f"[{{'type': '{kind}', 'loc': ('body'{loc}), 'msg': '{msg}', 'input': {value!r}}}]"
    )


def parse_abort(raw: bytes) -> tuple[str, bool]:
    """(rid, abort_all) of an AbortReq body, or _Invalid with pydantic's complaint."""
    if not raw.strip():
        raise _error("missing", "", "Field required", None)
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise _error("json_invalid", ", 0", "JSON decode error", str(exc)) from None
    if not isinstance(body, dict):
        raise _error("model_attributes_type", "", "Input should be a valid dictionary", body)
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise _error("string_type", ", 'rid'", "Input should be a valid string", rid)
    message = body.get("abort_message")
    if message is not None and not isinstance(message, str):
        raise _error("string_type", ", 'abort_message'", "Input should be a valid string", message)
    return rid or "", _bool(body.get("abort_all", False))


def _bool(value: Any) -> bool:
    """pydantic's lax bool."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
        return value.lower() in _TRUE
    raise _error("bool_parsing", ", 'abort_all'", "Input should be a valid boolean", value)
