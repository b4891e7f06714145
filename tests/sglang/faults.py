"""The fault matrix's pieces: request shapes, their answers, a resetting raw client, signals
to engines, and the release-time ledger. Shared by `test_fault_matrix.py` and `chaos.py`.

- **Shapes**: `/generate`, chat and completions, each stream and non-stream (`SHAPES`).
- **Answers** are reduced to what must match an unfaulted reference of the same prompt: the
  generated text and the prompt's token count (greedy decoding on the tiny model is
  deterministic, so an answer that differs carries another request's output or a garbled one).
- **Resets** use a raw socket closed with `SO_LINGER 0` (a TCP RST, what a crashed client or a
  proxy's reset looks like), at a moment chosen by what happened (headers or the n-th event
  read) or after a seeded offset.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import statistics
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx2
import orjson
import trio

from trio_pd_testing.sglang import SGLangPair
from trio_pd_testing.sglang.launcher import Engine

ROUTES = ("/generate", "/v1/chat/completions", "/v1/completions")
SHAPES = tuple((route, stream) for route in ROUTES for stream in (False, True))
# ~2.9 tokens a word of `prompt()` (measured with the tiny tokenizer): 220 words (~650 tokens)
# plus 200 new tokens stay under the prefill's --context-length 1024, which SGLang checks
# against prompt + max_new_tokens; 500 words (~1450) are over it and under the decode's 4096.
LONG_WORDS = 220
OVER_CONTEXT_WORDS = 500


def shape_name(route: str, stream: bool) -> str:
    return f"{route.rsplit('/', 1)[-1]}-{'stream' if stream else 'plain'}"


def prompt(seed: int, words: int = 12) -> str:
    """A seeded prompt of pseudo-words; its length varies with the seed."""
    rng = random.Random(seed)
    n = words + seed % 7
    return " ".join(
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 6)))
        for _ in range(n)
    )


def body(route: str, stream: bool, text: str, max_tokens: int) -> dict[str, Any]:
    """One request of a shape; greedy, `ignore_eos` so the length is fixed."""
    if route == "/generate":
        return {
            "text": text,
            "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
            "stream": stream,
        }
    common = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream}
    if stream:
        common["stream_options"] = {"include_usage": True}
    if route == "/v1/chat/completions":
        return {"messages": [{"role": "user", "content": text}], **common}
    return {"prompt": text, **common}


@dataclass
class Result:
    """What a client got: status, and for a 200 the text and prompt tokens it carried."""

    status: int
    text: str = ""
    prompt_tokens: int | None = None
    complete: bool = False  # a 200 whose answer ended normally (finish reason "length")
    error: str = ""

    def key(self) -> tuple[str, int | None]:
        return (self.text, self.prompt_tokens)


def _finish(route: str, chunk: dict) -> str | None:
    if route == "/generate":
        reason = (chunk.get("meta_info") or {}).get("finish_reason")
        return reason.get("type") if isinstance(reason, dict) else reason
    choices = chunk.get("choices") or []
    return choices[0].get("finish_reason") if choices else None


def parse(route: str, stream: bool, status: int, raw: bytes) -> Result:
    """Reduce an answer's body (already de-chunked) to a `Result`."""
    if status != 200:
        return Result(status, error=raw[:300].decode(errors="replace"))
    try:
        if not stream:
            data = orjson.loads(raw)
            if route == "/generate":
                return Result(
                    200,
                    data["text"],
                    data["meta_info"]["prompt_tokens"],
                    _finish(route, data) == "length",
                )
            choice = data["choices"][0]
            text = choice["message"]["content"] if "message" in choice else choice["text"]
            return Result(
                200,
                text,
                data["usage"]["prompt_tokens"],
                choice["finish_reason"] == "length",
            )
        events = []
        for line in raw.decode(errors="replace").splitlines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                events.append(orjson.loads(line[5:].strip()))
        text, tokens, finish, errors = "", None, None, ""
        for event in events:
            if "error" in event:
                errors = json.dumps(event["error"])[:300]
                continue
            finish = _finish(route, event) or finish
            if route == "/generate":
                chunk_text = event.get("text", "")
                # cumulative by default, incremental with --stream-output: both read right
                text = chunk_text if chunk_text.startswith(text) else text + chunk_text
                tokens = event["meta_info"]["prompt_tokens"]
                continue
            for choice in event.get("choices") or []:
                text += (choice.get("delta") or {}).get("content") or choice.get("text") or ""
            if event.get("usage"):
                tokens = event["usage"]["prompt_tokens"]
        done = b"data: [DONE]" in raw
        return Result(200, text, tokens, done and finish == "length" and not errors, errors)
    except (ValueError, KeyError, IndexError, TypeError) as e:
        return Result(200, error=f"unparsable: {e!r}: {raw[:200]!r}")


def dechunk(raw: bytes) -> bytes:
    """The body of a `Transfer-Encoding: chunked` response, as far as it arrived."""
    out, rest = b"", raw
    while rest:
        size_line, sep, rest = rest.partition(b"\r\n")
        if not sep:
            break
        try:
            size = int(size_line.split(b";")[0], 16)
        except ValueError:
            break
        if size == 0:
            break
        out += rest[:size]
        rest = rest[size + 2 :]
    return out


@dataclass
class Raw:
    """A raw HTTP/1.1 exchange: what was read, and when (if) the client reset it."""

    status: int = 0
    head: bytes = b""
    body: bytes = b""
    reset_at: float | None = None  # time.monotonic() of the RST
    events: int = 0  # SSE `data:` lines read before the reset
    headers_before_reset: bool = False

    def result(self, route: str, stream: bool) -> Result:
        chunked = b"transfer-encoding: chunked" in self.head.lower()
        return parse(route, stream, self.status, dechunk(self.body) if chunked else self.body)


def _reset(sock: trio.SocketStream) -> None:
    """Close with SO_LINGER 0: the kernel sends RST, not FIN."""
    sock.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


async def raw_post(
    url: str,
    path: str,
    payload: dict,
    *,
    reset_after: float | None = None,
    reset_after_events: int | None = None,
    reset_before_headers: bool = False,
    reset_on: trio.Event | None = None,
    timeout: float = 60.0,
) -> Raw:
    """POST and read the answer, resetting the connection at the moment asked:
    `reset_after` seconds after the request went out, after `reset_after_events` SSE events,
    (`reset_before_headers`) right after sending, or when `reset_on` is set."""
    parts = urlsplit(url)
    data = orjson.dumps(payload)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n"
    ).encode()
    out = Raw()
    stream = await trio.open_tcp_stream(parts.hostname or "127.0.0.1", parts.port or 80)
    buffer = b""
    try:
        await stream.send_all(head + data)
        if reset_before_headers:
            _reset(stream)
            out.reset_at = time.monotonic()
            return out
        deadline = trio.current_time() + (timeout if reset_after is None else reset_after)
        async with trio.open_nursery() as nursery:
            with trio.move_on_at(deadline) as scope:
                if reset_on is not None:

                    async def watch() -> None:
                        await reset_on.wait()
                        scope.cancel()

                    nursery.start_soon(watch)
                while True:
                    chunk = await stream.receive_some(65536)
                    if not chunk:
                        break
                    buffer += chunk
                    if (
                        reset_after_events is not None
                        and buffer.count(b"data:") >= reset_after_events
                    ):
                        _reset(stream)
                        out.reset_at = time.monotonic()
                        break
            nursery.cancel_scope.cancel()
        if scope.cancelled_caught and (reset_after is not None or reset_on is not None):
            _reset(stream)
            out.reset_at = time.monotonic()
        out.headers_before_reset = out.reset_at is not None and b"\r\n\r\n" in buffer
    finally:
        await stream.aclose()
    head_part, sep, body_part = buffer.partition(b"\r\n\r\n")
    if sep:
        out.head = head_part
        out.body = body_part
        out.status = int(head_part.split(b" ", 2)[1])
    out.events = buffer.count(b"data:")
    return out


async def request(
    client: httpx2.AsyncClient, url: str, route: str, stream: bool, payload: dict
) -> Result:
    """A well-behaved client's request: the whole answer, reduced."""
    try:
        if not stream:
            response = await client.post(url + route, json=payload)
            return parse(route, stream, response.status_code, response.content)
        async with client.stream("POST", url + route, json=payload) as response:
            raw = b""
            try:
                async for chunk in response.aiter_bytes():
                    raw += chunk
            except httpx2.HTTPError as e:  # a stream cut by a dying engine
                result = parse(route, stream, response.status_code, raw)
                result.complete = False
                result.error = result.error or f"cut: {e!r}"
                return result
            return parse(route, stream, response.status_code, raw)
    except httpx2.HTTPError as e:
        return Result(0, error=repr(e))


# ------------------------------------------------------------------------------ engines


def scheduler_pid(engine: Engine) -> int:
    """The engine's `sglang::scheduler` process (its title, set by SGLang)."""
    for pid in engine.pids():
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"sglang::scheduler"):
                return pid
        except OSError:
            continue
    raise AssertionError(f"{engine.role}: no sglang::scheduler among {engine.pids()}")


def freeze(engine: Engine) -> int:
    """SIGSTOP the engine's scheduler: its HTTP server still accepts, nothing is scheduled."""
    pid = scheduler_pid(engine)
    os.kill(pid, signal.SIGSTOP)
    return pid


def thaw(pid: int) -> None:
    os.kill(pid, signal.SIGCONT)


# A decode's log when it forgets a prefill: `SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE` (2)
# missed heartbeats `SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL` (5 s) apart (`common/conn.py`).
LOST_PREFILL = "Lost connection with prefill instance (bootstrap_addr: 127.0.0.1:{port})"
FORGET_SECS = 60.0  # a hang guard: two missed heartbeats take 5-10 s


def losses(decode: Engine, bootstrap_port: int | None) -> int:
    """How often the decode's log says it forgot the prefill at this bootstrap port."""
    return decode.log_text().count(LOST_PREFILL.format(port=bootstrap_port))


async def decode_forgets(decode: Engine, bootstrap_port: int | None, before: int) -> None:
    """Until the decode has forgotten a killed prefill (its log says so).

    A decode registers its KV buffers with a prefill once, the first time it reaches that
    prefill's bootstrap address, and keeps them until it misses two heartbeats to it. A prefill
    started again on its own ports answers heartbeats within ~6 s of the kill (its bootstrap
    server starts before its model has loaded), so a decode that missed fewer than two never
    registers with the new one, and every request through the pair then waits in both engines
    for a transfer that cannot come (`tests/sglang/restart_probe.py`: 2 of 2 quick restarts;
    docs/protocol.md §10). A test restarting a prefill waits for this first."""
    with trio.fail_after(FORGET_SECS):
        while losses(decode, bootstrap_port) == before:
            await trio.sleep(0.1)


def counter(metrics: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus counter's samples with these labels, from a /metrics page."""
    total = 0.0
    for line in metrics.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def kill(pair: SGLangPair, role: str) -> float:
    """SIGKILL one engine's whole process group; the moment it was sent."""
    engine = pair.prefill if role == "prefill" else pair.decode
    t = time.monotonic()
    os.killpg(engine.pid, signal.SIGKILL)
    return t


# ------------------------------------------------------------------------------ ledger


@dataclass
class Ledger:
    """Release times by fault kind, crossed outputs, hits of the transfer window."""

    releases: dict[str, list[float]] = field(default_factory=dict)
    crossed: list[str] = field(default_factory=list)
    window: dict[str, int] = field(default_factory=lambda: {"tried": 0, "hit": 0})
    # Rounds whose first aborts reached the decode before it registered the rids (AIBrix #2746)
    unregistered: dict[str, int] = field(default_factory=lambda: {"tried": 0, "hit": 0})
    checked: int = 0  # successful answers compared with their reference

    def release(self, kind: str, secs: float) -> None:
        self.releases.setdefault(kind, []).append(secs)

    def compare(self, label: str, got: Result, want: Result) -> None:
        """A complete 200 must equal its reference; a cut one must be a prefix of it."""
        if got.status != 200 or got.error.startswith("unparsable"):
            return
        self.checked += 1
        if got.complete and got.key() != want.key():
            self.crossed.append(f"{label}: got {got.key()!r}, want {want.key()!r}")
        elif not got.complete and not want.text.startswith(got.text):
            self.crossed.append(f"{label}: partial {got.text!r} not a prefix of {want.text!r}")

    def table(self) -> list[dict[str, Any]]:
        rows = []
        for kind, values in sorted(self.releases.items()):
            ms = sorted(v * 1000 for v in values)
            rows.append(
                {
                    "fault": kind,
                    "n": len(ms),
                    "p50_ms": round(statistics.median(ms), 1),
                    "p99_ms": round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 1),
                    "max_ms": round(ms[-1], 1),
                }
            )
        return rows

    def render(self) -> str:
        lines = ["| fault | n | p50 ms | p99 ms | max ms |", "|---|---|---|---|---|"]
        for row in self.table():
            lines.append(
                f"| {row['fault']} | {row['n']} | {row['p50_ms']} | {row['p99_ms']} | "
                f"{row['max_ms']} |"
            )
        lines.append(
            f"transfer window: {self.window['hit']}/{self.window['tried']} aborts landed in it; "
            f"aborts before the decode registered: {self.unregistered['hit']}/"
            f"{self.unregistered['tried']} rounds; "
            f"{self.checked} answers compared, {len(self.crossed)} crossed"
        )
        return "\n".join(lines)
