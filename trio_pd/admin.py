"""Admin and fan-out routes: runtime worker membership, loads, model info.

Membership (`POST /workers`, `GET /workers`, `GET /workers/{id}`, `DELETE /workers/{id}`) and
`POST /flush_cache` are admin routes: when `config.api_key` is set they need
`Authorization: Bearer <api_key>` (401 otherwise, checked before anything else, so an unknown
id is not revealed to an unauthenticated caller). The read-only fan-out routes (`/v1/models`,
`/get_model_info`, `/get_server_info`, `/health_generate`, `/get_loads`) are open, like
`/health`.

A worker added at runtime starts unhealthy and takes traffic after the health checker's first
pass (the checker follows fleet membership). A removed worker is never selected again; requests
already running on it finish.
"""

from __future__ import annotations

import hmac
import ipaddress
from typing import Any
from urllib.parse import urlsplit

import orjson

from trio_pd.asgi import ControlHandler, Receive, Scope, json_reply, read_json_object
from trio_pd.config import WorkerSpec
from trio_pd.control import ControlContext
from trio_pd.errors import RouterError, bad_request, unauthorized
from trio_pd.fanout import (
    handle_flush_cache,
    handle_get_loads,
    handle_health_generate,
    proxy_from_prefill,
)
from trio_pd.respond import JSON_HEADERS, Reply, Responder

WORKERS_PATH = "/workers"
ADMIN_BODY_LIMIT = 64 * 1024
WORKER_TYPES = ("prefill", "decode")


def require_api_key(ctx: ControlContext, scope: Scope) -> None:
    """401 unless the request carries `Authorization: Bearer <config.api_key>` (when one is set)."""
    key = ctx.config.api_key
    if not key:
        return
    given = b""
    for name, value in scope["headers"]:
        if name == b"authorization":
            given = value
            break
    scheme, _, token = given.partition(b" ")
    if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), key.encode()):
        error = unauthorized()
        error.headers = ((b"www-authenticate", b'Bearer realm="trio_pd"'),)
        raise error


def admin(handler: ControlHandler) -> ControlHandler:
    """`handler` behind the API key check."""

    async def guarded(ctx: ControlContext, scope: Scope, receive: Receive, rsp: Responder) -> None:
        require_api_key(ctx, scope)
        await handler(ctx, scope, receive, rsp)

    guarded.__name__ = guarded.__qualname__ = handler.__name__
    return guarded


# -- membership --------------------------------------------------------------------------------


def parse_worker_spec(body: dict[str, Any]) -> WorkerSpec:
    """The `POST /workers` body as a WorkerSpec, or a 400 saying what is wrong."""
    worker_type = body.get("worker_type")
    if worker_type is None:
        raise bad_request("worker_type is required: 'prefill' or 'decode'")
    if worker_type not in WORKER_TYPES:
        raise bad_request(f"worker_type must be 'prefill' or 'decode', not {worker_type!r}")
    url = check_url(body.get("url"))
    port = body.get("bootstrap_port")
    if port is not None:
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            raise bad_request(f"bootstrap_port must be an integer in 1..65535 or null: {port!r}")
        if worker_type == "decode":
            raise bad_request("bootstrap_port applies to prefill workers only")
    return WorkerSpec(url, worker_type, port)


def check_url(url: object) -> str:
    if not isinstance(url, str) or not url:
        raise bad_request("url is required: the worker's base URL, e.g. http://10.0.0.5:30000")
    if any(c.isspace() for c in url):
        raise bad_request(f"url must not contain whitespace: {url!r}")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError as exc:
        raise bad_request(f"url {url!r} is not a valid URL: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise bad_request(f"url must start with http:// or https://: {url!r}")
    if not parts.hostname:
        raise bad_request(f"url has no host: {url!r}")
    if parts.query or parts.fragment or parts.username or parts.password:
        raise bad_request(f"url must not carry a query, fragment or credentials: {url!r}")
    if "[" in parts.netloc:
        try:
            ipaddress.IPv6Address(parts.hostname)
        except ValueError:
            raise bad_request(f"url has an invalid IPv6 host: {url!r}") from None
    return url


async def add_worker(ctx: ControlContext, scope: Scope, receive: Receive, rsp: Responder) -> None:
    body = await read_json_object(scope, receive, ADMIN_BODY_LIMIT)
    spec = parse_worker_spec(body)
    try:
        worker = ctx.fleet.add(spec)
    except ValueError as exc:
        raise RouterError(409, str(exc), "conflict") from None
    headers = [*JSON_HEADERS, (b"location", f"{WORKERS_PATH}/{worker.id}".encode())]
    await rsp.reply(Reply(201, headers, orjson.dumps(worker.to_json())))


async def list_workers(ctx: ControlContext, scope: Scope, receive: Receive, rsp: Responder) -> None:
    workers = ctx.fleet.to_json()
    await json_reply(rsp, 200, {"workers": workers, "total": len(workers)})


def worker_id_of(ctx: ControlContext, scope: Scope) -> str:
    worker_id = scope["path"][len(WORKERS_PATH) + 1 :]
    try:
        ctx.fleet.get(worker_id)
    except KeyError:
        raise RouterError(404, f"no worker {worker_id!r}", "not_found_error") from None
    return worker_id


async def get_worker(ctx: ControlContext, scope: Scope, receive: Receive, rsp: Responder) -> None:
    worker = ctx.fleet.get(worker_id_of(ctx, scope))
    await json_reply(rsp, 200, worker.to_json())


async def delete_worker(
    ctx: ControlContext, scope: Scope, receive: Receive, rsp: Responder
) -> None:
    worker = ctx.fleet.remove(worker_id_of(ctx, scope))
    await json_reply(rsp, 200, {**worker.to_json(), "removed": True})


ADMIN_ROUTES: dict[str, dict[str, ControlHandler]] = {
    WORKERS_PATH: {"GET": admin(list_workers), "POST": admin(add_worker)},
    "/flush_cache": {"POST": admin(handle_flush_cache)},
    "/get_loads": {"GET": handle_get_loads},
    "/health_generate": {"GET": handle_health_generate},
    "/v1/models": {"GET": proxy_from_prefill},
    "/get_model_info": {"GET": proxy_from_prefill},
    "/get_server_info": {"GET": proxy_from_prefill},
}
WORKER_ITEM_ROUTES: dict[str, ControlHandler] = {
    "GET": admin(get_worker),
    "DELETE": admin(delete_worker),
}
