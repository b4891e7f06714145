"""Endpoints the router answers by asking its workers (as SGLang's router has them).

- `GET /v1/models`, `/get_model_info`, `/get_server_info`: proxied from one available prefill
  worker (random order; a worker that cannot be reached is skipped for the next one); the
  worker's status, content type and body are relayed as they are. 503 when no prefill is
  available, 502 when none of them answered.
- `GET /health_generate`: `GET /health_generate` on one available prefill and one available
  decode at the same time (SMG's PD behaviour). It does not go through dispatch: no bootstrap
  room is spent, no policy state or circuit breaker is touched. 200 when both answer 2xx,
  else 503; the body says what each one answered.
- `POST /flush_cache`, `GET /get_loads`: every registered worker (healthy or not) concurrently,
  in one nursery. The call itself answers 200; each worker's entry says whether it worked and
  carries its error if not, so one dead worker does not hide the others' results. `/get_loads`
  asks each engine's `/v1/loads` (`/get_load` on engines before SGLang 0.5.23,
  `engine_info.py`), shows the old figures (`num_reqs`, `num_waiting_reqs`, `num_tokens`) and
  every DP rank's, and feeds each answer to `worker.report_load`.

Every upstream call uses the router's pooled client under a trio timeout of
`config.health.timeout_secs`, and carries the request id and the client's forwarded headers.
"""

from __future__ import annotations

import logging
from typing import Any

import attrs
import httpx2
import orjson
import trio

from trio_pd.asgi import Receive, Scope, json_reply
from trio_pd.control.context import ControlContext
from trio_pd.control.engine_info import (
    EngineAnswerError,
    EngineInfoError,
    LoadReportRejected,
    fetch_load,
)
from trio_pd.errors import RouterError, no_worker
from trio_pd.fleet.worker import Worker
from trio_pd.respond import Reply, Responder
from trio_pd.spec import ROLES
from trio_pd.upstream.headers import forwarded_headers

log = logging.getLogger(__name__)

MAX_BODY = 4 << 20  # an info answer larger than this is refused (they are a few hundred bytes)


@attrs.frozen
class Call:
    """What one upstream call gave: a status and body, or an error message (never both)."""

    status: int | None = None
    body: bytes = b""
    content_type: str = "application/json"
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300


def upstream_headers(
    ctx: ControlContext, scope: Scope, responder: Responder
) -> list[tuple[bytes, bytes]]:
    """The request id and tracing headers (less any carrying one of the router's keys); never
    the caller's authorization, which on these routes is a control-plane key (each worker gets
    its own key in `call_worker`)."""
    headers = [(b"x-request-id", responder.request_id)]
    headers.extend(forwarded_headers(scope["headers"], ctx.router_keys))
    return headers


async def call_worker(
    ctx: ControlContext,
    worker: Worker,
    method: str,
    path: str,
    headers: list[tuple[bytes, bytes]],
) -> Call:
    """One request to one worker under the health timeout; failures become `Call.error`."""
    client = ctx.http
    timeout = ctx.config.health.timeout_secs
    headers = [*headers, *ctx.authorization(worker)]
    with trio.move_on_after(timeout):
        try:
            async with client.stream(method, worker.url + path, headers=headers) as response:
                body = b""
                async for chunk in response.aiter_raw():
                    body += chunk
                    if len(body) > MAX_BODY:
                        return Call(error=f"answer larger than {MAX_BODY} bytes")
                content_type = response.headers.get("content-type", "application/json")
                return Call(response.status_code, body, content_type)
        except httpx2.HTTPError as exc:
            text = str(exc)
            return Call(error=f"{type(exc).__name__}: {text}" if text else type(exc).__name__)
    return Call(error=f"timed out after {timeout}s")


def entry(worker: Worker, call: Call) -> dict[str, Any]:
    """A worker's line in a fan-out answer."""
    item: dict[str, Any] = {
        "id": worker.id,
        "url": worker.url,
        "worker_type": worker.role,
        "ok": call.ok,
        "status": call.status,
    }
    if not call.ok:
        item["error"] = call.error or upstream_error_text(call)
    return item


def upstream_error_text(call: Call) -> str:
    try:
        parsed = orjson.loads(call.body)
    except orjson.JSONDecodeError:
        parsed = None
    if isinstance(parsed, dict):
        error = parsed.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str) and error:
            return error
    text = call.body[:200].decode("utf-8", "replace").strip()
    return f"worker answered {call.status}" + (f": {text}" if text else "")


async def fan_out(
    ctx: ControlContext,
    workers: list[Worker],
    method: str,
    path: str,
    headers: list[tuple[bytes, bytes]],
) -> list[Call]:
    """The same call on every worker concurrently, in one nursery; results in `workers` order."""
    results: list[Call] = [Call(error="not called")] * len(workers)

    async def one(index: int, worker: Worker) -> None:
        results[index] = await call_worker(ctx, worker, method, path, headers)

    async with trio.open_nursery() as nursery:
        for index, worker in enumerate(workers):
            nursery.start_soon(one, index, worker)
    return results


# -- proxied from one prefill -----------------------------------------------------------------


async def proxy_from_prefill(
    ctx: ControlContext, scope: Scope, receive: Receive, responder: Responder
) -> None:
    """Relay one available prefill worker's answer to the same GET."""
    candidates = ctx.fleet.available("prefill")
    if not candidates:
        raise no_worker("no available prefill worker to answer " + scope["path"])
    ctx.rng.shuffle(candidates)
    headers = upstream_headers(ctx, scope, responder)
    failures = []
    for worker in candidates:
        call = await call_worker(ctx, worker, "GET", scope["path"], headers)
        if call.status is not None:
            content_type = call.content_type.encode("latin-1")
            body = redacted(call.body) if scope["path"] in INFO_PATHS else call.body
            await responder.reply(Reply(call.status, [(b"content-type", content_type)], body))
            return
        log.info("%s from %s (%s) failed: %s", scope["path"], worker.id, worker.url, call.error)
        failures.append(f"{worker.id}: {call.error}")
    raise RouterError(
        502, f"no prefill worker answered {scope['path']}: {'; '.join(failures)}", "upstream_error"
    )


# The engine's server info lists its resolved server args: its `api_key` and `admin_api_key`
# among them. They are the workers' secrets, and these routes are open without control-plane
# keys: a string value under a secret's name is replaced before the answer leaves the router.
INFO_PATHS = frozenset(("/get_server_info", "/server_info"))
SECRET_SUFFIXES = ("api_key", "_secret", "password", "_token", "_credentials")
REDACTED = "<redacted by trio-pd>"


def redacted(body: bytes) -> bytes:
    """`body` with every string value under a secret's name replaced (any depth); a body that
    is not JSON is replaced whole (it cannot be checked)."""
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return orjson.dumps({"error": {"message": "the worker's answer is not JSON",
                                       "type": "upstream_error", "code": 502}})  # fmt: skip
    changed = _redact(parsed)
    return orjson.dumps(parsed) if changed else body


def _redact(value: Any, depth: int = 0) -> bool:
    changed = False
    if depth > 32:
        return changed
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(item, str) and item and str(key).lower().endswith(SECRET_SUFFIXES):
                value[key] = REDACTED
                changed = True
            else:
                changed = _redact(item, depth + 1) or changed
    elif isinstance(value, list):
        for item in value:
            changed = _redact(item, depth + 1) or changed
    return changed


async def handle_models(
    ctx: ControlContext, scope: Scope, receive: Receive, responder: Responder
) -> None:
    """`GET /v1/models`: one model, as a prefill worker answers it (unchanged, zero
    configuration); several, the router's own list of every model its workers serve."""
    models = ctx.fleet.models()
    if len(models) <= 1:
        await proxy_from_prefill(ctx, scope, receive, responder)
        return
    data = [{"id": m, "object": "model", "created": 0, "owned_by": "trio_pd"} for m in models]
    await json_reply(responder, 200, {"object": "list", "data": data})


# -- one pair ----------------------------------------------------------------------------------


async def handle_health_generate(
    ctx: ControlContext, scope: Scope, receive: Receive, responder: Responder
) -> None:
    pair: list[Worker] = []
    for role in ROLES:
        candidates = ctx.fleet.available(role)
        if not candidates:
            raise no_worker(f"no available {role} worker for /health_generate")
        pair.append(ctx.rng.choice(candidates))
    headers = upstream_headers(ctx, scope, responder)
    calls = await fan_out(ctx, pair, "GET", "/health_generate", headers)
    ok = all(c.ok for c in calls)
    body: dict[str, Any] = {"status": "ok" if ok else "unhealthy"}
    for worker, call in zip(pair, calls, strict=True):
        body[worker.role] = entry(worker, call)
    if not ok:
        failed = [f"{w.role} {w.id}" for w, c in zip(pair, calls, strict=True) if not c.ok]
        body["error"] = {
            "message": f"/health_generate failed on {' and '.join(failed)}",
            "type": "service_unavailable",
            "code": 503,
        }
    await json_reply(responder, 200 if ok else 503, body)


# -- every worker ------------------------------------------------------------------------------


async def handle_flush_cache(
    ctx: ControlContext, scope: Scope, receive: Receive, responder: Responder
) -> None:
    workers = ctx.fleet.workers()
    headers = upstream_headers(ctx, scope, responder)
    calls = await fan_out(ctx, workers, "POST", "/flush_cache", headers)
    items = [entry(w, c) for w, c in zip(workers, calls, strict=True)]
    await json_reply(responder, 200, summary(items))


async def handle_get_loads(
    ctx: ControlContext, scope: Scope, receive: Receive, responder: Responder
) -> None:
    """Every worker's load as its engine reports it (`/v1/loads`, `/get_load` on engines before
    SGLang 0.5.23), concurrently; each answer also feeds `worker.report_load`."""
    workers = ctx.fleet.workers()
    headers = upstream_headers(ctx, scope, responder)
    items: list[dict[str, Any]] = [{} for _ in workers]

    async def one(index: int, worker: Worker) -> None:
        item: dict[str, Any] = {"id": worker.id, "url": worker.url, "worker_type": worker.role}
        leg = [*headers, *ctx.authorization(worker)]
        timeout = ctx.config.health.timeout_secs
        error = f"timed out after {timeout}s"
        with trio.move_on_after(timeout):
            try:
                load = await fetch_load(ctx.http, worker.url, leg, worker.legacy_load)
            except EngineAnswerError as exc:
                error, item["status"] = str(exc), exc.status
            except LoadReportRejected as exc:
                error = f"load report refused: {exc}"
                ctx.fleet.reject_load(worker, exc.reason, str(exc))
            except EngineInfoError as exc:
                error = f"unreadable load answer: {exc}"
            except httpx2.HTTPError as exc:
                error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            else:
                item.update(ok=True, status=200, load=load.requests, **load.to_json())
                if not worker.removed:
                    worker.report_load(load)
                items[index] = item
                return
        item.update(ok=False, load=None, error=error)
        item.setdefault("status", None)
        items[index] = item

    async with trio.open_nursery() as nursery:
        for index, worker in enumerate(workers):
            nursery.start_soon(one, index, worker)
    await json_reply(responder, 200, summary(items))


def summary(items: list[dict[str, Any]]) -> dict[str, Any]:
    failed = sum(1 for item in items if not item["ok"])
    return {"workers": items, "ok": len(items) - failed, "failed": failed}
