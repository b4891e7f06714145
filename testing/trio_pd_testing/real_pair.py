"""What the real-engine tiers share (SGLang `sglang/`, vLLM `vllm/`).

One engine server as a process group (`Engine`: started with `spawn_engine`, ready by
`wait_ready`, killed with everything it started); free ports; `trio-pd serve` in front of a
pair as a real subprocess (`ServeProcess`, for the tiers' tests and demos); a pair held until a
signal (`hold`, the packages' `__main__`); a demo's frame (`run_demo`). Each tier keeps what is
its engine's own: flags, environment, readiness path, what a kill leaves behind.

Synchronous on purpose: pytest-trio cannot run session-scoped async fixtures, and a pair costs
~30-100 s and 2-3 GB of RAM per server, so each tier starts it once.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Self, TypeVar

from trio_pd_testing.ports import distinct_free_ports as distinct_free_ports
from trio_pd_testing.ports import free_port as free_port

ROUTER_READY_SECS = 60.0


class EngineStartError(RuntimeError):
    """An engine died or did not become ready; the message carries its log tail."""


def http_status(url: str, timeout: float = 2.0, headers: dict[str, str] | None = None) -> int:
    """The status of a GET, 0 when nothing answers."""
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code
    except (OSError, TimeoutError):
        return 0


def group_pids(pgid: int) -> list[int]:
    """Live processes of a process group (zombies excluded), read from /proc."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Fields after the parenthesised command: state, ppid, pgrp, ...
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(entry.name))
    return pids


def check_venv(python: Path, make_target: str) -> None:
    """The tier's engines' venv exists (`make <make_target>` creates it)."""
    if not python.exists():
        raise EngineStartError(f"{python} is missing: run `make {make_target}` first")


def write_model(python: Path, script: Path, directory: Path, env: dict[str, str]) -> Path:
    """Write the tier's tiny model once (its `make_model.py`, under the engines' python, which
    has `tokenizers`)."""
    subprocess.run([str(python), str(script), str(directory)], check=True, env=env)
    return directory


@dataclass
class Engine:
    """One engine server's process group (the HTTP server and every child it started)."""

    role: str
    port: int
    process: subprocess.Popen
    log_path: Path
    command: list[str]
    # SGLang: the prefill's bootstrap port; vLLM: the NIXL side channel's.
    bootstrap_port: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def pids(self) -> list[int]:
        """Every live process of this engine: the server and its engine's children."""
        return group_pids(self.process.pid)

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def kill(self, timeout: float = 20.0) -> None:
        """SIGKILL the whole group, wait until none of it lives, then reap the leader.

        SIGTERM to an SGLang server takes ~12 s (it sleeps 5 s for "crash diagnostics" when a
        child ends first) and still leaves its shared-memory files behind, so the tiers kill.
        """
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        deadline = time.monotonic() + timeout
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        left = self.pids()
        if left:
            raise RuntimeError(f"{self.role} engine: processes {left} survived SIGKILL")


@dataclass
class PairBase:
    """A real prefill and decode, each an `Engine`: what both tiers' pairs share. A tier's
    pair adds its start (`start`, through `with_port_retries`), its `stop` (`kill_engines`
    plus whatever its engine leaves behind) and its `describe`."""

    prefill: Engine
    decode: Engine
    startup_secs: float

    @property
    def prefill_url(self) -> str:
        return self.prefill.url

    @property
    def decode_url(self) -> str:
        return self.decode.url

    @property
    def engines(self) -> tuple[Engine, Engine]:
        return (self.prefill, self.decode)

    def pids(self) -> list[int]:
        return [pid for engine in self.engines for pid in engine.pids()]

    def kill_engines(self) -> list[str]:
        """Kill both process groups; what survived, one message per engine."""
        errors = []
        for engine in self.engines:
            try:
                engine.kill()
            except RuntimeError as e:
                errors.append(str(e))
        return errors

    def stop(self) -> None:
        errors = self.kill_engines()
        if errors:
            raise RuntimeError("; ".join(errors))

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


T = TypeVar("T")


def with_port_retries(start_once: Callable[[], T], tries: int = 3) -> T:
    """`start_once()`, again with new ports when an engine found its port taken between
    choosing it and binding it (other engines open many sockets at start-up; measured once in a
    full SGLang tier run), up to `tries` times."""
    for attempt in range(tries):
        try:
            return start_once()
        except EngineStartError as e:
            if "address already in use" not in str(e).lower() or attempt == tries - 1:
                raise
    raise AssertionError("unreachable")


def spawn_engine(
    role: str, port: int, log_path: Path, command: list[str], env: dict[str, str], **kw
) -> Engine:
    """Start one server in a process group of its own, its output appended to `log_path`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=str(log_path.parent),
            start_new_session=True,
        )
    return Engine(role, port, process, log_path, command, **kw)


def wait_ready(
    engines: Sequence[Engine], timeout: float, path: str, poll_secs: float, probe_secs: float
) -> None:
    """Poll `GET <path>` until every engine says 200.

    A process that exits meanwhile fails the start at once with its log tail.
    """
    deadline = time.monotonic() + timeout
    waiting = list(engines)
    while waiting:
        for engine in list(waiting):
            if not engine.alive():
                raise EngineStartError(
                    f"{engine.role} engine exited with {engine.process.returncode} during "
                    f"start-up; log {engine.log_path}:\n{engine.log_tail()}"
                )
            if http_status(engine.url + path, timeout=probe_secs) == 200:
                waiting.remove(engine)
        if not waiting:
            return
        if time.monotonic() > deadline:
            names = ", ".join(e.role for e in waiting)
            tails = "\n".join(f"--- {e.role} ({e.log_path}):\n{e.log_tail(30)}" for e in waiting)
            raise EngineStartError(f"{names} not ready after {timeout:.0f} s\n{tails}")
        time.sleep(poll_secs)


class ServeProcess:
    """A real `trio-pd serve` (the router's own venv) on 127.0.0.1 in front of `workers`
    (its `--prefill`/`--decode` arguments): its own port, its metrics on a listener of their
    own (`metrics_url`), the control plane on an ephemeral port, its output in `log_path`."""

    def __init__(self, workers: Sequence[str], log_path: Path, extra: Sequence[str] = ()) -> None:
        self.port = free_port()
        self.metrics_port = free_port()
        self.log_path = log_path
        self.command = [
            sys.executable, "-m", "trio_pd", "serve",
            "--host", "127.0.0.1", "--port", str(self.port),
            *workers,
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.metrics_port),
            "--admin-port", "0",
            "--log-level", "info",
            *extra,
        ]  # fmt: skip
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = ROUTER_READY_SECS) -> None:
        """Until `/readiness` answers 200; an AssertionError with the log when it exits or
        does not get there."""
        deadline = time.monotonic() + timeout
        while http_status(self.url + "/readiness") != 200:
            if self.process.poll() is not None:
                raise AssertionError(f"trio-pd serve exited early:\n{self.log()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"trio-pd serve not ready:\n{self.log()[-4000:]}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


class Pair(Protocol):
    prefill: Engine
    decode: Engine

    def stop(self) -> None: ...

    def describe(self) -> str: ...


P = TypeVar("P", bound=Pair)


def hold(start_pair: Callable[[], P], info: Callable[[P], dict[str, object]]) -> int:
    """`python -m trio_pd_testing.<tier>`: start a pair, print its `info` as one JSON line and
    keep it until SIGINT or SIGTERM (or until an engine dies: 1); the pair is stopped on the
    way out. The signals are caught before the start, so one during it stops the pair once it
    is up, never orphans it."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    pair = start_pair()
    try:
        logs = [str(e.log_path) for e in (pair.prefill, pair.decode)]
        print(json.dumps({**info(pair), "logs": logs}), flush=True)
        while not stop.wait(1.0):
            if not (pair.prefill.alive() and pair.decode.alive()):
                print("an engine died", file=sys.stderr)
                return 1
        return 0
    finally:
        pair.stop()


def post(url: str, body: dict, timeout: float) -> tuple[int, bytes, float]:
    """A demo's POST: status, body and seconds, an HTTP error's too."""
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read(), time.monotonic() - t0
    except urllib.error.HTTPError as e:
        return e.code, e.read(), time.monotonic() - t0


def run_demo(
    start_pair: Callable[[], P],
    workers: Callable[[P], list[str]],
    demo: Callable[[P, str], None],
    log_dir: Path,
    what: str,
) -> int:
    """A demo's frame: the pair, `trio-pd serve` in front (round robin, one attempt), the
    demo, and everything stopped on the way out, Ctrl-C and SIGTERM included."""
    log_dir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    print(f"starting a real {what} ...")
    pair = start_pair()
    router = None
    try:
        print(pair.describe())
        log_path = log_dir / "router.log"
        flags = ("--policy", "round_robin", "--disable-retries")
        router = ServeProcess(workers(pair), log_path, flags)
        try:
            router.wait_ready()
        except AssertionError:
            raise SystemExit(f"trio-pd serve did not become ready; see {log_path}") from None
        print(f"trio-pd serve at {router.url} (log {log_path})")
        demo(pair, router.url)
        return 0
    except KeyboardInterrupt:
        print("\ninterrupted")
        return 130
    finally:
        if router is not None:
            router.stop()
        pair.stop()
        print(f"stopped; logs in {log_dir}")
