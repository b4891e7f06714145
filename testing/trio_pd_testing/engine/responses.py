"""Response bodies in SGLang's native (/generate) and OpenAI shapes, whole and streamed.

`Output` is one request's answer, fed by its items (state.Item) as they produce tokens, finish
or fail; it renders what SGLang 0.5.23 sends for each route:

- /generate (`entrypoints/http_server.py`, `managers/tokenizer_manager.py`): one object per
  item (a list for a batch) with `text`, `output_ids`, `meta_info` (`id` = the item's rid,
  `finish_reason`, token counts, logprobs). A stream sends its 200 and SSE headers before any
  work, then one event per generated token (with `index` on a batch) and `data: [DONE]`. An
  abort WITHOUT a status (POST /abort_request of a running request) is a normal answer whose
  finish_reason is `{"type": "abort", "message", "status_code": null, "err_type": null}`; an
  abort WITH a status (a KV transfer that failed, a handshake aborted) fails a non-stream
  request (failures.abort_failure_body) and is one abort event in a stream.
- OpenAI (`entrypoints/openai/serving_chat.py`, `serving_completions.py`, `protocol.py`): NO
  top-level `meta_info`; a graceful abort shows only as `choices[*].finish_reason == "abort"`,
  an abort with a status as an HTTP status (non-stream) or a `data: {"error": {...}}` chunk
  after which the stream stops. Logprobs are in the OpenAI shape in `choices[].logprobs`. A
  stream's headers go out with its first chunk (SGLang kick-starts the generator first), so on
  a PD decode a chat or completions stream answers nothing until the KV has arrived.

With the engine's `multibyte_tokens` the text is what SGLang's detokenizer sends for the ids
(`detokenize.py`: a character cut between tokens is held back until whole); else each token's
text is its own `tok<k>`.

Logprobs are deterministic fakes. /generate prefill answers carry
`meta_info.input_token_logprobs` for every input token, decode answers an empty list there (a PD
router merges prefill's in front).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import trio

from trio_pd_testing.engine.asgi import Responder
from trio_pd_testing.engine.asgi import error_body as error_body  # (router tests import it here)
from trio_pd_testing.engine.detokenize import Detokenizer
from trio_pd_testing.engine.failures import abort_failure_body, stream_error
from trio_pd_testing.engine.workload import Workload, output_id, output_text


class Item(Protocol):
    """What an answer needs of an engine request (state.Item)."""

    index: int
    rid: str
    prompt_tokens: int
    cached_tokens: int
    generated: int


def logprob(token_id: int) -> float:
    return -round(0.01 + (token_id % 97) / 10.0, 4)


def triples(ids: list[int] | tuple[int, ...]) -> list[list[Any]]:
    return [[logprob(t), t, None] for t in ids]


def top_triples(ids: list[int] | tuple[int, ...], k: int) -> list[list[list[Any]]]:
    return [[[logprob(t + j), t + j, None] for j in range(k)] for t in ids]


def input_triples(ids: list[int] | tuple[int, ...]) -> list[list[Any]]:
    """Input logprobs: the prompt's first token has none (`[null, id, null]`)."""
    out = triples(ids)
    if out:
        out[0][0] = None
    return out


def input_top_triples(ids: list[int] | tuple[int, ...], k: int) -> list[Any]:
    """Input top logprobs: `null` for the prompt's first token."""
    out: list[Any] = top_triples(ids, k)
    if out:
        out[0] = None
    return out


def length_finish(count: int) -> dict[str, Any]:
    return {"type": "length", "length": count}


def abort_finish(message: str = "Aborted", status_code: int | None = None) -> dict[str, Any]:
    """FINISH_ABORT.to_json() (`managers/schedule_batch.py`)."""
    return {"type": "abort", "message": message, "status_code": status_code, "err_type": None}


def piece(k: int) -> str:
    return f"tok{k}" if k == 1 else f" tok{k}"


class Output:
    """The answer of one request; its items call token() / finish() / fail()."""

    def __init__(self, workload: Workload, resp: Responder, model: str, role: str) -> None:
        self.w = workload
        self.resp = resp
        self.model = workload.model or model
        self.role = role
        self.created = int(time.time())
        self.started = time.monotonic()
        self.sent_ts: set[int] = set()  # items whose response_sent_to_client_ts went out
        self.items: Sequence[Item] = ()
        self.finished: dict[int, dict[str, Any]] = {}  # index -> finish reason, in finish order
        self.failure: tuple[int, str] | None = None  # (status, message): the first abort error
        self.failed: set[int] = set()  # indexes of the items that aborted with a status
        self.stopped = False  # an OpenAI stream ended at an error chunk
        self.chat_opened: set[int] = set()
        self.last_id: str | None = None
        self.defer_headers = False  # a planned status fault holds a stream's headers back
        self.on_decided: Callable[[], None] | None = None
        self.held: list[Any] = []  # stream events held while headers are deferred
        # A request's `"sim_tag": true`: its generated text starts with its rid, so answers
        # that are otherwise alike (a router's `n > 1` samples) show which request wrote them.
        self.tag = False
        self.sent = 0  # tokens rendered so far, all items together (a stream's: sent)
        # `multibyte_tokens`: each item's detokenizer and the text its stream sent so far
        self.multibyte = False
        self.detokenizers: dict[int, Detokenizer] = {}
        self.streamed: dict[int, str] = {}
        self.streamed_piece: dict[int, str] = {}
        self._sent_waiters: list[tuple[int, trio.Event]] = []

    @property
    def complete(self) -> bool:
        """Nothing more will be rendered (all items ended, or the answer is already decided)."""
        if self.resp.completed or self.stopped:
            return True
        if self.failure is not None and not self.w.stream:
            return True
        return len(self.finished) + len(self.failed) >= len(self.items)

    def bind(self, items: Sequence[Item]) -> None:
        self.items = items

    def _text(self, item: Item, count: int) -> str:
        """The text of `item`'s first `count` tokens (tagged: its rid first); multibyte: what
        its stream sent so far, or a whole answer's text."""
        if self.multibyte:
            if self.w.stream:
                text = self.streamed.get(item.index, "")
            else:
                text = self._detokenizer(item).step(self._ids(item, 1, count), True)
        else:
            text = output_text(count, self.w.start_of(item.index) + 1)
        return f"{item.rid} {text}" if self.tag and count else text

    def _piece(self, item: Item, k: int) -> str:
        """The text of `item`'s k-th token in a stream (tagged: the first one after its rid)."""
        if self.multibyte:
            text = self.streamed_piece.pop(item.index, "")
        else:
            text = piece(self.w.start_of(item.index) + k)
        return f"{item.rid} {text}" if self.tag and k == 1 else text

    def _detokenizer(self, item: Item) -> Detokenizer:
        found = self.detokenizers.get(item.index)
        if found is None:
            prompt = self.w.prompts[self.w.prompt_of(item.index)]
            found = self.detokenizers[item.index] = Detokenizer.of(prompt, self.multibyte)
        return found

    def _detokenize_step(self, item: Item, k: int, last: bool) -> None:
        """multibyte: the detokenizer's step for the k-th token (its text for `_piece`, the
        stream's text so far for `_text`)."""
        out = self._detokenizer(item).step(self._ids(item, k, k), last)
        self.streamed[item.index] = self.streamed.get(item.index, "") + out
        self.streamed_piece[item.index] = out

    def _ids(self, item: Item, first: int, last: int) -> list[int]:
        """The ids of `item`'s tokens first..last (1-based, of this request's answer)."""
        start = self.w.start_of(item.index)
        return [output_id(start + k) for k in range(first, last + 1)]

    # ---- item callbacks -------------------------------------------------------------------
    async def token(self, item: Item, k: int, finish: dict[str, Any] | None = None) -> None:
        """Item produced its k-th token (`finish`: it is the last one, and why)."""
        item.generated = k
        if finish is not None:
            self.finished[item.index] = finish
        await self._render_token(item, k, finish)
        self.sent += 1
        for count, event in self._sent_waiters:
            if self.sent >= count:
                event.set()

    async def tokens_sent(self, count: int) -> None:
        """Wait until `count` tokens were rendered (a `@Ntok` fault's trigger)."""
        if self.sent < count:
            event = trio.Event()
            self._sent_waiters.append((count, event))
            await event.wait()

    async def _render_token(self, item: Item, k: int, finish: dict[str, Any] | None) -> None:
        if not self.w.stream or self.stopped:
            return
        self.last_id = item.rid
        if self.multibyte:
            self._detokenize_step(item, k, finish is not None)
        if self.w.api == "generate":
            await self._send(self._generate_event(item, k, finish))
        elif self.w.api == "chat":
            if item.index not in self.chat_opened:
                self.chat_opened.add(item.index)
                await self._send(self._chat_chunk(item.rid, item.index, _role_delta()))
            lp = self._chat_logprobs(k, k) if self.w.logprobs else None
            await self._send(
                self._chat_chunk(item.rid, item.index, _delta(self._piece(item, k)), lp)
            )
        else:
            lp = self._completion_logprobs(k, k) if self.w.logprobs else None
            reason = finish["type"] if finish else None
            text = self._piece(item, k)
            chunk = self._completion_chunk(item.rid, item.index, text, lp, reason)
            self._token_ids(chunk, item, self._ids(item, k, k), first=k == 1)
            await self._send(chunk)

    async def finish(self, item: Item, finish: dict[str, Any]) -> None:
        """Item ended without a further token (e.g. aborted before its first)."""
        self.finished[item.index] = finish
        if not self.w.stream or self.stopped:
            return
        self.last_id = item.rid
        if self.w.api == "generate":
            await self._send(self._generate_event(item, item.generated, finish))
        elif self.w.api == "chat":
            if item.index not in self.chat_opened:
                self.chat_opened.add(item.index)
                await self._send(self._chat_chunk(item.rid, item.index, _role_delta()))
        else:
            chunk = self._completion_chunk(item.rid, item.index, "", None, finish["type"])
            self._token_ids(chunk, item, [], first=item.generated == 0)
            await self._send(chunk)

    async def fail(self, item: Item, status: int, message: str) -> None:
        """Item aborted with a status: SGLang's FINISH_ABORT(message, status_code).

        Without a stream, or on an OpenAI stream, the first such failure decides the answer at
        once (SGLang raises it out of the request's handler, whose other engine requests are
        then aborted: `on_decided`); a /generate stream carries on with its other items.
        """
        self.failed.add(item.index)
        first = self.failure is None
        if first:
            self.failure = (status, message)
        if self.w.stream and self.w.api == "generate":
            self.last_id = item.rid
            finish = abort_finish(message, status)
            await self._send(self._generate_event(item, item.generated, finish))
            return
        if not first or self.stopped:
            return
        if self.on_decided is not None:  # the handler's cleanup runs before its answer goes
            self.on_decided()
        if self.w.stream:
            self.stopped = True
            await self._send(stream_error(message, status))
        await self.close()

    # ---- the end of the answer ------------------------------------------------------------
    async def close(self) -> None:
        """Send what remains once the items are done (or the answer was decided)."""
        if self.resp.completed:
            return
        if not self.w.stream:
            if self.failure is not None:
                status, message = self.failure
                await self.resp.json(status, abort_failure_body(self.w.api, status, message))
            else:
                await self.resp.json(200, self.full())
            return
        if self.w.api == "chat":
            for index, finish in self.finished.items():
                await self._send(
                    self._chat_chunk(
                        self.last_id or "", index, _finish_delta(), None, finish["type"]
                    )
                )
        if self.w.api != "generate" and self.w.include_usage:
            await self._send(self._usage_chunk())
        await self.flush()
        await self.resp.done()

    async def _send(self, obj: Any) -> None:
        if self.defer_headers and not self.resp.started:
            self.held.append(obj)
        else:
            await self.resp.event(obj)

    async def flush(self) -> None:
        for obj in self.held:
            await self.resp.event(obj)
        self.held.clear()

    # ---- /generate ------------------------------------------------------------------------
    def meta_info(self, item: Item, done: int, finish: dict[str, Any] | None) -> dict[str, Any]:
        ids = self._ids(item, 1, done)
        meta: dict[str, Any] = {
            "id": item.rid,
            "finish_reason": finish,
            "prompt_tokens": item.prompt_tokens,
            "completion_tokens": done,
            "cached_tokens": item.cached_tokens,
            "cached_tokens_details": None,  # null until the radix cache hits (SGLang 0.5.23)
            "weight_version": "default",
            "dp_rank": None,
            "num_retractions": 0,
            "reasoning_tokens": 0,
        }
        # Set once per request (`_wait_one_response`): on a stream's first event, on a whole
        # answer at its end.
        if item.index not in self.sent_ts and (self.w.stream or finish is not None):
            self.sent_ts.add(item.index)
            meta["response_sent_to_client_ts"] = time.time()
        if finish is not None:  # the last answer's figures (`_handle_batch_output`)
            meta["e2e_latency"] = time.monotonic() - self.started
            # one span: the weights never changed (utils/weight_versions.py)
            meta["weight_versions"] = [{"version": "default", "start": 0, "end": done}]
        if self.w.logprobs:
            inputs = self.w.prompts[self.w.prompt_of(item.index)] if self.role == "prefill" else ()
            meta["input_token_logprobs"] = input_triples(inputs)
            if self.w.top_logprobs:
                meta["input_top_logprobs"] = input_top_triples(inputs, self.w.top_logprobs)
            meta["output_token_logprobs"] = triples(ids)
            meta["output_token_logprobs_length"] = len(ids)
            if self.w.top_logprobs:
                meta["output_top_logprobs"] = top_triples(ids, self.w.top_logprobs)
        return meta

    def _generate_event(self, item: Item, k: int, finish: dict[str, Any] | None) -> dict[str, Any]:
        event: dict[str, Any] = {
            "text": self._text(item, k),
            "output_ids": self._ids(item, 1, k),
            "meta_info": self.meta_info(item, k, finish),
        }
        if self.w.is_batch:
            event["index"] = item.index
        return event

    # ---- whole bodies ---------------------------------------------------------------------
    def full(self) -> Any:
        """The non-stream answer of finished items (graceful aborts included)."""
        items = sorted(self.items, key=lambda i: i.index)
        if self.w.api == "generate":
            outs = [
                {
                    "text": self._text(i, i.generated),
                    "output_ids": self._ids(i, 1, i.generated),
                    "meta_info": self.meta_info(i, i.generated, self.finished.get(i.index)),
                }
                for i in items
            ]
            return outs if self.w.is_batch else outs[0]
        choices: list[dict[str, Any]] = []
        for item in items:
            done, finish = item.generated, self.finished.get(item.index) or {}
            choice: dict[str, Any] = {"index": item.index}
            if self.w.api == "chat":
                choice["message"] = {
                    "role": "assistant",
                    "content": self._text(item, done),
                    "reasoning_content": None,
                }
                lp = self._chat_logprobs(1, done) if self.w.logprobs else None
            else:
                choice["text"] = self._text(item, done)
                lp = self._completion_logprobs(1, done) if self.w.logprobs else None
            choice.update(
                {"logprobs": lp, "finish_reason": finish.get("type"), "matched_stop": None}
            )
            if self.w.api == "completions" and self.w.return_token_ids:
                choice["token_ids"] = self._ids(item, 1, done)
                choice["prompt_token_ids"] = list(self.w.prompts[self.w.prompt_of(item.index)])
            choices.append(choice)
        return {
            "id": items[0].rid,
            "object": "chat.completion" if self.w.api == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self._usage(),
            # build_endpoint_weight_version_metadata (utils/weight_versions.py)
            "metadata": {
                "weight_version": "default",
                "weight_versions": [{"version": "default", "start": 0, "end": items[0].generated}],
            },
        }

    def _usage(self) -> dict[str, Any]:
        """UsageProcessor: prompt tokens once per prompt (its first sample), all completions."""
        prompt = sum(len(p) for p in self.w.prompts)
        completion = sum(item.generated for item in self.items)
        return {
            "prompt_tokens": prompt,
            "total_tokens": prompt + completion,
            "completion_tokens": completion,
            "prompt_tokens_details": None,
            "reasoning_tokens": 0,
            "completion_tokens_details": None,
        }

    def _completion_logprobs(self, start: int, stop: int) -> dict[str, Any]:
        tokens = [piece(i) for i in range(start, stop + 1)]
        offsets, pos = [], len(output_text(start - 1)) if start > 1 else 0
        for tok in tokens:
            offsets.append(pos)
            pos += len(tok)
        top: list[Any] = []
        if self.w.top_logprobs:
            top = [
                {f"tok{i}+{j}": logprob(output_id(i) + j) for j in range(self.w.top_logprobs)}
                for i in range(start, stop + 1)
            ]
        return {
            "text_offset": offsets,
            "token_logprobs": [logprob(output_id(i)) for i in range(start, stop + 1)],
            "tokens": tokens,
            "top_logprobs": top,
        }

    def _chat_logprobs(self, start: int, stop: int) -> dict[str, Any]:
        content = []
        for i in range(start, stop + 1):
            tok = piece(i)
            content.append(
                {
                    "token": tok,
                    "bytes": list(tok.encode()),
                    "logprob": logprob(output_id(i)),
                    "top_logprobs": [
                        {
                            "token": f"{tok}+{j}",
                            "bytes": list(f"{tok}+{j}".encode()),
                            "logprob": logprob(output_id(i) + j),
                        }
                        for j in range(self.w.top_logprobs)
                    ],
                }
            )
        return {"content": content}

    # ---- OpenAI stream chunks -------------------------------------------------------------
    def _chat_chunk(
        self,
        chunk_id: str,
        index: int,
        delta: dict[str, Any],
        logprobs: Any = None,
        finish: str | None = None,
    ) -> dict[str, Any]:
        """sse_utils.build_sse_content: no `usage` key (omitted as a default)."""
        choice = {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish,
            "matched_stop": None,
        }
        return {
            "id": chunk_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        }

    def _completion_chunk(
        self, chunk_id: str, index: int, text: str, logprobs: Any, finish: str | None
    ) -> dict[str, Any]:
        choice = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish,
            "matched_stop": None,
        }
        return {
            "id": chunk_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": None,
        }

    def _token_ids(self, chunk: dict[str, Any], item: Item, ids: list[int], first: bool) -> None:
        """completions' `return_token_ids` (serving_completions.py): each chunk's new ids, the
        first chunk's the prompt's too; absent otherwise (popped when None)."""
        if not self.w.return_token_ids:
            return
        choice = chunk["choices"][0]
        choice["token_ids"] = ids
        if first:
            choice["prompt_token_ids"] = list(self.w.prompts[self.w.prompt_of(item.index)])

    def _usage_chunk(self) -> dict[str, Any]:
        usage = self._usage()
        chunk: dict[str, Any] = {
            "id": self.last_id or (self.items[0].rid if self.items else ""),
            "object": "chat.completion.chunk" if self.w.api == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage,
        }
        if self.w.api == "completions":  # model_dump_json(exclude_none=True)
            chunk["usage"] = {k: v for k, v in usage.items() if v is not None}
        return chunk


def _role_delta() -> dict[str, Any]:
    return {"reasoning_content": None, "role": "assistant", "content": ""}


def _delta(text: str) -> dict[str, Any]:
    return {"reasoning_content": None, "content": text}


def _finish_delta() -> dict[str, Any]:
    return {"reasoning_content": None}
