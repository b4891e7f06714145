"""vLLM 0.32 pairs (NixlConnector, pull): prefill first, then decode with its params.

vLLM's disaggregated prefill is sequential (docs/vllm.md §1): the prefill computes the prompt
under `kv_transfer_params: {"do_remote_decode": true, ...}` and answers one token and the
handoff (`kv_transfer_params` naming its engine, blocks and request); only then may the decode
be sent the client's own body with that handoff, read the blocks and generate. The attempt is
`attempt.Attempt` under these rules (`VllmRules`): sequential, so the decode phase (first-token
timeout, stream watchdog, the stream relay, buffering bounds) is the SGLang pair's own code:

- phase 1, the prefill leg, under the attempt's scope: a client that leaves, the deadline or a
  shutdown cancels it, which closes its connection, which is how vLLM is asked to free the
  request's blocks (it has no abort endpoint: `on_abandon` is None on both legs);
- phase 2, the decode leg, once the prefill's 200 is known good; the prefill's
  `kv_transfer_params` go to it as the prefill wrote them (never re-shaped, never reused by
  another attempt, since a read or a refusal frees them), once `pd/vllm_handoff.py` found them a
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
from collections.abc import Callable
from functools import partial
from typing import Any

import attrs
import orjson

from trio_pd.errors import RouterError, bad_request
from trio_pd.fleet.worker import Worker
from trio_pd.pd.answers import buffer_failure, read_answer, read_json
from trio_pd.pd.attempt import Attempt, Leg
from trio_pd.pd.budget import Account, OverBudget
from trio_pd.pd.cancel import RequestCancel
from trio_pd.pd.frames import answer_failure, event_data, parse_json
from trio_pd.pd.outcome import LegFailure, LegSuccess
from trio_pd.pd.payload import CHAT, GENERATE
from trio_pd.pd.request import DispatchContext, PDRequest, Ranks, leg_headers_for
from trio_pd.pd.sse import EventReader
from trio_pd.pd.vllm_bodies import KV_KEY, VllmBodies, VllmBodyMaker, engine_headers, with_params
from trio_pd.pd.vllm_handoff import handoff_problem
from trio_pd.respond import Responder
from trio_pd.upstream.pool import UpstreamResponse

log = logging.getLogger(__name__)

NAME = "vllm"
# A completions stream broken mid-way resumes on a fresh pair (`pd/resume.py`, docs/vllm.md
# §10): vLLM 0.32's completions chunks carry their `token_ids` and the first one the prompt's
# (`return_token_ids`), and /v1/completions takes a token-id prompt; the resumed attempt runs
# this module's whole schedule (prefill, then decode with its handoff). Chat streams are
# refused (`migration.REFUSALS["chat_stream"]`).
RESUMES = True
# vLLM 0.32's `/detokenize` takes one flat id list (`{"tokens": [ids]}`), not the batch the
# seam asks for: a resume keeps every id sent, so a break inside a multi-byte character can
# lose that character's text (docs/vllm.md §10). Not asked, rather than answered with a 400.
SEAM_BY_DETOKENIZE = False


@attrs.define(eq=False)
class VllmRules:
    """`attempt.EngineRules` of a vLLM pair (see the module docstring)."""

    bodies: VllmBodies  # the client's, made once per request
    account: Account | None  # the request's share of --max-buffered-bytes
    event_limit: int  # --max-sse-event-bytes
    missing_params: str = "decode-local"  # --vllm-missing-kv-params
    sequential: bool = True
    leases_prefill: bool = True  # docs/vllm.md §8, finding 1
    transform: Callable[[bytes], bytes] | None = None  # `rewrite_chunk`
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
        self.transform = self.rewrite_chunk

    def close(self) -> None:
        if self._events is not None:
            self._events.close()

    async def first_event(self, attempt: Attempt, event: bytes, data: bytes | None) -> bytes | None:
        """Relayed through `rewrite_chunk` like the rest of the stream."""
        return event

    # -- phase 1: prefill's answer ---------------------------------------------------------------

    async def read_prefill(self, attempt: Attempt, response: UpstreamResponse) -> None:
        """Prefill's 200: its handoff checked, and the decode leg's body written with it."""
        answer = read_json(await read_answer(response, attempt.account), attempt.account)
        found = answer_failure(answer)
        if found is not None:
            attempt.fail_prefill(LegFailure("inband", found.message, found.code))
            return
        if not isinstance(answer, dict):
            attempt.fail_prefill(LegFailure("transport", "prefill's answer is not a JSON object"))
            return
        params = answer.get(KV_KEY)
        if not isinstance(params, dict) or not params:
            attempt.metrics.vllm_kv_params_missing.labels(self.missing_params).inc()
            if self.missing_params == "fail":
                attempt.fail_prefill(
                    LegFailure("inband", "the vLLM prefill answered without kv_transfer_params")
                )
                return
            log.info("prefill %s answered no kv_transfer_params: decode computes the prompt",
                     attempt.prefill.url)  # fmt: skip
            attempt.metrics.vllm_prompts_recomputed.labels("missing_params").inc()
            params = None
        else:
            problem = await handoff_problem(params, attempt.pool.destinations)
            if problem is not None:  # never a decode's: it would act on it (vllm_handoff.py)
                log.warning("prefill %s answered a handoff no decode may be given: %s",
                            attempt.prefill.url, problem)  # fmt: skip
                attempt.fail_prefill(
                    LegFailure("inband", f"the vLLM prefill's kv_transfer_params: {problem}")
                )
                return
        self.params_forwarded = params is not None
        self.handoff_names_cached = params is not None and isinstance(
            params.get("remote_prefill_cached_tokens"), int
        )
        self.prefill_usage = answer.get("usage")
        if self.wants_prompt_logprobs:
            self.prompt_logprobs = prompt_logprobs_of(attempt.path, answer)
        echo = self.echo and params is not None  # decode-local: the decode echoes itself
        if echo:
            choices = answer.get("choices")
            first = choices[0] if isinstance(choices, list) and choices else None
            self.prefill_echo = first if isinstance(first, dict) else None
        bodies = self.bodies
        attempt.decode.body = with_params(bodies.decode_echo if echo else bodies.decode, params)
        attempt.prefill.result = LegSuccess(response.status, [], b"")

    # -- the client's answer ------------------------------------------------------------------

    def reclassify(self, attempt: Attempt) -> None:
        """A decode given the handoff that failed with vLLM's generation error (500, or an
        error chunk as its first event; what a failed KV read gives) is `kv_transfer`."""
        failure = attempt.decode.result
        if self.midstream_error is not None and isinstance(failure, LegSuccess):
            attempt.metrics.vllm_kv_read_failures.labels("started").inc()
            attempt.decode.result = LegFailure("kv_transfer", self.midstream_error, 500)
            return
        if not (self.params_forwarded and isinstance(failure, LegFailure)):
            return
        if failure.kind in ("status", "inband") and failure.status in (500, None):
            attempt.metrics.vllm_kv_read_failures.labels("not_started").inc()
            message = f"the decode could not use the prefill's KV cache: {failure.message}"
            attempt.decode.result = LegFailure("kv_transfer", message, 500)

    async def rewrite_answer(self, attempt: Attempt) -> None:
        """The decode's whole answer less the handoff, with the prefill's `cached_tokens`,
        `prompt_logprobs` and echo (see the module docstring)."""
        decode = attempt.decode.result
        if not isinstance(decode, LegSuccess) or attempt.responder.started:
            return
        body = decode.body
        if (
            KV_KEY.encode() not in body
            and b"cached_tokens" not in body
            and self.prompt_logprobs is None
            and self.prefill_echo is None
        ):
            return
        try:
            answer = read_json(body, attempt.account)
            if isinstance(answer, dict):
                self.rewrite(answer)
                if self.prompt_logprobs is not None:
                    merge_prompt_logprobs(attempt.path, answer, self.prompt_logprobs)
                if self.prefill_echo is not None:
                    merge_echo(answer, self.prefill_echo, self.prefill_usage)
                attempt.decode.result = LegSuccess(
                    decode.status, decode.headers, orjson.dumps(answer)
                )
        except OverBudget as exc:
            attempt.decode.result = buffer_failure(exc)
        except orjson.JSONEncodeError as exc:
            attempt.decode.result = LegFailure(
                "transport", f"answer the router cannot rewrite: {exc}"
            )

    def rewrite(self, answer: dict[str, Any]) -> None:
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

    def rewrite_chunk(self, chunk: bytes) -> bytes:
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
                    self.rewrite(parsed)
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


# -- building an attempt ------------------------------------------------------------------------


async def new_attempt(
    ctx: DispatchContext,
    request: PDRequest,
    responder: Responder,
    cancel: RequestCancel,
    pair: tuple[Worker, Worker],
    times: tuple[float, float],
    ranks: Ranks,
) -> Attempt:
    """An attempt on a vLLM pair (docs/vllm.md): the prefill's body now, the decode's once the
    prefill answered. vLLM has no abort endpoint: closing a leg's connection is its abort. The
    DP ranks are not sent (the gates' slots they carry are released by dispatch)."""
    prefill, decode = pair
    started, deadline = times
    inspected = request.inspected
    bodies = await vllm_bodies(request)
    body = bodies.prefill
    if len(body) > ctx.config.max_payload_size:
        raise RouterError(
            413,
            f"the request with the router's fields exceeds {ctx.config.max_payload_size} bytes",
            "payload_too_large",
        )

    def leg(worker: Worker, leg_body: bytes) -> Leg:
        return Leg(
            worker.role,
            worker,
            leg_body,
            engine_headers(leg_headers_for(ctx, request, worker), request.path),
            partial(ctx.fleet.track, worker, None, request.routing_key),
        )

    return Attempt(
        pool=ctx.pool,
        path=request.path,
        prefill=leg(prefill, body),
        decode=leg(decode, b""),  # written once the prefill answered
        stream=inspected.stream,
        responder=responder,
        deadline=deadline,
        timeouts=ctx.config.timeouts,
        outer_cause=cancel.why,
        metrics=ctx.metrics,
        request_started=started,
        rules=VllmRules(
            bodies,
            request.account,
            ctx.config.max_sse_event_bytes,
            missing_params=ctx.config.vllm_missing_kv_params,
        ),
        engine=NAME,
        account=request.account,
        event_limit=ctx.config.max_sse_event_bytes,
    )


async def vllm_bodies(request: PDRequest) -> VllmBodies:
    """The request's legs' bodies on a vLLM pair: made once per request (its retries and
    samples share them), off the event loop when large (`vllm_bodies.py`), or a 400 for what a
    vLLM pair cannot take."""
    if request.path == GENERATE:
        raise bad_request(
            "vLLM workers serve /v1/completions and /v1/chat/completions, not /generate"
        )
    if request.inspected.batch is not None:
        raise bad_request(
            "a vLLM pair takes one prompt per request (the prefill's answer carries one KV "
            "handoff): send the prompts as separate requests"
        )
    maker = request.vllm
    raw = request.inspected.body
    if maker is None:
        maker = VllmBodyMaker(request.path, raw)
    elif maker.raw is not raw:  # a migrated stream's body (`pd/resume.py`): made once too
        maker = maker.variant_for(raw)
    return await maker.bodies(request.account)
