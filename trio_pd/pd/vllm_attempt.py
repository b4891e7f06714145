"""One attempt on a vLLM pair (NixlConnector, pull): prefill first, then decode with its params.

vLLM's disaggregated prefill is sequential (docs/vllm.md §1): the prefill computes the prompt
under `kv_transfer_params: {"do_remote_decode": true, ...}` and answers one token and the
handoff (`kv_transfer_params` naming its engine, blocks and request); only then may the decode
be sent the client's own body with that handoff, read the blocks and generate. The attempt is
`attempt.Attempt` with its first phase replaced, so the decode phase (first-token timeout,
stream watchdog, the stream relay, buffering bounds) is the SGLang pair's own code:

- phase 1, the prefill leg, under the attempt's scope: a client that leaves, the deadline or a
  shutdown cancels it, which closes its connection, which is how vLLM is asked to free the
  request's blocks (it has no abort endpoint: `on_abandon` is None on both legs);
- phase 2, the decode leg, once the prefill's 200 is known good; the prefill's
  `kv_transfer_params` go to it as the prefill wrote them (never re-shaped, never reused by
  another attempt, since a read or a refusal frees them), once `vllm_handoff.py` found them a
  handoff a decode may act on (else the prefill failed: 502, retried on another prefill);
- the client's answer is the decode's, less `kv_transfer_params`, with the prefill's
  `cached_tokens` (the decode counts the transferred prompt as a cache hit) and the prefill's
  `prompt_logprobs` (the decode is sent none: vLLM recomputes the whole prompt of a request
  that asks them, `skip_reading_prefix_cache`).

The outcome table (docs/vllm.md §4) is `outcome.py`'s with one kind more: a decode that fails
after it was given the handoff (vLLM's `GenerationError`, a 500 or an error chunk, is what a
failed KV read gives) is `kv_transfer`: 502 `kv_transfer_failed` before the client's stream
started, the decode's own valid-JSON error frame after.
"""

from __future__ import annotations

import logging
from typing import Any

import attrs
import orjson
import trio

from trio_pd import jsonbody
from trio_pd.pd.answers import buffer_failure, read_answer, read_json, status_failure
from trio_pd.pd.attempt import Attempt
from trio_pd.pd.budget import OverBudget
from trio_pd.pd.outcome import LegFailure, LegSuccess
from trio_pd.pd.payload import CHAT, COMPLETIONS
from trio_pd.pd.relay import answer_failure, event_data, parse_json
from trio_pd.pd.sse import EventReader, EventTooLarge
from trio_pd.pd.vllm_handoff import handoff_problem
from trio_pd.upstream.pool import UpstreamError, UpstreamResponse

log = logging.getLogger(__name__)

# What the router asks of a vLLM prefill (vllm-router 0.1.17's `prepare_prefill_request` and
# `build_prefill_kv_transfer_params` for NIXL): a remote decode will read the blocks.
PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
KV_KEY = "kv_transfer_params"


def prefill_body(client: dict[str, Any]) -> bytes:
    """The prefill leg's body: the client's, one token, no stream, the remote-decode params.

    `stream_options` go (vLLM refuses them without `stream: true`); `max_tokens` (and
    `max_completion_tokens` when the client used it) are 1; `min_tokens` (and
    `min_completion_tokens`) are 1, which keeps min <= max (validated) and keeps the one token
    from being EOS (an older engine drops the params then); `n` is 1 (the handoff has one
    consumer). A client's own `kv_transfer_params` never reach an engine."""
    body = {k: v for k, v in client.items() if k not in (KV_KEY, "stream_options")}
    body["stream"] = False
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body["min_tokens"] = 1
    if "min_completion_tokens" in body:
        body["min_completion_tokens"] = 1
    if "n" in body:
        body["n"] = 1
    body[KV_KEY] = PREFILL_PARAMS
    return jsonbody.dump(body)


def engine_headers(headers: list[tuple[bytes, bytes]], path: str) -> list[tuple[bytes, bytes]]:
    """The legs' headers with the route's prefix taken off `x-request-id`: vLLM names its
    answer `cmpl-<x-request-id>` (`chatcmpl-` on chat, `_base_request_id`,
    entrypoints/serve/engine/serving.py), and the router's ids already carry that prefix, so the
    client saw `cmpl-cmpl-...`; now the answer's id is the router's request id, as one engine's
    would be (checked against vLLM 0.32)."""
    prefix = b"chatcmpl-" if path == CHAT else b"cmpl-"
    return [
        (name, value[len(prefix) :])
        if name == b"x-request-id" and value.startswith(prefix) and len(value) > len(prefix)
        else (name, value)
        for name, value in headers
    ]


def echoes_logprobs(path: str, client: dict[str, Any]) -> bool:
    """A non-stream completion with `echo` and `logprobs`: vLLM computes the prompt's
    logprobs for it (prompt_logprobs), so the router takes them, and the echo, from prefill."""
    return (
        path == COMPLETIONS
        and bool(client.get("echo"))
        and isinstance(client.get("logprobs"), int)
        and not client.get("stream")
    )


def decode_body(
    raw: bytes, client: dict[str, Any], params: dict[str, Any] | None, echo: bool = False
) -> bytes:
    """The decode leg's body: the client's own bytes plus the prefill's params (none: the
    decode computes the prompt itself)."""
    return with_params(decode_base(raw, client, echo), params)


def decode_base(raw: bytes, client: dict[str, Any], echo: bool = False) -> bytes:
    """The decode leg's body before the prefill's params: the client's own bytes (`raw`
    itself), re-serialized only when a key must go: the client's own `kv_transfer_params`, and
    `prompt_logprobs` (and `echo` with logprobs): prefill computed them; asked of the decode
    they make vLLM recompute the prompt instead of reading the blocks."""
    keys = (KV_KEY, "prompt_logprobs", "echo") if echo else (KV_KEY, "prompt_logprobs")
    drop = [key for key in keys if key in client]
    if drop:
        raw = jsonbody.dump({k: v for k, v in client.items() if k not in drop})
    return raw


def with_params(raw: bytes, params: dict[str, Any] | None) -> bytes:
    """`decode_base`'s bytes with the prefill's `kv_transfer_params` spliced in (None: none)."""
    if params is None:
        return raw
    end = raw.rindex(b"}")
    members = b'"kv_transfer_params":' + orjson.dumps(params)
    empty = raw.find(b":", 0, end) < 0  # an object with a member has a colon; `{}` has none
    # One copy of a body that may be megabytes: the join reads the client's bytes in place.
    return b"".join((memoryview(raw)[:end], b"" if empty else b",", members, b"}"))


@attrs.frozen
class VllmBodies:
    """What a vLLM attempt needs of the client's body, made from it once per request (off the
    event loop when large: `pd/vllm_bodies.py`), so no attempt parses it again."""

    prefill: bytes  # the prefill leg's body (`prefill_body`)
    decode: bytes  # `decode_base` of the client's body (b"" off the loop: the client's own)
    decode_echo: bytes  # ... less `echo` too (only when `echo`)
    wants_prompt_logprobs: bool
    echo: bool  # `echoes_logprobs`


def vllm_bodies(path: str, raw: bytes) -> VllmBodies:
    """`VllmBodies` of an inspected client body (valid JSON: `payload.inspect_body` said so);
    RouterError when it cannot be re-serialized (`jsonbody.dump`)."""
    client = jsonbody.parse_object(raw)
    echo = echoes_logprobs(path, client)
    return VllmBodies(
        prefill=prefill_body(client),
        decode=decode_base(raw, client),
        decode_echo=decode_base(raw, client, echo=True) if echo else b"",
        wants_prompt_logprobs=client.get("prompt_logprobs") is not None,
        echo=echo,
    )


@attrs.define(eq=False)
class VllmAttempt(Attempt):
    """`Attempt` with vLLM's sequential phases (see the module docstring)."""

    bodies: VllmBodies = VllmBodies(b"{}", b"{}", b"", False, False)  # the client's, made once
    missing_params: str = "decode-local"  # --vllm-missing-kv-params
    params_forwarded: bool = False  # the decode was given the prefill's handoff
    # ... and it named the prefill's cached tokens, which vLLM 0.32's decode then reports
    # as its own (`remote_prefill_cached_tokens`, v1/engine/output_processor.py)
    handoff_names_cached: bool = False
    prefill_usage: Any = None  # the prefill's `usage` (its cached_tokens are the real ones)
    prompt_logprobs: Any = None  # the prefill's, when the client asked them
    wants_prompt_logprobs: bool = False
    echo: bool = False  # echo with logprobs: the prompt's part comes from prefill's answer
    prefill_echo: Any = None  # prefill's first choice, when `echo`
    midstream_error: str | None = None  # an error chunk relayed after the stream started
    _events: EventReader | None = None

    def __attrs_post_init__(self) -> None:
        self.wants_prompt_logprobs = self.bodies.wants_prompt_logprobs
        self.echo = self.bodies.echo
        self.transform = self._rewrite_chunk

    async def run(self) -> None:
        ended = False
        try:
            with trio.CancelScope(deadline=self.deadline) as deadline_scope:
                await self._vllm_prefill()
                if isinstance(self.prefill.result, LegSuccess):
                    await self._decode_leg()
            ended = True
        finally:
            if self._events is not None:
                self._events.close()
            if not ended:  # an enclosing scope cancelled us (client gone, shutdown)
                cause, at = self.outer_cause()
                self.prefill.note_outer_cancel(cause, at)
                self.decode.note_outer_cancel(cause, at)
        if deadline_scope.cancelled_caught:
            now = trio.current_time()
            self.prefill.note_outer_cancel("deadline", now)
            self.decode.note_outer_cancel("deadline", now)
            timeout = LegFailure("timeout", "request deadline passed")
            if self.prefill.result is None:
                self.prefill.result = timeout
            elif self.decode.result is None:
                self.decode.result = timeout
        self._kv_failure()
        if isinstance(self.decode.result, LegSuccess) and not self.responder.started:
            self._finish_answer()

    # -- phase 1: prefill ---------------------------------------------------------------------

    async def _vllm_prefill(self) -> None:
        leg = self.prefill
        with leg.scope, leg.track():
            try:
                post = self.pool.post(leg.url, self.path, leg.headers, leg.body, leg.sending)
                async with post as response:
                    await self._read_vllm_prefill(response)
            except UpstreamError as exc:
                self._fail_prefill(LegFailure(exc.kind, str(exc)))
            except (EventTooLarge, OverBudget) as exc:
                self._fail_prefill(buffer_failure(exc))
            finally:
                leg.ended_at = trio.current_time()

    async def _read_vllm_prefill(self, response: UpstreamResponse) -> None:
        if not 200 <= response.status < 300:
            self._fail_prefill(await status_failure(response))
            return
        answer = read_json(await read_answer(response, self.account), self.account)
        found = answer_failure(answer)
        if found is not None:
            self._fail_prefill(LegFailure("inband", found.message, found.code))
            return
        if not isinstance(answer, dict):
            self._fail_prefill(LegFailure("transport", "prefill's answer is not a JSON object"))
            return
        params = answer.get(KV_KEY)
        if not isinstance(params, dict) or not params:
            self.metrics.vllm_kv_params_missing.labels(self.missing_params).inc()
            if self.missing_params == "fail":
                self._fail_prefill(
                    LegFailure("inband", "the vLLM prefill answered without kv_transfer_params")
                )
                return
            log.info("prefill %s answered no kv_transfer_params: decode computes the prompt",
                     self.prefill.url)  # fmt: skip
            self.metrics.vllm_prompts_recomputed.labels("missing_params").inc()
            params = None
        else:
            problem = await handoff_problem(params, self.pool.destinations)
            if problem is not None:  # never a decode's: it would act on it (vllm_handoff.py)
                log.warning("prefill %s answered a handoff no decode may be given: %s",
                            self.prefill.url, problem)  # fmt: skip
                self._fail_prefill(
                    LegFailure("inband", f"the vLLM prefill's kv_transfer_params: {problem}")
                )
                return
        self.params_forwarded = params is not None
        self.handoff_names_cached = params is not None and isinstance(
            params.get("remote_prefill_cached_tokens"), int
        )
        self.prefill_usage = answer.get("usage")
        if self.wants_prompt_logprobs:
            self.prompt_logprobs = prompt_logprobs_of(self.path, answer)
        echo = self.echo and params is not None  # decode-local: the decode echoes itself
        if echo:
            choices = answer.get("choices")
            first = choices[0] if isinstance(choices, list) and choices else None
            self.prefill_echo = first if isinstance(first, dict) else None
        bodies = self.bodies
        self.decode.body = with_params(bodies.decode_echo if echo else bodies.decode, params)
        self.prefill.result = LegSuccess(response.status, [], b"")

    # -- the client's answer ------------------------------------------------------------------

    def _kv_failure(self) -> None:
        """A decode given the handoff that failed with vLLM's generation error (500, or an
        error chunk as its first event; what a failed KV read gives) is `kv_transfer`."""
        failure = self.decode.result
        if self.midstream_error is not None and isinstance(failure, LegSuccess):
            self.metrics.vllm_kv_read_failures.labels("started").inc()
            self.decode.result = LegFailure("kv_transfer", self.midstream_error, 500)
            return
        if not (self.params_forwarded and isinstance(failure, LegFailure)):
            return
        if failure.kind in ("status", "inband") and failure.status in (500, None):
            self.metrics.vllm_kv_read_failures.labels("not_started").inc()
            message = f"the decode could not use the prefill's KV cache: {failure.message}"
            self.decode.result = LegFailure("kv_transfer", message, 500)

    def _finish_answer(self) -> None:
        decode = self.decode.result
        assert isinstance(decode, LegSuccess)
        body = decode.body
        if (
            KV_KEY.encode() not in body
            and b"cached_tokens" not in body
            and self.prompt_logprobs is None
            and self.prefill_echo is None
        ):
            return
        try:
            answer = read_json(body, self.account)
            if isinstance(answer, dict):
                self._rewrite(answer)
                if self.prompt_logprobs is not None:
                    merge_prompt_logprobs(self.path, answer, self.prompt_logprobs)
                if self.prefill_echo is not None:
                    merge_echo(answer, self.prefill_echo, self.prefill_usage)
                self.decode.result = LegSuccess(decode.status, decode.headers, orjson.dumps(answer))
        except OverBudget as exc:
            self.decode.result = buffer_failure(exc)
        except orjson.JSONEncodeError as exc:
            self.decode.result = LegFailure("transport", f"answer the router cannot rewrite: {exc}")

    def _rewrite(self, answer: dict[str, Any]) -> None:
        """Less `kv_transfer_params`; the prefill's `cached_tokens` for the decode's."""
        answer.pop(KV_KEY, None)
        usage = answer.get("usage")
        if not (self.params_forwarded and isinstance(usage, dict)):
            return
        details = usage.get("prompt_tokens_details")
        if not isinstance(details, dict) or "cached_tokens" not in details:
            return
        theirs = self.prefill_usage.get("prompt_tokens_details") if isinstance(
            self.prefill_usage, dict) else None  # fmt: skip
        if isinstance(theirs, dict) and "cached_tokens" in theirs:
            details["cached_tokens"] = theirs["cached_tokens"]
        elif not self.handoff_names_cached:
            # The prefill did not say, and the decode's figure is the transfer (an engine
            # before 0.32), not a cache hit. With the handoff naming the prefill's cached
            # tokens the decode's figure is the prefill's: kept.
            del details["cached_tokens"]

    def _rewrite_chunk(self, chunk: bytes) -> bytes:
        """The decode's stream as the client gets it, event by event (`attempt.py` calls this
        for each chunk it relays): events naming `kv_transfer_params` or `cached_tokens` are
        rewritten; an error chunk is noted (the stream is failed after it)."""
        if self._events is None:
            self._events = EventReader(self.event_limit, self.account)
        out = []
        for event in self._events.feed(chunk):
            if b"kv_transfer_params" in event or b"cached_tokens" in event or b'"error"' in event:
                data = event_data(event)
                parsed = parse_json(data) if data is not None else None
                if isinstance(parsed, dict):
                    error = parsed.get("error")
                    if error and self.midstream_error is None:
                        message = error.get("message") if isinstance(error, dict) else error
                        self.midstream_error = f"decode's stream failed: {message}"
                    self._rewrite(parsed)
                    event = b"data: " + orjson.dumps(parsed) + b"\n\n"
            out.append(event)
        return b"".join(out)


def prompt_logprobs_of(path: str, answer: dict[str, Any]) -> Any:
    """Where vLLM puts them: top level on chat, on each choice on completions."""
    if path == CHAT:
        return answer.get("prompt_logprobs")
    choices = answer.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        return choices[0].get("prompt_logprobs")
    return None


def merge_echo(answer: dict[str, Any], prefill: dict[str, Any], usage: Any) -> None:
    """Put the prefill's echo (the prompt's text and its tokens' logprobs) in front of each of
    the decode's choices, as vLLM's own echo would have: the prompt's `n` tokens are the first
    `n` of the prefill's logprobs (n: its `usage.prompt_tokens`), the prompt's text the prefill's
    text up to the offset of its first generated token; the decode's offsets move by it."""
    logprobs = prefill.get("logprobs")
    text = prefill.get("text")
    count = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    if not (isinstance(logprobs, dict) and isinstance(text, str) and isinstance(count, int)):
        return
    offsets = logprobs.get("text_offset")
    if not isinstance(offsets, list) or len(offsets) <= count:
        return
    prompt_text = text[: offsets[count]]
    prompt_logprobs = prefill.get("prompt_logprobs")  # vLLM computes them for an echo
    for choice in answer.get("choices") or []:
        if not isinstance(choice, dict) or not isinstance(choice.get("text"), str):
            continue
        choice["text"] = prompt_text + choice["text"]
        if prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs
        theirs = choice.get("logprobs")
        if not isinstance(theirs, dict):
            continue
        for key in ("tokens", "token_logprobs", "top_logprobs"):
            head, tail = logprobs.get(key), theirs.get(key)
            if isinstance(head, list) and isinstance(tail, list):
                theirs[key] = head[:count] + tail
        tail_offsets = theirs.get("text_offset")
        if isinstance(tail_offsets, list):
            moved = [o + len(prompt_text) for o in tail_offsets if isinstance(o, int)]
            theirs["text_offset"] = offsets[:count] + moved


def merge_prompt_logprobs(path: str, answer: dict[str, Any], logprobs: Any) -> None:
    if path == CHAT:
        answer["prompt_logprobs"] = logprobs
        return
    for choice in answer.get("choices") or []:
        if isinstance(choice, dict):
            choice["prompt_logprobs"] = logprobs
