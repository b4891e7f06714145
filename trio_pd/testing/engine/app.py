"""The engine's HTTP API (a bare ASGI app): info endpoints, the three generation endpoints and
POST /abort_request (abort.py). A generation request is admitted by intake.py, then runs here.

Disconnects: hypercorn never cancels an app when its client goes away, it only delivers
`http.disconnect` from receive(). Each generation request therefore runs a watcher task. On a
disconnect it logs `connection_closed` at once; a prefill request stops at once, a decode request
is aborted at the engine's next disconnect-poll tick (see slots.DisconnectTicker), which is when
its slots are freed with reason `aborted_disconnect`. POST /abort_request cancels the same work
scope at once (reason `aborted_request`) and the request then answers an abort if it still can.
"""

from __future__ import annotations

import contextvars
import logging
import time
from typing import Any

import trio

from trio_pd.testing.engine import info, loads
from trio_pd.testing.engine.abort import ABORTED, answer_aborted, handle_abort
from trio_pd.testing.engine.asgi import Responder
from trio_pd.testing.engine.decode import run_decode
from trio_pd.testing.engine.intake import admit
from trio_pd.testing.engine.prefill import run_prefill
from trio_pd.testing.engine.state import Call, EngineState
from trio_pd.testing.engine.workload import ENDPOINTS

log = logging.getLogger("trio_pd.testing.engine")


DEPRECATED = {"/get_server_info": "/server_info", "/get_model_info": "/model_info"}
_query: contextvars.ContextVar[bytes] = contextvars.ContextVar("query", default=b"")


class EngineApp:
    def __init__(self, engine: EngineState) -> None:
        self.engine = engine
        self.http_port: int | None = None  # set once the listeners are bound
        self.bootstrap_port: int | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if path in ENDPOINTS:
            if method != "POST":
                await Responder(send).error(405, f"{path} takes POST")
                return
            await self.generate(scope, receive, send, ENDPOINTS[path])
            return
        if path == "/abort_request":
            await handle_abort(self.engine, scope, receive, send)
            return
        _query.set(scope.get("query_string", b""))
        await self.info(path, method, send)

    # ---- info endpoints --------------------------------------------------------------------
    async def info(self, path: str, method: str, send: Any) -> None:
        """Every non-generation route (router tests wrap this method to watch arrivals)."""
        engine = self.engine
        resp = Responder(send)
        routes: dict[tuple[str, str], Any] = {
            ("GET", "/health"): None,
            ("GET", "/health_generate"): None,
            ("POST", "/flush_cache"): None,
            ("GET", "/model_info"): lambda: info.model_info(engine),
            ("GET", "/get_model_info"): lambda: info.model_info(engine),
            ("GET", "/v1/models"): lambda: info.models(engine),
            ("GET", "/server_info"): lambda: info.server_info(
                engine, self.http_port, self.bootstrap_port
            ),
            ("GET", "/get_server_info"): lambda: info.server_info(
                engine, self.http_port, self.bootstrap_port
            ),
        }
        if engine.config.legacy_load_endpoint:
            routes["GET", "/get_load"] = lambda: loads.legacy_get_load(engine)
        key = (method, path)
        if key == ("GET", "/v1/loads"):
            engine.events.emit("info_request", method=method, path=path)
            status, body = loads.v1_loads(engine, _query.get())
            if isinstance(body, str):
                kind = b"text/plain; version=0.0.4; charset=utf-8" if status == 200 else None
                await resp.text(status, body, kind or b"text/plain; charset=utf-8")
            else:
                await resp.json(status, body)
        elif key in routes:
            engine.events.emit("info_request", method=method, path=path)  # probes, polls
            if path in DEPRECATED:  # SGLang logs a deprecation warning on every call
                engine.events.emit("deprecated_endpoint", path=path, use=DEPRECATED[path])
            make = routes[key]
            if path == "/health" and engine.health_status != 200:
                await resp.error(engine.health_status, "the engine is not ready")
                return
            await (resp.empty() if make is None else resp.json(200, make()))
        elif path == "/get_load":  # gone in SGLang 0.5.23: FastAPI's 404
            engine.events.emit("info_request", method=method, path=path, status=404)
            await resp.json(404, {"detail": "Not Found"})
        elif any(p == path for _, p in routes):
            await resp.error(405, f"method {method} not allowed on {path}")
        else:
            await resp.error(404, f"no route {method} {path}")

    # ---- generation ------------------------------------------------------------------------
    async def generate(self, scope: dict[str, Any], receive: Any, send: Any, api: str) -> None:
        call = await admit(self.engine, scope, receive, send, api)
        if call is None:
            return  # refused (and answered) or the client left
        try:
            await self._serve(call, receive)
        finally:
            self.engine.rids.release(call.sglang_rids, call)  # (if _serve did not get to it)

    async def _serve(self, call: Call, receive: Any) -> None:
        """Run the role's flow under the request's work scope, watching for a disconnect."""
        engine, w, resp = self.engine, call.workload, call.resp
        started = time.monotonic()
        tokens = sum(len(i) for i in w.inputs) + w.max_new_tokens * w.size
        engine.inflight += 1
        engine.inflight_tokens += tokens
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch_disconnect, call, receive)
                with call.work_scope:
                    await self._run(call)
                if call.cancel_reason == ABORTED and not resp.completed:
                    await answer_aborted(call)
                # before the next checkpoint: a client holding its answer may reuse the rid
                engine.rids.release(call.sglang_rids, call)
                nursery.cancel_scope.cancel()
        finally:
            engine.inflight -= 1
            engine.inflight_tokens -= tokens
            end = call.ended or (call.cancel_reason if not resp.completed else None)
            call.emit("request_end", status=resp.status, ended=end)
            log.info(
                "%s %s %s rooms=%s status=%s%s %.0fms",
                engine.role,
                call.path,
                call.rid,
                w.rooms,
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
        except Exception as exc:  # a simulator bug must still answer, like a real server would
            log.exception("%s: internal error", call.rid)
            if not call.resp.completed:
                await call.resp.error(500, f"internal simulator error: {exc!r}")

    async def _watch_disconnect(self, call: Call, receive: Any) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if call.resp.completed:
            return
        call.disconnected = True
        call.emit("connection_closed", status=call.resp.status)
        if self.engine.role == "prefill":
            call.cancel("aborted_disconnect")
            return
        await self.engine.ticker.wait_next_tick()
        call.cancel("aborted_disconnect")


async def _lifespan(receive: Any, send: Any) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
