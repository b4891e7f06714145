"""The storm options of bench/instant_engine.py (`bench/abort_rate.py` counts on them): a prefill
failing every request with 500, a decode holding its slot until an abort names the rid, and the
records the benchmark reads. Without the options the engine answers as before."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from trio_pd_testing.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"


@contextmanager
def engine(role: str, *options: str) -> Iterator[int]:
    port = free_port()
    argv = [sys.executable, "-m", "bench.instant_engine", "--role", role, "--port", str(port)]
    proc = subprocess.Popen([*argv, *options], cwd=ROOT, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120  # a hang guard: the wait ends at /health
        while call(port, "GET", "/health")[0] != 200:
            assert proc.poll() is None and time.monotonic() < deadline, "engine did not start"
            time.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        proc.wait(5)


def call(port: int, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://{HOST}:{port}{path}", data=data, method=method)
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            raw = resp.read()
            return resp.status, json.loads(raw) if raw else None
    except urllib.error.HTTPError as exc:
        return exc.code, None
    except OSError:
        return 0, None


def send_and_leave(port: int, rid: str) -> None:
    """A decode request the client gives up on at once (as the router does)."""
    body = json.dumps({"text": "x", "rid": rid}).encode()
    head = f"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n\r\n"
    with socket.create_connection((HOST, port)) as s:
        s.sendall(head.encode() + body)
        s.settimeout(0.3)
        with suppress(TimeoutError):  # nothing is answered: the read times out
            assert s.recv(100) == b"", "a held request must not be answered"


def wait_for(check: Any, what: str) -> Any:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(what)


def test_a_failing_prefill_answers_500_and_notes_the_rid() -> None:
    with engine("prefill", "--prefill-status", "500", "--record-aborts") as port:
        status, _ = call(port, "POST", "/generate", {"text": "x", "rid": "trio-pd-a"})
        assert status == 500
        _, records = call(port, "GET", "/records")
        assert set(records["failures"]) == {"trio-pd-a"}


def test_a_held_decode_is_freed_by_its_abort_and_only_by_it() -> None:
    with engine("decode", "--decode-hold", "60", "--record-aborts") as port:
        assert call(port, "POST", "/abort_request", {"rid": "early"}) == (200, {})
        send_and_leave(port, "early")  # its abort came first: dropped, as SGLang does
        send_and_leave(port, "held")
        wait_for(lambda: call(port, "GET", "/stats")[1]["held"] == 2, "both held")
        assert call(port, "POST", "/abort_request", {"rid": "held"})[0] == 200
        _, records = call(port, "GET", "/records")
        assert set(records["held"]) == {"early"}  # closing the connection freed nothing
        assert [(rid, freed) for rid, _, freed in records["aborts"]] == [
            ("early", False),
            ("held", True),
        ]
        assert set(records["received"]) == {"early", "held"}


def test_the_hold_ends_at_its_timeout() -> None:
    with engine("decode", "--decode-hold", "0.2", "--record-aborts") as port:
        send_and_leave(port, "doomed")
        records = wait_for(
            lambda: (r := call(port, "GET", "/records")[1]) and r["expired"] == 1 and r,
            "the hold timeout freed the slot",
        )
        assert records["held"] == {}


def test_without_the_options_the_engine_answers_as_before() -> None:
    with engine("decode", "--interval-ms", "0") as port:
        status, answer = call(port, "POST", "/generate", {"text": "x", "rid": "r"})
        assert status == 200 and answer["meta_info"]["finish_reason"]["type"] == "length"
        assert call(port, "POST", "/abort_request", {"rid": "r"})[0] == 404
        assert call(port, "GET", "/records")[0] == 404
    with engine("prefill") as port:
        assert call(port, "POST", "/generate", {"text": "x"})[0] == 200
