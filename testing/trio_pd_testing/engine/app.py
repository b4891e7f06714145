"""The engine's HTTP API (a bare ASGI app): the routes of SGLang 0.5.23's http_server.py that a
PD router uses, the three generation endpoints, and POST /abort_request (abort.py).

A generation request is admitted by intake.py, reaches the scheduler after its tokenize window
(tokenizer.dispatch), then runs its role's flow (prefill.py / decode.py) under its work scope.

Disconnects: hypercorn never cancels an app when its client goes away, it only delivers
`http.disconnect` from receive(). Each generation request therefore runs a watcher task. On a
disconnect it logs `connection_closed` at once, drops everything the request would still send,
and reacts as SGLang does (tokenizer.client_left): a stream at once, a non-stream request at its
next disconnect poll; the aborts it sends may be dropped by the latch, and then the engine's
work goes on without a client, as it does in SGLang.
"""

from __future__ import annotations

import contextvars
import logging
import time
from typing import Any

import trio

from trio_pd_testing.engine import failures, info, loads
from trio_pd_testing.engine.abort import handle_abort
from trio_pd_testing.engine.asgi import Responder
from trio_pd_testing.engine.decode import run_decode
from trio_pd_testing.engine.intake import admit
from trio_pd_testing.engine.prefill import run_prefill
from trio_pd_testing.engine.state import Call, EngineState
from trio_pd_testing.engine.tokenize import PATHS as TOKENIZE_PATHS
from trio_pd_testing.engine.tokenize import handle_tokenize
from trio_pd_testing.engine.tokenizer import abort_request, background_abort, client_left, dispatch
from trio_pd_testing.engine.workload import ENDPOINTS

log = logging.getLogger("trio_pd_testing.engine")

INFO_ROUTES: dict[str, tuple[str, ...]] = {
    "/health": ("GET",),
    "/health_generate": ("GET",),
    "/ready": ("GET",),
    "/flush_cache": ("GET", "POST"),
    "/server_info": ("GET",),
    "/get_server_info": ("GET",),
    "/model_info": ("GET",),
    "/get_model_info": ("GET",),
    "/v1/models": ("GET",),
    "/v1/loads": ("GET",),
    "/get_load": ("GET",),
}
DEPRECATED = {"/get_server_info": "/server_info", "/get_model_info": "/model_info"}
_query: contextvars.ContextVar[bytes] = contextvars.ContextVar("query", default=b"")


class EngineApp:
    def __init__(self, engine: EngineState) -> None:
        self.engine = engine
        self.http_port: int | None = None
        self.bootstrap_port: int | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if path in ENDPOINTS:
            allowed = ("POST", "PUT") if path == "/generate" else ("POST",)
            if method not in allowed:
                await failures.method_not_allowed(Responder(send))
                return
            await self.generate(scope, receive, send, ENDPOINTS[path])
            return
        if path == "/abort_request":
            await handle_abort(self.engine, scope, receive, send)
            return
        if path in TOKENIZE_PATHS:
            await handle_tokenize(self.engine, scope, receive, send)
            return
        _query.set(scope.get("query_string", b""))
        await self.info(path, method, send, scope.get("headers", ()))

    # ---- info endpoints --------------------------------------------------------------------
    async def info(self, path: str, method: str, send: Any, headers: Any = ()) -> None:
        """Every non-generation route (router tests wrap this method to watch arrivals)."""
        engine = self.engine
        resp = Responder(send)
        if path.startswith("/v1/models/") and method == "GET":
            await self._model_card(path.removeprefix("/v1/models/"), resp)
            return
        methods = INFO_ROUTES.get(path)
        # An engine before 0.5.23 (`legacy_load_endpoint`) has /get_load and no /v1/loads.
        legacy = engine.config.legacy_load_endpoint
        missing = "/v1/loads" if legacy else "/get_load"
        if methods is None or path == missing:
            if path == missing:
                engine.events.emit("info_request", method=method, path=path, status=404)
            await failures.not_found(resp)
            return
        if method not in methods:
            await failures.method_not_allowed(resp)
            return
        seen = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in headers}
        engine.events.emit("info_request", method=method, path=path, headers=seen)  # probes
        if path in DEPRECATED:
            engine.events.emit("deprecated_endpoint", path=path, use=DEPRECATED[path])
        if path in ("/health", "/health_generate"):
            await resp.empty(await info.health_status(engine))
        elif path == "/ready":
            await resp.empty(info.ready_status(engine))
        elif path == "/flush_cache":
            engine.kv.flush()
            await resp.empty()
        elif path in ("/server_info", "/get_server_info"):
            await resp.json(200, info.server_info(engine, self.http_port, self.bootstrap_port))
        elif path in ("/model_info", "/get_model_info"):
            await resp.json(200, info.model_info(engine))
        elif path == "/v1/models":
            await resp.json(200, info.models(engine))
        elif path == "/v1/loads":
            status, body = loads.v1_loads(engine, _query.get())
            if isinstance(body, str):
                content = b"text/plain; version=0.0.4; charset=utf-8" if status == 200 else None
                await resp.text(status, body, content or b"text/plain; charset=utf-8")
            else:
                await resp.json(status, body)
        else:  # /get_load, kept by --legacy-load-endpoint
            await resp.json(200, loads.legacy_get_load(engine))

    async def _model_card(self, model: str, resp: Responder) -> None:
        card = info.models(self.engine)["data"][0]
        if model != card["id"]:
            error = {
                "message": f"The model '{model}' does not exist",
                "type": "invalid_request_error",
                "param": "model",
                "code": "model_not_found",
            }
            await resp.json(404, {"error": error})
            return
        await resp.json(200, card)

    # ---- generation ------------------------------------------------------------------------
    async def generate(self, scope: dict[str, Any], receive: Any, send: Any, api: str) -> None:
        call = await admit(self.engine, scope, receive, send, api)
        if call is None:
            return  # refused (and answered) or the client left
        w = call.workload
        if w.stream and api == "generate" and not call.output.defer_headers:
            await call.resp.start_stream()  # SGLang's StreamingResponse: 200 before any work
        call.output.on_decided = lambda: _abort_the_rest(call)
        try:
            await self._serve(call, receive)
        finally:
            for item in call.items:
                self.engine.retire(item)
            for rid in call.sglang_rids:
                state = self.engine.rids.get(rid)
                if state is not None and state.owner.call is call:
                    self.engine.rids.release([rid], state.owner)

    async def _serve(self, call: Call, receive: Any) -> None:
        """Run the role's flow under the request's work scope, watching for a disconnect."""
        engine, w, resp = self.engine, call.workload, call.resp
        started = time.monotonic()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch_disconnect, call, receive)
                with call.work_scope:
                    await dispatch(call)
                    await self._run(call)
                if not resp.completed and not call.disconnected and call.ended is None:
                    await call.output.close()
                nursery.cancel_scope.cancel()
        finally:
            for item in call.items:
                engine.retire(item)
            end = call.ended or _abort_ending(call)
            call.emit("request_end", status=resp.status, ended=end)
            if w.stream and not call.disconnected:
                self._schedule_background_abort(call)
            log.info(
                "%s %s %s rooms=%s status=%s%s %.0fms",
                engine.role,
                call.path,
                call.rid,
                w.prompt_rooms,
                resp.status,
                f" ({end})" if end else "",
                (time.monotonic() - started) * 1000,
            )

    async def _run(self, call: Call) -> None:
        try:
            if self.engine.role == "prefill":
                await run_prefill(call)
            else:
                await run_decode(call)
        except Exception:  # a simulator bug must still answer, like a real server would
            log.exception("%s: internal error", call.rid)
            if not call.resp.started:
                await failures.internal_error(call.resp)

    async def _watch_disconnect(self, call: Call, receive: Any) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if call.resp.completed:
            return
        call.disconnected = True
        call.resp.closed = True
        left = trio.current_time()
        call.emit("connection_closed", status=call.resp.status)
        if call.workload.stream:
            self._schedule_background_abort(call)
        await client_left(call, left)
        if call.hanging:
            call.cancel("aborted_disconnect")

    def _schedule_background_abort(self, call: Call) -> None:
        """create_abort_task: attached to a /generate stream always, to an OpenAI stream once its
        first chunk went out."""
        if call.background_abort_scheduled or self.engine.background is None:
            return
        if call.workload.api != "generate" and not call.resp.started:
            return
        call.background_abort_scheduled = True
        self.engine.background.start_soon(background_abort, self.engine, call.sglang_rids)


def _abort_the_rest(call: Call) -> None:
    """The answer failed: SGLang's handler exits and aborts the request's other rids."""
    done = call.output.finished.keys() | call.output.failed
    for item in call.items:
        if item.index in done or item.stage == "done":
            continue
        state = call.engine.rids.get(item.rid)
        if state is not None and state.owner is item and state.dispatched:
            abort_request(call.engine, item.rid, source="cleanup")


def _abort_ending(call: Call) -> str | None:
    reasons = [item.abort_reason for item in call.items if item.abort_reason]
    if reasons:
        return reasons[0]
    if call.cancel_reason and not call.resp.completed:
        return call.cancel_reason
    return None


async def _lifespan(receive: Any, send: Any) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
