"""serve_engine(): run one simulated engine (HTTP API + prefill bootstrap server) in a nursery."""

from __future__ import annotations

import logging
from typing import Any

import attrs
import trio

from trio_pd_testing.engine.app import EngineApp
from trio_pd_testing.engine.auth import ApiKeyGate
from trio_pd_testing.engine.bootstrap import BootstrapApp, bootstrap_client
from trio_pd_testing.engine.config import EngineConfig
from trio_pd_testing.engine.events import EventLog
from trio_pd_testing.engine.heartbeat import Heartbeat
from trio_pd_testing.engine.httpserver import ASGIApp, ConnectionRegistry, serve_asgi
from trio_pd_testing.engine.state import EngineState
from trio_pd_testing.engine.tls import server_ssl_context

log = logging.getLogger("trio_pd_testing.engine")


@attrs.define(eq=False)
class EngineHandle:
    """What serve_engine reports once the engine listens."""

    config: EngineConfig
    port: int
    bootstrap_port: int | None
    state: EngineState = attrs.field(repr=False)

    @property
    def role(self) -> str:
        return self.config.role

    @property
    def host(self) -> str:
        return self.config.host

    @property
    def url(self) -> str:
        host = self.config.host
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"{self.config.scheme}://{host}:{self.port}"

    @property
    def events(self) -> EventLog:
        return self.state.events

    @property
    def running(self) -> int:
        """Decode: slots in use (KV still held by an aborted transfer included). Prefill: engine
        requests at the scheduler, not yet done."""
        return self.state.running

    @property
    def queued(self) -> int:
        """Decode: requests waiting for a slot. Prefill: always 0."""
        return self.state.queued

    @property
    def open_connections(self) -> int:
        """Client TCP connections currently open to the HTTP port (exact, from the accept loop)."""
        return len(self.state.connections)

    async def wait_open_connections(self, count: int = 0, timeout: float = 10.0) -> None:  # noqa: ASYNC109
        """Wait until exactly `count` client connections are open; trio.TooSlowError on timeout."""
        with trio.fail_after(timeout):
            await self.state.connections.wait_count(count)

    @property
    def total_connections(self) -> int:
        return self.state.connections.total

    @property
    def rooms(self) -> dict[int, Any]:
        """Prefill: rooms currently known to the bootstrap server (registered or awaited), each
        mapped to its entries per data-parallel rank."""
        return self.state.rooms.rooms

    def set_faults(self, specs: tuple[str, ...] | list[str]) -> None:
        """Replace the process-wide faults (ValueError on a bad spec; `refuse` has no effect)."""
        self.state.set_faults(specs)


async def serve_engine(
    config: EngineConfig, *, task_status: trio.TaskStatus[EngineHandle] = trio.TASK_STATUS_IGNORED
) -> None:
    """Run until cancelled; `await nursery.start(serve_engine, cfg)` returns the EngineHandle."""
    events = EventLog(config.role, config.events_path)
    state = EngineState(config, events)
    refuse = any(f.kind == "refuse" and f.role in (None, config.role) for f in state.faults)
    try:
        async with trio.open_nursery() as nursery:
            state.background = nursery
            state.kv.start(nursery)
            bootstrap_port = None
            if config.role == "prefill" and config.bootstrap_port is not None:
                bootstrap = BootstrapApp(
                    state.rooms,
                    events,
                    config.num_dp_ranks,
                    follow_room=config.load_balance_method_resolved == "follow_bootstrap_room",
                )
                bootstrap_port = await nursery.start(_serve_bootstrap, bootstrap, config)
            elif config.role == "decode":
                state.bootstrap_client = bootstrap_client()
                state.heartbeat = Heartbeat(
                    config, events, state.bootstrap_client, lambda: list(state.live)
                )
                nursery.start_soon(state.heartbeat.run)
            engine_app = EngineApp(state)
            engine_app.bootstrap_port = bootstrap_port
            app: ASGIApp = engine_app
            if config.api_key or config.admin_api_key:  # like SGLang, an empty key means none
                app = ApiKeyGate(app, config.api_key, config.admin_api_key, events)
            port = await nursery.start(_serve_http, app, config, state.connections, not refuse)
            engine_app.http_port = port
            log.info(
                "%s engine on %s://%s:%s%s%s",
                config.role,
                config.scheme,
                config.host,
                port,
                f" bootstrap port {bootstrap_port}" if bootstrap_port else "",
                " (refusing connections)" if refuse else "",
            )
            task_status.started(EngineHandle(config, port, bootstrap_port, state))
    finally:
        state.stopping = True
        state.kv.close()
        with trio.CancelScope(shield=True):
            if state.bootstrap_client is not None:
                await state.bootstrap_client.aclose()
        events.close()


async def _serve_bootstrap(
    app: BootstrapApp, config: EngineConfig, *, task_status: trio.TaskStatus[int]
) -> None:
    await serve_asgi(
        app,
        config.host,
        config.bootstrap_port or 0,
        ConnectionRegistry(),
        keep_alive_secs=config.keep_alive_secs,
        task_status=task_status,
    )


async def _serve_http(
    app: ASGIApp,
    config: EngineConfig,
    registry: ConnectionRegistry,
    listen: bool,
    *,
    task_status: trio.TaskStatus[int],
) -> None:
    await serve_asgi(
        app,
        config.host,
        config.port,
        registry,
        keep_alive_secs=config.keep_alive_secs,
        listen=listen,
        ssl_context=server_ssl_context(config),
        task_status=task_status,
    )
