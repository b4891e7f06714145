"""The outcome table of docs/protocol.md §4 (and docs/vllm.md §4), as a table.

Each row drives one `Attempt` (under its engine's rules, `pd/engines/`) against a scripted
upstream with no sockets (`scripted.py`): leg x phase x failure kind x stream x engine. A row
says what the attempt must make of it: the client's status, the leg to blame and its failure
kind, the other leg's cancel cause, which legs the engine was asked to abort, the retry state's
next step, and whether "decode broke after prefill succeeded and bytes already went out" (the
case a migration resumes). Under trio's autojump clock every timeout fires at once: the whole
table runs in well under a second. The socket tests (tests/router/) stay: they prove the same
against real connections and the simulator; this proves the decisions, row by row.
"""

from __future__ import annotations

import contextlib
import random
from typing import Any

import attrs
import orjson
import pytest
import trio
import trio.testing

from tests.pd.scripted import (
    SSE,
    Break,
    Client,
    Hang,
    Mark,
    Script,
    ScriptedPool,
    Wait,
    sent_mark,
)
from trio_pd.config import RetryConfig, TimeoutConfig
from trio_pd.fleet.worker import Worker
from trio_pd.observe.metrics import RouterMetrics
from trio_pd.pd.attempt import Attempt, Leg
from trio_pd.pd.engines.sglang import SglangRules
from trio_pd.pd.engines.vllm import VllmRules
from trio_pd.pd.outcome import AttemptOutcome
from trio_pd.pd.retry_state import Answer, EndStream, Retry, RetryState, decode_broke_after_bytes
from trio_pd.pd.vllm_bodies import vllm_bodies
from trio_pd.respond import Responder
from trio_pd.spec import WorkerSpec

PREFILL_URL, DECODE_URL, SPARE_DECODE_URL = "http://prefill", "http://decode", "http://decode2"
DEADLINE_SECS = 1000.0  # past every idle timeout: the deadline row hangs both legs

# SGLang answers (/generate).
SG_PREFILL_OK = b'{"text":"","meta_info":{"id":"r"}}'
SG_DECODE_OK = b'{"text":"hello","meta_info":{"finish_reason":{"type":"stop"}}}'
INBAND_ERROR = b'{"error":{"message":"engine exploded"}}'
INBAND_400 = b'{"error":{"message":"prompt too long","code":400}}'
STATUS_400 = b'{"error":{"message":"bad parameter"}}'
ABORTED = b'{"text":"","meta_info":{"finish_reason":{"type":"abort","message":"Aborted"}}}'
EV1, EV2 = b'data: {"text":"a"}\n\n', b'data: {"text":"b"}\n\n'
DONE = b"data: [DONE]\n\n"
EV_ERROR = b'data: {"error":{"message":"engine exploded"}}\n\n'

# vLLM answers (/v1/completions).
HANDOFF = {
    "do_remote_decode": False,
    "do_remote_prefill": True,
    "remote_block_ids": [1, 2],
    "remote_engine_id": "engine-1",
    "remote_request_id": "req-1",
    "remote_host": "127.0.0.1",
    "remote_port": 5600,
    "tp_size": 1,
}
VL_PREFILL_OK = orjson.dumps(
    {"choices": [{"text": "h"}], "usage": {"prompt_tokens": 3}, "kv_transfer_params": HANDOFF}
)
VL_PREFILL_NO_PARAMS = b'{"choices":[{"text":"h"}],"usage":{"prompt_tokens":3}}'
VL_DECODE_OK = b'{"choices":[{"text":"hello"}],"kv_transfer_params":null}'
VL_EV1 = b'data: {"choices":[{"text":"a"}]}\n\n'
VL_EV_ERROR = b'data: {"error":{"message":"KV read failed","code":500}}\n\n'


def ok(body: bytes) -> Script:
    return Script(body=(body,))


def sse(*events: Any) -> Script:
    return Script(content_type=SSE, body=tuple(events))


def status(code: int, body: bytes = b'{"error":{"message":"worker says no"}}') -> Script:
    return Script(status=code, body=(body,))


HANG = Script(head=(Hang(),))
PREFILL_OUT, DECODE_OUT = Wait(sent_mark(PREFILL_URL)), Wait(sent_mark(DECODE_URL))


def once(out: Wait, script: Script) -> Script:
    """`script`, answered once the other leg's request is out (the engine holds it)."""
    return attrs.evolve(script, head=(out, *script.head))


def after_decode(script: Script) -> Script:
    return once(DECODE_OUT, script)


def after_prefill(script: Script) -> Script:
    return once(PREFILL_OUT, script)


@attrs.frozen
class Row:
    """One row: the scripts of both legs, and what must follow from them."""

    name: str
    engine: str  # "sglang" | "vllm"
    stream: bool
    prefill: Script
    decode: Script
    client: int | None  # the status the client gets (None: the client left)
    culprit: str | None  # the leg blamed, "prefill" | "decode"
    kind: str | None  # its failure kind
    step: str  # "answer" | "retry:<role>" | "cut:<code>" (an error event) | "done" | "gone"
    cancelled: tuple[tuple[str, str], ...] = ()  # (role, cancel cause) of legs cut while out
    aborted: tuple[str, ...] = ()  # roles whose engine was asked to abort (`/abort_request`)
    broke_after_bytes: bool = False  # `retry_state.decode_broke_after_bytes`
    decode_sent: bool = True  # the decode leg's request was written at all
    client_leaves_at: str | None = None  # a mark: the client goes away there
    stop_reading_after: int | None = None  # the client stops reading after this many writes
    deadline: float = DEADLINE_SECS  # the request's, from the attempt's start


S, V = "sglang", "vllm"
ROWS = [
    # -- SGLang, no stream -------------------------------------------------------------------
    Row("prefill 5xx, decode waiting", S, False,
        after_decode(status(500)), HANG, 502, "prefill", "status",
        "retry:prefill", (("decode", "prefill_failed"),), ("decode",)),
    Row("prefill 4xx relayed", S, False,
        after_decode(status(400, STATUS_400)), HANG, 400, "prefill",
        "status", "answer", (("decode", "prefill_failed"),), ("decode",)),
    Row("prefill transport", S, False, after_decode(Script(body=(Break(),))), HANG, 502, "prefill",
        "transport", "retry:prefill", (("decode", "prefill_failed"),), ("decode",)),
    Row("prefill refused before sending", S, False, Script(refuse=True), HANG, 502, "prefill",
        "transport", "retry:prefill", decode_sent=False),
    Row("prefill in-band error", S, False,
        after_decode(ok(INBAND_ERROR)), HANG, 502, "prefill", "inband",
        "retry:prefill", (("decode", "prefill_failed"),), ("decode",)),
    Row("prefill in-band 4xx", S, False,
        after_decode(ok(INBAND_400)), HANG, 400, "prefill", "inband",
        "answer", (("decode", "prefill_failed"),), ("decode",)),
    Row("prefill aborted in its engine", S, False,
        after_decode(ok(ABORTED)), HANG, 502, "prefill", "inband",
        "retry:prefill", (("decode", "prefill_failed"),), ("decode",)),
    Row("decode 5xx first", S, False, HANG, after_prefill(status(503)), 503, "decode", "status",
        "retry:decode", (("prefill", "decode_failed"),), ("prefill",)),
    Row("decode 4xx relayed", S, False,
        HANG, after_prefill(status(400, STATUS_400)), 400, "decode", "status",
        "answer", (("prefill", "decode_failed"),), ("prefill",)),
    Row("decode transport first", S, False,
        HANG, after_prefill(Script(body=(Break(),))), 502, "decode",
        "transport", "retry:decode", (("prefill", "decode_failed"),), ("prefill",)),
    Row("decode refused before sending", S, False, HANG, Script(refuse=True), 502, "decode",
        "transport", "retry:decode", (("prefill", "decode_failed"),), ("prefill",),
        decode_sent=False),
    Row("decode in-band error", S, False,
        HANG, after_prefill(ok(INBAND_ERROR)), 502, "decode", "inband",
        "retry:decode", (("prefill", "decode_failed"),), ("prefill",)),
    Row("both succeed", S, False, ok(SG_PREFILL_OK), ok(SG_DECODE_OK), 200, None, None,
        "answer"),
    Row("decode first, prefill then succeeds", S, False,
        Script(head=(Wait("decoded"),), body=(SG_PREFILL_OK,)),
        Script(body=(SG_DECODE_OK, Mark("decoded"))), 200, None, None, "answer"),
    Row("decode first, prefill then fails", S, False,
        Script(status=500, head=(Wait("decoded"),), body=(b"{}",)),
        Script(body=(SG_DECODE_OK, Mark("decoded"))), 502, "prefill", "status",
        "retry:prefill"),
    Row("decode first, prefill past its hold", S, False, HANG, ok(SG_DECODE_OK), 504,
        "prefill", "timeout", "retry:prefill", (), ("prefill",)),
    Row("the deadline", S, False, HANG, HANG, 504, "prefill", "timeout", "retry:prefill",
        (("prefill", "deadline"), ("decode", "deadline")), ("prefill", "decode")),
    Row("the client leaves", S, False,
        after_decode(Script(body=(Mark("asked"), Hang()))), HANG, None,
        None, None, "gone", (("prefill", "client_gone"), ("decode", "client_gone")),
        ("prefill", "decode"), client_leaves_at="asked"),
    # -- SGLang, stream ----------------------------------------------------------------------
    Row("stream: both succeed", S, True, sse(EV1, DONE), sse(EV1, EV2, DONE), 200, None, None,
        "done"),
    Row("stream: prefill fails before decode's first event", S, True,
        after_decode(status(500)), HANG, 502,
        "prefill", "status", "retry:prefill", (("decode", "prefill_failed"),), ("decode",)),
    Row("stream: prefill fails after the stream started", S, True,
        Script(status=500, head=(Wait("first"),), body=(b"{}", Mark("prefill_failed"))),
        sse(EV1, Mark("first"), Wait("prefill_failed"), EV2, DONE), 200, "prefill", "status",
        "done"),
    Row("stream: decode's first event an error", S, True, HANG,
        after_prefill(sse(EV_ERROR, DONE)), 502, "decode", "inband", "retry:decode",
        (("prefill", "decode_failed"),), ("prefill",)),
    Row("stream: no first token", S, True, sse(EV1, DONE), Script(content_type=SSE,
        body=(Hang(),)), 504, "decode", "timeout", "retry:decode", (), ("decode",)),
    Row("stream: decode breaks mid-stream", S, True, sse(EV1, DONE), sse(EV1, EV2, Break()),
        200, "decode", "transport", "cut:502", broke_after_bytes=True),
    Row("stream: decode silent mid-stream", S, True, sse(EV1, DONE), sse(EV1, Hang()), 200,
        "decode", "timeout", "cut:504", (), ("decode",), broke_after_bytes=True),
    Row("stream: the client stops reading", S, True, sse(EV1, DONE), sse(EV1, EV2, EV2, Hang()),
        200, None, None, "done", (("decode", "stall"),), ("decode",), stop_reading_after=1),
    Row("stream: the deadline after the first event", S, True, sse(EV1, DONE),
        sse(EV1, Wait("never")), 200, "decode", "timeout", "cut:504", (("decode", "deadline"),),
        ("decode",), broke_after_bytes=True, deadline=100.0),
    # -- vLLM, no stream (sequential: decode is sent nothing until prefill answered) ---------
    Row("vllm: prefill 5xx", V, False, status(500), ok(VL_DECODE_OK), 502, "prefill",
        "status", "retry:prefill", decode_sent=False),
    Row("vllm: prefill 4xx relayed", V, False, status(400, STATUS_400), ok(VL_DECODE_OK), 400,
        "prefill", "status", "answer", decode_sent=False),
    Row("vllm: prefill transport", V, False, Script(body=(Break(),)), ok(VL_DECODE_OK), 502,
        "prefill", "transport", "retry:prefill", decode_sent=False),
    Row("vllm: prefill in-band error", V, False, ok(INBAND_ERROR), ok(VL_DECODE_OK), 502,
        "prefill", "inband", "retry:prefill", decode_sent=False),
    Row("vllm: prefill past the deadline", V, False, HANG, ok(VL_DECODE_OK), 504, "prefill",
        "timeout", "retry:prefill", (("prefill", "deadline"),), decode_sent=False),
    Row("vllm: decode 500 after the handoff is kv_transfer", V, False, ok(VL_PREFILL_OK),
        status(500), 502, "decode", "kv_transfer", "retry:decode"),
    Row("vllm: decode 4xx stays the client's", V, False, ok(VL_PREFILL_OK),
        status(400, STATUS_400), 400, "decode", "status", "answer"),
    Row("vllm: decode transport", V, False, ok(VL_PREFILL_OK), Script(body=(Break(),)), 502,
        "decode", "transport", "retry:decode"),
    Row("vllm: both succeed", V, False, ok(VL_PREFILL_OK), ok(VL_DECODE_OK), 200, None, None,
        "answer"),
    Row("vllm: no handoff, decode computes the prompt", V, False, ok(VL_PREFILL_NO_PARAMS),
        ok(VL_DECODE_OK), 200, None, None, "answer"),
    # -- vLLM, stream -------------------------------------------------------------------------
    Row("vllm stream: both succeed", V, True, ok(VL_PREFILL_OK), sse(VL_EV1, DONE), 200, None,
        None, "done"),
    Row("vllm stream: decode's error chunk after the start is kv_transfer", V, True,
        ok(VL_PREFILL_OK), sse(VL_EV1, VL_EV_ERROR, DONE), 200, "decode", "kv_transfer", "done",
        broke_after_bytes=True),
    Row("vllm stream: decode breaks mid-stream", V, True, ok(VL_PREFILL_OK),
        sse(VL_EV1, Break()), 200, "decode", "transport", "cut:502", broke_after_bytes=True),
    Row("vllm stream: no first token", V, True, ok(VL_PREFILL_OK),
        Script(content_type=SSE, body=(Hang(),)), 504, "decode", "timeout", "retry:decode"),
]  # fmt: skip


def worker(url: str, role: str, engine: str) -> Worker:
    return Worker(WorkerSpec(url, role, 8998 if role == "prefill" else None, engine=engine), url)  # type: ignore[arg-type]


def build(row: Row, pool: ScriptedPool, responder: Responder, aborted: list[str]) -> Attempt:
    """The attempt an engine module builds for this row, minus the fleet and the bodies'
    bootstrap fields (pd/engines/*.new_attempt; those are the socket tests')."""
    prefill, decode = worker(PREFILL_URL, "prefill", row.engine), worker(DECODE_URL, "decode",
                                                                         row.engine)  # fmt: skip
    now = trio.current_time()
    if row.engine == S:
        path, body = "/generate", orjson.dumps({"text": "hi", "stream": row.stream})
        rules: Any = SglangRules(logprobs=False)
        prefill_body, decode_body = body, body

        def hook(leg: Leg) -> None:
            aborted.append(leg.role)

        abort: Any = hook
    else:
        path = "/v1/completions"
        bodies = vllm_bodies(path, orjson.dumps({"prompt": "hi", "stream": row.stream}))
        rules = VllmRules(bodies, None, 1 << 20)
        prefill_body, decode_body = bodies.prefill, b""
        abort = None  # vLLM has no abort endpoint: a closed connection is its abort
    return Attempt(
        pool=pool,  # type: ignore[arg-type]
        path=path,
        prefill=Leg("prefill", prefill, prefill_body, [], contextlib.nullcontext, abort),
        decode=Leg("decode", decode, decode_body, [], contextlib.nullcontext, abort),
        stream=row.stream,
        responder=responder,
        deadline=now + row.deadline,
        timeouts=TimeoutConfig(),
        outer_cause=lambda: ("client_gone", trio.current_time()),
        metrics=RouterMetrics(),
        request_started=now,
        rules=rules,
        engine=row.engine,
    )


@attrs.define
class OneDecodeMore:
    """The fleet as the retry state sees it: a decode this request has not tried yet."""

    engine: str

    def available(self, role: str, model: str | None) -> list[Worker]:
        return [worker(SPARE_DECODE_URL, "decode", self.engine)]


def step_name(step: Answer | Retry | EndStream, outcome: AttemptOutcome) -> str:
    if isinstance(step, Retry):
        return f"retry:{step.culprit}"
    if isinstance(step, Answer):
        return "answer"
    if step.frame is None:
        return "done"
    error = orjson.loads(step.frame.split(b"\n\n")[0].removeprefix(b"data: "))["error"]
    return f"cut:{error['code']}"


async def drive(row: Row) -> tuple[AttemptOutcome, str, Client, ScriptedPool, list[str]]:
    """Run the row's attempt to its end, and what the retry state makes of it."""
    pool = ScriptedPool({PREFILL_URL: row.prefill, DECODE_URL: row.decode})
    client = Client(stop_reading_after=row.stop_reading_after)
    responder = Responder(client.send, b"req-1")
    aborted: list[str] = []
    attempt = build(row, pool, responder, aborted)
    outcome = None
    async with trio.open_nursery() as nursery:
        with trio.CancelScope() as request_scope:
            if row.client_leaves_at is not None:

                async def leave(mark: str) -> None:
                    await pool.board.event(mark).wait()
                    request_scope.cancel()

                nursery.start_soon(leave, row.client_leaves_at)
            outcome = await attempt.run()
        nursery.cancel_scope.cancel()
    if outcome is None:  # the client left: the attempt as it stood
        return attempt.outcome(), "gone", client, pool, aborted
    retries = RetryState(
        OneDecodeMore(row.engine),  # type: ignore[arg-type]
        RetryConfig(),
        random.Random(0),
        RouterMetrics(),
        total=3,
        deadline=trio.current_time() + DEADLINE_SECS,
    )
    step = retries.next_step(outcome, 1)
    if isinstance(step, Retry):  # what the client would get were this the last attempt
        await responder.reply(outcome.reply())  # type: ignore[arg-type]
    elif isinstance(step, Answer):
        await responder.reply(step.reply)
    elif isinstance(step, EndStream) and step.frame is not None:
        await responder.finish_stream(step.frame)
    return outcome, step_name(step, outcome), client, pool, aborted


@pytest.mark.parametrize("row", ROWS, ids=[row.name for row in ROWS])
async def test_outcome_table_row(row: Row, autojump_clock: trio.testing.MockClock) -> None:
    outcome, step, client, pool, aborted = await drive(row)
    # What was provoked happened: each leg's request went out (or not) as the row says.
    assert (DECODE_URL in pool.sent) is row.decode_sent
    assert (PREFILL_URL in pool.sent) is not row.prefill.refuse
    assert outcome.engine == row.engine
    culprit = outcome.culprit()
    assert (culprit.role if culprit else None) == row.culprit, outcome
    if row.culprit is None and row.kind is None and outcome.prefill.failed:
        raise AssertionError(f"prefill failed unblamed: {outcome}")
    failure = culprit.failure if culprit else None
    assert (failure.kind if failure else None) == row.kind, outcome
    assert step == row.step
    assert client.status == row.client
    cut = {(leg.role, leg.cancel_cause) for leg in outcome.legs if leg.cancel_cause and leg.posted}
    assert cut == set(row.cancelled)
    assert sorted(aborted) == sorted(row.aborted)
    assert decode_broke_after_bytes(outcome) is row.broke_after_bytes
    # The outcome names the workers that served the legs, and whether bytes went out.
    assert (outcome.prefill.worker.url, outcome.decode.worker.url) == (PREFILL_URL, DECODE_URL)
    assert outcome.streamed is (row.stream and client.status == 200)


async def test_the_kv_handoff_goes_to_vllm_decode_and_never_to_the_client(
    autojump_clock: trio.testing.MockClock,
) -> None:
    row = next(r for r in ROWS if r.name == "vllm: both succeed")
    outcome, _, client, pool, _ = await drive(row)
    decode_sent = orjson.loads(pool.sent[DECODE_URL].body)
    assert decode_sent["kv_transfer_params"] == HANDOFF
    assert b"kv_transfer_params" not in client.body
    assert outcome.leases_prefill


async def test_a_stalled_client_has_decode_closed_under_the_blocked_write(
    autojump_clock: trio.testing.MockClock,
) -> None:
    row = next(r for r in ROWS if r.name == "stream: the client stops reading")
    outcome, _, _, pool, _ = await drive(row)
    response = pool.sent[DECODE_URL].response
    assert response is not None and response.closed_under_it
    assert outcome.stalled and not outcome.finished
