"""`n > 1`: each sample its own PD request, in one nursery, merged into one answer.

SGLang cannot sample `n > 1` on a PD pair: its tokenizer manager expands one prompt into n
requests with regenerated rids that share the one bootstrap room, so the prefill answers and
the decode's samples wait for KV caches that never come (docs/protocol.md §2; and a list of n
rids is refused, the batch size being 1). The router therefore runs sample i as a request of its
own (the client's body less `n`: a fresh pair, room and rid per attempt, retried on its own),
and merges the n answers as the engine would have given them:

- non-stream: OpenAI routes get one answer whose `choices` are the samples' first choices, in
  order, with `index` i, and `usage` counting the prompt once and every sample's completion;
  `/generate` gets the list of the n answers, as SGLang answers a parallel-sampling request;
- stream: the client's headers go out once EVERY sample has its first event (so a failed
  prefill of any sample still gets a real status); from then on each sample's events are
  relayed as they come, OpenAI chunks with their choices' `index` set to i, `/generate` events
  with `index` i (SGLang's own field for parallel samples); the samples' `[DONE]`s and usage
  chunks are held back and the stream ends with one usage chunk (when the samples sent any)
  and one `[DONE]`.

Failure: the first sample to fail decides. Before the client's stream started, its answer is
the client's (a prefill 4xx stays that 4xx, and so on) and the other samples are cancelled at
once, which closes their legs and aborts them in their engines, exactly as a failed prefill
cancels its decode; after it started, its error frame ends the stream. A client that leaves
cancels every sample.

The request's outcome (the access line, the span: `respond.RequestNotes`) names the route of
the sample that decided the answer: the first to fail (its workers, its attempts and
resumes), not a sample that another's failure cancelled; else sample 0. `samples` is n.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import orjson
import trio

from trio_pd.pd.budget import Account
from trio_pd.pd.cancel import RequestCancel
from trio_pd.pd.frames import DONE_FRAME, event_data
from trio_pd.pd.frames import parse_json as parse
from trio_pd.pd.payload import CHAT, COMPLETIONS, GENERATE
from trio_pd.pd.sse import EventReader, EventTooLarge
from trio_pd.respond import JSON_HEADERS, Reply, RequestNotes, Responder

log = logging.getLogger(__name__)
MAX_HELD_BYTES = 64 << 10  # a sample's stream held before the client's stream starts, at most

Dispatch = Callable[[int, Responder, RequestCancel], Awaitable[None]]


@attrs.define(eq=False)
class Sample:
    """One sample's answer as it arrives: the messages its dispatch sent to its responder."""

    index: int
    cancel: RequestCancel
    reader: EventReader  # its stream's events, each byte scanned once, each event bounded
    status: int | None = None
    headers: list[tuple[bytes, bytes]] = attrs.Factory(list)
    body: bytearray = attrs.Factory(bytearray)  # a whole (non-stream) answer
    held: list[bytes] = attrs.Factory(list)  # events before every sample had started
    held_bytes: int = 0
    done: bool = False  # its response ended
    failed: bool = False  # not a 2xx, or its stream ended with an error frame
    notes: RequestNotes = attrs.Factory(RequestNotes)  # its route (its own dispatch writes it)


class SampleStreams:
    """The merge of n sample streams into the client's one (see the module docstring)."""

    def __init__(self, path: str, responder: Responder, samples: list[Sample]) -> None:
        self.path = path
        self.responder = responder
        self.samples = samples
        self.started = trio.Event()  # every sample has its first event: the client's stream is on
        self.usage: list[dict[str, Any]] = []
        self.lock = trio.Lock()  # one sample's events at a time on the client's stream

    async def on_start(self, sample: Sample) -> None:
        if all(s.status is not None for s in self.samples) and not self.started.is_set():
            first = self.samples[0]
            await self.responder.start(first.status or 200, first.headers)
            self.started.set()

    async def on_bytes(self, sample: Sample, chunk: bytes) -> bool:
        """Relay a sample's events once every sample started; False: it sent an event past
        the bound, or too much while the others had not started (a first event is a few
        hundred bytes), so it failed."""
        try:
            events = sample.reader.feed(chunk)
        except EventTooLarge:
            return False
        if not self.started.is_set():
            sample.held += events
            sample.held_bytes += sum(len(e) for e in events)
            if sample.held_bytes + len(sample.reader.pending) > MAX_HELD_BYTES:
                return False
            await self.started.wait()
            events, sample.held = sample.held, []
        async with self.lock:
            out = self.rewrite(sample, events)
            if out:
                await self.responder.send(out)
        return True

    def rewrite(self, sample: Sample, events: list[bytes]) -> bytes:
        """`sample`'s events as the client gets them: indexed by sample, `[DONE]` and usage
        chunks held back for the end."""
        out = bytearray()
        for event in events:
            data = event_data(event)
            if data is None or data == b"[DONE]":
                continue  # one [DONE] ends the merged stream
            parsed = parse(data)
            if not isinstance(parsed, dict):
                out += event
                continue
            if self.path == GENERATE:
                parsed["index"] = sample.index
            else:
                choices = parsed.get("choices")
                if choices == [] and isinstance(parsed.get("usage"), dict):
                    self.usage.append(parsed)  # the samples' usage chunks: merged at the end
                    continue
                if isinstance(choices, list):
                    for choice in choices:
                        if isinstance(choice, dict):
                            choice["index"] = sample.index
            out += b"data: " + orjson.dumps(parsed) + b"\n\n"
        return bytes(out)

    def final_frames(self) -> bytes:
        """One usage chunk (when the samples sent any) and the one `[DONE]`."""
        if not self.usage:
            return DONE_FRAME
        merged = dict(self.usage[0])
        merged["usage"] = merge_usage([u["usage"] for u in self.usage])
        return b"data: " + orjson.dumps(merged) + b"\n\n" + DONE_FRAME


def merge_usage(usages: list[dict[str, Any]]) -> dict[str, Any]:
    """The prompt counted once (every sample read the same one), completions summed."""
    merged = dict(usages[0])
    completion = sum(u.get("completion_tokens") or 0 for u in usages)
    merged["completion_tokens"] = completion
    merged["total_tokens"] = (merged.get("prompt_tokens") or 0) + completion
    return merged


def merge_answers(path: str, answers: list[bytes]) -> bytes | None:
    """The n non-stream answers as one (None: one of them is not the JSON expected)."""
    parsed = [parse(a) for a in answers]
    if path == GENERATE:
        return orjson.dumps(parsed) if all(isinstance(p, dict) for p in parsed) else None
    if not all(isinstance(p, dict) and isinstance(p.get("choices"), list) for p in parsed):
        return None
    merged = dict(parsed[0])
    choices = []
    for index, answer in enumerate(parsed):
        for choice in answer["choices"][:1]:
            choices.append({**choice, "index": index} if isinstance(choice, dict) else choice)
    merged["choices"] = choices
    usages = [a["usage"] for a in parsed if isinstance(a.get("usage"), dict)]
    if usages:
        merged["usage"] = merge_usage(usages)
    return orjson.dumps(merged)


async def dispatch_samples(
    path: str,
    count: int,
    stream: bool,
    responder: Responder,
    cancel: RequestCancel,
    dispatch_one: Dispatch,
    event_limit: int,
    account: Account | None = None,
) -> None:
    """Answer a request of `count` samples through `dispatch_one(i, responder, cancel)`, one
    PD request each (see the module docstring); `event_limit` bounds an SSE event
    (`--max-sse-event-bytes`), `account` is the request's memory budget."""
    assert path in (GENERATE, COMPLETIONS, CHAT)
    samples = [
        Sample(i, RequestCancel(parent=cancel), EventReader(event_limit, account))
        for i in range(count)
    ]
    merge = SampleStreams(path, responder, samples) if stream else None
    failure: list[Sample] = []

    def fail(sample: Sample) -> None:
        """The first failure decides: every other sample is cancelled at once."""
        sample.failed = True
        if not failure:
            failure.append(sample)
            for other in samples:
                if other is not sample:
                    other.cancel.cancel("sample_failed")

    async def run(sample: Sample) -> None:
        async def sink(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                sample.status = message["status"]
                dropped = (b"x-request-id", b"content-length")  # the client's responder's own
                sample.headers = [(k, v) for k, v in message["headers"] if k not in dropped]
                if not 200 <= sample.status < 300:
                    fail(sample)
                elif merge is not None:
                    await merge.on_start(sample)
                return
            body = message.get("body", b"")
            ending = not message.get("more_body", False)
            if merge is not None and not sample.failed and sample.status is not None:
                if ending and body.strip():
                    fail(sample)  # a stream ends with bytes only with its error frame
                if not await merge.on_bytes(sample, body):
                    log.warning(
                        "sample %d sent an event past the bound, or more than %d bytes before "
                        "every sample started", sample.index, MAX_HELD_BYTES,
                    )  # fmt: skip
                    sample.status = 502
                    sample.headers = list(JSON_HEADERS)
                    sample.body = bytearray(error_json("a sample's stream misbehaved"))
                    fail(sample)
                    sample.cancel.cancel("sample_failed")
                    await trio.lowlevel.checkpoint()
            else:
                sample.body += body
            if ending:
                sample.done = True

        sub = Responder(sink, responder.request_id, notes=sample.notes)
        with sample.cancel.scope:
            await dispatch_one(sample.index, sub, sample.cancel)

    responder.notes.samples = count
    try:
        async with trio.open_nursery() as nursery:
            for sample in samples:
                nursery.start_soon(run, sample)
    finally:
        for sample in samples:
            sample.reader.close()  # gives its budget back
        # The request's route is the one of the sample that decided its answer.
        responder.notes.take_route((failure or samples)[0].notes)
    await answer(path, responder, samples, merge, failure)


async def answer(
    path: str,
    responder: Responder,
    samples: list[Sample],
    merge: SampleStreams | None,
    failure: list[Sample],
) -> None:
    """The client's answer once every sample ended (or was cancelled)."""
    if responder.finished:
        return
    if responder.started:  # a stream: its end (after a failing sample's error event)
        assert merge is not None
        await responder.finish_stream(DONE_FRAME if failure else merge.final_frames())
        return
    if failure:
        first = failure[0]
        status = first.status or 502
        await responder.reply(Reply(status, first.headers or JSON_HEADERS, bytes(first.body)))
        return
    if merge is not None:  # every sample ended before the stream could start: cannot happen
        return
    body = merge_answers(path, [bytes(s.body) for s in samples])
    if body is None:
        first = samples[0]
        await responder.reply(Reply(502, JSON_HEADERS, error_json("a sample's answer is not JSON")))
        log.warning("sample answers could not be merged (the first: %r)", bytes(first.body[:200]))
        return
    await responder.reply(Reply(samples[0].status or 200, samples[0].headers or JSON_HEADERS, body))


def error_json(message: str) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": "upstream_error", "code": 502}})
