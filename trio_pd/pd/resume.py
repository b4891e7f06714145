"""One request's migration (issue 29): its transcript, its resumes, and the resumed attempt's body.

`migration.py` says what may resume and with which body, `stitch.py` how the resumed stream is
made to follow what the client got; this module holds one request's state across its attempts
and does the little I/O a resume needs:

- `Migration.for_request`: whether a stream is watched at all (`--migration-limit` > 0, a stream
  on /generate or completions, not refused by what is known without parsing the body);
- `Migration.request_for`: the attempt's request (completions ask for `return_token_ids`, so
  the ids the client got are the engine's own);
- `transcribed`: decode's stream as whole events through the transcript (what the client got
  is recorded; an engine's abort event mid-stream becomes a broken stream, never relayed);
- `Migration.decide`: at a break, resume or not (`outcome` label of trio_pd_migrations_total);
- `Migration.resumed_request`: the resumed attempt's request on its new pair; the prompt's ids
  of a text prompt come from that prefill engine's own `/tokenize`, and a greedy request's
  seam (`migration.py`: where the text of the ids sent is whole) from its `/detokenize`;
- `ContinuedResponder`: the client's responder as a resumed attempt sees it (already started:
  the resumed attempt sends no headers, only its events).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import attrs
import orjson

from trio_pd.observe.metrics import RouterMetrics
from trio_pd.pd.frames import answer_failure, event_data, parse_json
from trio_pd.pd.injection import splice
from trio_pd.pd.migration import (
    Seam,
    greedy,
    refusal,
    remaining_tokens,
    resume_body,
    seam_lists,
    seam_of,
    skip_special_tokens,
    within_context,
)
from trio_pd.pd.outcome import LegFailure
from trio_pd.pd.payload import CHAT, COMPLETIONS, GENERATE, Inspected
from trio_pd.pd.sse import EventReader
from trio_pd.pd.stitch import Transcript
from trio_pd.respond import Reply, Responder
from trio_pd.upstream.pool import UpstreamError

TOKENIZE_PATH = "/tokenize"
DETOKENIZE_PATH = "/detokenize"
MAX_TOKENIZE_ANSWER = 64 << 20

log = logging.getLogger(__name__)


class ResumeFailed(Exception):
    """The resume could not be prepared (the engine's /tokenize failed or said no)."""


@attrs.define(eq=False)
class Migration:
    """The migration state of one streamed request (see the module docstring)."""

    path: str
    inspected: Inspected  # the client's request, as it came
    limit: int
    early_refusal: str | None  # refused by what is known without parsing the body
    resumable: bool = True  # the current pair's engine resumes streams (`Engine.RESUMES`)
    # Its /detokenize finds a greedy resume's seam (`Engine.SEAM_BY_DETOKENIZE`)
    seam_by_detokenize: bool = True
    strip_ids: bool = False  # completions: token ids asked by the router, not the client
    transcript: Transcript | None = None
    resumes: int = 0
    break_reason: str | None = None  # set by `transcribed` when the engine aborted in-band
    payload: dict[str, Any] | None = None  # the client's body, parsed at the first break
    # The reason of the break being resumed, until its resumed attempt streams or fails.
    open_break: str | None = None
    context: int | None = None  # the engine's context (`max_model_len` of its /tokenize)

    @classmethod
    def for_request(cls, path: str, inspected: Inspected, limit: int) -> Migration | None:
        """A request's migration state; None when no break of it can be resumed or counted
        (migration off, not a stream)."""
        if limit <= 0 or not inspected.stream or path not in (GENERATE, COMPLETIONS, CHAT):
            return None
        early = None
        if inspected.batch is not None:
            early = "batch"
        elif inspected.multimodal:
            early = "multimodal"
        elif inspected.logprobs:
            early = "logprobs"
        elif path == CHAT:
            early = "chat_stream"
        asked = path == COMPLETIONS and b'"return_token_ids"' in inspected.body
        if asked:
            parsed = parse_json(inspected.body)
            asked = isinstance(parsed, dict) and parsed.get("return_token_ids") is True
        migration = cls(path, inspected, limit, early, strip_ids=path == COMPLETIONS and not asked)
        if early is None:
            migration.transcript = Transcript(path, strip_ids=migration.strip_ids)
        return migration

    def watching(self) -> bool:
        """Whether this attempt's stream goes through the transcript (an engine that resumes)."""
        return self.transcript is not None and self.resumable

    def request_inspected(self) -> Inspected:
        """The body the first attempt sends: completions ask for the ids of their tokens."""
        inspected = self.inspected
        if self.path != COMPLETIONS or not self.watching() or not self.strip_ids:
            return inspected
        body = splice(inspected.body, inspected.empty, {"return_token_ids": True})
        return attrs.evolve(inspected, body=body, empty=False)

    def broke(self, prefill_failed: bool, decode: object, cause: str | None) -> str | None:
        """The break's reason (`transport`, `timeout`, `inband`) when decode's stream broke
        after prefill succeeded, else None: a prefill failure, the request's own deadline
        (`cause`: the decode leg's cancel cause), an answer the router had no room for are no
        decode's death (nor is a client that stopped reading, which never gets here)."""
        inband, self.break_reason = self.break_reason, None
        if prefill_failed or not isinstance(decode, LegFailure) or cause == "deadline":
            return None
        if inband is not None:
            return inband
        return decode.kind if decode.kind in ("transport", "timeout", "inband") else None

    def count(self, metrics: RouterMetrics, reason: str, outcome: str) -> None:
        metrics.migrations.labels(reason, outcome).inc()

    def settle(self, metrics: RouterMetrics, streamed: bool) -> None:
        """The resumed attempt ended: a resume that got its stream going counts `resumed`."""
        if self.open_break is not None and streamed:
            self.count(metrics, self.open_break, "resumed")
            self.open_break = None

    def fail_open_break(self, metrics: RouterMetrics) -> None:
        if self.open_break is not None:
            self.count(metrics, self.open_break, "failed")
            self.open_break = None

    def parsed(self, inspected: Inspected) -> dict[str, Any]:
        if self.payload is None:
            payload = parse_json(inspected.body)
            self.payload = payload if isinstance(payload, dict) else {}
        return self.payload

    def decide(self, resumable: bool) -> str | None:
        """At a break after prefill succeeded: None to resume, else the outcome label saying
        why not (`refused_<rule>`, `limit`); `resumable`: the broken pair's engine resumes."""
        if not resumable:
            return "refused_engine"
        if self.early_refusal is not None or self.transcript is None:
            return f"refused_{self.early_refusal or 'unwatched'}"
        why = refusal(self.path, self.parsed(self.inspected), True)
        if why is not None:
            return f"refused_{why}"
        if self.resumes >= self.limit:
            return "limit"
        if remaining_tokens(self.path, self.payload or {}, self.transcript.sent) < 1:
            return "refused_budget_spent"
        return None

    async def resumed_inspected(self, inspected: Inspected, tokenize: Any) -> Inspected:
        """The resumed attempt's body (`migration.resume_body`) as the request's new bytes.

        `tokenize(payload, path)` asks the new pair's prefill (its `/tokenize` answer for a
        text prompt's ids; ids the client gave or the engine reported are used as they are, and
        its `/detokenize` answer for a greedy request's seam). The resumed prompt keeps the
        ids sent up to the seam; the stitcher then drops what the client already has.
        """
        assert self.transcript is not None
        payload = self.parsed(inspected)
        self.transcript.settle()
        sent = list(self.transcript.ids)
        prompt_ids = await self.prompt_ids(payload, tokenize)
        seam = Seam(len(sent), self.transcript.text)
        if sent and self.seam_by_detokenize and greedy(self.path, payload):
            seam = await self.seam(prompt_ids, sent, payload, tokenize) or seam
        kept = sent[: seam.keep]
        body = resume_body(self.path, payload, prompt_ids, kept)
        remaining = remaining_tokens(self.path, payload, len(kept))
        if not within_context(len(prompt_ids), len(kept), remaining, self.context):
            raise ResumeFailed("the resumed request would exceed the engine's context")
        if self.path == COMPLETIONS:
            body["return_token_ids"] = True
        self.resumes += 1
        self.transcript.resume(seam.keep, seam.text)
        return attrs.evolve(inspected, body=orjson.dumps(body), empty=False)

    async def seam(
        self, prompt_ids: list[int], sent: list[int], payload: dict[str, Any], tokenize: Any
    ) -> Seam | None:
        """Where the text of the ids sent is whole (`migration.seam_of`), by the engine's own
        `/detokenize`; None (every id kept, as for a sampled request) when it cannot say."""
        assert self.transcript is not None
        ask: dict[str, Any] = {"tokens": seam_lists(prompt_ids, sent)}
        skip = skip_special_tokens(self.path, payload)
        if isinstance(skip, bool):
            ask["skip_special_tokens"] = skip
        try:
            answer = await tokenize(ask, DETOKENIZE_PATH)
        except (ResumeFailed, UpstreamError) as exc:
            log.warning("migration: no seam, every id sent kept: /detokenize failed: %s", exc)
            return None
        seam = seam_of(answer.get("text"), len(sent), self.transcript.text)
        if seam is None:
            log.warning("migration: no seam in reach, every id sent kept (the text may differ)")
        elif seam.keep < len(sent):
            log.info(
                "migration: the break cut a character: resumed from %d of the %d ids sent",
                seam.keep, len(sent),
            )  # fmt: skip
        return seam

    async def prompt_ids(self, payload: dict[str, Any], tokenize: Any) -> list[int]:
        assert self.transcript is not None
        if self.path == COMPLETIONS:
            if self.transcript.prompt_ids is None:
                raise ResumeFailed("the engine reported no prompt_token_ids")
            return list(self.transcript.prompt_ids)
        ids = payload.get("input_ids")
        if isinstance(ids, list) and all(isinstance(i, int) for i in ids):
            return list(ids)
        text = payload.get("text")
        if not isinstance(text, str):
            raise ResumeFailed("no prompt to resume from")
        answer = await tokenize({"prompt": text})
        tokens = answer.get("tokens") if isinstance(answer, dict) else None
        context = answer.get("max_model_len") if isinstance(answer, dict) else None
        self.context = context if isinstance(context, int) and context > 0 else None
        if not isinstance(tokens, list) or not all(isinstance(i, int) for i in tokens):
            raise ResumeFailed(f"the engine's /tokenize answered {str(answer)[:200]}")
        return tokens


def tokenize_body(payload: dict[str, Any]) -> bytes:
    return orjson.dumps(payload)


def parse_tokenize(status: int, body: bytes) -> dict[str, Any]:
    """The engine's /tokenize or /detokenize answer, a JSON object."""
    if not 200 <= status < 300:
        raise ResumeFailed(f"the engine answered {status}: {body[:200]!r}")
    answer = parse_json(body)
    if not isinstance(answer, dict):
        raise ResumeFailed(f"the engine answered {body[:200]!r}")
    return answer


def transcribed(
    migration: Migration,
    transcript: Transcript,
    first: bytes,
    rest: bytes,
    chunks: AsyncIterator[bytes],
    limit: int,
    account: Any = None,
) -> tuple[bytes, AsyncIterator[bytes]]:
    """Decode's stream as the client gets it while it may be resumed: whole events only, each
    through the transcript (`stitch.Transcript.relay`), the first one returned now. An event in
    which the engine aborted the request ends the stream as a break (TransportError), unsent;
    the events before it go out first, so the transcript holds exactly what the client got."""
    head, broken = _through(migration, transcript, [first])
    if broken is not None:
        raise broken

    async def events() -> AsyncIterator[bytes]:
        reader = EventReader(limit, account)
        try:
            pending = [rest] if rest else []
            async for chunk in _chained(pending, chunks):
                out, broken = _through(migration, transcript, reader.feed(chunk))
                if out:
                    yield out
                if broken is not None:
                    raise broken
        finally:
            reader.close()

    return head, events()


async def _chained(first: list[bytes], chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    for chunk in first:
        yield chunk
    async for chunk in chunks:
        yield chunk


def _through(
    migration: Migration, transcript: Transcript, events: list[bytes]
) -> tuple[bytes, UpstreamError | None]:
    """The events as the client gets them, up to an abort event of the engine's (returned as
    the break it is, itself unsent)."""
    out = []
    for event in events:
        data = event_data(event)
        if data is None or data == b"[DONE]":
            out.append(event)
            continue
        if b"error" not in data and b"abort" not in data and transcript.defer(data):
            out.append(event)  # the whole answer so far: read only if a break asks
            continue
        obj = parse_json(data)
        failure = answer_failure(obj)
        if failure is not None and not transcript.finished:
            migration.break_reason = "inband"
            message = f"the engine ended the stream: {failure.message}"
            return b"".join(out), UpstreamError("transport", message)
        new = transcript.relay(obj)
        if new is None:
            continue  # a resumed event with nothing the client has not got
        out.append(event if new is obj else b"data: " + orjson.dumps(new) + b"\n\n")
    return b"".join(out), None


@attrs.define(eq=False)
class ContinuedResponder(Responder):
    """The client's responder as a resumed attempt sees it: the client's stream is open
    already (its headers went out with the broken attempt's first event), so `start` only
    notes that this attempt began relaying; its events and the stream's end are the client's."""

    inner: Responder | None = None

    @classmethod
    def of(cls, inner: Responder) -> ContinuedResponder:
        return cls(inner.send_message, inner.request_id, inner.cors, inner=inner)

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.started = True
        self.status = status

    async def send(self, chunk: bytes) -> None:
        assert self.inner is not None
        await self.inner.send(chunk)

    async def finish_stream(self, last: bytes) -> None:
        assert self.inner is not None
        self.finished = True
        await self.inner.finish_stream(last)

    async def reply(self, reply: Reply) -> None:  # pragma: no cover - dispatch never does
        raise AssertionError("a resumed attempt's client already has its stream")
