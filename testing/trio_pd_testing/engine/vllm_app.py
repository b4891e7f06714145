"""The vLLM-mode engine's ASGI app: its routes, the prefill and decode legs, the answers.

What each leg does, and where it follows vLLM 0.33.0, is `vllm.py`'s module docstring.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from typing import Any

import httpx2
import orjson
import trio

from trio_pd_testing.engine.asgi import Responder, header, read_body
from trio_pd_testing.engine.httpserver import ConnectionRegistry
from trio_pd_testing.engine.vllm_request import (
    CHAT,
    COMPLETIONS,
    GENERATION_ERROR,
    Job,
    Refused,
    continued,
    error_json,
    max_tokens_of,
    output_token_id,
    parse_faults,
    prompt_ids_of,
    prompt_of,
    validate,
)
from trio_pd_testing.engine.vllm_state import VERSION, VllmState

log = logging.getLogger("trio_pd_testing.engine.vllm")


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
                    "root": state.config.model,
                    "max_model_len": state.config.max_model_len}  # fmt: skip
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
        job.external_id = resp._request_id or None
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", ())}  # fmt: skip
        state.events.emit("request_start", rid=request_id, path=path, kv_role=job.role,
                          stream=job.stream, body=body, params=job.params,
                          headers=headers)  # fmt: skip
        try:
            validate(path, body)
            tokens = len(prompt_of(path, body).split())
            if tokens >= state.config.max_model_len:  # the renderer's check, vLLM 0.32
                raise Refused(  # `param` as vLLM 0.32's (renderers/params.py), recorded
                    f"This model's maximum context length is {state.config.max_model_len} "
                    f"tokens. However, your prompt contains {tokens} input tokens, which "
                    "exceeds this limit even without any output tokens. Please reduce the "
                    "length of the input prompt.",
                    "input_tokens",
                )
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
        # vLLM's engine request id: its answer's id, the prompt's index, 8 hex digits
        # (`remote_request_id: "cmpl-<x-request-id>-0-95be5620"`, checked on vLLM 0.32).
        prefix = "chatcmpl" if job.path == CHAT else "cmpl"
        engine_rid = f"{self.answer_id(job, prefix)}-0-{uuid.uuid4().hex[:8]}"
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
                    params["remote_prefill_cached_tokens"] = self.cached_tokens(job, cached)
                    if "bad_handoff" in job.faults:
                        spoil_handoff(params, job.faults["bad_handoff"])
                    state.events.emit("blocks_held", rid=job.request_id, engine_rid=engine_rid,
                                      blocks=blocks)  # fmt: skip
                finished = True
        finally:
            # Aborted before it finished (the client closed its connection): freed at once.
            if not finished and pool.release_running(engine_rid, "aborted"):
                state.events.emit("blocks_freed", rid=job.request_id, engine_rid=engine_rid,
                                      reason="aborted")  # fmt: skip
        cached_tokens = self.cached_tokens(job, cached)
        answer = self.answer(job, ["tok0"], "length", cached_tokens, with_prompt_logprobs=True)
        answer["kv_transfer_params"] = params
        await resp.json(200, answer)

    def cached_tokens(self, job: Job, cached: bool) -> int:
        """The prefix cache's hit: whole blocks of a prompt seen before."""
        size = self.state.config.block_size
        return (job.prompt_tokens // size) * size if cached else 0

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
                await self.generate_tokens(job, resp, self.decode_cached_tokens(job, loaded))
        finally:
            if not read_done:  # aborted before reading: request_finished notifies the prefill
                await self.notify_prefill(job, "aborted")

    def decode_cached_tokens(self, job: Job, loaded: bool) -> int:
        """vLLM 0.32 reports the prefill's cached tokens when the handoff names them
        (`remote_prefill_cached_tokens`, v1/engine/output_processor.py), else the prompt it
        loaded counts as cached."""
        remote = (job.params or {}).get("remote_prefill_cached_tokens")
        if loaded and isinstance(remote, int):
            return remote
        return job.prompt_tokens if loaded else 0

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

    async def die(self, job: Job, resp: Responder) -> None:
        """`die@Ntok`: the whole engine dies as a SIGKILLed vLLM server does: every connection
        closes at once (this stream's too, mid-answer) and later ones close on accept."""
        resp.closed = True
        self.connections.dead = True
        self.state.events.emit("engine_died", rid=job.request_id, kv_role=job.role)
        await self.connections.drop_all()

    async def generate_tokens(self, job: Job, resp: Responder, cached_tokens: int) -> None:
        config = self.state.config
        # A token-id prompt ending with the answer's first M ids (a migrated request) goes on
        # with tok<M>: its tokens are the uninterrupted run's (`vllm_request.continued`).
        prompt_ids = prompt_ids_of(job.path, job.body)
        start = continued(prompt_ids) if isinstance(job.body.get("prompt"), list) else 0
        tokens = [f"tok{start + i}" for i in range(job.max_tokens)]
        die_at = job.faults.get("die")  # `die@Ntok`: once the answer sent N tokens
        dies = die_at is not None and start < int(die_at)
        hold_at = job.faults.get("hold")  # `hold@Ntok`: silent there until released
        holds = hold_at is not None and start < int(hold_at)
        if not job.stream:
            await trio.sleep(config.inter_token_ms * len(tokens) / 1e3)
            if dies:
                await self.die(job, resp)
                return
            answer = self.answer(job, tokens, "length", cached_tokens, with_prompt_logprobs=True)
            answer["kv_transfer_params"] = None
            await resp.json(200, answer)
            return
        chat = job.path == CHAT
        ids = bool(job.body.get("return_token_ids"))  # each chunk's ids, the first the prompt's
        created, stream_id = int(time.time()), self.answer_id(job, "chatcmpl" if chat else "cmpl")
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
            # A continuation's first token keeps the space that separates it from the ones
            # before it, as vLLM's incremental detokenizer renders it.
            piece = token if i == 0 and start == 0 else " " + token
            if chat:
                choice["delta"] = {"role": "assistant", "content": piece} if i == 0 else {
                    "content": piece}  # fmt: skip
            else:
                choice["text"] = piece
            if ids:  # vLLM 0.32: `prompt_token_ids` in the first chunk, `token_ids` in each
                if i == 0:
                    choice["prompt_token_ids"] = prompt_ids
                choice["token_ids"] = [output_token_id(start + i)]
            chunk: dict[str, Any] = {"id": stream_id, "created": created,
                                     "object": "chat.completion.chunk" if chat
                                     else "text_completion",
                                     "model": config.model, "choices": [choice]}  # fmt: skip
            # No `kv_transfer_params` in any chunk: vLLM 0.32's stream chunk models have none
            # (checked against the real engine, tests/data/vllm_0.32.0_observables.json).
            await resp.event(chunk)
            if dies and start + i + 1 >= int(die_at or 0):
                await self.die(job, resp)
                return
            if holds and start + i + 1 == int(hold_at or 0):
                self.state.events.emit("fault", rid=job.request_id, kind="hold")
                await self.state.released.wait()
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
        details = (
            {"cached_tokens": cached_tokens} if self.state.config.prompt_tokens_details else None
        )
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": details}  # fmt: skip

    def prompt_logprobs(self, job: Job) -> list[Any] | None:
        echo = job.path != CHAT and job.body.get("echo") and job.body.get("logprobs") is not None
        if job.body.get("prompt_logprobs") is None and not echo:  # echo + logprobs asks them
            return None
        words = job.prompt.split() or [""]
        return [None] + [
            {str(1000 + i): {"logprob": -0.5 - i / 100, "rank": 1, "decoded_token": w}}
            for i, w in enumerate(words[1:])
        ]

    def answer_id(self, job: Job, prefix: str) -> str:
        """vLLM's: the prefix and the caller's `X-Request-Id`, else a fresh id."""
        if job.external_id:
            return f"{prefix}-{job.external_id}"
        return self.state.next_id(prefix)

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
                "id": self.answer_id(job, "chatcmpl"), "object": "chat.completion",
                "created": int(time.time()), "model": config.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "logprobs": None, "finish_reason": finish, "stop_reason": None}],
                "usage": usage, "prompt_logprobs": prompt_logprobs,
            }  # fmt: skip
        text, logprobs = self.completion_text(job, tokens)
        return {
            "id": self.answer_id(job, "cmpl"), "object": "text_completion",
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


def spoil_handoff(params: dict[str, Any], how: str | None) -> None:
    """`sim_fault=prefill:bad_handoff:<how>`: a prefill answering a handoff no decode should
    act on: `metadata` (remote_host 169.254.169.254), `no_blocks` (remote_block_ids gone:
    vLLM 0.32's decode dies on it), `port` (remote_port 0). Its blocks wait for the lease."""
    if how == "metadata":
        params["remote_host"] = "169.254.169.254"
    elif how == "no_blocks":
        del params["remote_block_ids"]
    elif how == "port":
        params["remote_port"] = 0
    else:
        raise ValueError(f"bad_handoff:{how}: metadata, no_blocks or port")
