"""`--api-key` / `--admin-api-key`: SGLang's key check in front of the engine's HTTP API.

SGLang 0.5.23 (`utils/auth.py` `decide_request_auth`, added only when a key is configured):
- always open: OPTIONS, and paths starting with /health, /ready or /metrics;
- NORMAL routes (generation, info): need `Authorization: Bearer <api_key>` when an api_key is
  set (the admin key does not unlock them), open otherwise, even with an admin key alone;
- ADMIN_OPTIONAL routes (/abort_request, /flush_cache): open without keys; with only api_key
  they need it; with an admin_api_key they need THAT key and refuse the ordinary one.
A refusal is 401 `{"error": "Unauthorized"}` and logs `unauthorized` (path, method; `rid` is
the x-request-id header, if any). The prefill's bootstrap server is not behind it.
"""

from __future__ import annotations

import secrets
from typing import Any

from trio_pd_testing.engine.asgi import Responder, header
from trio_pd_testing.engine.events import EventLog
from trio_pd_testing.engine.httpserver import ASGIApp

OPEN_PREFIXES = ("/health", "/ready", "/metrics")
ADMIN_OPTIONAL = frozenset({"/abort_request", "/flush_cache"})


def bearer_matches(authorization: str | None, expected: str) -> bool:
    if not authorization:
        return False
    parts = authorization.split(" ", 1)
    if len(parts) != 2 or parts[0].lower() != "bearer":
        return False
    return secrets.compare_digest(parts[1], expected)


def allowed(
    method: str,
    path: str,
    authorization: str | None,
    api_key: str | None,
    admin_api_key: str | None,
) -> bool:
    if method == "OPTIONS" or path.startswith(OPEN_PREFIXES):
        return True
    if path in ADMIN_OPTIONAL:
        if admin_api_key:
            return bearer_matches(authorization, admin_api_key)
        return bearer_matches(authorization, api_key) if api_key else True
    return bearer_matches(authorization, api_key) if api_key else True


class ApiKeyGate:
    def __init__(
        self, app: ASGIApp, api_key: str | None, admin_api_key: str | None, events: EventLog
    ) -> None:
        self.app = app
        self.api_key = api_key or None
        self.admin_api_key = admin_api_key or None
        self.events = events

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or allowed(
            scope["method"],
            scope["path"],
            header(scope, b"authorization"),
            self.api_key,
            self.admin_api_key,
        ):
            await self.app(scope, receive, send)
            return
        rid = header(scope, b"x-request-id")
        self.events.emit("unauthorized", rid=rid, path=scope["path"], method=scope["method"])
        await Responder(send, rid).json(401, {"error": "Unauthorized"})
