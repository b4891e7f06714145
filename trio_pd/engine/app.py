"""The engine's HTTP API (a bare ASGI app): info endpoints and the three generation endpoints.

Disconnects: hypercorn never cancels an app when its client goes away, it only delivers
`http.disconnect` from receive(). Each generation request therefore runs a watcher task. On a
disconnect it logs `connection_closed` at once; a prefill request stops at once, a decode request
is aborted at the engine's next disconnect-poll tick (see slots.DisconnectTicker), which is when
its slots are freed with reason `aborted_disconnect`.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import orjson
import trio

from trio_pd.engine.asgi import BodyTooLarge, Responder, header, read_body
from trio_pd.engine.decode import run_decode
from trio_pd.engine.faults import FaultError, parse_many, plan_for
from trio_pd.engine.prefill import run_prefill
from trio_pd.engine.responses import Shaper
from trio_pd.engine.state import Call, EngineState
from trio_pd.engine.workload import ENDPOINTS, BadRequest, parse_workload

log = logging.getLogger("trio_pd.engine")


class EngineApp:
    def __init__(self, engine: EngineState) -> None:
        self.engine = engine

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
        await self.info(path, method, send)

    # ---- info endpoints --------------------------------------------------------------------
    async def info(self, path: str, method: str, send: Any) -> None:
        engine, cfg = self.engine, self.engine.config
        resp = Responder(send)
        routes: dict[tuple[str, str], Any] = {
            ("GET", "/health"): None,
            ("GET", "/health_generate"): None,
            ("POST", "/flush_cache"): None,
            ("GET", "/get_model_info"): {
                "model_path": cfg.model,
                "tokenizer_path": cfg.model,
                "is_generation": True,
            },
            ("GET", "/v1/models"): {
                "object": "list",
                "data": [{"id": cfg.model, "object": "model", "created": 0, "owned_by": "trio_pd"}],
            },
            ("GET", "/get_load"): {
                "num_reqs": engine.running + engine.queued,
                "num_waiting_reqs": engine.queued,
                "num_tokens": engine.inflight_tokens,
            },
            ("GET", "/get_server_info"): {
                "model_path": cfg.model,
                "disaggregation_mode": cfg.role,
                "disaggregation_bootstrap_port": cfg.bootstrap_port,
                "max_running_requests": cfg.max_running,
                "simulator": "trio_pd.engine",
                "waiting_timeout": cfg.waiting_timeout,
                "bootstrap_timeout": cfg.bootstrap_timeout,
                "disconnect_poll_secs": cfg.disconnect_poll_secs,
                "faults": [f.spec for f in engine.faults],
            },
        }
        key = (method, path)
        if key in routes:
            body = routes[key]
            await (resp.empty() if body is None else resp.json(200, body))
        elif any(p == path for _, p in routes):
            await resp.error(405, f"method {method} not allowed on {path}")
        else:
            await resp.error(404, f"no route {method} {path}")

    # ---- generation ------------------------------------------------------------------------
    async def generate(self, scope: dict[str, Any], receive: Any, send: Any, api: str) -> None:
        engine = self.engine
        rid = header(scope, b"x-request-id") or engine.new_rid()
        path = scope["path"]
        started = time.monotonic()
        hdrs = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}

        def on_start(status: int) -> None:
            engine.events.emit("response_start", rid=rid, room=room, status=status)

        room: int | None = None
        resp = Responder(send, rid, on_start)
        try:
            raw = await read_body(receive)
        except BodyTooLarge:
            await resp.error(413, "request body too large")
            return
        if raw is None:
            return  # the client left before sending its body
        try:
            body = orjson.loads(raw)
            if not isinstance(body, dict):
                raise BadRequest("the request body must be a JSON object")
            workload = parse_workload(api, body)
            faults = parse_many(body.get("sim_fault"))
        except (orjson.JSONDecodeError, BadRequest, FaultError) as exc:
            bad_json = isinstance(exc, orjson.JSONDecodeError)
            message = f"invalid JSON: {exc}" if bad_json else str(exc)
            engine.events.emit(
                "request_start", rid=rid, room=None, path=path, stream=None, body=None, headers=hdrs
            )
            await resp.error(400, message)
            engine.events.emit("request_end", rid=rid, room=None, status=400)
            return
        room = workload.first_room
        call = Call(
            engine=engine,
            rid=rid,
            path=path,
            client=scope.get("client"),
            workload=workload,
            plan=plan_for(engine.role, (*engine.faults, *faults)),
            resp=resp,
            shaper=Shaper(workload, rid, engine.config.model, engine.role),
        )
        call.emit(
            "request_start",
            path=path,
            stream=workload.stream,
            rooms=list(workload.rooms) if workload.rooms else None,
            batch=workload.is_batch,
            body=body,  # as received: lets router tests check injection and pass-through
            headers=hdrs,
        )
        tokens = sum(len(i) for i in workload.inputs) + workload.max_new_tokens * workload.size
        engine.inflight += 1
        engine.inflight_tokens += tokens
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch_disconnect, call, receive)
                with call.work_scope:
                    await self._run(call)
                nursery.cancel_scope.cancel()
        finally:
            engine.inflight -= 1
            engine.inflight_tokens -= tokens
            end = call.ended or (call.cancel_reason if not resp.completed else None)
            call.emit("request_end", status=resp.status, ended=end)
            log.info(
                "%s %s %s rooms=%s status=%s%s %.0fms",
                engine.role,
                path,
                rid,
                workload.rooms,
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
