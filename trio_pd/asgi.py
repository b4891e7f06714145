"""ASGI plumbing shared by every handler: types, reading a bounded body, JSON replies."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeAlias

import orjson

from trio_pd.errors import payload_too_large
from trio_pd.jsonbody import parse_object
from trio_pd.respond import JSON_HEADERS, Reply, Responder

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
# A route's handler, bound to the narrow context it needs (see app.route_table).
Handler: TypeAlias = Callable[[Scope, Receive, Responder], Awaitable[None]]


class ClientGone(Exception):
    """The client disconnected while we were still reading its body."""


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The whole request body, refused with 413 as soon as it is known to exceed `limit`."""
    for name, value in scope["headers"]:
        if name == b"content-length" and value.isdigit() and int(value) > limit:
            raise payload_too_large(limit)
    chunks = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise payload_too_large(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def read_json_object(scope: Scope, receive: Receive, limit: int) -> dict[str, Any]:
    """The (small, control-plane) body parsed as a JSON object, or a 400 saying what is wrong."""
    return parse_object(await read_body(scope, receive, limit))


async def json_reply(responder: Responder, status: int, obj: Any) -> None:
    await responder.reply(Reply(status, JSON_HEADERS, orjson.dumps(obj)))
