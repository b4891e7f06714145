"""The simulator's vLLM mode: one vLLM OpenAI server with NixlConnector (pull), no model.

Faithful to what a PD router can observe of vLLM 0.33.0 (`vllm/...` of its wheel; docs/vllm.md
cites each fact), and like the SGLang simulator it imports nothing of the router:

- A request's role comes from its `kv_transfer_params`, as on a `kv_both` engine:
  `do_remote_decode: true` makes it a **prefill** for a remote decode (the engine computes the
  prompt, answers one token and a top-level `kv_transfer_params`, and holds the prompt's blocks
  under a lease, `vllm_kv.py`); `do_remote_prefill: true` with the prefill's fields makes it a
  **decode** (it heartbeats the prefill from admission, reads the blocks, generates); anything
  else is a plain local request.
- The OpenAI validation a PD router trips on: `stream_options` without `stream: true`, and
  `min_tokens > max_tokens`, are 400s (`entrypoints/openai/*/protocol.py`,
  `sampling_params.py`), in vLLM's `ErrorResponse` shape.
- A closed connection aborts the request (vLLM cancels its handler): a prefill still computing
  frees its blocks at once; a decode that has not read yet sends the prefill the notice that
  frees them (`request_finished` with `do_remote_prefill` still set).
- A decode that asks `prompt_logprobs` skips the remote blocks (`skip_reading_prefix_cache`,
  `sampling_params.py`, `v1/core/sched/scheduler.py`): it recomputes the prompt and sends the
  empty-read notice.
- A failed KV read: `kv_load_failure_policy` `fail` (vLLM's default) answers 500
  `InternalServerError` (non-stream) or an error chunk inside the 200 stream
  (`GenerationError`, `entrypoints/generate/base/serving.py`); `recompute` computes the prompt
  locally.

Where it deliberately differs: the NIXL side channel and the transfer are plain HTTP on the
engine's own port (`/sim/nixl/{read,notify,heartbeat}`; `remote_host`/`remote_port` name it);
tokens are words; `sim_fault` (`[prefill:|decode:]KIND[:ARG]`, comma-separated: `status:N`,
`close`, `hang`, `no_params`, `bad_handoff:metadata|no_blocks|port`, `kv_fail`,
`stream_error:N`, `die@Ntok`: the whole engine dies as a SIGKILLed server once its answer
streamed N tokens; `hold@Ntok`: the stream goes silent after its N-th token until
`state.release_held()`) injects faults; a completions stream with `return_token_ids` carries each
chunk's `token_ids` and the first one's `prompt_token_ids`, and a token-id prompt ending with
the answer's first tokens (a migrated request) goes on after them; `GET /sim/kv_blocks`
shows the pool, so a test sees a leak; the event log (`events.py`) records what happened.

Here: serving one engine and its command line; the app and its legs are `vllm_app.py`, a
request and its refusals `vllm_request.py`, the configuration and state `vllm_state.py`, the KV
blocks and leases `vllm_kv.py`.
"""

from __future__ import annotations

import contextlib
import logging

import attrs
import httpx2
import trio

from trio_pd_testing.engine.events import EventLog
from trio_pd_testing.engine.httpserver import ConnectionRegistry, serve_asgi
from trio_pd_testing.engine.vllm_app import VllmApp
from trio_pd_testing.engine.vllm_kv import BlockPool
from trio_pd_testing.engine.vllm_state import FAILURE_POLICIES, VERSION, VllmEngineConfig, VllmState

__all__ = ["VERSION", "VllmEngineConfig", "VllmEngineHandle", "main", "serve_vllm_engine"]

log = logging.getLogger("trio_pd_testing.engine.vllm")


@attrs.define(eq=False)
class VllmEngineHandle:
    config: VllmEngineConfig
    port: int
    state: VllmState = attrs.field(repr=False)
    connections: ConnectionRegistry = attrs.field(repr=False)
    role: str = "prefill"  # what the test cluster registers it as (the engine is kv_both)

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    @property
    def bootstrap_port(self) -> None:
        return None

    @property
    def events(self) -> EventLog:
        return self.state.events

    @property
    def pool(self) -> BlockPool:
        return self.state.pool

    @property
    def held_blocks(self) -> int:
        """Blocks held for decodes now (0 once every handoff was read, refused or expired)."""
        return self.state.pool.held

    @property
    def open_connections(self) -> int:
        return len(self.connections)

    def set_faults(self, specs: tuple[str, ...] | list[str]) -> None:
        self.state.faults = tuple(specs)

    async def wait_blocks_free(self, timeout: float = 10.0) -> None:  # noqa: ASYNC109
        """Until no block is held or computing; trio.TooSlowError after `timeout`."""
        with trio.fail_after(timeout):
            while self.state.pool.in_use:
                await self.state.pool.wait_changed()


async def _reap_leases(state: VllmState) -> None:
    """Expired leases free their blocks (base_worker._reap_expired_send_leases)."""
    pool = state.pool
    while True:
        next_at = pool.next_expiry()
        with trio.move_on_at(min(next_at, trio.current_time() + 3600)):
            await pool.wait_changed()
            continue
        for lease in pool.expire(trio.current_time()):
            state.events.emit("blocks_freed", rid=None, engine_rid=lease.request_id,
                              reason="expired", blocks=lease.blocks)  # fmt: skip


async def serve_vllm_engine(
    config: VllmEngineConfig,
    role: str = "prefill",
    *,
    task_status: trio.TaskStatus[VllmEngineHandle] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run until cancelled; `await nursery.start(serve_vllm_engine, cfg)` gives the handle."""
    if config.kv_load_failure_policy not in FAILURE_POLICIES:
        raise ValueError(f"kv_load_failure_policy must be one of {FAILURE_POLICIES}")
    events = EventLog(role, config.events_path)
    pool = BlockPool(config.num_blocks, config.kv_lease_duration, config.fixed_lease)
    state = VllmState(config, events, pool, faults=config.faults)
    state.client = httpx2.AsyncClient(trust_env=False, timeout=httpx2.Timeout(5.0))
    connections = ConnectionRegistry()
    app = VllmApp(state, connections)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_reap_leases, state)
            port = await nursery.start(
                lambda task_status: serve_asgi(
                    app, config.host, config.port, connections,
                    keep_alive_secs=config.keep_alive_secs, task_status=task_status,
                )
            )  # fmt: skip
            state.port = port
            log.info("vLLM-mode engine (%s) on http://%s:%s", role, config.host, port)
            task_status.started(VllmEngineHandle(config, port, state, connections, role))
    finally:
        with trio.CancelScope(shield=True):
            await state.client.aclose()
        events.close()


def main(argv: list[str] | None = None) -> None:
    """`python -m trio_pd_testing.engine.vllm --port N [...]`: one vLLM-mode engine process."""
    import argparse

    parser = argparse.ArgumentParser(prog="trio_pd_testing.engine.vllm", description=__doc__)
    defaults = VllmEngineConfig()
    add = parser.add_argument
    add("--host", default=defaults.host)
    add("--port", type=int, default=8000)
    add("--role", default="prefill", help="a label for the event log (the engine is kv_both)")
    add("--num-blocks", type=int, default=defaults.num_blocks)
    add("--kv-lease-duration", type=float, default=defaults.kv_lease_duration)
    add("--fixed-lease", action="store_true", help="the old fixed lease (no heartbeats)")
    add("--kv-load-failure-policy", choices=FAILURE_POLICIES, default="fail")
    add("--prefill-ms-per-token", type=float, default=0.0)
    add("--inter-token-ms", type=float, default=0.0)
    add("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    add("--fault", action="append", default=[], help="a process-wide sim_fault spec")
    add("--events", default=None, help="mirror the event log to this JSON-lines file")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    config = VllmEngineConfig(
        host=args.host, port=args.port, num_blocks=args.num_blocks,
        kv_lease_duration=args.kv_lease_duration, fixed_lease=args.fixed_lease,
        kv_load_failure_policy=args.kv_load_failure_policy,
        prefill_ms_per_token=args.prefill_ms_per_token, inter_token_ms=args.inter_token_ms,
        max_num_seqs=args.max_num_seqs, faults=tuple(args.fault), events_path=args.events,
    )  # fmt: skip
    with contextlib.suppress(KeyboardInterrupt):
        trio.run(serve_vllm_engine, config, args.role)


if __name__ == "__main__":
    main()
