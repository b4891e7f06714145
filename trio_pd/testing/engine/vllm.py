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
`close`, `hang`, `no_params`, `kv_fail`, `stream_error:N`) injects faults; `GET /sim/kv_blocks`
shows the pool, so a test sees a leak; the event log (`events.py`) records what happened.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
import uuid
from typing import Any

import attrs
import httpx2
import orjson
import trio

from trio_pd.testing.engine.asgi import Responder, header, read_body
from trio_pd.testing.engine.events import EventLog
from trio_pd.testing.engine.httpserver import ConnectionRegistry, serve_asgi
from trio_pd.testing.engine.vllm_kv import BlockPool

log = logging.getLogger("trio_pd.testing.engine.vllm")
VERSION = "0.33.0"  # the vLLM whose behaviour this models
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
FAILURE_POLICIES = ("fail", "recompute")


@attrs.frozen
class VllmEngineConfig:
    host: str = "127.0.0.1"
    port: int = 0
    model: str = "sim-model"
    num_blocks: int = 4096  # the KV cache, in blocks
    block_size: int = 16  # tokens per block (vLLM's default)
    kv_lease_duration: float = 30.0  # kv_connector_extra_config.kv_lease_duration
    # The old fixed lease (VLLM_NIXL_ABORT_REQUEST_TIMEOUT, 480 s): no heartbeat extends it.
    fixed_lease: bool = False
    heartbeat_interval: float | None = None  # None: kv_lease_duration // 6, as vLLM
    kv_load_failure_policy: str = "fail"
    prefill_ms_per_token: float = 0.0
    inter_token_ms: float = 0.0
    default_max_tokens: int = 16
    max_num_seqs: int = 256  # requests running at once; the rest wait
    keep_alive_secs: float = 5.0
    faults: tuple[str, ...] = ()  # process-wide sim_fault specs
    events_path: str | None = None

    @property
    def heartbeat_secs(self) -> float:
        if self.heartbeat_interval is not None:
            return self.heartbeat_interval
        return max(self.kv_lease_duration / 6, 0.05)  # vLLM: kv_lease_duration // 6


class Refused(Exception):
    """A 4xx vLLM answers before any work (its `ErrorResponse`)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.status = message, param, status

    def body(self) -> dict[str, Any]:
        error_type = "BadRequestError" if self.status == 400 else "ServiceUnavailableError"
        return error_json(self.message, error_type, self.status, self.param)


def error_json(message: str, error_type: str, code: int, param: str | None = None) -> dict:
    """vLLM's `ErrorResponse` (`entrypoints/serve/engine/protocol.py`)."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


GENERATION_ERROR = error_json("Internal server error", "InternalServerError", 500)


@attrs.define(eq=False)
class VllmState:
    config: VllmEngineConfig
    events: EventLog
    pool: BlockPool
    engine_id: str = attrs.Factory(lambda: str(uuid.uuid4()))
    port: int = 0
    faults: tuple[str, ...] = ()
    running: trio.Semaphore = attrs.field(default=None)
    client: httpx2.AsyncClient | None = None
    seen_prompts: set[str] = attrs.Factory(set)  # the prefix cache, by whole prompt
    counter: int = 0

    def __attrs_post_init__(self) -> None:
        self.running = trio.Semaphore(self.config.max_num_seqs)

    def next_id(self, prefix: str) -> str:
        self.counter += 1
        return f"{prefix}-{self.counter:06d}-{uuid.uuid4().hex[:8]}"


# ---- the request -----------------------------------------------------------------------------


@attrs.define
class Job:
    path: str
    body: dict[str, Any]
    request_id: str
    stream: bool
    prompt: str
    max_tokens: int
    params: dict[str, Any] | None
    faults: dict[str, str | None]  # this role's faults: kind -> argument

    @property
    def role(self) -> str:
        params = self.params or {}
        if params.get("do_remote_decode"):
            return "prefill"
        if params.get("do_remote_prefill"):
            return "decode"
        return "local"

    @property
    def prompt_tokens(self) -> int:
        return max(1, len(self.prompt.split()))

    @property
    def wants_prompt_logprobs(self) -> bool:
        """`prompt_logprobs`, or echo with logprobs on completions, which vLLM turns into
        prompt_logprobs (`openai/completion/protocol.py` to_sampling_params)."""
        if self.body.get("prompt_logprobs") is not None:
            return True
        return self.path == COMPLETIONS and bool(self.body.get("echo")) and isinstance(
            self.body.get("logprobs"), int)  # fmt: skip


def validate(path: str, body: Any) -> None:
    """What vLLM's protocol models and SamplingParams refuse that a PD router may send."""
    if not isinstance(body, dict):
        raise Refused("The request body must be a JSON object")
    if body.get("stream_options") and not body.get("stream"):
        raise Refused(
            "Stream options can only be defined when `stream=True`.", "stream_options"
        )  # completion/protocol.py, chat_completion/protocol.py validate_stream_options
    if path == CHAT:
        if not isinstance(body.get("messages"), list):
            raise Refused("`messages` is required", "messages")
    elif not isinstance(body.get("prompt"), str | list):
        raise Refused("`prompt` is required", "prompt")
    max_tokens = max_tokens_of(path, body)
    if max_tokens is not None and max_tokens < 1:
        raise Refused(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens")
    min_tokens = body.get("min_tokens", 0)
    if isinstance(min_tokens, int) and max_tokens is not None and min_tokens > max_tokens:
        raise Refused(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}."
        )  # sampling_params.py _verify_args
    if body.get("prompt_logprobs") and body.get("stream"):
        raise Refused("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")


def max_tokens_of(path: str, body: dict[str, Any]) -> int | None:
    if path == CHAT and isinstance(body.get("max_completion_tokens"), int):
        return body["max_completion_tokens"]
    value = body.get("max_tokens")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def prompt_of(path: str, body: dict[str, Any]) -> str:
    if path == CHAT:
        parts = []
        for message in body.get("messages") or []:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                parts.append(content)
        return "\n".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        prompt = " ".join(str(p) for p in prompt)
    return str(prompt)


def parse_faults(specs: list[str], role: str) -> dict[str, str | None]:
    """`[prefill:|decode:]KIND[:ARG]` specs that apply to `role`."""
    found: dict[str, str | None] = {}
    for spec in specs:
        parts = spec.strip().split(":")
        if parts[0] in ("prefill", "decode", "local"):
            if parts[0] != role:
                continue
            parts = parts[1:]
        if parts and parts[0]:
            found[parts[0]] = parts[1] if len(parts) > 1 else None
    return found


# ---- the app ---------------------------------------------------------------------------------


class VllmApp:
    def __init__(self, state: VllmState, connections: ConnectionRegistry) -> None:
        self.state = state
        self.connections = connections

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        resp = Responder(send, header(scope, b"x-request-id"))
        state = self.state
        if path in (COMPLETIONS, CHAT) and method == "POST":
            await self.generate(scope, receive, resp)
        elif path.startswith("/sim/nixl/") and method == "POST":
            await self.side_channel(path.removeprefix("/sim/nixl/"), receive, resp)
        elif path == "/sim/kv_blocks":
            await resp.json(200, state.pool.to_json(trio.current_time()))
        elif path == "/health":
            await resp.empty()
        elif path == "/version":
            await resp.json(200, {"version": VERSION})
        elif path == "/v1/models":
            card = {"id": state.config.model, "object": "model", "owned_by": "vllm",
                    "root": state.config.model, "max_model_len": 1 << 20}  # fmt: skip
            await resp.json(200, {"object": "list", "data": [card]})
        else:
            await resp.json(404, {"detail": "Not Found"})

    # -- the NIXL side channel (HTTP here) --------------------------------------------------

    async def side_channel(self, what: str, receive: Any, resp: Responder) -> None:
        raw = await read_body(receive)
        message = orjson.loads(raw or b"{}")
        pool, now = self.state.pool, trio.current_time()
        if what == "read":
            lease = pool.take(str(message.get("remote_request_id")), "read")
            self.state.events.emit(
                "kv_read", rid=message.get("remote_request_id"), found=lease is not None
            )
            if lease is None:
                await resp.json(410, {"error": "no such blocks (freed or expired)"})
            else:
                await resp.json(200, {"blocks": lease.blocks})
        elif what == "notify":
            lease = pool.take(str(message.get("remote_request_id")), "notified")
            self.state.events.emit(
                "kv_notified", rid=message.get("remote_request_id"), found=lease is not None
            )
            await resp.json(200, {"freed": lease.blocks if lease else 0})
        elif what == "heartbeat":
            ids = [str(i) for i in message.get("remote_request_ids") or []]
            found = pool.heartbeat(ids, now)
            self.state.events.emit("heartbeat_received", rids=ids, extended=found)
            await resp.json(200, {"extended": found})
        else:
            await resp.json(404, {"detail": "Not Found"})

    # -- generation ---------------------------------------------------------------------------

    async def generate(self, scope: dict[str, Any], receive: Any, resp: Responder) -> None:
        state = self.state
        raw = await read_body(receive)
        if raw is None:
            return
        path = scope["path"]
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            await resp.json(400, error_json("Invalid JSON", "BadRequestError", 400))
            return
        params = body.get("kv_transfer_params") if isinstance(body, dict) else None
        request_id = resp._request_id or state.next_id("req")
        specs = list(state.faults)
        fault = body.get("sim_fault") if isinstance(body, dict) else None
        if isinstance(fault, str):
            specs += fault.split(",")
        elif isinstance(fault, list):
            specs += [str(f) for f in fault]
        job = Job(path, body if isinstance(body, dict) else {}, request_id,
                  bool(isinstance(body, dict) and body.get("stream")), "", 0,
                  params if isinstance(params, dict) else None, {})  # fmt: skip
        job.faults = parse_faults(specs, job.role)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", ())}  # fmt: skip
        state.events.emit("request_start", rid=request_id, path=path, kv_role=job.role,
                          stream=job.stream, body=body, params=job.params,
                          headers=headers)  # fmt: skip
        try:
            validate(path, body)
            status = job.faults.get("status")
            if status is not None and int(status) >= 400:
                message = f"simulated {status}"
                raise Refused(message, status=int(status))
        except Refused as refused:
            state.events.emit("refused", rid=request_id, status=refused.status, kv_role=job.role)
            if job.role == "decode":  # the D-side serving layer's rejection frees P's blocks
                await self.notify_prefill(job, "refused")
            await resp.json(refused.status, refused.body())
            return
        job.prompt = prompt_of(path, body)
        job.max_tokens = max_tokens_of(path, body) or state.config.default_max_tokens
        if "close" in job.faults:
            state.events.emit("fault", rid=request_id, kind="close")
            if job.role == "decode":
                await self.notify_prefill(job, "closed")
            await self.connections.drop(scope.get("client"))
            return
        async with trio.open_nursery() as nursery:
            cancel = nursery.cancel_scope
            nursery.start_soon(self._watch_disconnect, receive, cancel, job)
            try:
                if job.role == "prefill":
                    await self.run_prefill(job, resp)
                else:
                    await self.run_decode(job, resp)
            finally:
                cancel.cancel()
        state.events.emit("request_end", rid=request_id, status=resp.status, kv_role=job.role)

    async def _watch_disconnect(self, receive: Any, scope: trio.CancelScope, job: Job) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.state.events.emit("connection_closed", rid=job.request_id, kv_role=job.role)
        scope.cancel()

    # -- prefill ------------------------------------------------------------------------------

    async def run_prefill(self, job: Job, resp: Responder) -> None:
        state, pool, config = self.state, self.state.pool, self.state.config
        blocks = math.ceil(job.prompt_tokens / config.block_size)
        engine_rid = state.next_id("cmpl")
        finished = False
        try:
            async with state.running:
                await pool.acquire(engine_rid, blocks)
                state.events.emit("blocks_allocated", rid=job.request_id, engine_rid=engine_rid,
                                  blocks=blocks)  # fmt: skip
                if "hang" in job.faults:
                    await trio.sleep_forever()
                await trio.sleep(config.prefill_ms_per_token * job.prompt_tokens / 1e3)
                cached = job.prompt in state.seen_prompts
                state.seen_prompts.add(job.prompt)
                if "no_params" in job.faults:
                    pool.release_running(engine_rid, "finished")
                    params = None
                else:
                    pool.hold(engine_rid, trio.current_time())
                    params = self.handoff(engine_rid, blocks)
                    state.events.emit("blocks_held", rid=job.request_id, engine_rid=engine_rid,
                                      blocks=blocks)  # fmt: skip
                finished = True
        finally:
            # Aborted before it finished (the client closed its connection): freed at once.
            if not finished and pool.release_running(engine_rid, "aborted"):
                state.events.emit("blocks_freed", rid=job.request_id, engine_rid=engine_rid,
                                      reason="aborted")  # fmt: skip
        cached_tokens = (
            (job.prompt_tokens // config.block_size) * config.block_size if cached else 0
        )
        answer = self.answer(job, ["tok0"], "length", cached_tokens, with_prompt_logprobs=True)
        answer["kv_transfer_params"] = params
        await resp.json(200, answer)

    def handoff(self, engine_rid: str, blocks: int) -> dict[str, Any]:
        """The prefill's `kv_transfer_params` (`pull_scheduler.request_finished`)."""
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [list(range(blocks))],
            "remote_engine_id": self.state.engine_id,
            "remote_request_id": engine_rid,
            "remote_host": self.state.config.host,
            "remote_port": self.state.port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": blocks * self.state.config.block_size,
            "remote_blocks_expiry_time": None,
            "remote_registration_generation": 1,
            "transfer_mode": "pull",
        }

    # -- decode -------------------------------------------------------------------------------

    def remote_ready(self, job: Job) -> bool:
        params = job.params or {}
        needed = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")
        return bool(params.get("remote_block_ids")) and all(
            params.get(key) is not None for key in needed
        )

    async def notify_prefill(self, job: Job, why: str) -> None:
        """Tell the prefill this decode will not read its blocks (they are freed there)."""
        if job.role != "decode" or not self.remote_ready(job):
            return
        self.state.events.emit("notice_sent", rid=job.request_id, why=why)
        with trio.CancelScope(shield=True), trio.move_on_after(2):
            try:
                await self._post(
                    job, "notify", {"remote_request_id": (job.params or {})["remote_request_id"]}
                )
            except httpx2.HTTPError as exc:
                log.info("notice to the prefill failed: %r", exc)

    async def _post(self, job: Job, what: str, message: dict[str, Any]) -> httpx2.Response:
        params = job.params or {}
        client = self.state.client
        assert client is not None
        url = f"http://{params['remote_host']}:{params['remote_port']}/sim/nixl/{what}"
        return await client.post(url, content=orjson.dumps(message))

    async def _heartbeat(self, job: Job) -> None:
        """From admission until the read (base_scheduler.on_new_request, _send_heartbeats)."""
        rid = (job.params or {}).get("remote_request_id")
        while True:
            try:
                await self._post(job, "heartbeat", {"remote_request_ids": [rid]})
                self.state.events.emit("heartbeat_sent", rid=job.request_id)
            except httpx2.HTTPError:
                pass
            await trio.sleep(self.state.config.heartbeat_secs)

    async def run_decode(self, job: Job, resp: Responder) -> None:
        state, config = self.state, self.state.config
        remote = job.role == "decode" and self.remote_ready(job)
        loaded = False
        read_done = not remote
        try:
            async with state.running:
                async with trio.open_nursery() as beats:
                    if remote:
                        beats.start_soon(self._heartbeat, job)
                    if "hang" in job.faults:
                        await trio.sleep_forever()
                    if remote and job.wants_prompt_logprobs:
                        # skip_reading_prefix_cache: the prompt is recomputed, blocks released
                        read_done = True
                        await self.notify_prefill(job, "prompt_logprobs")
                        state.events.emit("recomputed", rid=job.request_id, why="prompt_logprobs")
                    elif remote:
                        loaded = await self.read_blocks(job)
                        read_done = True
                    else:
                        state.events.emit("recomputed", rid=job.request_id, why="no_params")
                    beats.cancel_scope.cancel()
                if remote and read_done and not loaded and not job.wants_prompt_logprobs:
                    state.events.emit("kv_read_failed", rid=job.request_id,
                                      policy=config.kv_load_failure_policy)  # fmt: skip
                    if config.kv_load_failure_policy == "fail":
                        await self.fail_generation(job, resp)
                        return
                    state.events.emit("recomputed", rid=job.request_id, why="kv_read_failed")
                if not loaded:
                    await trio.sleep(config.prefill_ms_per_token * job.prompt_tokens / 1e3)
                await self.generate_tokens(job, resp, job.prompt_tokens if loaded else 0)
        finally:
            if not read_done:  # aborted before reading: request_finished notifies the prefill
                await self.notify_prefill(job, "aborted")

    async def read_blocks(self, job: Job) -> bool:
        if "kv_fail" in job.faults:
            self.state.events.emit("fault", rid=job.request_id, kind="kv_fail")
            return False
        try:
            answer = await self._post(
                job, "read", {"remote_request_id": (job.params or {})["remote_request_id"]}
            )
        except httpx2.HTTPError:
            return False
        return answer.status_code == 200

    async def fail_generation(self, job: Job, resp: Responder) -> None:
        """`GenerationError` (finish_reason "error"): 500, or an error chunk in the stream."""
        if job.stream:
            await resp.start_stream()
            await resp.event(GENERATION_ERROR)
            await resp.done()
        else:
            await resp.json(500, GENERATION_ERROR)

    async def generate_tokens(self, job: Job, resp: Responder, cached_tokens: int) -> None:
        config = self.state.config
        tokens = [f"tok{i}" for i in range(job.max_tokens)]
        if not job.stream:
            await trio.sleep(config.inter_token_ms * len(tokens) / 1e3)
            answer = self.answer(job, tokens, "length", cached_tokens, with_prompt_logprobs=True)
            answer["kv_transfer_params"] = None
            await resp.json(200, answer)
            return
        chat = job.path == CHAT
        created, stream_id = int(time.time()), self.state.next_id("chatcmpl" if chat else "cmpl")
        fail_after = job.faults.get("stream_error")  # an error chunk after N tokens
        for i, token in enumerate(tokens):
            await trio.sleep(config.inter_token_ms / 1e3)
            if fail_after is not None and i >= int(fail_after):
                self.state.events.emit("fault", rid=job.request_id, kind="stream_error")
                await resp.event(GENERATION_ERROR)
                await resp.done()
                return
            last = i == len(tokens) - 1
            choice: dict[str, Any] = {"index": 0, "logprobs": None,
                                      "finish_reason": "length" if last else None}  # fmt: skip
            if chat:
                choice["delta"] = {"role": "assistant", "content": token} if i == 0 else {
                    "content": " " + token}  # fmt: skip
            else:
                choice["text"] = token if i == 0 else " " + token
            chunk: dict[str, Any] = {"id": stream_id, "created": created,
                                     "object": "chat.completion.chunk" if chat
                                     else "text_completion",
                                     "model": config.model, "choices": [choice]}  # fmt: skip
            if last:
                chunk["kv_transfer_params"] = None
            await resp.event(chunk)
        options = job.body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):
            usage = self.usage(job, len(tokens), cached_tokens)
            await resp.event({"id": stream_id, "created": created, "model": config.model,
                              "object": "chat.completion.chunk" if chat else "text_completion",
                              "choices": [], "usage": usage})  # fmt: skip
        await resp.done()

    # -- answers ------------------------------------------------------------------------------

    def usage(self, job: Job, completion: int, cached_tokens: int) -> dict[str, Any]:
        prompt = job.prompt_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached_tokens}}  # fmt: skip

    def prompt_logprobs(self, job: Job) -> list[Any] | None:
        if job.body.get("prompt_logprobs") is None:
            return None
        words = job.prompt.split() or [""]
        return [None] + [
            {str(1000 + i): {"logprob": -0.5 - i / 100, "rank": 1, "decoded_token": w}}
            for i, w in enumerate(words[1:])
        ]

    def answer(
        self, job: Job, tokens: list[str], finish: str, cached_tokens: int,
        with_prompt_logprobs: bool = False,
    ) -> dict[str, Any]:  # fmt: skip
        config = self.state.config
        text = " ".join(tokens)
        usage = self.usage(job, len(tokens), cached_tokens)
        prompt_logprobs = self.prompt_logprobs(job) if with_prompt_logprobs else None
        if job.path == CHAT:
            return {
                "id": self.state.next_id("chatcmpl"), "object": "chat.completion",
                "created": int(time.time()), "model": config.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "logprobs": None, "finish_reason": finish, "stop_reason": None}],
                "usage": usage, "prompt_logprobs": prompt_logprobs,
            }  # fmt: skip
        text, logprobs = self.completion_text(job, tokens)
        return {
            "id": self.state.next_id("cmpl"), "object": "text_completion",
            "created": int(time.time()), "model": config.model,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish,
                         "stop_reason": None, "prompt_logprobs": prompt_logprobs}],
            "usage": usage,
        }  # fmt: skip

    def completion_text(self, job: Job, tokens: list[str]) -> tuple[str, Any]:
        """A completion's text and `logprobs` (`tokens`, `token_logprobs`, `top_logprobs`,
        `text_offset`); with `echo` the prompt comes first, its first token without a logprob
        (`openai/completion/serving.py`)."""
        pieces: list[tuple[str, float | None]] = []
        if job.body.get("echo"):
            words = job.prompt.split()
            pieces += [(w if i == 0 else " " + w, None if i == 0 else -0.5 - i / 100)
                       for i, w in enumerate(words)]  # fmt: skip
        # vLLM's echo is prompt_text + output.text: the output's text is the same either way
        pieces += [(("" if i == 0 else " ") + t, -0.1 * (i + 1)) for i, t in enumerate(tokens)]
        text = "".join(p for p, _ in pieces)
        if not isinstance(job.body.get("logprobs"), int):
            return text, None
        offsets, at = [], 0
        for piece, _ in pieces:
            offsets.append(at)
            at += len(piece)
        return text, {
            "tokens": [p for p, _ in pieces],
            "token_logprobs": [lp for _, lp in pieces],
            "top_logprobs": [None if lp is None else {p: lp} for p, lp in pieces],
            "text_offset": offsets,
        }


# ---- serving ---------------------------------------------------------------------------------


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
    """`python -m trio_pd.testing.engine.vllm --port N [...]`: one vLLM-mode engine process."""
    import argparse

    parser = argparse.ArgumentParser(prog="trio_pd.testing.engine.vllm", description=__doc__)
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
