"""Reading one upstream answer: a whole body within its bounds, JSON parsed on the request's
budget, an SSE event's in-band failure, a non-2xx answer kept to relay, and the failure a
buffer the router will not hold becomes. Shared by the SGLang attempt (`attempt.py`, both legs
at once) and the vLLM one (`engines/vllm.py`, prefill first)."""

from __future__ import annotations

from typing import Any

import attrs

from trio_pd.pd.budget import Account, OverBudget, json_marks, parse_cost
from trio_pd.pd.frames import InbandError, data_failure, parse_json
from trio_pd.pd.outcome import LegFailure
from trio_pd.pd.sse import EventTooLarge
from trio_pd.upstream.pool import UpstreamError, UpstreamResponse

SSE_TYPE = b"text/event-stream"
MAX_ERROR_BODY = 1 << 20  # an upstream error body we relay is read up to this size
MAX_ANSWER_BODY = 256 << 20  # a non-streamed answer larger than this fails the leg


@attrs.define
class AnswerScan:
    """What a pass over an answer's chunks found as they arrived (so a large answer is never
    scanned whole on the event loop): its JSON structure count, to price its parse, and
    whether it carries a failure marker (`error`, `abort`), so must be parsed to know."""

    marks: int = 0
    suspect: bool = False
    _tail: bytes = b""  # the last bytes of the previous chunk: a marker may straddle two

    def feed(self, chunk: bytes) -> None:
        self.marks += json_marks(chunk)
        if not self.suspect:
            edge = self._tail + chunk[:4]
            self.suspect = any(m in chunk or m in edge for m in (b"error", b"abort"))
            self._tail = (self._tail + chunk)[-4:] if len(chunk) < 4 else chunk[-4:]


async def read_answer(
    response: UpstreamResponse, account: Account | None = None, scan: AnswerScan | None = None
) -> bytes:
    """A whole non-streamed answer, charged to `account` as it arrives (OverBudget when the
    budget cannot hold it), each chunk fed to `scan`; one past `MAX_ANSWER_BODY` fails the
    leg, never truncated."""
    parts = []
    size = 0
    async for chunk in response.chunks():
        size += len(chunk)
        if size > MAX_ANSWER_BODY:
            raise UpstreamError("transport", f"answer larger than {MAX_ANSWER_BODY} bytes")
        if account is not None:
            account.charge(len(chunk))
        if scan is not None:
            scan.feed(chunk)
        parts.append(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def read_json(data: bytes, account: Account | None) -> Any:
    """`data` parsed (None if it is not JSON), its parse charged to `account` first (the
    objects it becomes: `budget.parse_cost`) and held until the request ends."""
    if account is not None:
        account.charge(parse_cost(len(data), json_marks(data)))
    return parse_json(data)


def event_failure(data: bytes, account: Account | None) -> InbandError | None:
    """`relay.data_failure` of one SSE event, its parse (only when it may carry a failure)
    charged to `account` while it runs."""
    if account is None or (b"error" not in data and b"abort" not in data):
        return data_failure(data)
    cost = parse_cost(len(data), json_marks(data))
    account.charge(cost)
    try:
        return data_failure(data)
    finally:
        account.release(cost)


def buffer_failure(exc: EventTooLarge | OverBudget) -> LegFailure:
    """A worker's answer the router will not hold: an event past --max-sse-event-bytes, or an
    answer larger than the whole budget, is the worker's fault (502); a budget full of other
    requests' buffers is the router's overload (503, `outcome.py`), never charged to the worker."""
    if not isinstance(exc, OverBudget):
        return LegFailure("transport", str(exc))
    flag = f"--max-buffered-bytes {exc.limit}"
    if exc.never:
        return LegFailure("transport", f"answer needs {exc.wanted} bytes, more than {flag}")
    return LegFailure("overload", f"the router's buffers are full ({flag}): try again")


def is_sse(response: UpstreamResponse) -> bool:
    return (response.header(b"content-type") or b"").startswith(SSE_TYPE)


async def status_failure(response: UpstreamResponse) -> LegFailure:
    """A non-2xx answer: keep (a bounded part of) its body and content type to relay it."""
    body = await response.read(limit=MAX_ERROR_BODY)
    content_type = response.header(b"content-type") or b"application/json"
    message = upstream_message(body) or f"status {response.status}"
    return LegFailure("status", message, response.status, body, content_type)


def upstream_message(body: bytes) -> str | None:
    """The human-readable message of an upstream error body, when it has one."""
    parsed = parse_json(body)
    if isinstance(parsed, dict):
        error = parsed.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str):
            return error
        if parsed.get("message"):
            return str(parsed["message"])
    return None
