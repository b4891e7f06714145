"""Error answers in the shapes SGLang 0.5.23 gives them, per route (`entrypoints/http_server.py`,
`entrypoints/openai/serving_base.py`, `managers/tokenizer_manager.py`).

- the schema (FastAPI/pydantic validation), on every route and before any work: 400
  `{"object": "error", "message", "type": "Bad Request", "param": null, "code": 400}`;
- a ValueError while normalizing or registering (rid rules, duplicates, ranks, length):
  /generate 400 `{"error": {"message"}}`, or on a stream 200 and `data: {"error": {"message",
  "type": "invalid_request_error", "code": 400, "retryable": false}}`; OpenAI routes 400
  `{"object": "error", ..., "type": "BadRequestError", ...}` (streams too: it is raised before
  their first chunk);
- an abort with a status (a KV transfer that failed, a handshake aborted): without a stream the
  flat error above with `"type": "<code>"` (400: the ValueError shapes); in a /generate stream
  an abort event (responses.py), in an OpenAI stream `data: {"error": {..., "type":
  "INTERNAL_SERVER_ERROR", ...}}`;
- no route / wrong method: FastAPI's `{"detail": "Not Found"}` 404 / `{"detail": "Method Not
  Allowed"}` 405;
- an unexpected exception: 500 text/plain `Internal Server Error`.

The simulator's own fault injection (`sim_fault`) keeps its `{"error":{"message","type","code"}}`
envelope (faults.py): no engine answers those.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from trio_pd_testing.engine.asgi import BodyTooLarge, Responder, read_body


def flat_error(message: str, err_type: str, code: int) -> dict[str, Any]:
    """SGLang's ErrorResponse (`entrypoints/openai/protocol.py`)."""
    return {"object": "error", "message": message, "type": err_type, "param": None, "code": code}


def stream_error(message: str, code: int) -> dict[str, Any]:
    """An OpenAI stream's error chunk (`create_streaming_error_response`)."""
    return {"error": flat_error(message, HTTPStatus(code).name, code)}


def generate_stream_value_error(message: str) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "code": 400,
            "retryable": False,
        }
    }


async def validation_error(resp: Responder, message: str) -> None:
    await resp.json(400, flat_error(message, "Bad Request", 400))


async def refusal(resp: Responder, api: str, stream: bool, message: str) -> None:
    """A ValueError the engine raised before the request reached its scheduler."""
    if api != "generate":
        await resp.json(400, flat_error(message, "BadRequestError", 400))
    elif stream:
        await resp.event(generate_stream_value_error(message))
        await resp.done()
    else:
        await resp.json(400, {"error": {"message": message}})


def abort_failure_body(api: str, status: int, message: str) -> dict[str, Any]:
    """The non-stream answer of a request whose engine request aborted with a status."""
    if status == 400:
        if api == "generate":
            return {"error": {"message": message}}
        return flat_error(message, "BadRequestError", 400)
    return flat_error(message, str(status), status)


async def not_found(resp: Responder) -> None:
    await resp.json(404, {"detail": "Not Found"})


async def method_not_allowed(resp: Responder) -> None:
    await resp.json(405, {"detail": "Method Not Allowed"})


async def read_post_body(scope: dict[str, Any], receive: Any, resp: Responder) -> bytes | None:
    """A POST route's whole body; None once answered (405 for another method, 413 for a body
    too large) or when the client left before sending it."""
    if scope["method"] != "POST":
        await method_not_allowed(resp)
        return None
    try:
        return await read_body(receive)
    except BodyTooLarge:
        await resp.error(413, "request body too large")
        return None


async def internal_error(resp: Responder) -> None:
    await resp.text(500, "Internal Server Error")
