"""SSE frames and payloads: event data, in-band failures, the logprob merge, the error frame.

Decode's bytes are relayed raw; only what a decision needs is parsed: the first event of a stream,
a prefill answer, an error marker. Events are cut out of the byte stream by `sse.EventReader`.
"""

from __future__ import annotations

from typing import Any

import attrs
import orjson

DONE_FRAME = b"data: [DONE]\n\n"
LOGPROB_KEYS = ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs")


def event_data(event: bytes) -> bytes | None:
    """The joined `data:` payload of one SSE event, or None when it has no data line."""
    # What engines send, one data line and its blank line, is taken with one copy: a prefill's
    # answer with logprobs can be tens of MB, and each pass over it holds the event loop.
    ending = 2 if event.endswith(b"\n\n") else 4 if event.endswith(b"\r\n\r\n") else 0
    if ending and event.startswith(b"data:"):
        end = len(event) - ending
        if event.find(b"\n", 0, end) < 0 and event.find(b"\r", 0, end) < 0:
            return event[6 if event.startswith(b"data: ") else 5 : end]
    lines = [
        line[5:].removeprefix(b" ") for line in event.splitlines() if line.startswith(b"data:")
    ]
    return b"\n".join(lines) if lines else None


def parse_json(data: bytes) -> Any:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return None


@attrs.frozen
class InbandError:
    """A failure carried inside a 2xx answer. ``code`` is its HTTP-like status when the worker
    gave one (the error object's `code`, an abort's `status_code`): a 4xx there is the client's
    request being refused (docs/protocol.md §4), anything else the worker's failure."""

    message: str
    code: int | None = None

    @property
    def is_client_error(self) -> bool:
        return self.code is not None and 400 <= self.code < 500


def inband_failure(obj: Any) -> InbandError | None:
    """The failure carried inside a 2xx answer: an `error` object or an aborted finish."""
    if isinstance(obj, list):
        for item in obj:
            found = inband_failure(item)
            if found is not None:
                return found
        return None
    if not isinstance(obj, dict):
        return None
    error = obj.get("error")
    if error:
        if isinstance(error, dict):
            return InbandError(str(error.get("message") or error), status_code(error.get("code")))
        return InbandError(str(error), status_code(obj.get("code")))
    meta = obj.get("meta_info")
    if isinstance(meta, dict):
        finish = meta.get("finish_reason")
        if isinstance(finish, dict) and finish.get("type") == "abort":
            message = str(finish.get("message") or "request aborted")
            return InbandError(message, status_code(finish.get("status_code")))
    # OpenAI routes have no top-level meta_info: a graceful abort shows only as a choice's
    # `finish_reason: "abort"` (a coded one is an `error` event or an HTTP status instead,
    # `entrypoints/openai/serving_chat.py`): no code, so it is the worker's failure.
    choices = obj.get("choices")
    if isinstance(choices, list):
        for choice in choices:
            if isinstance(choice, dict) and choice.get("finish_reason") == "abort":
                return InbandError("the engine aborted the request (finish_reason abort)")
    return None


def status_code(value: Any) -> int | None:
    """An HTTP status from an error's `code`: an int or a numeric string in 100..599."""
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and 100 <= value <= 599:
        return value
    return None


def answer_failure(obj: Any) -> InbandError | None:
    """The failure a parsed answer (or SSE event) carries, `inband_failure`, once its shape is
    one an engine sends: an object, or a batch (a list of objects). Lists nested in a batch are
    no engine's answer, and walking them could recurse as deep as the worker liked: the
    worker's fault."""
    if isinstance(obj, list) and any(isinstance(item, list) for item in obj):
        return InbandError("the worker's answer nests lists inside a batch: not an engine answer")
    return inband_failure(obj)


def data_failure(data: bytes) -> InbandError | None:
    """In-band failure in one SSE data payload; cheap when there is none (no JSON parse)."""
    if b"error" not in data and b"abort" not in data:
        return None
    return answer_failure(parse_json(data))


def merge_logprobs(prefill: Any, decode: Any) -> bool:
    """Put prefill's input logprobs in front of decode's, item by item for a batch (one level:
    engines answer an object or a list of them); True if anything changed."""
    if isinstance(prefill, list) and isinstance(decode, list):
        changed = False
        for p_item, d_item in zip(prefill, decode, strict=False):
            changed = _merge_one(p_item, d_item) or changed
        return changed
    return _merge_one(prefill, decode)


def _merge_one(prefill: Any, decode: Any) -> bool:
    if not (isinstance(prefill, dict) and isinstance(decode, dict)):
        return False
    p_meta, d_meta = prefill.get("meta_info"), decode.get("meta_info")
    if not (isinstance(p_meta, dict) and isinstance(d_meta, dict)):
        return False
    changed = False
    for key in LOGPROB_KEYS:
        head = p_meta.get(key)
        if isinstance(head, list):
            tail = d_meta.get(key)
            d_meta[key] = head + tail if isinstance(tail, list) else head
            changed = True
    return changed


def error_frame(message: str, error_type: str, code: str | int) -> bytes:
    """The valid-JSON error event that ends a stream after an upstream failure, then [DONE]."""
    body = orjson.dumps({"error": {"message": message, "type": error_type, "code": code}})
    return b"data: " + body + b"\n\n" + DONE_FRAME
