"""`--api-key`: SGLang's API key check, in front of the engine's HTTP API.

Like SGLang's `add_api_key_middleware`: every request needs `Authorization: Bearer <key>`, except
OPTIONS requests and paths starting with `/health` or `/metrics`; otherwise 401 with SGLang's body
`{"error": "Unauthorized"}`. Refusals log `unauthorized` (path, method; `rid` is the
x-request-id header, if any). The prefill's bootstrap server is not behind it.
"""

from __future__ import annotations

import hmac
from typing import Any

from trio_pd.testing.engine.asgi import Responder, header
from trio_pd.testing.engine.events import EventLog
from trio_pd.testing.engine.httpserver import ASGIApp

OPEN_PREFIXES = ("/health", "/metrics")


class ApiKeyGate:
    def __init__(self, app: ASGIApp, api_key: str, events: EventLog) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.events = events

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        rid = header(scope, b"x-request-id")
        self.events.emit("unauthorized", rid=rid, path=scope["path"], method=scope["method"])
        await Responder(send, rid).json(401, {"error": "Unauthorized"})

    def _allowed(self, scope: dict[str, Any]) -> bool:
        if scope["method"] == "OPTIONS" or scope["path"].startswith(OPEN_PREFIXES):
            return True
        given = (header(scope, b"authorization") or "").encode("latin-1")
        return hmac.compare_digest(given, self.expected)
